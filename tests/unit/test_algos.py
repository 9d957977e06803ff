"""verl_async.algos pinned on hand-worked numbers (or a plain reference loop written here).

Padded positions hold extreme values (1e4, -1e4, inf) that must never reach a kept output.
"""

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.algos import (
    AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    entropy_from_logits,
    entropy_loss,
    explained_variance,
    gae_advantages,
    group_ids,
    grpo_advantages,
    grpo_outcome_advantages,
    kl_k3,
    kl_penalty,
    make_kl_controller,
    masked_center,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_entropy,
    value_loss,
)

from .ppo_loss import ppo_loss

PAD = 1e4
INF = float("inf")
D = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def close(actual, expected, **kw):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, **({"rtol": 1e-9, "atol": 1e-9} | kw))


# ----------------------------------------------------------------------------- masked ops


def test_masked_sum_and_mean_ignore_padding_even_inf():
    x = t([[1.0, 2.0, INF], [3.0, -INF, PAD]])
    m = t([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(x, m), 6.0)
    close(masked_sum(x, m, dim=-1), [3.0, 3.0])
    close(masked_mean(x, m), 6.0 / (3 + 1e-8))
    close(masked_mean(x, m, dim=-1), [3.0 / (2 + 1e-8), 3.0 / (1 + 1e-8)])
    close(masked_mean(x, torch.zeros_like(m)), 0.0)  # nothing kept: 0, not nan


def test_masked_center_subtracts_the_kept_mean_and_zeroes_padding():
    x, m = t([1.0, 2.0, 6.0, INF]), t([1, 1, 1, 0])
    close(masked_center(x, m), [-2.0, -1.0, 3.0, 0.0], atol=1e-7)  # the mean's 1e-8 count
    close(masked_center(t([5.0, -INF]), t([1, 0])), [0.0, 0.0], atol=1e-7)  # one kept: fine


def test_masked_var_is_unbiased_and_refuses_fewer_than_two_entries():
    x = t([1.0, 2.0, 6.0, PAD])
    m = t([1, 1, 1, 0])
    # mean 3, squared deviations 4 + 1 + 9 = 14, over n - 1 = 2
    close(masked_var(x, m), 7.0, rtol=1e-7)
    close(masked_var(x, m, unbiased=False), 14 / 3, rtol=1e-7)
    with pytest.raises(ValueError):
        masked_var(x, t([1, 0, 0, 0]))
    with pytest.raises(ValueError):
        masked_var(x, t([0, 0, 0, 0]))


def test_masked_whiten_over_kept_entries_only():
    x = t([1.0, 2.0, 6.0, -PAD])
    m = t([1, 1, 1, 0])
    s = math.sqrt(7.0 + 1e-8)
    close(masked_whiten(x, m), [-2 / s, -1 / s, 3 / s, 0.0], rtol=1e-7)
    close(masked_whiten(x, m, shift_mean=False), [3 - 2 / s, 3 - 1 / s, 3 + 3 / s, 3.0], rtol=1e-7)


# ----------------------------------------------------------------------------- outcome advantages


def test_group_ids_from_tensors_and_strings():
    inverse, n = group_ids(torch.tensor([7, 3, 7, 9]))
    assert n == 3 and inverse.tolist() == [1, 0, 1, 2]
    inverse, n = group_ids(np.array(["b", "a", "b"]))
    assert n == 2 and inverse.tolist() == [0, 1, 0]


def test_grpo_outcome_uses_unbiased_std_and_adds_eps_to_std():
    scores = t([1.0, 0.0, 0.0, 0.0])
    idx = ["u"] * 4
    # mean .25, unbiased std sqrt((.5625 + 3 * .0625) / 3) = .5 (the biased one is .433)
    close(grpo_outcome_advantages(scores, idx, eps=0.0), [1.5, -0.5, -0.5, -0.5])
    # eps is added to the std, not under the root: divisor .5 + .5 = 1
    close(grpo_outcome_advantages(scores, idx, eps=0.5), [0.75, -0.25, -0.25, -0.25])


def test_grpo_outcome_singleton_and_tied_groups():
    scores = t([3.0, 2.0, 2.0, -1.0])
    idx = np.array(["solo", "tie", "tie", "solo2"])
    # a group of one: mean 0, std 1 -> s / (1 + eps); a tied group: 0 / eps = 0
    close(grpo_outcome_advantages(scores, idx), [3 / (1 + 1e-6), 0.0, 0.0, -1 / (1 + 1e-6)])
    # the learner's grpo_advantages gives a group of one 0 instead
    close(grpo_advantages(scores, torch.tensor([0, 1, 1, 2])), [0.0, 0.0, 0.0, 0.0])


def test_dr_grpo_centres_without_scaling():
    scores = t([1.0, 0.0, 0.0, 5.0, 4.0])
    idx = torch.tensor([0, 0, 0, 1, 2])
    close(
        grpo_outcome_advantages(scores, idx, norm_by_std=False),
        [2 / 3, -1 / 3, -1 / 3, 5.0, 4.0],  # singletons keep their score (mean 0)
    )


def test_rloo_leave_one_out_singleton_and_tied():
    scores = t([1.0, 2.0, 6.0, 4.0, 7.0, 7.0])
    idx = ["g", "g", "g", "one", "tie", "tie"]
    # s_i minus the mean of the others: 1 - 4, 2 - 3.5, 6 - 1.5; singleton unchanged; tie 0
    close(rloo_advantages(scores, idx), [-3.0, -1.5, 4.5, 4.0, 0.0, 0.0])


def test_reinforce_plus_plus_baseline_whitens_tiled_scores_over_kept_tokens():
    scores = t([1.0, 3.0, 5.0])
    mask = t([[1, 1], [1, 0], [0, 0]])
    adv, ret = reinforce_plus_plus_baseline_advantages(scores, [0, 0, 1], mask)
    # centred -1, 1 (the singleton: 5 - 0, but it has no kept token); kept tokens -1, -1, 1:
    # mean -1/3, deviations -2/3, -2/3, 4/3, unbiased var (24/9) / 2 = 4/3
    s = math.sqrt(4 / 3 + 1e-8)
    close(adv, [[-2 / 3 / s, -2 / 3 / s], [4 / 3 / s, 0.0], [0.0, 0.0]], rtol=1e-7)
    assert ret is adv


# ----------------------------------------------------------------------------- GAE


def _gae_reference(rewards, values, mask, gamma, lam):
    """GAE row by row over the kept positions only, then whitening with python floats."""
    raw = torch.zeros_like(rewards)
    ret = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        kept = [j for j in range(rewards.shape[1]) if mask[i, j] > 0]
        next_value = last = 0.0
        for j in reversed(kept):
            delta = float(rewards[i, j]) + gamma * next_value - float(values[i, j])
            last = delta + gamma * lam * last
            next_value = float(values[i, j])
            raw[i, j] = last
            ret[i, j] = last + float(values[i, j])
    flat = [float(raw[i, j]) for i, j in mask.nonzero().tolist()]
    mean, var = statistics.fmean(flat), statistics.variance(flat)  # variance: n - 1
    adv = torch.where(mask > 0, (raw - mean) / math.sqrt(var + 1e-8), torch.zeros_like(raw))
    return adv, ret


def test_gae_hand_computed_no_bootstrap_past_the_last_token():
    rewards = t([[0.0, 1.0, PAD]])
    values = t([[0.5, 0.2, -PAD]])
    mask = t([[1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=1: delta = 1 - .2 = .8 (nothing after it); t=0: delta = .9 * .2 - .5 = -.32,
    # A0 = -.32 + .72 * .8 = .256. Two values whiten to -+1/sqrt(2) (up to the 1e-8).
    close(ret, [[0.756, 1.0, 0.0]])
    k = 0.272 / math.sqrt(2 * 0.272**2 + 1e-8)
    close(adv, [[-k, k, 0.0]], rtol=1e-7)


def test_gae_without_std_centres_the_raw_advantages_over_kept_tokens():
    rewards = t([[0.0, 1.0, PAD], [2.0, INF, -INF]])
    values = t([[0.5, 0.2, -PAD], [0.5, PAD, INF]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, norm_by_std=False)
    # raw: .256 and .8 as above, 2 - .5 = 1.5 in the second row; mean 2.556 / 3
    close(ret, [[0.756, 1.0, 0.0], [2.0, 0.0, 0.0]])
    m = (0.256 + 0.8 + 1.5) / 3
    close(adv, [[0.256 - m, 0.8 - m, 0.0], [1.5 - m, 0.0, 0.0]], rtol=1e-6)
    # A critic that predicts every return leaves advantages of 0, where whitening would
    # blow its last errors up to unit variance:
    # (raw advantages 0 and -0.01 here: centred +-0.005, whitened +-0.707)
    exact = t([[1.0, 1.0 + 1e-2, PAD]])
    kept = t([[1, 1, 0]])
    flat, _ = gae_advantages(t([[0.0, 1.0, 0.0]]), exact, kept, 1.0, 1.0, norm_by_std=False)
    close(flat, [[0.005, -0.005, 0.0]], atol=1e-7)
    whitened, _ = gae_advantages(t([[0.0, 1.0, 0.0]]), exact, kept, 1.0, 1.0)
    close(whitened.abs()[0, :2], [1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-3)
    # A single kept token has no unbiased variance to whiten with, but can be centred:
    one, _ = gae_advantages(t([[1.0, PAD]]), t([[0.0, PAD]]), t([[1, 0]]), 1.0, 1.0, False)
    close(one, [[0.0, 0.0]], atol=1e-7)


def test_gae_skips_masked_positions_inside_a_response():
    rewards = t([[1.0, PAD, 2.0], [0.5, 0.0, -PAD]])
    values = t([[0.3, -PAD, 0.7], [0.1, 0.4, PAD]])
    mask = t([[1, 0, 1], [1, 1, 0]])
    gamma, lam = 0.9, 0.95
    _, ret = gae_advantages(rewards, values, mask, gamma, lam)
    a2 = 2.0 - 0.7
    a0 = (1.0 + gamma * 0.7 - 0.3) + gamma * lam * a2  # the gap passes V and A through
    b1 = 0.0 - 0.4
    b0 = (0.5 + gamma * 0.4 - 0.1) + gamma * lam * b1
    close(ret, [[a0 + 0.3, 0.0, a2 + 0.7], [b0 + 0.1, b1 + 0.4, 0.0]])


def test_gae_matches_the_reference_loop_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 8, generator=g, dtype=D)
    values = torch.randn(5, 8, generator=g, dtype=D)
    mask = (torch.rand(5, 8, generator=g) > 0.35).to(D)
    mask[:, 0] = 1
    mask[1, 4:] = 0  # a row with trailing padding
    adv, ret = gae_advantages(rewards, values, mask, 0.99, 0.95)
    exp_adv, exp_ret = _gae_reference(rewards, values, mask, 0.99, 0.95)
    close(adv, exp_adv, rtol=1e-7, atol=1e-9)
    close(ret, exp_ret)
    pad = mask == 0
    for fill in (PAD, -PAD, INF):
        adv2, ret2 = gae_advantages(
            rewards.masked_fill(pad, fill), values.masked_fill(pad, -fill), mask, 0.99, 0.95
        )
        assert torch.equal(adv2, adv) and torch.equal(ret2, ret)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(2, 6),
    st.integers(0, 2**31 - 1),
    st.sampled_from([PAD, -PAD, INF, -INF]),
)
def test_gae_property_padding_never_matters(n, length, seed, fill):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, length, generator=g, dtype=D)
    values = torch.randn(n, length, generator=g, dtype=D)
    mask = (torch.rand(n, length, generator=g) > 0.4).to(D)
    mask[0, :2] = 1  # at least two kept tokens for the unbiased variance
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.7)
    pad = mask == 0
    adv2, ret2 = gae_advantages(
        rewards.masked_fill(pad, fill), values.masked_fill(pad, fill), mask, 0.9, 0.7
    )
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


# ----------------------------------------------------------------------------- REINFORCE++ / ReMax


def test_reinforce_plus_plus_discounts_and_whitens_over_kept_tokens():
    rewards = t([[0.0, 0.0, 1.0, PAD], [1.0, 0.0, -PAD, INF]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # kept returns .25 .5 1 1 0: mean .55, deviations -.3 -.05 .45 .45 -.55, unbiased var .8/4
    s = math.sqrt(0.2 + 1e-8)
    close(adv, [[-0.3 / s, -0.05 / s, 0.45 / s, 0.0], [0.45 / s, -0.55 / s, 0.0, 0.0]], rtol=1e-7)


def test_reinforce_plus_plus_without_std_only_centres():
    rewards = t([[0.0, 0.0, 1.0, PAD], [1.0, 0.0, -PAD, INF]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5, norm_by_std=False)
    close(ret, [[0.25, 0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    close(adv, [[-0.3, -0.05, 0.45, 0.0], [0.45, -0.55, 0.0, 0.0]], rtol=1e-6)


def test_reinforce_plus_plus_restarts_after_a_masked_gap():
    rewards = t([[1.0, 5.0, 2.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 0, 1], [1, 1, 1]])
    _, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # t=2: 2; t=1 is masked: the running sum restarts, so t=0 sees nothing after it
    close(ret[0], [1.0, 0.0, 2.0])


def test_remax_returns_minus_baseline():
    adv, ret = remax_advantages(
        t([[1.0, 2.0, PAD], [4.0, INF, INF]]), t([0.5, 1.0]), t([[1, 1, 0], [1, 0, 0]])
    )
    close(ret, [[3.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    close(adv, [[2.5, 1.5, 0.0], [3.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- KL


def test_kl_penalty_kinds_hand_computed():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])  # d = logp - ref = .5, -1
    for kind in ("kl", "k1"):
        close(kl_penalty(logp, ref, kind), [0.5, -1.0])
    close(kl_penalty(logp, ref, "abs"), [0.5, 1.0])
    for kind in ("mse", "k2"):
        close(kl_penalty(logp, ref, kind), [0.125, 0.5])
    for kind in ("low_var_kl", "k3"):  # x = ref - logp = -.5, 1: e^x - x - 1
        close(kl_penalty(logp, ref, kind), [math.exp(-0.5) - 0.5, math.e - 2])


def test_k3_clamps_keep_huge_differences_finite():
    logp = torch.tensor([0.0, -1000.0, -30.0])
    ref = torch.tensor([-1000.0, 0.0, -15.0])
    kl = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(kl).all()
    # x clamped to -20: e^-20 + 19 > 10 -> 10; x clamped to 20: e^20 - 21 -> 10;
    # x = 15: e^15 - 16 -> 10 as well (the output clamp)
    close(kl, [10.0, 10.0, 10.0])
    close(kl_penalty(t([0.0]), t([-3.0]), "k3"), [math.exp(-3) + 2])  # under the clamp


def test_kl_penalty_rejects_full_and_unknown_kinds():
    with pytest.raises(ValueError, match="full"):
        kl_penalty(t([0.0]), t([0.0]), "full")
    with pytest.raises(ValueError, match="unknown"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


def test_kl_k3_metric_is_k3_with_the_arguments_exchanged():
    a, b = t([-1.0, -2.0, -0.3]), t([-1.2, -1.0, -0.3])
    close(kl_k3(a, b), kl_penalty(b, a, "k3"))
    close(kl_k3(a, b)[2], 0.0)


def test_apply_kl_penalty_masks_and_averages_per_sequence():
    scores = t([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    logp = t([[-1.0, -1.0, -1.0, PAD], [-2.0, -1.0, -PAD, -PAD], [PAD, PAD, PAD, PAD]])
    ref = t([[-1.5, -1.0, -0.5, -PAD], [-1.0, -1.0, PAD, PAD], [0.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    rewards, batch_kl = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="kl")
    # kl per kept token: .5 0 -.5 | -1 0; masked positions keep their score
    close(rewards, [[-0.05, 0.0, 1.05, 7.0], [0.1, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # per-sequence means 0, -.5 and 0 (nothing kept), averaged over the three rows
    assert batch_kl == pytest.approx(-0.5 / 3, rel=1e-7)


def test_adaptive_kl_controller_hand_computed_and_checkpointable():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    ctl.update(current_kl=0.07, n_steps=64)  # error .4 -> clipped .2; x (1 + .2 * .064)
    assert ctl.value == pytest.approx(0.10128)
    ctl.update(current_kl=0.0, n_steps=100)  # error -1 -> -.2; x (1 - .02)
    assert ctl.value == pytest.approx(0.10128 * 0.98)
    ctl.update(current_kl=0.055, n_steps=500)  # error .1; x 1.05
    assert ctl.value == pytest.approx(0.10128 * 0.98 * 1.05)
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    other = AdaptiveKLController(1.0, 1.0, 1.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    fixed = FixedKLController(0.3)
    fixed.update(5.0, 100)
    assert fixed.value == 0.3 and fixed.state_dict() == {"value": 0.3}
    assert isinstance(make_kl_controller("adaptive", 0.1, 0.05, 10), AdaptiveKLController)
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    with pytest.raises(ValueError):
        make_kl_controller("adaptive", 0.1, 0.05, 0)
    with pytest.raises(ValueError):
        make_kl_controller("pid", 0.1)


# ----------------------------------------------------------------------------- agg_loss

LOSS = t([[1.0, 2.0, 3.0, PAD], [4.0, INF, -INF, PAD], [PAD, -PAD, INF, INF]])
MASK = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the last row has no token


@pytest.mark.parametrize(
    ("mode", "kw", "expected"),
    [
        ("token-mean", {}, (1 + 2 + 3 + 4) / 4),
        ("token-mean", {"batch_num_tokens": 5}, 10 / 5),
        ("seq-mean-token-sum", {}, (6 + 4) / 2),  # the empty row is not a sequence
        ("seq-mean-token-sum", {"global_batch_size": 4}, 10 / 4),
        ("seq-mean-token-mean", {}, (6 / (3 + 1e-8) + 4 / (1 + 1e-8)) / 2),
        # verl 1dda039: seq-mean-token-sum's value, then divided by the width T = 4 (or F)
        ("seq-mean-token-sum-norm", {}, (6 + 4) / 2 / 4),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 10}, (6 + 4) / 2 / 10),
        ("seq-mean-token-sum-norm", {"global_batch_size": 5, "loss_scale_factor": 10}, 10 / 50),
        ("token-sum", {}, 10.0),
        # two ranks: global denominators, times dp (the ranks' gradients are averaged)
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 8}, 10 / 8 * 2),
        ("token-sum", {"dp_size": 2}, 20.0),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 6}, 10 / 6 * 2),
        (
            "seq-mean-token-mean",
            {"dp_size": 3, "global_batch_size": 6},
            (6 / (3 + 1e-8) + 4 / (1 + 1e-8)) / 6 * 3,
        ),
    ],
)
def test_agg_loss_denominators(mode, kw, expected):
    close(agg_loss(LOSS, MASK, mode, **kw), expected)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_empty_batch_is_zero_with_finite_gradient(mode):
    loss = LOSS.clone().requires_grad_()
    out = agg_loss(loss, torch.zeros_like(MASK), mode)
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros_like(loss))


@pytest.mark.parametrize("mode", [m for m in AGG_MODES if m != "token-sum"])
def test_agg_loss_needs_global_denominators_on_several_ranks(mode):
    with pytest.raises(ValueError, match="required when dp_size > 1"):
        agg_loss(LOSS, MASK, mode, dp_size=2)


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "sum")


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(0, 2**31 - 1),
    st.sampled_from(AGG_MODES),
    st.sampled_from([PAD, -PAD, INF, -INF]),
)
def test_agg_loss_property_pad_values_never_matter(n, length, seed, mode, fill):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(n, length, generator=g, dtype=D)
    mask = (torch.rand(n, length, generator=g) > 0.5).to(D)
    pad = mask == 0
    a = agg_loss(loss, mask, mode)
    b = agg_loss(loss.masked_fill(pad, fill), mask, mode)
    assert torch.equal(a, b) and torch.isfinite(a)
    # and token-mean is the plain mean of the kept entries
    if mode == "token-mean" and mask.sum() > 0:
        close(a, loss[mask > 0].mean())


# ----------------------------------------------------------------------------- policy loss


def _tokens(ratios, advs, pad_logp=PAD):
    """One row of tokens with the given ratios pi_theta / pi_behav, plus a padded token."""
    behav = torch.full((1, len(ratios) + 1), -2.0)
    logp = behav + torch.log(torch.tensor([[*ratios, 1.0]]))
    logp[0, -1] = pad_logp
    adv = torch.tensor([[*advs, -PAD]])
    mask = torch.tensor([[1.0] * len(ratios) + [0.0]])
    return logp, behav, adv, mask


def test_dual_clip_bounds_negative_advantages_and_is_counted():
    # tokens: (A=-1, r=4) dual clip binds: max(4, 1.2) = 4 -> min(4, 3) = 3
    #         (A=1, r=2)  ordinary clip: max(-2, -1.2) = -1.2           (pg_clipfrac)
    #         (A=-1, r=.5) lower clip: max(.5, .8) = .8                   (pg_clipfrac)
    #         (A=1, r=1)  nothing clips: -1
    logp, behav, adv, mask = _tokens([4.0, 2.0, 0.5, 1.0], [-1.0, 1.0, -1.0, 1.0])
    out = ppo_loss(logp, logp, behav, adv, mask, "none", 0.2, 2.0, clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx((3 - 1.2 + 0.8 - 1) / 4, rel=1e-6)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 4)
    assert out.clip_fraction.item() == pytest.approx(2 / 4)
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 4)
    assert out.ppo_kl.item() == pytest.approx(-math.log(4 * 2 * 0.5 * 1) / 4, rel=1e-5)
    # without clip_ratio_c the first token costs the full 4 and nothing is counted lower
    off = ppo_loss(logp, logp, behav, adv, mask, "none", 0.2, 2.0)
    assert off.loss.item() == pytest.approx((4 - 1.2 + 0.8 - 1) / 4, rel=1e-6)
    assert off.pg_clipfrac_lower.item() == 0.0


def test_dual_clip_multiplies_the_correction_weight():
    # tis: u = pi_theta / pi_prox = 4, A = -1 -> 3 after the dual clip; w = 1.6 (under cap 2)
    prox = torch.tensor([[-1.0]])
    behav = prox - math.log(1.6)
    logp = prox + math.log(4.0)
    out = ppo_loss(
        logp, prox, behav, -torch.ones(1, 1), torch.ones(1, 1), "tis", 0.2, 2.0, clip_ratio_c=3.0
    )
    assert out.loss.item() == pytest.approx(1.6 * 3, rel=1e-6)


def test_dual_clip_constant_must_exceed_one():
    logp, behav, adv, mask = _tokens([1.0], [1.0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_loss(logp, logp, behav, adv, mask, "none", 0.2, 2.0, clip_ratio_c=1.0)


def test_log_ratio_is_clamped_to_20_before_exp():
    behav = torch.tensor([[-200.0, -50.0]])
    logp = torch.tensor([[-100.0, -50.0]])  # log r = 100 -> 20; exp(100) overflows float32
    out = ppo_loss(
        logp, logp, behav, torch.tensor([[-1.0, 1.0]]), torch.tensor([[1.0, 0.0]]), "none", 0.2, 2.0
    )
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(math.exp(20), rel=1e-6)
    assert out.ppo_kl.item() == pytest.approx(-20.0)


def test_policy_loss_padding_never_matters_and_agg_mode_is_applied():
    logp, behav, adv, mask = _tokens([4.0, 2.0, 0.5, 1.0], [-1.0, 1.0, -1.0, 1.0])
    base = ppo_loss(logp, logp, behav, adv, mask, "tis", 0.2, 2.0, clip_ratio_c=3.0)
    for fill in (-PAD, INF):
        logp2 = logp.clone()
        logp2[0, -1] = fill
        adv2 = adv.clone()
        adv2[0, -1] = -fill
        other = ppo_loss(logp2, logp2, behav, adv2, mask, "tis", 0.2, 2.0, clip_ratio_c=3.0)
        for name in ("loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "is_weight_mean"):
            assert torch.equal(getattr(base, name), getattr(other, name)), name
    # two rows, seq-mean-token-sum: (row sums) / 2
    logp2, behav2, adv2, mask2 = (torch.cat([x, x]) for x in (logp, behav, adv, mask))
    mask2[1, 1:] = 0  # second row: only the dual-clipped token (3)
    out = ppo_loss(
        logp2,
        logp2,
        behav2,
        adv2,
        mask2,
        "none",
        0.2,
        2.0,
        clip_ratio_c=3.0,
        loss_agg_mode="seq-mean-token-sum",
    )
    assert out.loss.item() == pytest.approx(((3 - 1.2 + 0.8 - 1) + 3) / 2, rel=1e-6)


# ----------------------------------------------------------------------------- value loss, metrics


def test_value_loss_half_factor_clip_range_and_clipfrac():
    values = t([[1.0, 2.0, 0.0, 1.0, PAD]])
    old = t([[0.5, 2.0, 1.0, 0.0, -PAD]])
    returns = t([[3.0, 1.0, 0.0, 0.1, INF]])
    mask = t([[1, 1, 1, 1, 0]])
    loss, clipfrac = value_loss(values, old, returns, mask, cliprange_value=0.2)
    # clipped values .7, 2, .8, .2; losses max((v-R)^2, (vc-R)^2):
    #   max(4, 5.29) = 5.29 (clip counted), max(1, 1) = 1, max(0, .64) = .64 (counted),
    #   max(.81, .01) = .81 (clipping would help, so the unclipped loss is kept; not counted)
    close(loss, 0.5 * (5.29 + 1 + 0.64 + 0.81) / 4)
    close(clipfrac, 2 / (4 + 1e-8))
    loss_seq, _ = value_loss(values, old, returns, mask, 0.2, loss_agg_mode="seq-mean-token-sum")
    close(loss_seq, 0.5 * (5.29 + 1 + 0.64 + 0.81))


def test_explained_variance_over_kept_tokens():
    values = t([[1.0, 2.0, PAD], [3.0, -PAD, PAD]])
    returns = t([[1.0, 3.0, INF], [5.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # returns 1 3 5 (var 4), residuals 0 1 2 (var 1)
    close(explained_variance(values, returns, mask), 1 - 1 / (4 + 1e-5))
    assert math.isnan(explained_variance(values, returns, t([[1, 0, 0], [0, 0, 0]])).item())


def test_entropy_loss_and_entropy_from_logits():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -PAD, -PAD], [PAD, 0.0, 0.0, 0.0]]])
    mask = t([[1, 1, 0]])
    close(entropy_from_logits(logits)[0, :2], [math.log(4), math.log(2)])
    close(token_entropy(logits)[0, :2], [math.log(4), math.log(2)], rtol=1e-6, atol=1e-6)
    close(entropy_loss(logits, mask), (math.log(4) + math.log(2)) / 2)
    close(entropy_loss(logits, mask, "seq-mean-token-sum-norm"), (math.log(4) + math.log(2)) / 3)
