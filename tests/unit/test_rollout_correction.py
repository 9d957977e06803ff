"""Rollout correction (verl_async/algos/correction/rollout.py and settings.py)
pinned on hand-worked numbers, then the config section.

The running example: three tokens of row 0 and one of row 1 are kept, with token ratios
r = pi_train / pi_rollout = [3, 1/4, 1 | 3/2]; the masked positions hold inf and 1e4,
which must never reach a kept output. Sequence log-weights: S0 = ln(3/4), S1 = ln(3/2).
"""

import json
import math
from dataclasses import asdict
from pathlib import Path

import msgspec
import pytest
import torch

from verl_async.algos import GlobalBatch, actor_inputs, policy_loss
from verl_async.algos.correction.rollout import (
    importance_weights,
    offpolicy_metrics,
    rejection_mask,
    rollout_correction,
)
from verl_async.algos.correction.settings import (
    PRESETS,
    RolloutCorrection,
    SettingError,
    parse_is_threshold,
    parse_rs_thresholds,
    preset_settings,
    resolve,
)
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.schema import AlgoConfig, RolloutCorrectionConfig

D = torch.float64
PAD, INF = 1e4, float("inf")
L = math.log
R = [[3.0, 0.25, 1.0], [1.5, None, None]]  # kept ratios; None = masked
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, INF, PAD]], dtype=D)
ROLL = torch.tensor([[-1 - L(3), -2 - L(0.25), -0.5], [-0.5 - L(1.5), PAD, -INF]], dtype=D)
RHO = torch.where(MASK.bool(), TRAIN - ROLL, torch.zeros_like(TRAIN))  # what the module reads


def close(actual, expected, rtol=1e-7, atol=1e-9):
    actual = torch.as_tensor(actual, dtype=D)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=D), rtol=rtol, atol=atol)


def mean(xs):
    return sum(xs) / len(xs)


# ------------------------------------------------------------------ importance weights


def test_token_truncated_weights_and_metrics_over_the_truncated_weights():
    w, m = importance_weights(RHO, MASK, "token", 2.0)
    close(w, [[2.0, 0.25, 1.0], [1.5, 0.0, 0.0]])
    kept = [2.0, 0.25, 1.0, 1.5]
    mu, second = mean(kept), mean([x * x for x in kept])
    close(m["rollout_is_mean"], mu)  # 1.1875: truncated (raw would give 1.4375)
    close(m["rollout_is_max"], 2.0)
    close(m["rollout_is_min"], 0.25)
    close(m["rollout_is_ratio_fraction_high"], 0.25)  # raw 3 > 2
    close(m["rollout_is_ratio_fraction_low"], 0.25)  # raw 1/4 < 1/2
    close(m["rollout_is_std"], math.sqrt(second - mu * mu))
    close(m["rollout_is_eff_sample_size"], mu * mu / second)
    rows = [3.25 / 3, 1.5]  # row means of w
    close(m["rollout_is_seq_mean"], mean(rows))
    close(m["rollout_is_seq_std"], abs(rows[0] - rows[1]) / math.sqrt(2))
    close(m["rollout_is_seq_max"], 1.5)
    close(m["rollout_is_seq_min"], 3.25 / 3)
    close(m["rollout_is_seq_max_deviation"], 0.5)
    assert m["rollout_is_seq_fraction_high"] == 0.0  # raw row means 4.25/3, 1.5
    assert m["rollout_is_seq_fraction_low"] == 0.0
    assert "rollout_is_oob_ratio" not in m and "rollout_is_batch_norm_factor" not in m


def test_token_icepop_zeroes_out_of_band_weights_and_reports_the_out_of_band_share():
    w, m = importance_weights(RHO, MASK, "token", "0.5_2.5")
    close(w, [[0.0, 0.0, 1.0], [1.5, 0.0, 0.0]])
    close(m["rollout_is_oob_ratio"], 0.5)
    close(m["rollout_is_mean"], 2.5 / 4)
    close(m["rollout_is_min"], 0.0)
    close(m["rollout_is_ratio_fraction_high"], 0.25)  # 3 > 2.5
    close(m["rollout_is_ratio_fraction_low"], 0.25)  # 1/4 < 0.5 (the band's L, not 1/U)


