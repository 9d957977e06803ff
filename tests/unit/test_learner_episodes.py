"""A group's baseline counts episodes, not samples: an agent episode that gave several
samples (``EpisodeStats.episode``) enters its group's statistics once, and each of its
samples gets the episode's advantage. Hand-worked values through the learner's own path
(``Learner.compute_advantages``: rewards, ``episodes_of``, ``estimate``); groups of
one-sample episodes give bit for bit what they always gave."""

import math

import msgspec
import pytest
import torch

from learners.advantages import (
    SourceScores,
    episodes_of,
    estimate,
    gdpo_columns,
    kl_controller,
)
from learners.trainer import Learner
from tests.unit.learner_samples import Sample, batch, fake_learner
from verl_async.algos import (
    Episodes,
    gdpo_advantages,
    grpo_advantages,
    grpo_outcome_advantages,
    masked_whiten,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from verl_async.schema import AlgoConfig, KLConfig

EPS = 1e-6
# One group of two episodes: episode 0 gave three samples (reward 1; a call rewrote the
# conversation twice), episode 1 one sample (reward 0).
SPLIT = [Sample(0, 1.0, episode=0)] * 3 + [Sample(0, 0.0, episode=1)]


def advantages_of(samples, **algo) -> torch.Tensor:
    """[N] each sample's advantage (the same on each of its sampled tokens)."""
    b = batch(samples)
    adv = Learner.compute_advantages(fake_learner(**algo), b, b).advantages
    per_sample = adv.sum(dim=1) / b.loss_mask.sum(dim=1)
    torch.testing.assert_close(adv, per_sample[:, None] * b.loss_mask)  # broadcast
    return per_sample


def test_grpo_takes_each_episodes_return_once():
    # Episodes' returns 1 and 0: mean 0.5 (over the 4 samples it would be 0.75), unbiased
    # std sqrt(0.5), so A = +-0.5 / (sqrt(0.5) + eps) on every sample of each episode.
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(advantages_of(SPLIT), torch.tensor([a, a, a, -a]))


def test_dr_grpo_and_rloo_take_each_episode_once():
    # Dr.GRPO: returns minus the episodes' mean 0.5 (not 0.75).
    torch.testing.assert_close(
        advantages_of(SPLIT, normalize_adv_std=False), torch.tensor([0.5, 0.5, 0.5, -0.5])
    )
    # RLOO over n = 2 episodes: each one's return minus the other's.
    torch.testing.assert_close(
        advantages_of(SPLIT, adv_estimator="rloo"), torch.tensor([1.0, 1.0, 1.0, -1.0])
    )


def test_gdpo_normalises_each_source_over_episodes():
    adv = advantages_of(SPLIT, adv_estimator="gdpo")
    # The source's GRPO advantage over the two episodes (+-a), on every sampled token,
    # whitened over the step's 8 tokens.
    a = 0.5 / (math.sqrt(0.5) + EPS)
    tiled = torch.tensor([a, a, a, -a])[:, None].expand(4, 2)
    expected = masked_whiten(tiled, torch.ones(4, 2))[:, 0]
    torch.testing.assert_close(adv, expected)


def test_an_episodes_return_sums_what_each_of_its_samples_adds():
    """In-reward KL: 0.5 per sampled token at coefficient 0.1. Episode 0's return is its
    reward once less the KL of all 6 of its tokens (1 - 0.3 = 0.7), episode 1's 0 - 0.1;
    a sample of episode 0 without a sampled token adds nothing."""
    samples = [*SPLIT[:3], Sample(0, 1.0, (), episode=0), SPLIT[3]]
    b = batch(samples)
    kl = KLConfig(in_reward=True, penalty="kl", coef=0.1)
    algo = msgspec.structs.replace(AlgoConfig(), kl=kl, normalize_adv_std=False)
    logp_ref = torch.full_like(b.loss_mask, -1.5)
    logp_old = torch.full_like(b.loss_mask, -1.0)
    out = estimate(
        algo, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]), b.group_index, b.loss_mask, None,
        logp_old, logp_ref, kl_controller(kl), episodes=episodes_of(b.group_index, b.episodes),
    )  # fmt: skip
    per_sample = out.advantages.sum(dim=1) / b.loss_mask.sum(dim=1).clamp(min=1)
    mean = (0.7 + -0.1) / 2
    expected = torch.tensor([0.7 - mean] * 3 + [0.0, -0.1 - mean])  # the empty one: no token
    torch.testing.assert_close(per_sample, expected)


def test_turn_rewards_of_every_sample_count_in_the_episodes_gdpo_column():
    """gdpo's environment column is the episode's turn rewards summed over its samples."""
    samples = [
        Sample(0, 1.0, (1, 1), episode=0, turn_rewards=(0.0, 0.25)),
        Sample(0, 1.0, (1, 1), episode=0, turn_rewards=(0.5, 0.0)),
        Sample(0, 1.0, (1, 1), episode=1, turn_rewards=(0.0, 0.0)),
    ]
    b = batch(samples)
    sources = SourceScores(torch.tensor([[1.0], [1.0], [1.0]]), [1.0])
    columns, _ = gdpo_columns(
        sources, b.turn_rewards, b.loss_mask, episodes_of(b.group_index, b.episodes)
    )
    assert columns[:, 1].tolist() == [0.75, 0.75, 0.0]


