"""The learner's policy update: pi_prox, then PPO-clip minibatch steps (pure torch).

Shared by the learner process (one rank or FSDP2 ranks) and ``benchmarks/gpu.py``, so
all run this code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from learners.batching import TrainBatch
from learners.finite import (
    EMPTY,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    SKIPS,
    STEPPED,
    step_unless_nonfinite,
)
from learners.logprobs import PassOptions, token_stats
from learners.plan import MicroRows, Minibatch, micro_rows, plan_update, planned_rows
from learners.whole_step_correction import (
    WholeStep,
    combine,
    needs_every_prox,
    recount,
    rollout_settings,
    whole_step,
)
from verl_async.algos import (
    GlobalBatch,
    LossInputs,
    LossOutput,
    actor_inputs,
    distillation,
    kl_k3,
    policy_loss,
)
from verl_async.algos.kl import kl_penalty
from verl_async.algos.masked import masked_sum
from verl_async.schema import AlgoConfig, LearnerConfig


@dataclass
class StepStats:
    loss: float  # the whole loss: policy gradient - entropy bonus + KL loss term
    pg_loss: float  # its policy-gradient part (verl's actor/pg_loss)
    kl: float  # k3 estimate of KL(pi_behav || pi_prox): how far the samples' policy lags
    entropy: float
    clip_fraction: float  # verl's actor/pg_clipfrac
    clip_fraction_lower: float  # dual-clip active (verl's actor/pg_clipfrac_lower)
    ppo_kl: float  # mean of logp_old - logp over the update (verl's actor/ppo_kl; per mode)
    is_weight_mean: float
    is_weight_max: float
    is_clipped_fraction: float
    grad_norm: float
    kl_loss: float | None = None  # the KL-to-reference loss term (algo.kl.loss_coef > 0)
    distill_loss: float | None = None  # the distillation term (distillation.enabled)
    # Tokens sampled by the very weights being trained (version == the learner's): their
    # vLLM log-probs must equal pi_prox's. The largest gap (verl's rollout_probs_diff, in
    # log space) shows a weight push gone wrong; the fraction says how many were compared.
    rollout_logp_diff_max: float = 0.0
    rollout_fresh_fraction: float = 0.0
    # Seconds of this update by part (CUDA: between events recorded at each boundary,
    # read after the update; elsewhere the host's clock), and the
    # share of the computed [rows x width] positions that were padding.
    prox_s: float = 0.0  # the no-grad pi_prox pass
    forward_s: float = 0.0  # gradient passes: model, log-probs, losses
    backward_s: float = 0.0
    optimizer_s: float = 0.0  # gradient clipping and the optimizer steps
    padding_fraction: float = 0.0
    # The share of the gradient passes' real tokens not computed because rows of a pass
    # share their prompt (learners/logprobs.py: computed once per packed row).
    shared_prefix_fraction: float = 0.0
    # Optimizer steps taken, and skipped for a loss or a gradient norm that was not finite
    # or for a minibatch without a token to learn from (learners/finite.py): one each per
    # minibatch.
    optimizer_steps: int = 0
    skipped_nonfinite_loss: int = 0
    skipped_nonfinite_grad: int = 0
    skipped_empty: int = 0
    # verl's rollout_corr/* metrics (algo.correction: rollout; learners/whole_step_correction.py)
    rollout_corr: dict[str, float] | None = None


@dataclass(frozen=True)
class UpdateHooks:
    """How the caller's setup runs the parts of an update that differ between setups (one
    rank under Accelerate or plain torch, FSDP2 ranks, the GPU benchmark). A caller builds
    them once; every setup then runs the same ``policy_update``."""

    backward: Callable[[torch.Tensor], None]
    """Back-propagates a micro-batch's loss (``accelerator.backward``, or
    ``torch.Tensor.backward``); the gradients accumulate until the minibatch's step."""
    clip_grad: Callable[[], float]
    """Clips the model's gradients and returns their norm before clipping: the norm over
    every rank's shards under FSDP2, so every rank sees the same one."""
    any_rank: Callable[[bool], bool] | None = None
    """Whether a flag is true on any data-parallel rank (a collective:
    ``DataParallel.any_rank``), so a loss that is not finite on one rank skips the
    minibatch's step on all (``guarded_step``). None: this rank alone decides."""
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A tensor summed over the data-parallel ranks (a collective:
    ``DataParallel.all_sum``), for the rollout correction's step-wide statistics
    (learners/whole_step_correction.py). None: this rank's rows are the whole step."""


