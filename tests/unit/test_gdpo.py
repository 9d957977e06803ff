"""gdpo (several reward sources, each group-normalised, weighted, whitened) and the Dr.GRPO
key set, pinned on hand-worked float64 numbers, through the pure function and the learner."""

import json
import math
import statistics
from pathlib import Path

import msgspec
import pytest
import torch

from learners.advantages import SourceScores, estimate
from verl_async.algos import gdpo_advantages, group_ids, grpo_outcome_advantages, masked_whiten
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.schema import AlgoConfig, KLConfig

D = torch.float64
NAN = float("nan")
EPS = 1e-6
ROOT = Path(__file__).resolve().parents[2]


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def close(actual, expected, **kw):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, **({"rtol": 1e-9, "atol": 1e-9} | kw))


def whitened_reference(per_sample, lengths, width):
    """Each sample's value on its first ``lengths[i]`` tokens, whitened over those tokens
    with python floats (unbiased variance, 1e-8 under the root); 0 elsewhere."""
    flat = [v for v, n in zip(per_sample, lengths, strict=True) for _ in range(n)]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    scale = math.sqrt(var + 1e-8)
    pairs = zip(per_sample, lengths, strict=True)
    return [[(v - mean) / scale] * n + [0.0] * (width - n) for v, n in pairs]


# Groups: samples 0-2 (both sources), 3 alone, 4-5 (source b not routed there).
GROUPS = torch.tensor([0, 0, 0, 1, 2, 2])
LENGTHS = [2, 1, 3, 1, 2, 1]
MASK = t([[1.0] * n + [0.0] * (4 - n) for n in LENGTHS])
SCORES = t([[1, 3], [0, 3], [0, 0], [2, 4], [1, NAN], [0, NAN]])
WEIGHTS = [1.0, 0.5]


def hand_worked_sums():
    """sum_k w_k * A_k per sample, worked out by hand."""
    r3 = math.sqrt(3)
    # source a, group 0: [1, 0, 0], mean 1/3, unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3
    a0 = [x / (1 / r3 + EPS) for x in (2 / 3, -1 / 3, -1 / 3)]
    # source b, group 0: [3, 3, 0], mean 2, unbiased var (1 + 1 + 4) / 2 = 3
    b0 = [x / (r3 + EPS) for x in (1.0, 1.0, -2.0)]
    # group 1 alone: mean 0, std 1 (verl's rule) for both sources
    a1, b1 = 2 / (1 + EPS), 4 / (1 + EPS)
    # source a, group 2: [1, 0], mean .5, unbiased var .5; source b scores nobody there
    a2 = [x / (math.sqrt(0.5) + EPS) for x in (0.5, -0.5)]
    sums = [a + 0.5 * b for a, b in zip(a0, b0, strict=True)]
    return [*sums, a1 + 0.5 * b1, *a2]


def test_gdpo_hand_worked_two_sources_weights_a_singleton_and_an_unrouted_source():
    sums = hand_worked_sums()
    # 2.5/r3, -0.5/r3, -2/r3, 4, 1/r2, -1/r2 up to eps
    r3, r2 = math.sqrt(3), math.sqrt(2)
    close(t(sums), [2.5 / r3, -0.5 / r3, -2 / r3, 4.0, 1 / r2, -1 / r2], rtol=1e-5)
    adv, ret = gdpo_advantages(SCORES, GROUPS, WEIGHTS, MASK)
    close(adv, whitened_reference(sums, LENGTHS, 4))
    assert ret is adv and adv.dtype == D
    assert torch.all(adv[MASK == 0] == 0)
    # Group keys may be any hashables (uid strings), as for the other outcome estimators.
    keys = ["u0", "u0", "u0", "u1", "u2", "u2"]
    close(gdpo_advantages(SCORES, keys, WEIGHTS, MASK)[0], adv)


def test_gdpo_group_statistics_are_over_the_routed_samples_only():
    scores = t([[NAN], [1.0], [3.0], [NAN]])
    mask = torch.ones(4, 2, dtype=D)
    adv, _ = gdpo_advantages(scores, torch.tensor([0, 0, 0, 1]), [2.0], mask)
    # routed in group 0: [1, 3], mean 2, std sqrt(2); the unrouted ones (and the group
    # with no routed sample) get 0 before the whitening
    a = 2.0 / (math.sqrt(2) + EPS)
    close(adv, whitened_reference([0.0, -a, a, 0.0], [2, 2, 2, 2], 2))


