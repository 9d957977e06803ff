"""The policy-loss registry and every built-in mode, pinned on hand-worked values and
gradients (float64). The values follow verl 1dda039's definitions (verl_async/algos/loss_modes.py).

Padded positions hold extreme values (1e4, inf) that must never reach a kept output.
"""

import copy
import math

import msgspec
import pytest
import torch

from verl_async.algos import (
    GlobalBatch,
    LossInputs,
    get_policy_loss,
    kl_penalty,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from verl_async.algos import policy_losses as registry
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.schema import AlgoConfig, LearnerConfig

D = torch.float64
PAD = 1e4
MODES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
    "geo_mean", "dro", "cispo", "reinforce",
)  # fmt: skip


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def close(actual, expected, **kw):
    expected = torch.as_tensor(expected, dtype=D)
    torch.testing.assert_close(actual.to(D), expected, **({"rtol": 1e-9, "atol": 1e-12} | kw))


def run(mode, lp, olp, adv, mask, *, weights=None, behav=None, batch=None, seed=0, **settings):
    """(LossOutput, d loss / d lp) of ``mode`` with the given ``algo`` settings."""
    algo = msgspec.structs.replace(AlgoConfig(), loss_mode=mode, **settings)
    logp = lp.clone().requires_grad_()
    behav = olp if behav is None else behav
    out = policy_loss(LossInputs(logp, olp, behav, adv, mask, weights, seed), algo, batch)
    out.loss.backward()
    return out, logp.grad


# ----------------------------------------------------------------------------- each mode


def test_vanilla_clip_dual_clip_and_gradient():
    # r = 4, A = -1: dual clip -> 3, no gradient; r = 2, A = 1: clipped to 1.2, no gradient;
    # r = 1, A = 1: -1, gradient -A r = -1; token-mean over 3 kept tokens.
    lp = t([[-1.0, -1.0, -1.0, PAD]])
    olp = lp - torch.log(t([[4.0, 2.0, 1.0, 1.0]]))
    out, grad = run("vanilla", lp, olp, t([[-1.0, 1.0, 1.0, 0]]), t([[1, 1, 1, 0]]))
    close(out.loss, (3 - 1.2 - 1) / 3)
    close(grad, [[0, 0, -1 / 3, 0]])
    close(out.pg_clipfrac, 1 / (3 + 1e-8))  # r = 4, A < 0: the clip would lower the loss
    close(out.pg_clipfrac_lower, 1 / (3 + 1e-8))
    close(out.ppo_kl, -math.log(8) / (3 + 1e-8))


def test_dppo_tv_drops_tokens_moved_past_the_threshold_and_truncates_the_ratio():
    p_old = t([[0.5, 0.5, 0.5, 0.5, 0.1]])
    p = t([[0.6, 0.8, 0.25, 0.4, 0.5]])
    adv = t([[1.0, 1.0, -1.0, -2.0, -1.0]])
    # valid: +.1 <= .2 yes; +.3 no; -.25 >= -.2 no; -.1 yes; +.4 with A < 0 yes.
    # ratios 1.2, -, -, .8, 5 -> truncated at clip_ratio_c = 3 (stopped gradient).
    out, grad = run("dppo_tv", p.log(), p_old.log(), adv, torch.ones_like(p))
    r_bar = t([[1.2, 0, 0, 0.8, 3.0]])
    close(out.loss, (-adv * r_bar * p.log()).sum() / 5)
    close(grad, -adv * r_bar / 5)
    close(out.pg_clipfrac, 2 / (5 + 1e-8))
    close(out.pg_clipfrac_lower, 1 / (5 + 1e-8))  # the truncated one