def policy_update(
    model,
    optimizer,
    batch: TrainBatch,
    advantages: torch.Tensor,
    algo: AlgoConfig,
    hooks: UpdateHooks,
    *,
    plan: StepPlan | list[Minibatch] | None = None,
    version: int | None = None,
    step: bool = True,
    temperature: float = 1.0,
    learner: LearnerConfig | None = None,
    distill=None,
) -> StepStats:
    """pi_prox, then one optimizer step per minibatch of ``plan`` (learners/plan.py; by
    default ``algo.minibatches`` chunks of this batch on one rank, no micro-batching).
    A ``StepPlan`` (``plan_step``, made from the batch's host copy before it went to the
    device) carries every pass's shapes, and then nothing in the update waits for the
    device (no value is read back on the host) until its metrics are read, once, at its
    end; with fused AdamW even the non-finite guard decides on the device
    (``step_unless_nonfinite``). Without one it is made here from ``batch``.

    ``advantages`` is [N] (one per sample) or [N, T-1] (per token). ``hooks`` backpropagate,
    clip and agree over ranks the way the caller's setup does. The batch's optional
    tensors join in: ``batch.logp_ref`` adds the KL loss term (``algo.kl.loss_coef``),
    ``batch.logp_teacher`` the distillation term (as ``distill``, the distillation section, says), and
    ``batch.logp_prox``, when the caller computed pi_prox already, is taken as pi_prox. The step:
    ``version`` is the weights' (for the rollout-versus-learner log-prob check of
    ``StepStats``, and the seed below); ``step=False`` computes the losses and metrics
    without changing the weights (the critic's warm-up steps). The settings:
    ``temperature`` is the generators' sampling temperature (``generators.temperature``),
    at which every log-prob is computed; ``learner`` (None: its defaults) gives how each
    pass runs (``PassOptions.of``: the log-prob chunk size, shared prompts, padding-free
    packing; ``token_stats``) and ``seed``, which with the version, minibatch and
    micro-batch seeds a loss mode's random choices (clip_cov), so a run repeats them.

    pi_prox, when not given: the first minibatch's gradient passes run at the weights
    pi_prox is defined by, so their log-probs, detached, are pi_prox's for those rows, and
    a no-grad pass before the update covers the later minibatches' rows only: with one
    minibatch no separate forward at all (a quarter of the step's compute on a real
    model), with k of them (k - 1)/k of one. When the rollout correction needs every row's
    pi_prox before the first loss, one no-grad pass computes them all
    (learners/whole_step_correction.py). Log-probs and entropies are computed at the loss mask's
    positions only (learners/logprobs.py). A minibatch whose loss or gradient norm is not
    finite, or that holds no token to learn from (no row with a sampled token, or every
    token rejected by the rollout correction), takes no step (``guarded_step``).

    Every loss term and statistic reads the positions of ``batch.loss_mask`` only: the
    sampled tokens (a multi-turn sample's observation tokens are 0 there, and ``collate``
    has already replaced their placeholder log-probs and versions).
    """
    settings = learner or LearnerConfig()
    if plan is None:
        mask = batch.loss_mask
        plan = plan_update(mask, batch.attention_mask, [len(mask)], 0, algo.minibatches)
    if not isinstance(plan, StepPlan):
        plan = plan_step(model, batch, plan, algo, settings, batch.logp_prox is not None)
    update = _Update(model, batch, advantages, algo, hooks, temperature, settings, version, step)
    update.distill = distill
    minibatches = update.prox_first(plan)
    grads = [
        update.minibatch(k, mb, rows, optimizer)
        for k, (mb, rows) in enumerate(zip(minibatches, plan.rows, strict=True))
    ]
    return update.stats(grads)


@dataclass
class StepPlan:
    """An update's shapes, decided on the host before its batch is on the device: the
    minibatches (learners/plan.py), each pass's rows, width and positions
    (``MicroRows`` with its ``PassPlan``), and the pi_prox pass's, if the update runs one."""

    minibatches: list[Minibatch]
    rows: list[list[MicroRows]]  # [minibatch][micro-batch]
    prox: MicroRows | None


