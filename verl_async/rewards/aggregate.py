"""From raw per-source scores to one reward per sample, and the reward metrics (numpy).

    scores   [N, S] raw score of sample i under source s; NaN where s is not routed to
             sample i's data_source
    z[i, s]  normalised score:
               none     x
               group    (x - mean_g) / (std_g + 1e-6)   over the routed samples of i's group,
                        std_g UNBIASED (ddof=1, like algorithms.grpo_advantages; a group of
                        one has std 0, and x - mean_g = 0); an agent's episode that gave
                        several samples (the same score on each) counts once, as in the
                        estimators' group baselines
               running  (x - mean) / (std + 1e-6)       over every routed score of s so far,
                        this batch included (the stats are updated first), std POPULATION
                        (ddof=0, Welford)
    reward_i = sum over routed s of weight_s * z[i, s]; 0 when no source is routed to i
               (``unrouted`` counts those samples: a reward of 0 there is not a score).

Normalising before weighting lets sources on different scales (a 0/1 rule, a reward
model's logit) be mixed by weight alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from verl_async.numerics import finite32_mask
from verl_async.reward_config import RewardSource

EPS = 1e-6


class RunningStats:
    """Mean and population std of every value seen (Welford, merged batch-wise by Chan's
    formula: m2 = m2_a + m2_b + delta^2 * n_a * n_b / n).

    A value that is not finite in float32 is left out: one infinity would make the mean
    infinite for the rest of the run (and in every checkpoint after it), and scores are
    finite by then anyway (the scorer and the buffer refuse the others)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    def update(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64).ravel()
        values = values[finite32_mask(values)]
        n_b = values.size
        if n_b == 0:
            return
        mean_b = float(values.mean())
        m2_b = float(((values - mean_b) ** 2).sum())
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.count * n_b / n
        self.count = n

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state_dict(self) -> dict[str, float | int]:
        """Plain JSON-able state (saved in checkpoints)."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])


def group_normalize(
    column: np.ndarray, group_index: np.ndarray, first: np.ndarray | None = None
) -> np.ndarray:
    """(x - group mean) / (unbiased group std + 1e-6) over the non-NaN entries; NaN stays.
    ``first``: a sample's index -> the index of its episode's first sample, when some
    episode gave several samples: the group's mean and std are then taken over one sample
    per episode, and every sample gets its episode's value."""
    if first is not None:
        once = np.unique(first)
        normalised = group_normalize(column[once], group_index[once])
        return normalised[np.searchsorted(once, first)]
    out = np.full_like(column, np.nan, dtype=np.float64)
    routed = ~np.isnan(column)
    for g in np.unique(group_index[routed]):
        members = routed & (group_index == g)
        x = column[members].astype(np.float64)
        std = float(x.std(ddof=1)) if x.size > 1 else 0.0
        out[members] = (x - x.mean()) / (std + EPS)
    return out


def running_normalize(column: np.ndarray, stats: RunningStats) -> np.ndarray:
    """Update ``stats`` with the non-NaN entries, then (x - mean) / (std + 1e-6); NaN stays."""
    column = np.asarray(column, np.float64)
    stats.update(column[~np.isnan(column)])
    return (column - stats.mean) / (stats.std + EPS)


def combine(
    scores: np.ndarray,
    group_index: np.ndarray,
    sources: Sequence[RewardSource],
    running: dict[str, RunningStats],
    first: np.ndarray | None = None,
) -> np.ndarray:
    """[N, S] raw scores -> [N] rewards (float64); see the module docstring for the formula.

    ``running`` holds one ``RunningStats`` per source name using ``normalize: running`` (a
    missing one is created); they are updated in place. ``first`` [N]: each sample's
    episode's first sample, when an episode gave several (None: each sample is one).
    """
    scores = np.asarray(scores, np.float64).reshape(-1, len(sources))
    group_index = np.asarray(group_index)
    total = np.zeros(scores.shape[0], np.float64)
    for s, src in enumerate(sources):
        column = scores[:, s]
        if src.normalize == "group":
            column = group_normalize(column, group_index, first)
        elif src.normalize == "running":
            column = running_normalize(column, running.setdefault(src.name, RunningStats()))
        # NaN (not routed) adds nothing; a sample no source scores ends at 0.
        total += np.where(np.isnan(column), 0.0, src.weight * column)
    return total


def unrouted(scores: np.ndarray) -> int:
    """Samples no source is routed to (``combine`` gives them a reward of 0)."""
    scores = np.asarray(scores, np.float64)
    if scores.size == 0:
        return 0
    return int(np.isnan(scores.reshape(scores.shape[0], -1)).all(axis=1).sum())


def summarize(
    scores: np.ndarray,
    rewards: np.ndarray,
    failed: Sequence[int],
    data_sources: Sequence[str],
    sources: Sequence[RewardSource],
) -> dict[str, float | int | None]:
    """Metric fields of one batch (or evaluation round), JSON-able:

    reward/<source>         mean raw score over the samples routed to it; None if none were
    reward_failed/<source>  samples scored with its default_score after a failure
    reward_ds/<data_source> mean combined reward of that data source's samples
    reward_unrouted         samples no source is routed to (their reward is 0)
    """
    scores = np.asarray(scores, np.float64).reshape(-1, len(sources))
    rewards = np.asarray(rewards, np.float64).ravel()
    row: dict[str, float | int | None] = {}
    for s, src in enumerate(sources):
        column = scores[:, s]
        routed = column[~np.isnan(column)]
        row[f"reward/{src.name}"] = float(routed.mean()) if routed.size else None
        row[f"reward_failed/{src.name}"] = int(failed[s]) if s < len(failed) else 0
    names = np.asarray(list(data_sources), dtype=object)
    for ds in sorted(set(data_sources)):
        row[f"reward_ds/{ds}"] = float(rewards[names == ds].mean())
    row["reward_unrouted"] = unrouted(scores)
    return row