def test_dppo_kl_tests_the_binary_kl_in_the_advantage_direction():
    def binary_kl(q, p):  # of the old probability q and the new p
        return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))

    assert binary_kl(0.5, 0.8) > 0.2 > binary_kl(0.5, 0.6)
    assert binary_kl(0.5, 0.1) > 0.2
    p_old = t([[0.5, 0.5, 0.5, 0.5]])
    p = t([[0.8, 0.6, 0.1, 0.1]])
    adv = t([[1.0, 1.0, 1.0, -1.0]])
    # A > 0: p = .8 too far up (dropped); .6 within; .1 moved down (kept whatever the KL).
    # A < 0: .1 moved down by a KL above .2: dropped.
    out, grad = run("dppo_kl", p.log(), p_old.log(), adv, torch.ones_like(p))
    r_bar = t([[0, 1.2, 0.2, 0]])
    close(out.loss, (-adv * r_bar * p.log()).sum() / 4)
    close(grad, -adv * r_bar / 4)
    close(out.pg_clipfrac, 2 / (4 + 1e-8))


def test_dppo_cap_is_20_without_clip_ratio_c():
    p_old, p = t([[0.01]]), t([[0.5]])  # ratio 50
    _, grad = run("dppo_tv", p.log(), p_old.log(), t([[-1.0]]), t([[1]]), clip_ratio_c=None)
    close(grad, [[20.0]])