def plan_step(
    model,
    host: TrainBatch,
    plan: list[Minibatch],
    algo: AlgoConfig,
    learner: LearnerConfig,
    prox_given: bool = False,
    device: torch.device | None = None,
) -> StepPlan:
    """The ``StepPlan`` of ``plan`` over ``host`` (this rank's rows, in host memory: the
    step's batch before its copy to the device, whose tensors are read here), its index
    tensors on ``device`` (None: ``host``'s). ``prox_given``: the update gets pi_prox
    with the batch (``batch.logp_prox``), so it runs no pi_prox pass."""
    device = host.loss_mask.device if device is None else device
    options = PassOptions.of(learner)

    def rows_of(idx: torch.Tensor) -> MicroRows:
        return planned_rows(model, idx, host, options, device)

    passes = [[rows_of(idx) for idx in mb.micro] for mb in plan]
    prox = None
    if not prox_given and needs_every_prox(rollout_settings(algo)):
        prox = rows_of(torch.arange(len(host.loss_mask)))
    elif not prox_given and len(plan) > 1:  # the later minibatches' rows
        later = [idx for mb in plan[1:] for idx in mb.micro if len(idx)]
        prox = rows_of(torch.cat(later) if later else torch.zeros(0, dtype=torch.long))
    return StepPlan(plan, passes, prox)