def test_sequence_weights_are_the_product_over_the_row_and_max_reads_the_log_sums():
    w, m = importance_weights(RHO, MASK, "sequence", 1.2)
    close(w, [[0.75, 0.75, 0.75], [1.2, 0.0, 0.0]])
    close(m["rollout_is_max"], 1.5)  # exp of the largest log-sum: untruncated
    close(m["rollout_is_min"], 0.75)
    close(m["rollout_is_mean"], (3 * 0.75 + 1.2) / 4)  # token-weighted
    assert m["rollout_is_ratio_fraction_high"] == 0.5  # over rows: ln 1.5 > ln 1.2
    assert m["rollout_is_ratio_fraction_low"] == 0.5  # ln 0.75 < ln(1/1.2)
    close(m["rollout_is_seq_fraction_high"], 0.5)
    close(m["rollout_is_seq_fraction_low"], 0.5)


def test_sequence_icepop_zeroes_the_whole_row_and_leaves_the_mask():
    w, mask, _ = rollout_correction(
        TRAIN, ROLL, MASK, RolloutCorrection(rollout_is="sequence", rollout_is_threshold="0.8_2")
    )
    close(w, [[0.0, 0.0, 0.0], [1.5, 0.0, 0.0]])
    assert torch.equal(mask, MASK)


def test_batch_normalisation_token_mean_versus_sequence_mean_of_rows():
    w, m = importance_weights(RHO, MASK, "token", 2.0, batch_normalize=True)
    close(m["rollout_is_batch_norm_factor"], 1.1875)
    close(w, torch.tensor([[2.0, 0.25, 1.0], [1.5, 0.0, 0.0]], dtype=D) / 1.1875)
    close(m["rollout_is_mean"], 1.1875)  # the other metrics are taken before
    w, m = importance_weights(RHO, MASK, "sequence", 2.0, batch_normalize=True)
    close(m["rollout_is_batch_norm_factor"], (0.75 + 1.5) / 2)  # rows alike, not tokens
    close(w[1, 0], 1.5 / 1.125)


def test_batch_normalisation_over_a_group_through_reduce():
    """Another rank holds four tokens of weight sum 2: the mean is (4.75 + 2) / 8."""
    others = [torch.tensor(2.0, dtype=D), torch.tensor(4.0, dtype=D)]  # num, den
    calls = []

    def reduce(x):
        calls.append(x)
        return x + others[len(calls) - 1]

    w, m = importance_weights(RHO, MASK, "token", 2.0, batch_normalize=True, reduce=reduce)
    assert len(calls) == 2
    close(m["rollout_is_batch_norm_factor"], 6.75 / 8)
    close(w[0, 0], 2.0 / (6.75 / 8))


def test_all_weights_zero_gives_no_effective_sample_and_no_normalisation():
    w, m = importance_weights(RHO, MASK, "token", "5_6", batch_normalize=True)
    assert torch.equal(w, torch.zeros_like(w))
    assert m["rollout_is_eff_sample_size"] == 0.0  # verl divides by zero here
    assert m["rollout_is_batch_norm_factor"] == 1.0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(2, (2.0, None)), ("1.5", (1.5, None)), (" 0.5_5.0 ", (5.0, 0.5)), ("1_1", (1.0, 1.0))],
)
def test_is_threshold_grammar(spec, expected):
    assert parse_is_threshold(spec) == expected


@pytest.mark.parametrize("spec", [True, "", "abc", "0", "-1", "2_1", "0_1", "a_2", None, "1_x"])
def test_is_threshold_refusals_name_the_key(spec):
    with pytest.raises(SettingError) as err:
        parse_is_threshold(spec)
    assert err.value.key == "rollout_is_threshold"


# ------------------------------------------------------------------ rejection sampling