def test_gdpo_of_one_source_is_whitened_grpo():
    scores = t([0.3, 1.7, -2.0, 5.0, 4.0, 4.5, 9.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    mask = (torch.rand(7, 5, generator=torch.Generator().manual_seed(0)) > 0.4).to(D)
    per_sample = grpo_outcome_advantages(scores, groups)
    expected = masked_whiten(per_sample[:, None] * mask, mask)
    close(gdpo_advantages(scores[:, None], groups, [1.0], mask)[0], expected)


def test_gdpo_ignores_each_sources_scale_where_a_summed_reward_would_not():
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3, dtype=D)
    rule = t([1, 0, 1, 0, 0, 0, 1, 1])  # a 0/1 rule
    model = t([0.2, 0.1, -0.3, 0.4, 0.6, -0.2, 0.3, 0.0])  # a reward model's logits
    base, _ = gdpo_advantages(torch.stack([rule, model], 1), groups, [1.0, 1.0], mask)
    # Rescaling one source (x 100, shifted) leaves gdpo's advantages as they were (up to
    # eps)...
    scaled = torch.stack([rule, 100 * model - 7], 1)
    close(gdpo_advantages(scaled, groups, [1.0, 1.0], mask)[0], base, rtol=1e-5, atol=1e-5)
    # ...while GRPO on the sum follows the large source alone.
    summed = grpo_outcome_advantages(scaled.sum(1), groups)
    close(summed, grpo_outcome_advantages(model, groups), rtol=0.05, atol=0.05)
    assert not torch.allclose(summed, base[:, 0], atol=0.1)


def test_gdpo_needs_two_kept_tokens():
    with pytest.raises(ValueError, match="single entry"):
        gdpo_advantages(t([[1.0], [0.0]]), [0, 0], [1.0], t([[1, 0], [0, 0]]))


# ----------------------------------------------------------------------------- learner


def algo(**kw) -> AlgoConfig:
    return msgspec.structs.replace(AlgoConfig(), **kw)


def test_learner_gdpo_reads_the_sources_scores_and_not_the_combined_reward():
    junk = torch.full((6,), 1e4)  # the combined reward: gdpo must not read it
    sources = SourceScores(SCORES.float(), WEIGHTS)
    out = estimate(algo(adv_estimator="gdpo"), junk, GROUPS, MASK.float(), sources=sources)
    expected = whitened_reference(hand_worked_sums(), LENGTHS, 4)
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float32))
    assert out.returns is None


def test_learner_gdpo_adds_the_environment_return_as_one_more_column():
    mask = torch.ones(4, 3)
    mask[:, 1] = 0  # an observation token between two sampled ones
    turn = torch.zeros(4, 3)
    turn[:, 0] = torch.tensor([-2.0, 0.0, 4.0, -6.0])  # env rewards x env_reward_weight -2
    turn[:, 1] = 1e4  # on the observation: never read
    scores = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    groups = torch.tensor([0, 0, 1, 1])
    sources = SourceScores(scores, [1.0], env_weight=-2.0)
    cfg = algo(adv_estimator="gdpo")
    out = estimate(cfg, torch.zeros(4), groups, mask, turn_rewards=turn, sources=sources)
    # the env column (-2, 0, 4, -6) = -2 x raw (1, 0, -2, 3), weighted |-2|: the same as
    # -2 x the raw return's group advantages
    columns = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, -2.0], [1.0, 3.0]])
    expected, _ = gdpo_advantages(columns, groups, [1.0, -2.0], mask)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-5, atol=1e-5)


def test_learner_gdpo_refuses_missing_scores_and_a_kl_in_the_reward():
    with pytest.raises(ValueError, match="gdpo"):
        estimate(algo(adv_estimator="gdpo"), torch.zeros(6), GROUPS, MASK.float())
    cfg = algo(adv_estimator="gdpo", kl=KLConfig(in_reward=True))
    sources = SourceScores(SCORES.float(), WEIGHTS)
    with pytest.raises(ValueError, match="KL"):
        estimate(cfg, torch.zeros(6), GROUPS, MASK.float(), sources=sources)