class _Update:
    """One ``policy_update``: pi_prox and the entropies as they are filled in, the
    step-wide rollout correction, what each gradient pass reported, and the clock."""

    def __init__(
        self, model, batch, advantages, algo, hooks, temperature, learner, version, step
    ) -> None:
        self.model, self.batch, self.algo, self.hooks = model, batch, algo, hooks
        self.adv = advantages if advantages.dim() == 2 else advantages[:, None]
        self.temperature, self.passes = temperature, PassOptions.of(learner)
        self.seed, self.version, self.step = learner.seed, version, step
        self.clock = _Clock(batch.loss_mask.device)
        self.rollout = rollout_settings(algo)
        self.bonus = algo.entropy_coeff > 0
        self.given = batch.logp_prox is not None
        self.have_prox = self.given or needs_every_prox(self.rollout)  # before any step
        self.logp_prox = batch.logp_prox  # [N, T-1]; filled in by prox_first if not given
        # pi_prox's entropies, or (given) the ones seen during the update
        self.entropy = torch.zeros_like(batch.loss_mask)
        self.whole: WholeStep | None = None
        self.parts: list = []  # (pg LossOutput, correction, tokens) of each real pass
        self.distill = None  # the distillation section, read when batch.logp_teacher is set

    def prox_first(self, step_plan: StepPlan) -> list[Minibatch]:
        """What the update needs before its first step: pi_prox of the rows the first
        minibatch's gradient passes will not give (all of them when the rollout correction
        needs them first: ``step_plan.prox``), and the step-wide rollout correction.
        Returns the minibatches, their token counts recounted when rejection sampling
        masked tokens."""
        mask, plan = self.batch.loss_mask, step_plan.minibatches
        if not self.given:
            if self.have_prox and step_plan.prox is None:
                raise ValueError("the rollout correction needs a pi_prox pass the plan lacks")
            self.logp_prox = torch.zeros_like(mask)
            if step_plan.prox is not None:
                self.logp_prox, self.entropy = self._prox_pass(step_plan.prox)
        rollout, reduce = self.rollout, self.hooks.reduce
        if self.have_prox and rollout is not None and not rollout.bypass_mode:
            behav = self.batch.behav_logprobs
            self.whole = whole_step(self.logp_prox, behav, mask, rollout, reduce)
            if rollout.rollout_rs is not None:
                plan = recount(plan, self.whole.mask, reduce)
        return plan

    def _prox_pass(self, part: MicroRows) -> tuple[torch.Tensor, torch.Tensor]:
        out = prox_pass(self.model, self.batch, self.temperature, options=self.passes, part=part)
        self.clock.lap("prox_s")
        return out

    def minibatch(self, k: int, mb: Minibatch, passes: list[MicroRows], optimizer) -> dict:
        """Minibatch ``k``: a gradient pass per micro-batch (``passes``, planned), then
        (``step``) one guarded optimizer step. Returns its losses summed over its
        micro-batches and its step's outcome, as device tensors."""
        agg = mb.global_batch(self.algo.loss_scale_factor)
        zero = torch.zeros((), device=self.batch.loss_mask.device)
        sums = {"loss": zero, "pg_loss": zero, "kl_loss": zero, "distill_loss": zero}
        at_prox = k == 0 and not self.have_prox  # this pass's log-probs are pi_prox's
        for j, rows in enumerate(passes):
            out = self.micro(k, j, rows, agg, at_prox)
            if out is not None:
                sums["loss"] = sums["loss"] + out.total.detach()
                sums["pg_loss"] = sums["pg_loss"] + out.pg.loss.detach()
                if out.kl_loss is not None:
                    sums["kl_loss"] = sums["kl_loss"] + out.kl_loss.detach()
                if out.distill is not None:
                    sums["distill_loss"] = sums["distill_loss"] + out.distill.detach()
        grad, code = zero, None  # code None: no step was to be taken (``step`` False)
        if self.step:
            hooks, empty = self.hooks, mb.tokens == 0  # the minibatch's, over every rank
            grad, code = step_unless_nonfinite(
                optimizer, hooks.clip_grad, sums["loss"], hooks.reduce, hooks.any_rank, empty
            )
        self.clock.lap("optimizer_s")
        if self.batch.logp_ref is None or self.algo.kl.loss_coef == 0:
            sums["kl_loss"] = None
        if self.batch.logp_teacher is None:
            sums["distill_loss"] = None
        return {**sums, "grad": grad, "code": code}

    def micro(
        self, k: int, j: int, rows: MicroRows, agg: GlobalBatch, at_prox: bool
    ) -> ActorLoss | None:
        """Micro-batch ``j`` of minibatch ``k`` (``rows``, planned): its losses and
        backward. Records its pi_prox (``at_prox``) and entropies, and its metrics;
        returns its losses, or None for a placeholder row (it counts for nothing)."""
        batch, mask, algo = self.batch, self.batch.loss_mask, self.algo
        rows_mask = rows.mask(mask)
        ids, attn = rows.inputs(batch.input_ids, batch.attention_mask)
        entropy = self.bonus or at_prox or self.given
        top_ids = None if batch.teacher_topk_ids is None else rows.take(batch.teacher_topk_ids)
        with torch.enable_grad() if self.step else torch.no_grad():
            stats = token_stats(
                self.model, ids, attn, rows_mask, self.temperature, entropy, self.passes,
                rows.plan, at_ids=top_ids,
            )  # fmt: skip
            self.clock.count(stats)
            logp = stats.logp
            prox = logp.detach() if at_prox else rows.take(self.logp_prox)
            behav, adv = rows.take(batch.behav_logprobs), rows.take(self.adv)
            seed, given = micro_seed(self.seed, self.version or 0, k, j), _rows_of(self.whole, rows)
            inputs, corr = actor_inputs(logp, prox, behav, adv, rows_mask, algo, seed, given=given)
            ref = None if batch.logp_ref is None else rows.take(batch.logp_ref)
            teacher = None if batch.logp_teacher is None else rows.take(batch.logp_teacher)
            topk = None if top_ids is None else (stats.ids_logp, rows.take(batch.teacher_topk_logp))
            out = actor_loss(
                inputs, algo, stats.entropy if self.bonus else None, ref, agg, teacher, self.distill,
                topk,
            )  # fmt: skip
        self.clock.lap("forward_s")
        if self.step:
            self.hooks.backward(out.total)
        self.clock.lap("backward_s")
        if rows.placeholder:
            return None
        cols = slice(0, rows.width - 1)
        if at_prox:
            self.logp_prox[rows.idx, cols] = prox
        if at_prox or self.given:
            self.entropy[rows.idx, cols] = stats.entropy.detach()
        self.parts.append((out.pg, corr, rows_mask.sum()))
        return out

    def stats(self, grads: list[dict]) -> StepStats:
        """The update's metrics (``grads``: each minibatch's ``minibatch`` result)."""
        logp_prox, batch = self.logp_prox, self.batch
        stats = _step_stats(self.parts, grads, logp_prox, self.entropy, batch, self.version)
        stats.rollout_corr = _rollout_metrics(
            self.rollout, self.whole, self.parts, logp_prox, batch
        )
        return self.clock.fill(stats)


def _rows_of(whole: WholeStep | None, rows) -> tuple | None:
    """The step-wide rollout correction's weights and mask for one pass's rows."""
    if whole is None:
        return None
    weights = None if whole.weights is None else rows.take(whole.weights)
    return weights, rows.mask(whole.mask)


