"""learners/advantages.py: where rewards land, and each estimator wired to its inputs."""

import msgspec
import pytest
import torch

from learners.advantages import estimate, kl_controller, token_level_scores
from verl_async.schema import AlgoConfig, KLConfig

# Two groups of two samples in the targets' layout: a prompt (mask 0), a response (mask 1)
# of 3 or 2 tokens, then padding (mask 0).
MASK = torch.tensor(
    [
        [0, 1, 1, 1, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1],
        [0, 1, 0, 0, 0],
    ],
    dtype=torch.float32,
)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5])
GROUPS = torch.tensor([0, 0, 1, 1])


def algo(**kw) -> AlgoConfig:
    return msgspec.structs.replace(AlgoConfig(), **kw)


def test_each_reward_lands_on_its_last_response_token():
    scores = token_level_scores(REWARDS, MASK)
    expected = torch.zeros_like(MASK)
    expected[0, 3], expected[1, 2], expected[2, 4], expected[3, 1] = 1.0, 0.0, 0.5, 0.5
    assert torch.equal(scores, expected)
    empty = token_level_scores(torch.tensor([2.0]), torch.zeros(1, 4))
    assert torch.equal(empty, torch.zeros(1, 4))  # no response token: nowhere to put it


def test_grpo_broadcasts_group_advantages_over_response_tokens_only():
    out = estimate(algo(adv_estimator="grpo"), REWARDS, GROUPS, MASK)
    # Group 0: scores 1, 0 -> mean 0.5, unbiased std 0.7071 -> +-0.7071; group 1 tied -> 0.
    a = 0.5 / (0.5**0.5 + 1e-6)
    expected = torch.tensor([a, -a, 0.0, 0.0])[:, None] * MASK
    torch.testing.assert_close(out.advantages, expected)
    assert out.returns is None and out.kl_in_reward is None


def test_rloo_uses_the_leave_one_out_mean():
    out = estimate(algo(adv_estimator="rloo"), REWARDS, GROUPS, MASK)
    # n = 2: A_i = n/(n-1) * (r_i - mean) = r_i - r_other.
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None] * MASK
    torch.testing.assert_close(out.advantages, expected)


def test_gae_needs_values_and_returns_reward_to_go():
    with pytest.raises(ValueError, match="critic"):
        estimate(algo(adv_estimator="gae"), REWARDS, GROUPS, MASK)
    values = torch.zeros_like(MASK)
    out = estimate(algo(adv_estimator="gae", gamma=1.0, lam=1.0), REWARDS, GROUPS, MASK, values)
    # Zero values, gamma = lambda = 1: the return at every response token is the reward.
    torch.testing.assert_close(out.returns, REWARDS[:, None] * MASK)
    assert torch.all(out.advantages[MASK == 0] == 0)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_normalize_adv_std_false_centres_token_level_advantages(estimator):
    values = torch.zeros_like(MASK)
    kw = {"adv_estimator": estimator, "gamma": 1.0, "lam": 1.0}
    whitened = estimate(algo(**kw), REWARDS, GROUPS, MASK, values).advantages
    centred = estimate(algo(normalize_adv_std=False, **kw), REWARDS, GROUPS, MASK, values)
    # Zero values and gamma = lambda = 1: each kept token's raw advantage is its reward;
    # the 9 kept tokens hold 3 x 1, 2 x 0, 3 x .5 and 1 x .5, mean 5 / 9.
    expected = (REWARDS[:, None] - 5 / 9) * MASK
    torch.testing.assert_close(centred.advantages, expected)
    std = float(expected[MASK > 0].std())
    torch.testing.assert_close(whitened, expected / std, rtol=1e-5, atol=1e-6)


def test_kl_in_reward_is_charged_per_token_and_moves_the_adaptive_coefficient():
    logp_old = torch.full_like(MASK, -1.0)
    logp_ref = torch.full_like(MASK, -1.5)  # k1 = logp_old - logp_ref = 0.5 per token
    cfg = algo(
        adv_estimator="reinforce_plus_plus",
        kl=KLConfig(in_reward=True, penalty="kl", coef=0.1, controller="adaptive", target_kl=0.1),
    )
    ctrl = kl_controller(cfg.kl)
    out = estimate(cfg, REWARDS, GROUPS, MASK, None, logp_old, logp_ref, ctrl)
    expected = token_level_scores(REWARDS, MASK) - 0.1 * 0.5 * MASK
    torch.testing.assert_close(out.token_rewards, expected)
    assert out.kl_in_reward == pytest.approx(0.5)
    # KL 0.5 > target 0.1: the error is clipped to 0.2 and the coefficient grows.
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 10000))
    torch.testing.assert_close(out.returns[0, 1:4], torch.tensor([0.85, 0.9, 0.95]))
