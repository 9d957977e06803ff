"""Non-finite numbers in the learner: the optimizer step that is skipped, and the weights
that never leave.

    minibatch:  backward per micro-batch -> guarded_step
                  no token to learn from         -> skipped: empty
                  loss not finite (on any rank)  -> skipped: nonfinite_loss
                  gradient norm not finite       -> skipped: nonfinite_grad
                  else                           -> optimizer.step
                  the gradients are dropped either way
    publish, checkpoint, resume:  require_finite(every tensor) or stop with NonFiniteWeights

Rewards are checked where they are accepted (verl_async/numerics.py), so a non-finite loss
comes from something else: a reward sum that overflows float32, an estimator or loss that
divides by nothing, a model that overflows. One such step is dropped and counted
(``skipped_steps/*`` in the metrics); AdamW would otherwise write the NaN into every
moment and weight it touches, the weights would go to the generators (which then cannot
sample) and into the checkpoints a resume starts from. With the step guarded, weights can
turn non-finite only through a bug; then nothing is published or checkpointed, and the
learner stops instead of training on (a resume starts from the last checkpoint, which was
checked when it was written, and is checked again when it is loaded: learners/checkpoints/).

A minibatch without a token to learn from (its episodes all ended without a sampled token,
or rejection sampling removed every token) has a zero loss and zero gradients, yet an
AdamW step would still move the weights (weight decay, the moments of earlier steps):
it takes no step either, counted as ``skipped_steps/empty``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger("verl_async.learner")

# Why an optimizer step was skipped, and how the log says it.
SKIPS = {
    "nonfinite_loss": "loss was not finite",
    "nonfinite_grad": "gradient norm was not finite",
    "empty": "minibatch held no token to learn from",
}


class NonFiniteWeights(RuntimeError):
    """Weights or optimizer state hold a NaN or an infinity: not published, not saved."""


# The outcome of a guarded step as ``step_unless_nonfinite`` codes it on the device.
STEPPED, NONFINITE_LOSS, NONFINITE_GRAD, EMPTY = 0, 1, 2, 3
OUTCOMES = (None, "nonfinite_loss", "nonfinite_grad", "empty")  # by code


def guarded_step(
    optimizer,
    clip_grad: Callable[[], float],
    loss: float,
    any_rank: Callable[[bool], bool] | None = None,
    empty: bool = False,
) -> tuple[float, str | None]:
    """Clip, then step ``optimizer`` unless this minibatch is ``empty`` (no token to learn
    from on any rank: the caller's count is the whole minibatch's), or its ``loss`` (this
    rank's part of it) or the gradient norm is not finite; the gradients are zeroed either
    way. Returns (the norm, 0 when empty; None when the step was taken, else its kind of
    skip in ``SKIPS``): ``step_unless_nonfinite``'s verdict, read on the host.

    Every rank comes to the same verdict: the norm ``clip_grad`` returns is the global one
    (under FSDP2 it is reduced over every rank's DTensor shards, so a NaN on one rank is a
    NaN on all), and a non-finite loss on any rank is every rank's through ``any_rank``
    (a collective: ``DataParallel.any_rank``; None with one rank). A loss can be NaN while
    the gradients are finite (a NaN in a term that carries no gradient), hence both.
    A skipped step leaves the weights and the optimizer state (moments, step count) as
    they were."""
    norm, code = step_unless_nonfinite(optimizer, clip_grad, loss, any_rank=any_rank, empty=empty)
    return float(norm), OUTCOMES[int(code)]


def step_unless_nonfinite(
    optimizer,
    clip_grad: Callable[[], float | torch.Tensor],
    loss: float | torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    any_rank: Callable[[bool], bool] | None = None,
    empty: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``guarded_step`` decided on the device: returns (the norm, the outcome's code in
    ``OUTCOMES``) as tensors, and reads neither on the host when the optimizer can skip
    a step by itself. A fused Adam, AdamW or SGD (``_step_supports_amp_scaling``, as
    ``learners.setup.adamw`` makes) takes a ``found_inf`` flag, the way a gradient
    scaler skips a step: where it is set the kernel leaves weights and moments as they
    were and the step count is taken back, so the verdict stays on the device. Any other
    optimizer, or one under a gradient scaler (fp16, which sets that flag itself): the
    verdict is read on the host (one read per minibatch).

    The loss's verdict is every rank's through ``reduce`` (a sum over ranks, on the
    device: ``DataParallel.all_sum``), else through ``any_rank`` (read on the host);
    neither: this rank's alone. ``empty``: the caller's count (host), no step, no clip."""
    inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
    if empty:  # every rank alike, so no rank waits in clip_grad's collective alone
        optimizer.zero_grad(set_to_none=True)
        return torch.zeros(()), torch.tensor(EMPTY)
    norm = clip_grad()
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else torch.as_tensor(norm)
    loss = torch.as_tensor(loss, device=norm.device)
    bad_loss = ~torch.isfinite(loss.detach())
    if reduce is not None:
        bad_loss = reduce(bad_loss.float()) > 0
    elif any_rank is not None:
        bad_loss = torch.tensor(any_rank(bool(bad_loss)))
    bad_loss = bad_loss.to(norm.device)
    code = torch.where(
        bad_loss, NONFINITE_LOSS, torch.where(torch.isfinite(norm), 0, NONFINITE_GRAD)
    )
    # A gradient scaler (Accelerate's, fp16) sets and removes found_inf itself.
    scaled = getattr(optimizer, "scaler", None) is not None
    if getattr(inner, "_step_supports_amp_scaling", False) and not scaled:
        inner.found_inf = (code != STEPPED).float()
        try:
            optimizer.step()
        finally:
            vars(inner).pop("found_inf", None)
    elif int(code) == STEPPED:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, code


class SkipLog:
    """Logs the first skipped step of each kind per model; the rest are only counted."""

    def __init__(self) -> None:
        self.logged: set[tuple[str, str]] = set()

    def report(self, step: int, actor, critic=None) -> None:
        """``actor``: the update's ``StepStats``; ``critic``: its ``CriticStats`` or None."""
        for model, stats in (("actor", actor), ("critic", critic)):
            for kind in SKIPS if stats is not None else ():
                count = getattr(stats, f"skipped_{kind}", 0)
                if count and (model, kind) not in self.logged:
                    self._log(step, model, kind, count)

    def _log(self, step: int, model: str, kind: str, count: float) -> None:
        self.logged.add((model, kind))
        metric = f"{'critic/' if model == 'critic' else ''}skipped_steps/{kind}"
        log.warning(
            "step %d: the %s skipped %d optimizer step(s) whose %s (their "
            "gradients were dropped; weights and optimizer state stay as they were). Later "
            "skips of this kind are only counted (%s)",
            step, model, round(count), SKIPS[kind], metric,
        )  # fmt: skip


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity (a DTensor's
    local shard on this rank).

    One sum per tensor and a single wait for all of them: a sum is finite only if every
    element is (a NaN or an infinity never adds back to a finite number), and it reads the
    tensor once and allocates nothing: on one CPU core, float32 weights shaped like
    SmolLM2-135M's took 53 ms, ``isfinite().all()`` per tensor 0.5 to 1.3 s. A sum that is
    not finite is confirmed with ``isfinite`` (finite elements can add up past the dtype's
    range), so no finite tensor is ever named."""
    names, sums = [], []
    with torch.no_grad():  # no autograd graph for the parameters' to_local() and sums
        for name, tensor in named:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.is_floating_point() and local.numel():
                names.append((name, local))
                sums.append(local.sum())
        if not sums:
            return []
        finite = torch.stack([s.to(sums[0].device) for s in sums]).isfinite().tolist()
        return [
            name
            for (name, local), ok in zip(names, finite, strict=True)
            if not ok and not bool(torch.isfinite(local).all())
        ]


def require_finite(
    what: str,
    named: Iterable[tuple[str, torch.Tensor]],
    any_rank: Callable[[bool], bool] | None = None,
    advice: str = "the last checkpoint written is finite (resume from it)",
) -> None:
    """Raise ``NonFiniteWeights`` (on every rank, through ``any_rank``) when a tensor of
    ``named`` is not finite; ``what`` says what was about to happen to them, ``advice``
    what to do instead."""
    bad = nonfinite_names(named)
    if not (any_rank(bool(bad)) if any_rank is not None else bad):
        return
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    message = (
        f"refusing to {what}: {shown or 'tensors on another rank'} hold NaN or infinite "
        "values. Optimizer steps with a non-finite loss or gradient are skipped, so this is "
        f"a bug; {advice}"
    )
    log.error("%s", message)
    raise NonFiniteWeights(message)