def test_learner_dr_grpo_centres_in_the_group_without_the_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0], dtype=D)
    out = estimate(algo(normalize_adv_std=False), rewards, GROUPS, MASK)
    # group 0: mean 1/3; the group of one keeps its score (mean 0); the tied group 0
    per_sample = t([2 / 3, -1 / 3, -1 / 3, 5.0, 0.0, 0.0])
    torch.testing.assert_close(out.advantages, (per_sample[:, None] * MASK).float())


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["rewards.sources=[{name: a, kind: exact}, {name: b, kind: exact, normalize: group}]"],
            "rewards.sources.1.normalize",
        ),
        (["algo.normalize_adv_std=false"], "algo.normalize_adv_std"),
        (["algo.kl.in_reward=true"], "algo.kl.in_reward"),
    ],
)
def test_gdpo_refuses_settings_it_would_ignore(overrides, key):
    path = ROOT / "configs" / "tiny.yaml"
    load_config(path, ["algo.adv_estimator=gdpo"])  # the tiny default takes gdpo as it is
    with pytest.raises(ConfigError, match=f"^bad value for '{key}': adv_estimator gdpo"):
        load_config(path, ["algo.adv_estimator=gdpo", *overrides])


def test_drgrpo_tiny_is_the_tiny_default_with_dr_grpos_keys():
    cfg = load_config(ROOT / "configs" / "drgrpo_tiny.yaml")
    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    a = cfg.algo
    assert a.adv_estimator == "grpo" and not a.normalize_adv_std
    assert a.loss_agg_mode == "seq-mean-token-sum-norm"
    assert a.loss_scale_factor == cfg.generators.max_new_tokens
    assert a.kl.loss_coef == 0 and not a.kl.in_reward
    rest = {"normalize_adv_std": True, "loss_agg_mode": "token-mean", "loss_scale_factor": None}
    assert msgspec.structs.replace(a, **rest) == tiny.algo
    same = msgspec.structs.replace(cfg, name=tiny.name, algo=tiny.algo)
    assert same == tiny


# ----------------------------------------------------------------------------- verl 1dda039
# tests/fixtures/verl_1dda039.json holds the outputs of verl's own compute_grpo_outcome_advantage
# and compute_gdpo_outcome_advantage at commit 1dda039, inputs included (made by
# tests/reference/verl_1dda039.py).


def verl_advantages() -> dict:
    return json.loads((ROOT / "tests" / "fixtures" / "verl_1dda039.json").read_text())["advantages"]


VERL = verl_advantages()


@pytest.mark.parametrize(
    "case", VERL["grpo"], ids=lambda c: f"{c['name']}/std={c['norm_adv_by_std_in_grpo']}"
)
def test_grpo_with_and_without_the_std_matches_verl(case):
    rewards, mask = t(case["token_level_rewards"]), t(case["response_mask"])
    assert case["epsilon"] == EPS
    norm = case["norm_adv_by_std_in_grpo"]
    per_sample = grpo_outcome_advantages(rewards.sum(dim=1), case["index"], norm_by_std=norm)
    close(per_sample[:, None] * mask, case["advantages"], rtol=1e-12, atol=1e-12)
    # The learner's grpo (normalize_adv_std false: Dr.GRPO) on the same rewards; its mask is
    # float32, so the comparison is at float32 precision.
    groups, _ = group_ids(case["index"])
    out = estimate(algo(normalize_adv_std=norm), rewards.sum(dim=1), groups, mask)
    close(out.advantages.double(), case["advantages"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", VERL["gdpo"], ids=lambda c: c["name"])
def test_gdpo_matches_verl(case):
    scores = t([case["scores"][key] for key in case["reward_keys"]]).T  # [N, K]
    weights = case["reward_weights"] or [1.0] * len(case["reward_keys"])  # verl: None = ones
    mask = t(case["response_mask"])
    # verl builds the component scores and the weights in float32 (exact here: 0/1 scores,
    # weights 1 and .5); the rest of its arithmetic ends within 1.2e-8 of float64's.
    adv, _ = gdpo_advantages(scores, case["index"], weights, mask)
    close(adv, case["advantages"], rtol=1e-7, atol=1e-7)
    groups, _ = group_ids(case["index"])
    cfg = algo(adv_estimator="gdpo")
    sources = SourceScores(scores.float(), weights)
    out = estimate(cfg, torch.zeros(len(groups)), groups, mask, sources=sources)
    close(out.advantages.double(), case["advantages"], rtol=1e-6, atol=1e-6)
