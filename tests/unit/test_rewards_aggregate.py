"""Combination of reward sources (none / group / running, weights, routing) and metrics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from verl_async.reward_config import ExactReward
from verl_async.rewards.aggregate import EPS, RunningStats, combine, summarize, unrouted

NAN = math.nan


def src(name: str, weight: float = 1.0, normalize: str = "none") -> ExactReward:
    return ExactReward(name=name, weight=weight, normalize=normalize)


def test_none_is_the_weighted_sum_over_routed_sources():
    scores = np.array([[1.0, 0.5], [0.0, NAN], [NAN, NAN]])
    rewards = combine(scores, np.array([0, 0, 1]), [src("a", 2.0), src("b", -1.0)], {})
    np.testing.assert_allclose(rewards, [2.0 * 1.0 - 0.5, 0.0, 0.0])
    assert unrouted(scores) == 1  # the third sample's 0 is "no source", not a score


def test_group_uses_the_unbiased_std_per_group():
    scores = np.array([[1.0], [0.0], [0.0], [0.0], [5.0], [5.0]])
    group = np.array([7, 7, 7, 7, 9, 9])
    rewards = combine(scores, group, [src("a", 1.0, "group")], {})
    mean, std = 0.25, 0.5  # [1, 0, 0, 0]: sum of squares 0.75, / (4 - 1) -> std 0.5
    want = [(1 - mean) / (std + EPS)] + [(0 - mean) / (std + EPS)] * 3 + [0.0, 0.0]
    np.testing.assert_allclose(rewards, want, rtol=1e-9)
    assert rewards[0] == pytest.approx(1.5, rel=1e-5)  # population std would give 1.732


def test_group_counts_an_episode_of_several_samples_once():
    """Episode 0 of group 7 gave three samples (all scored 1), episode 1 one (scored 0):
    the group's mean is 0.5 over its two episodes, not 0.75 over four samples."""
    scores = np.array([[1.0], [1.0], [1.0], [0.0]])
    first = np.array([0, 0, 0, 3])  # each sample's episode's first sample
    rewards = combine(scores, np.array([7, 7, 7, 7]), [src("a", 1.0, "group")], {}, first)
    std = math.sqrt(0.5)  # [1, 0]: unbiased std over the episodes
    np.testing.assert_allclose(rewards, [0.5 / (std + EPS)] * 3 + [-0.5 / (std + EPS)])
    # One sample per episode: the same as without the map.
    alone = combine(scores, np.array([7, 7, 7, 7]), [src("a", 1.0, "group")], {})
    same = combine(scores, np.array([7, 7, 7, 7]), [src("a", 1.0, "group")], {}, np.arange(4))
    np.testing.assert_array_equal(alone, same)


def test_group_skips_unrouted_samples_and_a_group_of_one():
    scores = np.array([[2.0], [4.0], [NAN], [3.0]])
    rewards = combine(scores, np.array([0, 0, 0, 1]), [src("a", 3.0, "group")], {})
    std = math.sqrt(2.0)  # [2, 4]: unbiased std
    np.testing.assert_allclose(
        rewards, [3 * (-1 / (std + EPS)), 3 * (1 / (std + EPS)), 0.0, 0.0], rtol=1e-9
    )


def test_running_updates_the_stats_first_then_normalises():
    running: dict[str, RunningStats] = {}
    sources = [src("a", 1.0, "running")]
    first = combine(np.array([[1.0], [3.0]]), np.array([0, 0]), sources, running)
    np.testing.assert_allclose(first, [-1 / (1 + EPS), 1 / (1 + EPS)])  # mean 2, std 1
    second = combine(np.array([[5.0], [NAN]]), np.array([1, 1]), sources, running)
    mean, std = 3.0, math.sqrt(8 / 3)  # over 1, 3, 5 (population std)
    np.testing.assert_allclose(second, [(5 - mean) / (std + EPS), 0.0])
    assert running["a"].count == 3  # the NaN was not counted


def test_mixed_normalisations_and_weights():
    sources = [src("rule", 1.0, "none"), src("model", 0.5, "group")]
    scores = np.array([[1.0, 2.0], [0.0, 0.0], [1.0, NAN]])
    rewards = combine(scores, np.array([0, 0, 1]), sources, {})
    z = 1 / (math.sqrt(2.0) + EPS)
    np.testing.assert_allclose(rewards, [1.0 + 0.5 * z, 0.0 - 0.5 * z, 1.0])


def test_running_stats_match_numpy_and_round_trip_through_json():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, size=101)
    stats = RunningStats()
    for chunk in np.array_split(values, 7):
        stats.update(chunk)
    assert stats.mean == pytest.approx(values.mean())
    assert stats.std == pytest.approx(values.std(ddof=0))
    restored = RunningStats()
    restored.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    assert restored.state_dict() == stats.state_dict()
    restored.update(np.array([10.0]))
    assert restored.mean == pytest.approx(np.append(values, 10.0).mean())


def test_running_stats_never_absorb_a_value_float32_cannot_hold():
    """One infinity would make the mean infinite for the rest of the run and in every
    checkpoint; 1e39 is finite in the float64 the stats keep, but is no float32 score."""
    stats = RunningStats()
    stats.update(np.array([1.0, math.inf, 3.0, NAN, -1e39, -math.inf]))
    assert (stats.count, stats.mean, stats.std) == (2, 2.0, 1.0)
    assert all(math.isfinite(v) for v in stats.state_dict().values())


def test_empty_running_stats():
    stats = RunningStats()
    stats.update(np.array([]))
    assert (stats.count, stats.mean, stats.std) == (0, 0.0, 0.0)


def test_summarize_fields():
    sources = [src("correct"), src("fmt")]
    scores = np.array([[1.0, NAN], [0.0, NAN], [1.0, 0.5], [NAN, NAN]])
    rewards = np.array([1.0, 0.0, 1.5, 0.0])
    row = summarize(scores, rewards, [2, 0], ["gsm8k", "gsm8k", "math", "other"], sources)
    assert row == {
        "reward/correct": pytest.approx(2 / 3),
        "reward_failed/correct": 2,
        "reward/fmt": 0.5,
        "reward_failed/fmt": 0,
        "reward_ds/gsm8k": 0.5,
        "reward_ds/math": 1.5,
        "reward_ds/other": 0.0,
        "reward_unrouted": 1,
    }
    json.dumps(row)  # plain Python values only
    assert all(type(v) in (float, int) for v in row.values())


def test_summarize_source_routed_nowhere_is_null():
    row = summarize(np.array([[NAN]]), np.array([0.0]), [0], ["x"], [src("a")])
    assert row["reward/a"] is None
    assert json.loads(json.dumps(row))["reward/a"] is None
