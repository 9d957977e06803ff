"""One ``metrics.jsonl`` line per learner step (the run-directory contract)."""

from __future__ import annotations

import logging
import resource
from collections import Counter
from collections.abc import Sequence

import torch

from learners.batching import TrainBatch
from learners.update import StepStats
from verl_async import protocol as P

log = logging.getLogger("verl_async.learner")


def step_row(
    step: int,
    version: int,
    max_staleness: int,
    batch: TrainBatch,
    s: StepStats,
    sync_s: float,
    step_s: float,
    wall_s: float,
    sync_bytes: int = 0,
) -> dict:
    """One metrics.jsonl line. Staleness is measured against the version trained at (= step).

    A sample's staleness is the step minus the oldest version among its sampled tokens, so
    only samples with at least one sampled token have one: a sample without (an agent
    episode that never reached the model, raised or timed out) enters neither
    ``staleness_mean``, ``staleness_max``, ``staleness_hist`` nor
    ``inflight_update_samples`` (all 0 / empty counts when no sample has a token).
    ``staleness_hist[k]`` counts the samples of staleness k, for k = 0 .. max(eta, max seen);
    ``inflight_update_samples`` counts samples whose sampled tokens span more than one
    version (a multi-turn sample's observation tokens carry none of their own).
    """
    mask = batch.loss_mask > 0
    sampled = mask.any(dim=1)  # [N] samples with a sampled token
    versions = batch.token_versions[sampled]  # [M, T-1]
    oldest = versions.masked_fill(~mask[sampled], 1 << 30).min(dim=1).values  # [M]
    newest = versions.masked_fill(~mask[sampled], -1).max(dim=1).values
    stale = (step - oldest).float()
    n_resp = int(mask.sum())
    seen = int(stale.max()) if len(stale) else 0
    hist = torch.bincount(stale.long().clamp(min=0), minlength=max(max_staleness, seen) + 1)
    return {
        "step": step,
        "version": version,
        "wall_s": round(wall_s, 3),
        "step_s": round(step_s, 4),
        "reward_mean": float(batch.rewards.mean()) if len(batch.rewards) else 0.0,
        "samples": len(batch.rewards),
        "tokens": int(batch.attention_mask.sum()),
        "response_tokens": n_resp,
        "staleness_mean": float(stale.mean()) if len(stale) else 0.0,
        "staleness_max": seen,
        "staleness_hist": hist.tolist(),
        "inflight_update_samples": int((newest > oldest).sum()),
        "dropped_stale": batch.dropped_stale,
        "buffer_size": batch.buffer_size,
        "learner_wait_s": round(batch.wait_s, 4),
        "weight_sync_s": round(sync_s, 4),
        "weight_sync_mb": round(sync_bytes / 2**20, 3),
        "loss": s.loss,
        "kl": s.kl,
        "entropy": s.entropy,
        "clip_fraction": s.clip_fraction,
        "is_weight_mean": s.is_weight_mean,
        "is_weight_max": s.is_weight_max,
        "is_clipped_fraction": s.is_clipped_fraction,
        "grad_norm": s.grad_norm,
        "skipped_steps/nonfinite_loss": round(s.skipped_nonfinite_loss),
        "skipped_steps/nonfinite_grad": round(s.skipped_nonfinite_grad),
        "skipped_steps/empty": round(s.skipped_empty),
        "rollout_logp_diff_max": s.rollout_logp_diff_max,
        "rollout_fresh_fraction": round(s.rollout_fresh_fraction, 4),
        "padding_fraction": round(s.padding_fraction, 4),
        "shared_prefix_fraction": round(s.shared_prefix_fraction, 4),
        "timing/prox_s": round(s.prox_s, 4),
        "timing/forward_s": round(s.forward_s, 4),
        "timing/backward_s": round(s.backward_s, 4),
        "timing/optimizer_s": round(s.optimizer_s, 4),
        # Peak resident memory of the learner process so far (Linux reports KiB).
        "learner_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def algo_metrics(batch: TrainBatch, s: StepStats, critic, adv, kl_ctrl) -> dict:
    """The names verl users look for: actor/..., critic/... (``critic`` is the critic's
    ``CriticStats`` or None; ``adv`` the step's ``Advantages``)."""
    mask = batch.loss_mask > 0
    a = adv.advantages[mask]
    row = {
        "actor/pg_loss": s.pg_loss,
        "actor/pg_clipfrac": s.clip_fraction,
        "actor/pg_clipfrac_lower": s.clip_fraction_lower,
        "actor/ppo_kl": s.ppo_kl,
        "actor/entropy": s.entropy,
        "actor/grad_norm": s.grad_norm,
        "critic/advantages/mean": float(a.mean()) if len(a) else 0.0,
        "critic/advantages/std": float(a.std()) if len(a) > 1 else 0.0,
    }
    if torch.cuda.is_available():
        row["learner_peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    if s.kl_loss is not None:
        row["actor/kl_loss"] = s.kl_loss
    if s.rollout_corr:
        row.update(s.rollout_corr)  # already named rollout_corr/...
    if adv.kl_in_reward is not None:
        row["actor/reward_kl_penalty"] = adv.kl_in_reward
        row["actor/reward_kl_penalty_coeff"] = kl_ctrl.value
    if adv.returns is not None:
        row["critic/returns/mean"] = float(adv.returns[mask].mean()) if mask.any() else 0.0
    if critic is not None:
        row.update(
            {
                "critic/vf_loss": critic.vf_loss,
                "critic/vf_clipfrac": critic.vf_clipfrac,
                "critic/vf_explained_var": critic.vf_explained_var,
                "critic/grad_norm": critic.grad_norm,
                "critic/values/mean": critic.values_mean,
                "critic/values/mse": critic.values_mse,
                "critic/returns/var": critic.returns_var,
                "critic/skipped_steps/nonfinite_loss": round(critic.skipped_nonfinite_loss),
                "critic/skipped_steps/nonfinite_grad": round(critic.skipped_nonfinite_grad),
                "critic/skipped_steps/empty": round(critic.skipped_empty),
            }
        )
    return row


def multiturn_metrics(batch: TrainBatch) -> dict:
    """``multiturn/env_reward`` and the ``multiturn/*`` fields of a step with multi-turn samples
    (``episode_metrics``); {} for a step without any."""
    rows = [i for i, e in enumerate(batch.episodes) if e is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, device=batch.loss_mask.device)
    sampled = (batch.loss_mask[index] > 0).sum(dim=1)
    env = 0.0
    if batch.turn_rewards is not None:
        env = float(batch.turn_rewards[index].sum(dim=1).mean())
    episodes = [batch.episodes[i] for i in rows]
    return {"multiturn/env_reward": env, **episode_metrics(episodes, sampled.tolist())}


def episode_metrics(episodes: Sequence[P.EpisodeStats], sampled_tokens: Sequence[int]) -> dict:
    """The ``multiturn/*`` fields of a step's episodes (at least one), ``sampled_tokens``
    being each one's sampled tokens: means per episode, or totals over the step."""
    n = len(episodes)
    mean = lambda values: sum(values) / n  # noqa: E731
    budgets = Counter(e.budget for e in episodes if e.budget)
    row = {
        "multiturn/turns_mean": mean([e.turns for e in episodes]),
        "multiturn/turns_max": max(e.turns for e in episodes),
        "multiturn/tool_calls": mean([e.tool_calls for e in episodes]),
        "multiturn/tool_errors": sum(e.tool_errors for e in episodes),
        "multiturn/tool_timeouts": sum(e.tool_timeouts for e in episodes),
        "multiturn/tool_parse_errors": sum(e.tool_parse_errors for e in episodes),
        "multiturn/prefix_breaks": sum(e.prefix_breaks for e in episodes),
        "multiturn/env_seconds": mean([e.env_seconds for e in episodes]),
        "multiturn/observation_tokens": mean([e.observation_tokens for e in episodes]),
        "multiturn/sampled_tokens": mean(sampled_tokens),
        "multiturn/budget_hits": sum(budgets.values()),
        "multiturn/versions_spanned_mean": mean([e.versions_spanned for e in episodes]),
        "multiturn/versions_spanned_max": max(e.versions_spanned for e in episodes),
        "multiturn/template_mismatch": sum(e.template_mismatch for e in episodes),
    }
    for kind in sorted(set(P.EPISODE_BUDGETS) | set(budgets)):
        row[f"multiturn/budget_hits/{kind}"] = budgets[kind]
    return row


class GeneratorTiming:
    """The generators' part of a metrics line, from the buffer's ``Stats`` taken when the
    step's batch came: the generation rate (a gauge) and, per step, the seconds admission
    held generators back since the previous batch (summed over generators; ``gen_idle_s``
    is the part with nothing in flight); and the buffer's lease counters as it reports them
    (running totals: leases that ran out, renewals, rollouts dropped for coming after
    their lease), which say whether generators lose work to their leases.

    The buffer's totals count from its process's start and no checkpoint carries them (nor
    this object's last totals): after a resume both start from zero. A total smaller than
    the last one seen means a new buffer process; the step then counts from its start, so
    values never go negative nor jump.
    """

    SLACK_S = 1e-6  # a total this much smaller is rounding in the buffer's sums, not a restart

    def __init__(self) -> None:
        self.last = (0.0, 0.0)  # (blocked, idle) totals at the previous batch
        self.last_teacher = (0, 0.0, 0.0)  # (groups, wait, busy) totals at the previous batch

    def row(self, stats: P.Stats) -> dict:
        """gen_tokens_per_s, gen_blocked_s, gen_idle_s and the lease counters of this step's
        metrics line."""
        totals = (stats.gen_blocked_s, stats.gen_idle_s)
        if any(t < last - self.SLACK_S for t, last in zip(totals, self.last, strict=True)):
            self.last = (0.0, 0.0)  # the buffer started again
        blocked, idle = (max(t - last, 0.0) for t, last in zip(totals, self.last, strict=True))
        self.last = totals
        return {
            "gen_tokens_per_s": round(stats.gen_tokens_per_s, 2),
            "gen_blocked_s": round(blocked, 4),
            "gen_idle_s": round(idle, 4),
            "leases_expired": stats.leases_expired,
            "leases_renewed": stats.leases_renewed,
            "rollouts_dropped": stats.rollouts_dropped,
            "rollouts_refused": stats.rollouts_refused,
            "groups_ended": stats.groups_ended,
            **self.teacher_row(stats),
        }

    def teacher_row(self, stats: P.Stats) -> dict:
        """distill/teacher_wait_s and distill/teacher_busy_s: per group a teacher process
        scored since the previous batch, the generator's wait for the scores (queue,
        transport, retries) and the teacher's compute in it; nothing when none was."""
        totals = (stats.teacher_groups, stats.teacher_s, stats.teacher_busy_s)
        if totals[0] < self.last_teacher[0]:
            self.last_teacher = (0, 0.0, 0.0)  # the buffer started again
        groups, wait, busy = (t - last for t, last in zip(totals, self.last_teacher, strict=True))
        self.last_teacher = totals
        if groups <= 0:
            return {}
        return {
            "distill/teacher_wait_s": round(max(wait, 0.0) / groups, 4),
            "distill/teacher_busy_s": round(max(busy, 0.0) / groups, 4),
        }


def note_new_graphs(seen: int, step: int) -> int:
    """torch.compile's graph count in this process (recompiles included), logged when it
    is not ``seen`` (learner.compile): a count that keeps growing means the batches'
    shapes defeat the dynamic compile."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])
    if graphs != seen:
        log.info("torch.compile: %d graph(s) compiled so far (step %d)", graphs, step)
    return graphs
