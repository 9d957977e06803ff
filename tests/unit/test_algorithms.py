import math

import pytest
import torch

from verl_async.algos import grpo_advantages, kl_k3

from .ppo_loss import ppo_loss


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    groups = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # group 0: mean .25, unbiased std .5; group 5: mean .5, std sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])
    torch.testing.assert_close(adv, expected)


def test_grpo_uniform_group_has_zero_advantage_and_no_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(adv, torch.zeros(4))
    centered = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), normalize_std=False)
    torch.testing.assert_close(centered, torch.tensor([0.5, -0.5]))


def _one(p, prox, behav, adv, correction, cap=2.0):
    t = lambda x: torch.tensor([[math.log(x)]])  # noqa: E731
    return ppo_loss(
        t(p), t(prox), t(behav), torch.tensor([[adv]]), torch.ones(1, 1), correction, 0.2, cap
    )


@pytest.mark.parametrize(
    ("p", "prox", "behav", "adv", "correction", "cap", "expected"),
    [
        # none: r = .5/.25 = 2 -> clipped to 1.2 for A > 0
        (0.5, 0.4, 0.25, 1.0, "none", 2.0, -1.2),
        # none, A < 0: min(2 * -1, 1.2 * -1) = -2 -> loss +2 (the clip does not protect)
        (0.5, 0.4, 0.25, -1.0, "none", 2.0, 2.0),
        # tis: u = .5/.4 = 1.25 -> 1.2; w = min(.4/.25, 2) = 1.6 -> -1.92
        (0.5, 0.4, 0.25, 1.0, "tis", 2.0, -1.92),
        (0.5, 0.4, 0.25, 1.0, "decoupled", 2.0, -1.92),
        # weight 1.6 above cap 1.5: tis truncates to 1.5, decoupled masks the token
        (0.5, 0.4, 0.25, 1.0, "tis", 1.5, -1.8),
        (0.5, 0.4, 0.25, 1.0, "decoupled", 1.5, 0.0),
        # unclipped: u = 1, w = .4/.5 = .8, A = 2 -> -1.6
        (0.4, 0.4, 0.5, 2.0, "tis", 2.0, -1.6),
    ],
)
def test_policy_loss_hand_computed(p, prox, behav, adv, correction, cap, expected):
    out = _one(p, prox, behav, adv, correction, cap)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_clip_higher_widens_only_the_upper_bound():
    t = lambda x: torch.tensor([[math.log(x)]])  # noqa: E731
    args = (t(0.5), t(0.4), t(0.4), torch.tensor([[1.0]]), torch.ones(1, 1), "decoupled", 0.2, 2.0)
    # u = 1.25: clipped to 1.2 symmetric, unclipped (1.25) under clip_eps_high = 0.28
    assert ppo_loss(*args).loss.item() == pytest.approx(-1.2)
    assert ppo_loss(*args, clip_eps_high=0.28).loss.item() == pytest.approx(-1.25)
    # u = .5/.8 = .625 with A < 0: the lower bound .8 still binds -> -min(-.625, -.8) = .8
    low = (t(0.5), t(0.8), t(0.8), torch.tensor([[-1.0]]), torch.ones(1, 1), "decoupled", 0.2, 2.0)
    assert ppo_loss(*low, clip_eps_high=0.28).loss.item() == pytest.approx(0.8)


def test_loss_is_token_mean_over_mask_and_reports_clipping():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    behav = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third token is padding
    out = ppo_loss(logp, logp, behav, torch.ones(1, 1), mask, "none", 0.2, 2.0)
    # token 1: r=2 -> 1.2; token 2: r=1 -> 1; mean over 2 tokens
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert out.clip_fraction.item() == pytest.approx(0.5)


def test_gradient_flows_only_through_theta():
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    prox = torch.log(torch.tensor([[0.5]])).requires_grad_()
    out = ppo_loss(
        logp,
        prox.detach(),
        torch.log(torch.tensor([[0.4]])),
        torch.ones(1, 1),
        torch.ones(1, 1),
        "decoupled",
        0.2,
        2.0,
    )
    out.loss.backward()
    # d/dlogp of -w * exp(logp - prox) at u = 1 is -w = -(.5/.4)
    assert logp.grad.item() == pytest.approx(-1.25)


def test_kl_k3_is_zero_at_equal_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0])
    assert torch.equal(kl_k3(a, a), torch.zeros(2))
    assert (kl_k3(a, a + 0.3) > 0).all()
