"""The whole-step part of verl's rollout correction (``algo.correction: rollout``): what the
learner's update needs over every row of a step before its first minibatch, and the
step's metrics. The rest of the correction is shared (verl_async/algos/correction/: the
settings, ``rollout.py``'s tensors, ``off_policy.py``'s per-pass hook).

Decoupled mode (``bypass_mode: false``) compares pi_prox with pi_behav, so its weights and
mask are fixed for the step. Batch normalisation needs every row's weight, and rejection
changes the token count the token-mean denominators divide by (verl's trainer replaces the
response mask before the actor runs). With either, the update computes pi_prox for every
row before its first minibatch (one more no-grad pass over the first minibatch's rows,
which otherwise take pi_prox from their gradient pass), then ``whole_step`` computes the
weights and mask of this rank's rows, the normalising mean over every data-parallel rank
through ``reduce``, and ``recount`` gives each minibatch its kept tokens over all ranks.
Otherwise a row's weights depend on that row alone and each pass computes its own.

Bypass mode compares pi_theta with pi_behav, so each pass computes its own (and batch
normalisation is refused at config load: it would normalise each pass alone).

Metrics (``rollout_corr/*``): decoupled, over this rank's rows once pi_prox is known for
all of them; bypass, each pass's, averaged by its tokens (as verl averages its
micro-batches'). Over ranks (``DataParallel.mean_metrics``) means are weighted by the
ranks' tokens and ``*_max`` / ``*_min`` take the extremes, so a rank-wide std or effective
sample size is the ranks' average, not the step's exact value.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from learners.plan import Minibatch
from verl_async.algos.correction.rollout import Reduce, RolloutCorrection, rollout_correction


@dataclasses.dataclass
class WholeStep:
    weights: torch.Tensor | None  # [N, T-1] this rank's rows, None without rollout_is
    mask: torch.Tensor  # [N, T-1] the loss mask after rejection sampling
    metrics: dict[str, float]


def rollout_settings(algo) -> RolloutCorrection | None:
    """The resolved settings under ``algo.correction: rollout``, else None."""
    return algo.rollout_correction.settings() if algo.correction == "rollout" else None


def needs_every_prox(s: RolloutCorrection | None) -> bool:
    """Whether the update needs every row's pi_prox before its first minibatch."""
    return (
        s is not None
        and not s.bypass_mode
        and (s.rollout_is_batch_normalize or s.rollout_rs is not None)
    )


def whole_step(
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    s: RolloutCorrection,
    reduce: Reduce | None = None,
) -> WholeStep:
    """Decoupled mode's weights, mask and metrics over this rank's rows ([N, T-1]). A rank
    without a kept token still joins the normalising sums (with zeros)."""
    if not (mask > 0).any():
        if reduce is not None and s.rollout_is is not None and s.rollout_is_batch_normalize:
            zero = torch.zeros((), dtype=logp_prox.dtype, device=logp_prox.device)
            reduce(zero), reduce(zero)  # the others' two sums
        return WholeStep(None if s.rollout_is is None else torch.zeros_like(mask), mask, {})
    weights, new_mask, metrics = rollout_correction(logp_prox, logp_behav, mask, s, reduce)
    return WholeStep(weights, new_mask, metrics)


def recount(plan: list[Minibatch], mask: torch.Tensor, reduce: Reduce | None) -> list[Minibatch]:
    """``plan`` with each minibatch's token count taken from ``mask`` (after rejection),
    summed over ranks; its sequence count stays (verl's is the configured batch size)."""
    local = [sum((float(mask[idx].sum()) for idx in mb.micro if len(idx)), 0.0) for mb in plan]
    counts = torch.tensor(local, dtype=torch.float64)
    totals = (reduce(counts) if reduce is not None else counts).tolist()
    return [dataclasses.replace(mb, tokens=t) for mb, t in zip(plan, totals, strict=True)]


@functools.lru_cache(maxsize=8)
def metric_names(s: RolloutCorrection) -> tuple[str, ...]:
    """Every metric name the settings produce (the same on every rank, for a collective);
    found once per settings by a one-token run, not every step."""
    one = torch.zeros(1, 1, dtype=torch.float64)
    return tuple(sorted(rollout_correction(one, one, torch.ones_like(one), s)[2]))


def combine(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Per-pass metrics weighted by their tokens; ``*_max`` / ``*_min`` the extremes."""
    parts = [(m, w) for m, w in parts if m and w > 0]
    if not parts:
        return {}
    total = sum(w for _, w in parts)
    out = {}
    for key in parts[0][0]:
        values = [m[key] for m, _ in parts]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(m[key] * w for m, w in parts) / total
    return out