def _rollout_metrics(rollout, whole, parts, logp_prox, batch) -> dict | None:
    """rollout_corr/* of this rank: the step-wide ones (decoupled), else each pass's."""
    if rollout is None:
        return None
    if whole is not None:
        return whole.metrics
    if rollout.bypass_mode:
        return combine([(corr.metrics, w) for _, corr, w in parts])
    return whole_step(logp_prox, batch.behav_logprobs, batch.loss_mask, rollout).metrics


class _Clock:
    """Seconds spent in each part of an update, and the padding of what was computed.

    On CUDA each boundary records an event on the current stream (nothing waits), and
    the seconds between them are read in ``fill``, after the update's metrics were read
    (every event has completed by then); elsewhere each boundary reads the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.laps: list[tuple[str, object]] = []
        self.start = self._now()
        self.cells = self.real = self.tokens = 0

    def _now(self):
        return clock_mark(self.cuda)

    def lap(self, part: str) -> None:
        self.laps.append((part, self._now()))

    def count(self, stats) -> None:
        """What one gradient pass computed (``TokenStats``)."""
        self.cells += stats.computed
        self.real += stats.real
        self.tokens += stats.tokens

    def fill(self, stats: StepStats) -> StepStats:
        before = self.start
        if self.cuda and self.laps:
            self.laps[-1][1].synchronize()  # done already: the metrics were read after it
        for part, now in self.laps:
            setattr(stats, part, getattr(stats, part) + seconds_between(before, now))
            before = now
        stats.padding_fraction = 1.0 - self.real / self.cells if self.cells else 0.0
        stats.shared_prefix_fraction = 1.0 - self.real / self.tokens if self.tokens else 0.0
        return stats


def clock_mark(cuda: bool):
    """A point in time of the step: a recorded CUDA event on CUDA (read later, with no wait
    now), the host clock on a CPU (where the work is synchronous)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end) -> float:
    """Seconds between two ``clock_mark``s (CUDA events: once the device has passed both)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1000


def micro_seed(seed: int, version: int, minibatch: int, micro: int) -> int:
    """The seed of one micro-batch's random choices: the same run, step and pass, the
    same seed; any other, another."""
    return (((seed * 1_000_003 + version) * 1_009 + minibatch) * 1_009 + micro) % 2**63


@dataclass
class ActorLoss:
    total: torch.Tensor  # the policy loss - the entropy bonus + the KL loss term
    pg: LossOutput  # the policy loss alone (verl's actor/pg_loss) and its metrics
    kl_loss: torch.Tensor | None  # the KL loss term before its coefficient, if any
    distill: torch.Tensor | None = None  # the distillation term before its coefficient


def actor_loss(
    inputs: LossInputs,
    algo,
    entropy: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    batch: GlobalBatch | None = None,
    logp_teacher: torch.Tensor | None = None,
    distill=None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ActorLoss:
    """``algo.loss_mode``'s loss on ``inputs``, minus ``algo.entropy_coeff`` times the
    aggregated ``entropy``, plus ``algo.kl.loss_coef`` times the aggregated KL to
    ``logp_ref``: all aggregated with ``batch``'s denominators (``Minibatch.global_batch``;
    by default this batch's own and ``algo.loss_scale_factor``) and ``algo.loss_agg_mode``.
    With ``logp_teacher``, the distillation term joins as ``distill`` (the distillation
    section) says (verl_async/algos/distillation.py); with ``topk`` (the student's and the
    teacher's log-probs [N, T-1, K] of the teacher's top-k tokens) it is forward_kl_topk's."""
    batch = batch or GlobalBatch(loss_scale_factor=algo.loss_scale_factor)
    pg = policy_loss(inputs, algo, batch)
    total = pg.loss
    mask = inputs.mask
    if entropy is not None:
        total = total - algo.entropy_coeff * batch.agg(entropy, mask, algo.loss_agg_mode)
    kl_loss = None
    if logp_ref is not None and algo.kl.loss_coef > 0:
        kld = kl_penalty(inputs.logp, logp_ref, algo.kl.loss_type)
        kl_loss = batch.agg(kld, mask, algo.loss_agg_mode)
        total = total + algo.kl.loss_coef * kl_loss
    if logp_teacher is None:
        return ActorLoss(total, pg, kl_loss)
    if topk is not None:
        term = distillation.topk_term(inputs, *topk, distill, algo, batch)
    else:
        term = distillation.distillation_term(inputs, logp_teacher, distill, algo, batch)
    return ActorLoss(distillation.combine(total, term.loss, distill), pg, kl_loss, term.loss)