def test_token_k1_bounds_the_inverse_ratio():
    """k1 = ln(pi_rollout / pi_train): "0.5_5" keeps 0.2 <= r <= 2, not 0.5 <= r <= 5."""
    mask, m = rejection_mask(RHO, MASK, "token_k1", "0.5_5")
    close(mask, [[0, 1, 1], [1, 0, 0]])
    mask, _ = rejection_mask(RHO, MASK, "token_k1", 2)  # L = 1/2: keeps 0.5 <= r <= 2
    close(mask, [[0, 0, 1], [1, 0, 0]])
    close(m["rollout_rs_token_k1_masked_fraction"], 0.25)
    close(m["rollout_rs_token_k1_seq_masked_fraction"], 0.5)


def test_sequence_k1_options_test_the_row_sum_and_the_row_mean():
    # -S0 = ln(4/3), -S1 = ln(2/3): "0.6_1.2" keeps row 1 only.
    mask, _ = rejection_mask(RHO, MASK, "seq_sum_k1", "0.6_1.2")
    close(mask, [[0, 0, 0], [1, 0, 0]])
    # geometric means of 1/r: (4/3)^(1/3) = 1.1006 and 2/3; U = 1.2 keeps [1/1.2, 1.2].
    mask, m = rejection_mask(RHO, MASK, "seq_mean_k1", 1.2)
    close(mask, [[1, 1, 1], [0, 0, 0]])
    close(m["rollout_rs_seq_mean_k1_max"], L(4 / 3) / 3)
    close(m["rollout_rs_seq_mean_k1_min"], L(2 / 3))
    close(m["rollout_rs_seq_mean_k1_fraction_low"], 0.5)  # rows below ln(1/1.2)
    close(m["rollout_rs_seq_mean_k1_seq_fraction_low"], 0.5)
    close(m["rollout_rs_seq_mean_k1_mean"], (3 * L(4 / 3) / 3 + L(2 / 3)) / 4)  # token-weighted


def _k2(r):
    return 0.5 * L(r) ** 2


def _k3(r):
    return r - 1 - L(r)


def test_token_k2_metrics():
    mask, m = rejection_mask(RHO, MASK, "token_k2", 0.7)
    close(mask, [[1, 0, 1], [1, 0, 0]])  # k2 of 1/4 is 0.96
    k = [_k2(3), _k2(0.25), 0.0, _k2(1.5)]
    p = "rollout_rs_token_k2"
    close(m[f"{p}_mean"], mean(k))
    close(m[f"{p}_max"], _k2(0.25))
    close(m[f"{p}_min"], 0.0)
    close(m[f"{p}_fraction_high"], 0.25)
    assert m[f"{p}_fraction_low"] == 0.0 and f"{p}_seq_fraction_low" not in m
    c = [min(x, 0.7) for x in k]
    close(m[f"{p}_std"], math.sqrt(mean([x * x for x in c]) - mean(c) ** 2))
    rows = [mean(k[:3]), k[3]]  # a token option's rows: the mean of its tokens
    close(m[f"{p}_seq_mean"], mean(rows))
    close(m[f"{p}_seq_max"], max(rows))
    close(m[f"{p}_seq_max_deviation"], max(rows))
    close(m[f"{p}_seq_fraction_high"], 0.0)


def test_seq_max_k3_rejects_the_row_of_its_worst_token_and_options_combine_by_and():
    mask, m = rejection_mask(RHO, MASK, "seq_max_k3", 0.8)  # k3(3) = 0.90
    close(mask, [[0, 0, 0], [1, 0, 0]])
    close(m["rollout_rs_seq_max_k3_max"], _k3(3))
    close(m["rollout_rs_seq_max_k3_min"], _k3(1.5))
    mask, m = rejection_mask(RHO, MASK, "token_k2,seq_sum_k3", "0.7,1.6")  # row 0 sums 1.54
    close(mask, [[1, 0, 1], [1, 0, 0]])
    close(m["rollout_rs_seq_sum_k3_masked_fraction"], 0.0)
    close(m["rollout_rs_masked_fraction"], 0.25)
    close(m["rollout_rs_seq_masked_fraction"], 0.5)