# ----------------------------------------------------------------------- nothing changes


ONE_EACH = [
    Sample(0, 1.0),
    Sample(0, 0.0, (1, 0, 1)),
    Sample(0, 0.5, (1, 1, 1)),
    Sample(1, 0.2),
    Sample(1, 0.9, (0, 1)),
]
ESTIMATORS = [
    {"adv_estimator": "grpo"},
    {"adv_estimator": "grpo", "normalize_adv_std": False},
    {"adv_estimator": "rloo"},
    {"adv_estimator": "gdpo"},
    {"adv_estimator": "reinforce_plus_plus"},
]


@pytest.mark.parametrize("algo", ESTIMATORS, ids=lambda a: "-".join(map(str, a.values())))
@pytest.mark.parametrize("labels", ["single_turn", "minus_one", "one_each"])
def test_one_sample_per_episode_is_bit_for_bit_as_before(algo, labels):
    """Single-turn samples, episodes marked -1, and episodes 0, 1, 2 of one sample each:
    the learner's advantages equal the estimator's without any episode map, bit for bit."""
    index = {"single_turn": None, "minus_one": -1}
    samples = [
        Sample(s.group, s.reward, s.sampled, index.get(labels, i % 3))
        for i, s in enumerate(ONE_EACH)
    ]
    b = batch(samples)
    assert episodes_of(b.group_index, b.episodes) is None
    got = Learner.compute_advantages(fake_learner(**algo), b, b)
    # The same through estimate without episodes (today's code path).
    learner = fake_learner(**algo)
    sources = SourceScores.of(learner.cfg, b.scores)
    expected = estimate(
        learner.algo, torch.tensor([s.reward for s in samples]), b.group_index, b.loss_mask,
        sources=sources,
    )  # fmt: skip
    assert torch.equal(got.advantages, expected.advantages)


def test_the_algos_give_an_identity_episode_map_bit_for_bit():
    scores = torch.tensor([0.3, 1.0, 0.0, 0.7, 0.2, 0.9])
    index = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = torch.ones(6, 3)
    single = Episodes.of(index, [-1] * 6)
    assert single.singles
    pairs = [
        (
            grpo_outcome_advantages(scores, index),
            grpo_outcome_advantages(scores, index, episodes=single),
        ),
        (grpo_advantages(scores, index), grpo_advantages(scores, index, episodes=single)),
        (rloo_advantages(scores, index), rloo_advantages(scores, index, single)),
        (
            reinforce_plus_plus_baseline_advantages(scores, index, mask)[0],
            reinforce_plus_plus_baseline_advantages(scores, index, mask, single)[0],
        ),
        (
            gdpo_advantages(scores[:, None], index, [1.0], mask)[0],
            gdpo_advantages(scores[:, None], index, [1.0], mask, episodes=single)[0],
        ),
    ]
    for without, with_map in pairs:
        assert torch.equal(without, with_map)


def test_the_algos_count_episodes():
    # Group 0: episode A (samples 0, 1, score 1), episode B (sample 2, score 0); group 1:
    # one sample. Over episodes group 0's mean is 0.5.
    scores = torch.tensor([1.0, 1.0, 0.0, 0.4])
    index = torch.tensor([0, 0, 0, 1])
    episodes = Episodes.of(index, [0, 0, 1, -1])
    assert episodes.of_sample.tolist() == [0, 0, 1, 2] and episodes.first.tolist() == [0, 2, 3]
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(
        grpo_outcome_advantages(scores, index, episodes=episodes),
        torch.tensor([a, a, -a, 0.4 / (1 + EPS)]),
    )
    torch.testing.assert_close(
        grpo_advantages(scores, index, episodes=episodes), torch.tensor([a, a, -a, 0.0])
    )
    torch.testing.assert_close(
        rloo_advantages(scores, index, episodes), torch.tensor([1.0, 1.0, -1.0, 0.4])
    )
    # REINFORCE++-baseline: minus the episodes' mean (0 for a group of one), then whitened.
    mask = torch.ones(4, 1)
    adv, _ = reinforce_plus_plus_baseline_advantages(scores, index, mask, episodes)
    torch.testing.assert_close(
        adv, masked_whiten(torch.tensor([[0.5], [0.5], [-0.5], [0.4]]), mask)
    )


def test_episode_indices_are_per_group():
    """Episode 0 of group 3 and episode 0 of group 4 are two episodes."""
    episodes = Episodes.of(torch.tensor([3, 3, 4, 4]), [0, 0, 0, 1])
    assert episodes.of_sample.tolist() == [0, 0, 1, 2]
    assert episodes.count().tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="episode indices"):
        Episodes.of(torch.tensor([0, 0]), [0])