def _step_stats(
    parts: list, grads: list, logp_prox, entropy, batch: TrainBatch, version: int | None = None
) -> StepStats:
    """Metrics of one update. Token means are weighted by each micro-batch's tokens; the
    loss (and KL loss) is each minibatch's sum over its micro-batches, averaged over
    minibatches; the largest behaviour weight is the maximum. Computed on the device and
    read on the host at once (``_read``)."""
    mask = batch.loss_mask
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    n_tok = mask.sum().clamp(min=1)
    weight = sum((w for *_, w in parts), zero).clamp(min=1)
    mean = lambda get: sum((get(*p[:2]) * p[2] for p in parts), zero) / weight  # noqa: E731
    per_mb = lambda key: sum((g[key] for g in grads), zero) / len(grads)  # noqa: E731
    fresh = (mask > 0) & (batch.token_versions == (-2 if version is None else version))
    gap = torch.where(fresh, (logp_prox - batch.behav_logprobs).abs(), 0.0)
    codes = [g["code"] for g in grads if g["code"] is not None]
    outcome = lambda code: sum(((c == code).float() for c in codes), zero)  # noqa: E731
    maxima = [c.is_weight_max for _, c, _ in parts]
    device = {
        "rollout_logp_diff_max": gap.max(),
        "rollout_fresh_fraction": fresh.sum() / n_tok,
        "loss": per_mb("loss"),
        "pg_loss": per_mb("pg_loss"),
        "kl": masked_sum(kl_k3(logp_prox, batch.behav_logprobs), mask) / n_tok,
        "entropy": masked_sum(entropy, mask) / n_tok,
        "clip_fraction": mean(lambda o, c: o.pg_clipfrac),
        "clip_fraction_lower": mean(lambda o, c: o.pg_clipfrac_lower),
        "ppo_kl": mean(lambda o, c: o.ppo_kl),
        "is_weight_mean": mean(lambda o, c: c.is_weight_mean),
        "is_weight_max": torch.stack(maxima).max() if maxima else zero,
        "is_clipped_fraction": mean(lambda o, c: c.is_clipped_fraction),
        "grad_norm": per_mb("grad"),
        "optimizer_steps": outcome(STEPPED),
        "skipped_nonfinite_loss": outcome(NONFINITE_LOSS),
        "skipped_nonfinite_grad": outcome(NONFINITE_GRAD),
        "skipped_empty": outcome(EMPTY),
    }
    if grads[0]["kl_loss"] is not None:
        device["kl_loss"] = per_mb("kl_loss")
    if grads[0]["distill_loss"] is not None:
        device["distill_loss"] = per_mb("distill_loss")
    read = _read(device)
    counts = ("optimizer_steps", *(f"skipped_{kind}" for kind in SKIPS))
    return StepStats(**{**read, **{k: round(read[k]) for k in counts}})


def _read(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors read on the host in one transfer (the update's one wait for its
    device), in float64."""
    device = next(iter(values.values())).device
    stacked = torch.stack(
        [v.detach().to(device, torch.float64).reshape(()) for v in values.values()]
    )
    return dict(zip(values, stacked.tolist(), strict=True))


def prox_pass(
    model,
    batch: TrainBatch,
    temperature: float,
    rows: torch.Tensor | None = None,
    options: PassOptions | None = None,
    part: MicroRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_prox log-probs and token entropies [N, T-1] at the loss mask's positions, before
    any update (no grad, one forward pass run as ``options`` say; None: the defaults).
    ``rows``: only these rows, the others stay 0 (an empty set still runs the pass, on a
    placeholder row, for FSDP2's collectives). ``part``: the pass planned beforehand
    (``planned_rows``), instead of ``rows``."""
    mask = batch.loss_mask
    logp, entropy = torch.zeros_like(mask), torch.zeros_like(mask)
    if part is None:
        every = torch.arange(len(mask), device=mask.device)
        part = micro_rows(every if rows is None else rows, batch.attention_mask)
    ids, attn = part.inputs(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        stats = token_stats(
            model, ids, attn, part.mask(mask), temperature, entropy=True, options=options,
            plan=part.plan,
        )  # fmt: skip
    if not part.placeholder:
        cols = slice(0, part.width - 1)
        logp[part.idx, cols], entropy[part.idx, cols] = stats.logp, stats.entropy
    return logp, entropy