def test_rejection_keeps_the_mask_dtype_and_never_revives_padding():
    mask = MASK.bool()
    out, _ = rejection_mask(RHO, mask, "seq_mean_k3", 10.0)
    assert out.dtype == torch.bool and torch.equal(out, mask)


def test_empty_rows_count_in_the_overall_row_share_not_in_the_per_option_one():
    rho = torch.cat([RHO, torch.zeros(1, 3, dtype=D)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=D)])
    _, m = rejection_mask(rho, mask, "token_k1", 2)  # row 0 loses tokens, row 1 none
    close(m["rollout_rs_token_k1_seq_masked_fraction"], 1 / 2)
    close(m["rollout_rs_seq_masked_fraction"], 1 / 3, rtol=1e-6)  # float32, as verl


def test_duplicate_options_are_dropped_before_thresholds_are_counted():
    a, _ = rejection_mask(RHO, MASK, "token_k2, token_k2", 0.7)
    b, _ = rejection_mask(RHO, MASK, "token_k2", 0.7)
    assert torch.equal(a, b)
    with pytest.raises(SettingError, match="one per option"):
        rejection_mask(RHO, MASK, "token_k2,token_k2", "0.7,0.5")


@pytest.mark.parametrize(
    ("options", "spec", "match"),
    [
        ("seq_max_k1", 2, "unknown option 'seq_max_k1'"),
        ("token_k2", "0.5_2", "token_k2"),
        ("token_k2", 0, "positive"),
        ("token_k1", "2_1", "lower bound"),
        ("token_k1", "0_1", "positive"),
        ("token_k1", None, "needs a threshold"),
        ("token_k1,token_k2", "1,2,3", "one per option"),
        ("seq_sum_k3", "x", "not a number"),
    ],
)
def test_rs_refusals_name_the_option(options, spec, match):
    with pytest.raises(SettingError, match=match):
        rejection_mask(RHO, MASK, options, spec)


def test_rs_thresholds_per_option_and_shared():
    got = parse_rs_thresholds(("token_k1", "seq_mean_k3"), "0.5_2.0, 0.01")
    assert got == {"token_k1": (0.5, 2.0), "seq_mean_k3": (None, 0.01)}
    got = parse_rs_thresholds(("token_k1", "seq_sum_k1"), 4)
    assert got == {"token_k1": (0.25, 4.0), "seq_sum_k1": (0.25, 4.0)}


# ------------------------------------------------------------------ off-policy metrics


def test_offpolicy_metrics_hand_computed():
    m = offpolicy_metrics(
        torch.where(MASK.bool(), TRAIN, 0), torch.where(MASK.bool(), ROLL, 0), MASK
    )
    train_rows = [-3.5 / 3, -0.5]
    roll_rows = [(-3.5 - L(0.75)) / 3, -0.5 - L(1.5)]
    d = [r - t for r, t in zip(roll_rows, train_rows, strict=True)]
    close(m["training_log_ppl"], mean([-x for x in train_rows]))
    close(m["training_ppl"], mean([math.exp(-x) for x in train_rows]))
    close(m["rollout_log_ppl"], mean([-x for x in roll_rows]))
    close(m["rollout_ppl"], mean([math.exp(-x) for x in roll_rows]))
    close(m["kl"], -L(3 * 0.25 * 1 * 1.5) / 4)
    close(m["k3_kl"], mean([_k3(3), _k3(0.25), 0.0, _k3(1.5)]))
    close(m["log_ppl_diff"], mean(d))
    close(m["log_ppl_abs_diff"], mean([abs(x) for x in d]))
    close(m["log_ppl_diff_max"], max(d))
    close(m["log_ppl_diff_min"], min(d))
    close(m["ppl_ratio"], mean([math.exp(x) for x in d]))
    close(m["chi2_token"], mean([9.0, 1 / 16, 1.0, 2.25]) - 1)
    close(m["chi2_seq"], mean([0.75**2, 1.5**2]) - 1)


# ------------------------------------------------------------------ orchestration