def test_gspo_uses_the_sequence_ratio_and_forces_seq_mean_token_mean():
    # Row 0: log-ratios .1, .3 -> s = e^.2 > 1.2 with A = 1: clipped, no gradient.
    # Row 1: log-ratios 0, -.1 (and a pad) -> s = e^-.05, unclipped; d/dlp = -A s per token.
    lp = t([[-1.0, -2.0, -1.0], [-1.0, -0.5, PAD]])
    d = t([[0.1, 0.3, 0.0], [0.0, -0.1, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    adv = t([[1.0], [1.0]])
    s = math.exp(-0.05)
    n = 2 + 1e-8  # seq-mean-token-mean's row count
    for mode in ("token-mean", "token-sum"):  # the aggregation setting is not read
        out, grad = run("gspo", lp, lp - d, adv, mask, loss_agg_mode=mode)
        close(out.loss, (-1.2 * 2 / n - s * 2 / n) / 2)
        close(grad, [[0, 0, 0], [-s / n / 2, -s / n / 2, 0]])
    close(out.pg_clipfrac, 2 / (4 + 1e-8))
    close(out.pg_clipfrac_lower, 0.0)
    close(out.ppo_kl, -0.3 / (4 + 1e-8))


def test_gspo_log_ratio_is_clamped_at_10():
    lp = t([[-1.0]])
    out, grad = run("gspo", lp, lp - 12.0, t([[-1.0]]), t([[1]]))
    close(out.loss, math.exp(10) / (1 + 1e-8))
    close(grad, [[0.0]])  # the clamp binds: no gradient


def test_sapo_soft_gate_value_and_gradient():
    # r = 1: gate 2 / tau, gradient -A (tau_pos = 1 for A > 0, tau_neg = 1.05 otherwise).
    # r = 2, A = 1: gate 4 sigma(1); d/dlp = -A 4 sigma(1)(1 - sigma(1)) r.
    lp = t([[-1.0, -1.0, -1.0, PAD]])
    olp = lp - torch.log(t([[1.0, 1.0, 2.0, 1.0]]))
    adv = t([[1.0, -1.0, 1.0, 5.0]])
    out, grad = run("sapo", lp, olp, adv, t([[1, 1, 1, 0]]), loss_agg_mode="token-sum")
    sig = 1 / (1 + math.exp(-1))
    n = 3 + 1e-8
    close(out.loss, (-2 + 2 / 1.05 - 4 * sig) / n)  # seq-mean-token-mean, one row
    close(grad, [[-1 / n, 1 / n, -4 * sig * (1 - sig) * 2 / n, 0]])
    close(out.pg_clipfrac, 0.0)
    close(out.ppo_kl, -math.log(2) / (3 + 1e-8))


def test_gpg_is_the_plain_policy_gradient_with_weights():
    lp = t([[-1.0, -2.0, PAD]])
    w = t([[0.5, 2.0, PAD]])
    out, grad = run("gpg", lp, lp + 0.3, t([[1.0, -1.0, PAD]]), t([[1, 1, 0]]), weights=w)
    close(out.loss, (-1.0 * -1.0 * 0.5 + 1.0 * -2.0 * 2.0) / 2)
    close(grad, [[-0.5 / 2, 2.0 / 2, 0]])
    close(out.ppo_kl, 0.0)  # gpg reports no metric


# clip_cov: eight tokens at ratio 1 (no PPO clip), mean A = 0 and mean lp = -2, so
# cov = A (lp + 2) = 2, 2, 2, -2, -2, -2, -3, 3: tokens 0, 1, 2 and 7 lie in (1, 5);
# clip_cov_ratio .25 of 8 tokens drops 2 of them, drawn by randperm seeded with the seed.
COV_LP = t([[-1.0, -1, -1, -1, -1, -1, -5, -5]])
COV_ADV = t([[2.0, 2, 2, -2, -2, -2, 1, -1]])
COV_CANDIDATES = torch.tensor([0, 1, 2, 7])


def _clip_cov(seed):
    return run(
        "clip_cov", COV_LP, COV_LP, COV_ADV, torch.ones_like(COV_LP), seed=seed,
        clip_cov_ratio=0.25,
    )  # fmt: skip


def test_clip_cov_drops_a_seeded_random_choice_of_high_covariance_tokens():
    for seed in (0, 1, 7):
        perm = torch.randperm(4, generator=torch.Generator().manual_seed(seed))
        dropped = COV_CANDIDATES[perm[:2]]
        keep = torch.ones(8, dtype=D)
        keep[dropped] = 0
        out, grad = _clip_cov(seed)
        close(out.loss, (-COV_ADV[0] * keep).sum() / 8)
        close(grad[0], -COV_ADV[0] * keep / 8)
        close(out.pg_clipfrac, 2 / (8 + 1e-8))


def test_clip_cov_is_reproducible_by_seed():
    a, b = _clip_cov(3), _clip_cov(3)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].loss, b[0].loss)
    choices = {tuple((_clip_cov(s)[1][0] == 0).tolist()) for s in range(12)}
    assert len(choices) > 1  # other seeds, other tokens


def test_clip_cov_leaves_ppo_clipped_tokens_alone():
    # every token's ratio is 2 with A > 0: all clipped, none is a candidate
    out, grad = run(
        "clip_cov", COV_LP, COV_LP - math.log(2), COV_ADV.abs(), torch.ones_like(COV_LP),
        clip_cov_ratio=0.25,
    )  # fmt: skip
    close(out.pg_clipfrac, 0.0)
    close(out.loss, -(COV_ADV.abs() * 1.2).sum() / 8)


def test_kl_cov_penalises_the_largest_covariance_token():
    # A = 1, -1, 1, -1 (mean 0), lp - mean lp = 1, 0, -1, 0: cov = 1, 0, -1, 0 -> token 0.
    lp = t([[-1.0, -2.0, -3.0, -2.0, PAD]])
    d = t([[0.1, -0.2, 0.0, 0.3, 0.0]])
    adv = t([[1.0, -1.0, 1.0, -1.0, 9.0]])
    mask = t([[1, 1, 1, 1, 0]])
    out, grad = run("kl_cov", lp, lp - d, adv, mask, kl_cov_ratio=0.25, kl_cov_coef=0.1)
    r = torch.exp(d[0, :4])
    close(out.loss, ((-adv[0, :4] * r).sum() + 0.1 * 0.1) / 4)
    expected = -adv[0, :4] * r
    expected[0] += 0.1  # d/dlp of 0.1 |d| with d > 0
    close(grad[0, :4], expected / 4)
    close(out.ppo_kl, 0.6 / (4 + 1e-8))  # the mean |d|


def test_geo_mean_is_a_plain_mean_of_sequence_geometric_ratios():
    # Row 0, A = 1: log-ratios .1, .3, -.5 limited to at most .2 -> .1, .2, -.5;
    # row 1, A = -1: .5, -.3 limited to at least -.2 -> .5, -.2 (plus a pad).
    lp = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, PAD]])
    d = t([[0.1, 0.3, -0.5], [0.5, -0.3, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv = t([[1.0], [-1.0]])
    n0, n1 = 3 + 1e-8, 2 + 1e-8  # the rows' token counts (+ 1e-8, as verl)
    r0, r1 = math.exp(-0.2 / n0), math.exp(0.3 / n1)
    a0, a1 = 3 / n0, -2 / n1  # the rows' mean advantages
    for mode, batch in (("token-mean", None), ("token-sum", GlobalBatch(dp_size=4))):
        out, grad = run("geo_mean", lp, lp - d, adv, mask, loss_agg_mode=mode, batch=batch)
        close(out.loss, (-a0 * r0 - a1 * r1) / 2)  # the aggregation settings are not read
    close(grad, [[-a0 * r0 / n0 / 2, 0, -a0 * r0 / n0 / 2], [-a1 * r1 / n1 / 2, 0, 0]])
    close(out.pg_clipfrac, 2 / (5 + 1e-8))
    close(out.pg_clipfrac_lower, 2 / (5 + 1e-8))
    # token weights enter as their geometric mean per sequence
    w = t([[2.0, 8.0, 4.0], [1.0, 1.0, PAD]])
    out, _ = run("geo_mean", lp, lp - d, adv, mask, weights=w)
    g0 = math.exp(sum(math.log(x + 1e-10) for x in (2, 8, 4)) / n0)  # about 4
    g1 = math.exp(2 * math.log(1 + 1e-10) / n1)
    close(out.loss, (-a0 * r0 * g0 - a1 * r1 * g1) / 2)


def test_dro_value_gradient_and_required_beta():
    lp = t([[-1.0, -2.0, PAD]])
    d = t([[0.2, -0.4, PAD]])
    adv = t([[1.0, -2.0, PAD]])
    out, grad = run("dro", lp, lp - d, adv, t([[1, 1, 0]]), dro_beta=0.5)
    close(out.loss, (-(-1.0 - 0.25 * 0.04) - (4.0 - 0.25 * 0.16)) / 2)
    close(grad, [[-(1.0 - 0.5 * 0.2) / 2, -(-2.0 + 0.5 * 0.4) / 2, 0]])
    close(out.ppo_kl, 0.2 / (2 + 1e-8))
    with pytest.raises(ValueError, match="algo.dro_beta"):
        run("dro", lp, lp - d, adv, t([[1, 1, 0]]))


def test_cispo_weighs_every_token_by_the_stopped_clipped_ratio():
    lp = t([[-1.0, -2.0, -0.5]])
    olp = lp - torch.log(t([[1.5, 0.5, 1.0]]))
    adv = t([[1.0, -1.0, 2.0]])
    out, grad = run("cispo", lp, olp, adv, torch.ones_like(lp))
    c = t([[1.2, 0.8, 1.0]])
    close(out.loss, (-c * adv * lp).sum() / 3)
    close(grad, -c * adv / 3)
    close(out.pg_clipfrac, 2 / (3 + 1e-8))
    close(out.pg_clipfrac_lower, 0.0)


def test_reinforce_reports_kl_to_the_behaviour_policy():
    lp = t([[-1.0, -2.0]])
    behav = t([[-1.5, -2.5]])
    w = t([[2.0, 1.0]])
    out, grad = run("reinforce", lp, lp, t([[1.0, 1.0]]), t([[1, 1]]), weights=w, behav=behav)
    close(out.loss, (2.0 * 1.0 + 2.0) / 2)
    close(grad, [[-1.0, -0.5]])
    close(out.ppo_kl, -0.5 * 2 / (2 + 1e-8))


# ----------------------------------------------------------------------------- every mode

SETTINGS = {"dro_beta": 0.1, "clip_cov_ratio": 0.25, "kl_cov_ratio": 0.25}


def _random_case(seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 5, generator=g, dtype=D) * 2 - 0.1
    olp = lp + 0.3 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.randn(3, 1, generator=g, dtype=D).expand(3, 5).contiguous()
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    return lp, olp, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_ignores_padding_values_and_their_gradients(mode):
    lp, olp, adv, mask = _random_case(1)
    ones = torch.ones_like(lp)
    out, grad = run(mode, lp, olp, adv, mask, weights=ones, **SETTINGS)
    pad = mask == 0
    for fill in (PAD, -PAD, float("inf")):
        j_out, j_grad = run(
            mode, lp.masked_fill(pad, fill), olp.masked_fill(pad, -fill),
            adv.masked_fill(pad, fill), mask, weights=ones.masked_fill(pad, fill),
            **SETTINGS,
        )  # fmt: skip
        assert torch.equal(j_out.loss, out.loss), (mode, fill)
        assert torch.equal(j_grad, grad), (mode, fill)
        assert torch.equal(j_out.ppo_kl, out.ppo_kl), (mode, fill)
    assert torch.all(grad[pad] == 0) and torch.isfinite(out.loss)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_multiplies_its_loss_by_the_correction_weights(mode):
    lp, olp, adv, mask = _random_case(2)
    plain, _ = run(mode, lp, olp, adv, mask, **SETTINGS)
    doubled, _ = run(mode, lp, olp, adv, mask, weights=torch.full_like(lp, 2.0), **SETTINGS)
    close(doubled.loss, 2 * plain.loss, rtol=1e-8)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_honours_or_ignores_the_aggregation_as_verl(mode):
    lp, olp, adv, mask = _random_case(3)
    mean, _ = run(mode, lp, olp, adv, mask, loss_agg_mode="token-mean", **SETTINGS)
    total, _ = run(mode, lp, olp, adv, mask, loss_agg_mode="token-sum", **SETTINGS)
    if mode in ("gspo", "sapo", "geo_mean"):
        assert torch.equal(mean.loss, total.loss)
    else:
        close(total.loss, mean.loss * mask.sum(), rtol=1e-9)


def test_every_built_in_mode_is_registered():
    assert set(MODES) <= set(policy_loss_names())
    assert get_policy_loss("vanilla") is get_policy_loss("vanilla")


# ----------------------------------------------------------------------------- registry


@pytest.fixture
def own_registry(monkeypatch):
    """A copy of the registry, so a test's registrations end with it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_adding_a_mode_is_one_function_and_one_registration(own_registry):
    @register_policy_loss("doubled_gpg")
    def doubled_gpg(inputs, algo, batch):
        loss_mat = -2.0 * inputs.advantages * inputs.logp
        return batch.agg(loss_mat, inputs.mask, algo.loss_agg_mode), {"pg_clipfrac": 0.5}

    lp = t([[-1.0, -3.0]])
    out, grad = run("doubled_gpg", lp, lp, t([[1.0, 1.0]]), t([[1, 1]]))
    close(out.loss, 4.0)
    close(grad, [[-1.0, -1.0]])
    close(out.pg_clipfrac, 0.5)
    close(out.pg_clipfrac_lower, 0.0)  # a metric the mode does not report reads 0
    assert "doubled_gpg" in policy_loss_names()


def test_a_name_registered_twice_raises(own_registry):
    with pytest.raises(ValueError, match="'vanilla' is registered already"):
        register_policy_loss("vanilla")(lambda inputs, algo, batch: None)


def test_an_unknown_mode_names_the_key_and_the_known_modes():
    with pytest.raises(ConfigError, match="algo.loss_mode") as err:
        get_policy_loss("gpso")
    assert "gspo" in str(err.value) and "package.module:function" in str(err.value)


def test_a_custom_loss_by_import_path():
    lp = t([[-1.0, -3.0, PAD]])
    out, grad = run("tests.unit.custom_losses:halved", lp, lp, t([[1.0, 2.0, PAD]]), t([[1, 1, 0]]))
    close(out.loss, (0.5 + 3.0) / 2)
    close(grad, [[-0.25, -0.5, 0]])
    close(out.ppo_kl, 0.25)
    close(out.pg_clipfrac, 0.125)  # under verl's name
    for bad, why in (
        ("tests.unit.no_such_module:f", "cannot be imported"),
        ("tests.unit.custom_losses:missing", "has no 'missing'"),
        ("tests.unit.custom_losses:NOT_A_FUNCTION", "is not a function"),
    ):
        with pytest.raises(ConfigError, match=why):
            get_policy_loss(bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.loss_mode=dro"], "'algo.dro_beta': loss_mode dro needs a value > 0"),
        (["algo.loss_mode=my losses"], "'algo.loss_mode': 'my losses' is neither"),
        (["algo.clip_cov_lb=5"], "'algo.clip_cov_ub': must exceed algo.clip_cov_lb"),
        (["algo.dro_beta=0"], "algo.dro_beta"),
        (["algo.tau_neg=0"], "algo.tau_neg"),
        (["algo.kl_cov_ratio=0"], "algo.kl_cov_ratio"),
    ],
)
def test_config_refuses_bad_loss_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", overrides)


def test_the_launcher_refuses_a_mode_no_loss_has_before_starting_roles():
    from verl_async.launch.prepare import check_loss_mode

    with pytest.raises(ConfigError, match="unknown loss mode 'gpso'"):
        check_loss_mode(load_config("configs/tiny.yaml", ["algo.loss_mode=gpso"]))
    check_loss_mode(load_config("configs/tiny.yaml", ["algo.loss_mode=gspo"]))


def test_config_takes_a_mode_with_its_settings():
    cfg = load_config("configs/tiny.yaml", ["algo.loss_mode=dro", "algo.dro_beta=0.2"])
    assert cfg.algo.loss_mode == "dro" and cfg.algo.dro_beta == 0.2
    cfg = load_config("configs/tiny.yaml", ["algo.loss_mode=tests.unit.custom_losses:halved"])
    assert cfg.algo.loss_mode == "tests.unit.custom_losses:halved"


# ----------------------------------------------------------------------------- KL "+"


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "low_var_kl", "k3", "k2", "mse"])
def test_plus_kl_is_the_estimate_with_the_k2_gradient(kind):
    logp = t([[-1.0, -2.0, -0.5]]).requires_grad_()
    ref = t([[-1.5, -1.0, -0.5]])
    value = kl_penalty(logp, ref, kind + "+")
    close(value, kl_penalty(logp, ref, kind).detach())
    value.sum().backward()
    close(logp.grad, (logp - ref).detach())  # d/dlogp of 0.5 (logp - ref)^2


def test_plus_kl_gradient_ignores_the_k3_clamps_and_full_plus_raises():
    logp = t([[-30.0]]).requires_grad_()
    ref = t([[0.0]])
    value = kl_penalty(logp, ref, "k3+")
    close(value, [[10.0]])  # k3's clamped value
    value.sum().backward()
    close(logp.grad, [[-30.0]])
    with pytest.raises(ValueError, match="full"):
        kl_penalty(logp, ref, "full+")


# ----------------------------------------------------------------------------- in the learner


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig

    path = build_tiny_model(tmp_path_factory.mktemp("m"), TinyModelConfig())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _update(model, mode, seed=0, **settings):
    from learners.update import UpdateHooks, policy_update

    from .test_policy_update import _batch

    model = copy.deepcopy(model)
    algo = msgspec.structs.replace(AlgoConfig(), loss_mode=mode, **(SETTINGS | settings))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    hooks = UpdateHooks(backward=lambda x: x.backward(), clip_grad=lambda: 0.0)
    learner = LearnerConfig(seed=seed)
    stats = policy_update(model, opt, _batch(), adv, algo, hooks, learner=learner)
    return model, stats


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_steps_the_learner_and_reports_its_metrics(tiny_model, mode):
    model, stats = _update(tiny_model, mode)
    assert all(math.isfinite(x) for x in (stats.loss, stats.pg_loss, stats.ppo_kl)), mode
    assert stats.optimizer_steps == 2
    moved = max(
        (a - b).abs().max()
        for a, b in zip(model.parameters(), tiny_model.parameters(), strict=True)
    )
    assert moved > 0, mode
    if mode in ("sapo", "gpg", "kl_cov", "dro", "reinforce"):
        assert stats.clip_fraction == 0.0  # these report no clip fraction
    if mode == "kl_cov":
        assert stats.ppo_kl >= 0.0  # its ppo_kl is a mean |log-ratio|


def test_clip_cov_in_the_learner_repeats_with_its_seed(tiny_model):
    wide = {"clip_cov_lb": -100.0, "clip_cov_ratio": 0.5}  # most tokens are candidates
    a, _ = _update(tiny_model, "clip_cov", seed=5, **wide)
    b, _ = _update(tiny_model, "clip_cov", seed=5, **wide)
    c, _ = _update(tiny_model, "clip_cov", seed=6, **wide)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
