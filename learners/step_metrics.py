"""One ``metrics.jsonl`` line per learner step (the run-directory contract)."""

from __future__ import annotations

import torch

from learners.batching import TrainBatch
from learners.update import StepStats


def step_row(
    step: int,
    version: int,
    max_staleness: int,
    batch: TrainBatch,
    s: StepStats,
    sync_s: float,
    step_s: float,
    wall_s: float,
) -> dict:
    """One metrics.jsonl line. Staleness is measured against the version trained at (= step).

    ``staleness_hist[k]`` counts the samples of staleness k, for k = 0 .. max(eta, max seen);
    ``inflight_update_samples`` counts samples whose tokens span more than one version.
    """
    mask = batch.loss_mask > 0
    versions = batch.token_versions.masked_fill(~mask, 1 << 30)
    oldest = versions.min(dim=1).values  # [N]
    newest = batch.token_versions.max(dim=1).values
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
        "gen_tokens_per_s": round(batch.gen_tokens_per_s, 2),
        "buffer_size": batch.buffer_size,
        "learner_wait_s": round(batch.wait_s, 4),
        "weight_sync_s": round(sync_s, 4),
        "loss": s.loss,
        "kl": s.kl,
        "entropy": s.entropy,
        "clip_fraction": s.clip_fraction,
        "is_weight_mean": s.is_weight_mean,
        "is_weight_max": s.is_weight_max,
        "is_clipped_fraction": s.is_clipped_fraction,
        "grad_norm": s.grad_norm,
    }