def test_orchestration_prefixes_every_metric_and_padding_never_leaks():
    cfg = preset_settings("decoupled_seq_is_rs")  # sequence IS at 2, seq_sum_k1 in [0.5, 2]
    w, mask, m = rollout_correction(TRAIN, ROLL, MASK, cfg)
    close(w, [[0.75, 0.75, 0.75], [1.5, 0.0, 0.0]])
    assert torch.equal(mask, MASK)  # 1/r products 4/3 and 2/3 lie in [0.5, 2]
    assert all(k.startswith("rollout_corr/") for k in m)
    assert all(math.isfinite(v) for v in m.values())
    assert {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"} <= set(m)
    assert "rollout_corr/chi2_seq" in m


def test_orchestration_without_is_returns_no_weights_and_only_offpolicy_metrics():
    w, mask, m = rollout_correction(TRAIN, ROLL, MASK, RolloutCorrection())
    assert w is None and torch.equal(mask, MASK)
    assert {k.removeprefix("rollout_corr/") for k in m} == {
        "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl",
        "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
        "ppl_ratio", "chi2_token", "chi2_seq",
    }  # fmt: skip


def test_orchestration_refuses_an_empty_mask_and_mismatched_shapes():
    with pytest.raises(ValueError, match="at least one token"):
        rollout_correction(TRAIN, ROLL, torch.zeros_like(MASK), RolloutCorrection())
    with pytest.raises(ValueError, match="shapes differ"):
        rollout_correction(TRAIN[:, :2], ROLL, MASK, RolloutCorrection())


def test_no_gradient_flows_through_the_weights():
    train = TRAIN.clone().requires_grad_(True)
    w, _, _ = rollout_correction(train, ROLL, MASK, preset_settings("decoupled_token_is"))
    assert not w.requires_grad


# ------------------------------------------------------------------ presets and settings

# verl 1dda039's RolloutCorrectionConfig classmethods, with their arguments' defaults:
# (rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type)
VERL_PRESETS = {
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "bypass_ppo_clip": (None, 2.0, None, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "disabled": (None, 2.0, None, None, False, "ppo_clip"),
}


def test_every_verl_preset_with_its_values():
    assert list(PRESETS) == list(VERL_PRESETS)  # 19, in verl's order
    for name, row in VERL_PRESETS.items():
        s = preset_settings(name)
        got = (s.rollout_is, s.rollout_is_threshold, s.rollout_rs, s.rollout_rs_threshold)
        assert (*got, s.bypass_mode, s.loss_type) == row, name
        assert s.rollout_is_batch_normalize is False
        s.validate()


def test_resolve_preset_arguments_may_change_fixed_keys_may_not():
    s = resolve("decoupled_seq_is_rs", {"rollout_rs_threshold": "0.9_1.1"})
    assert (s.rollout_rs, s.rollout_rs_threshold) == ("seq_sum_k1", "0.9_1.1")
    s = resolve("decoupled_token_is", {"rollout_is_batch_normalize": True, "rollout_is": "token"})
    assert s.rollout_is_batch_normalize and s.rollout_is_threshold == 2.0
    with pytest.raises(SettingError, match="contradicts preset 'decoupled_seq_is_rs'") as err:
        resolve("decoupled_seq_is_rs", {"rollout_rs": "seq_mean_k1"})
    assert err.value.key == "rollout_rs"


@pytest.mark.parametrize(
    ("preset", "explicit", "key"),
    [
        (None, {"rollout_is_threshold": 3.0}, "rollout_is_threshold"),  # rollout_is null
        ("decoupled_geo_rs", {"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
        (None, {"rollout_rs_threshold": 0.1}, "rollout_rs_threshold"),
        ("decoupled_token_is", {"loss_type": "reinforce"}, "loss_type"),
        (None, {"rollout_rs": "token_k1"}, "rollout_rs_threshold"),
        ("nope", {}, "preset"),
    ],
)
def test_resolve_refuses_keys_never_read_or_incomplete(preset, explicit, key):
    with pytest.raises(SettingError) as err:
        resolve(preset, explicit)
    assert err.value.key == key


def test_defaults_are_verls_yaml_defaults():
    assert resolve(None, {}) == RolloutCorrection(
        rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
        rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False, loss_type="ppo_clip",
    )  # fmt: skip


# ------------------------------------------------------------------ the config section


def _load(*overrides):
    return load_config("configs/tiny.yaml", list(overrides))


def test_config_bypass_reinforce_names_its_loss_mode():
    cfg = _load(
        "algo.correction=rollout",
        "algo.rollout_correction.preset=bypass_pg_is",
        "algo.loss_mode=reinforce",
    )
    assert cfg.algo.rollout_correction.settings().loss_type == "reinforce"


def test_config_preset_resolves_and_writes_back_unset_keys_as_absent():
    cfg = _load("algo.correction=rollout", "algo.rollout_correction.preset=decoupled_geo_rs")
    assert cfg.algo.rollout_correction.settings() == preset_settings("decoupled_geo_rs")
    assert (
        _load("algo.correction=rollout").algo.rollout_correction.settings() == RolloutCorrection()
    )


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algo.rollout_correction.preset=decoupled_seq_is"], "'algo.rollout_correction'"),
        (["algo.correction=tis", "algo.rollout_correction.rollout_rs=token_k1"],
         "'algo.rollout_correction'"),
        (["algo.correction=rollout", "algo.rollout_correction.rollout_rs=token_k9",
          "algo.rollout_correction.rollout_rs_threshold=2"], "'algo.rollout_correction.rollout_rs'"),
        (["algo.correction=rollout", "algo.rollout_correction.rollout_is=token",
          "algo.rollout_correction.rollout_is_threshold='2_1.0'"],
         "'algo.rollout_correction.rollout_is_threshold'"),
        (["algo.correction=rollout", "algo.rollout_correction.preset=bypass_pg_is",
          "algo.rollout_correction.loss_type=ppo_clip"], "'algo.rollout_correction.loss_type'"),
        (["algo.correction=rollout", "algo.rollout_correction.preset=decoupled_seq"],
         "'algo.rollout_correction.preset'"),
        (["algo.correction=rollout", "algo.rollout_correction.rollout_is=seq"],
         "'algo.rollout_correction.rollout_is'"),
        (["algo.correction=rollout", "algo.rollout_correction.preset=bypass_pg_is",
          "algo.rollout_correction.rollout_is_batch_normalize=true", "algo.loss_mode=reinforce"],
         "'algo.rollout_correction.rollout_is_batch_normalize'"),
        (["algo.correction=rollout", "algo.rollout_correction.preset=bypass_pg_is"],
         "'algo.loss_mode'"),
        (["algo.correction=rollout", "algo.rollout_correction.preset=bypass_ppo_clip",
          "algo.loss_mode=reinforce"], "'algo.loss_mode'"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        _load(*overrides)


# ------------------------------------------------------------------ verl 1dda039's own values
# tests/fixtures/verl_1dda039.json, section "rollout_correction": each case ran verl's
# compute_rollout_correction_and_rejection_mask on inputs.main's old_log_prob (pi_train)
# and rollout_log_prob in float64 (tests/reference/verl_1dda039.py says how).

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "verl_1dda039.json"


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


def _cases() -> list[dict]:
    return _fixture().get("rollout_correction", {}).get("cases", [])


def _tensor(value, inputs: dict) -> torch.Tensor:
    """A fixture tensor: nested lists, or the name of an ``inputs.main`` tensor."""
    return torch.tensor(inputs[value] if isinstance(value, str) else value, dtype=D)


def test_the_verl_fixture_records_rollout_correction_cases_and_presets():
    data = _fixture()
    assert data, f"{FIXTURE} is missing"
    assert len(data["rollout_correction"]["cases"]) >= 10
    assert set(data["rollout_correction"]["presets"]) == set(PRESETS)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c['name']}-{c['mask']}")
def test_rollout_correction_equals_verl(case):
    main = _fixture()["inputs"]["main"]
    mask = _tensor(case["mask"], main)
    args = case["args"]
    settings = RolloutCorrection(
        rollout_is=args["rollout_is"],
        rollout_is_threshold=args.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=args.get("rollout_is_batch_normalize", False),
        rollout_rs=args.get("rollout_rs"),
        rollout_rs_threshold=args.get("rollout_rs_threshold"),
    )
    w, new_mask, metrics = rollout_correction(
        _tensor("old_log_prob", main), _tensor("rollout_log_prob", main), mask, settings
    )
    if case["weights"] is None:
        assert w is None
    else:
        close(w, case["weights"], rtol=1e-12, atol=1e-12)
    assert torch.equal(new_mask, _tensor(case["modified_mask"], main))
    expected = {k.removeprefix("rollout_corr/"): v for k, v in case["metrics"].items()}
    assert set(metrics) == {f"rollout_corr/{k}" for k in expected}
    for key, value in expected.items():
        got = metrics[f"rollout_corr/{key}"]
        assert got == pytest.approx(value, rel=1e-12, abs=1e-12, nan_ok=True), key


def test_presets_equal_verl():
    recorded = _fixture()["rollout_correction"]["presets"]
    for name, fields in recorded.items():
        ours = asdict(preset_settings(name))
        assert {k: fields[k] for k in ours} == ours, name


def _bypass_entries() -> list[dict]:
    return [e for e in _fixture().get("policy_loss", []) if e["loss_mode"] == "bypass_mode"]


def _bypass_algo(entry: dict):
    """Our algo section for a verl bypass_mode entry: correction rollout in bypass mode,
    with the keys its settings read."""
    c, rc = entry["config"], entry["config"]["policy_loss"]["rollout_correction"]
    keys = {"rollout_is": rc["rollout_is"], "rollout_rs": rc["rollout_rs"], "bypass_mode": True}
    keys["loss_type"] = rc["loss_type"]
    if rc["rollout_is"] is not None:
        keys["rollout_is_threshold"] = rc["rollout_is_threshold"]
    if rc["rollout_rs"] is not None:
        keys["rollout_rs_threshold"] = rc["rollout_rs_threshold"]
    low = c["clip_ratio"] if c["clip_ratio_low"] is None else c["clip_ratio_low"]
    high = c["clip_ratio"] if c["clip_ratio_high"] is None else c["clip_ratio_high"]
    return msgspec.structs.replace(
        AlgoConfig(), correction="rollout", rollout_correction=RolloutCorrectionConfig(**keys),
        loss_mode="reinforce" if rc["loss_type"] == "reinforce" else "vanilla",
        loss_agg_mode=entry["loss_agg_mode"], clip_eps=low, clip_eps_high=high,
        clip_ratio_c=c["clip_ratio_c"],
    )  # fmt: skip


@pytest.mark.parametrize("entry", _bypass_entries(), ids=lambda e: e["name"])
def test_bypass_mode_loss_equals_verl(entry):
    """verl's bypass_mode loss (IS weights of pi_theta against pi_rollout, rejection, then
    vanilla or REINFORCE) through our correction hook and the loss registry: loss,
    gradient, the loss's metrics and every rollout_corr/* metric."""
    group = _fixture()["inputs"][entry["inputs"]]
    mask = _tensor(entry["mask"], group)
    logp = _tensor("log_prob", group).requires_grad_()
    rollout = _tensor(entry["old_log_prob_from"], group)
    algo = _bypass_algo(entry)
    inputs, corr = actor_inputs(logp, rollout, rollout, _tensor("advantages", group), mask, algo)
    out = policy_loss(inputs, algo, GlobalBatch(**entry["config"]["global_batch_info"]))
    out.loss.backward()
    close(out.loss, entry["loss"], rtol=1e-10, atol=1e-12)
    close(logp.grad, entry["grad_log_prob"], rtol=1e-10, atol=1e-12)
    metrics = entry["metrics"]
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if f"actor/{key}" in metrics:
            close(getattr(out, key), metrics[f"actor/{key}"], rtol=1e-10, atol=1e-12)
    expected = {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}
    assert set(corr.metrics) == set(expected)
    for key, value in expected.items():
        assert corr.metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
