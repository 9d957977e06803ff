"""A step whose episodes came back without a sampled token (an agent that never called the
model, raised, or timed out: a response of length 0, or one whose loss mask is all 0) never
crashes the learner and never moves the weights: every estimator gives zero advantages,
every minibatch without a token skips its optimizer step (``skipped_steps/empty``), and a
step where only some samples are empty trains the others as it did. Through the learner's
own path on a tiny model: ``Learner.compute_advantages`` (learners/advantages.py), then
``critic_update`` and ``policy_update`` (learners/update.py)."""

import copy
import logging

import msgspec
import pytest
import torch

from learners.critic import critic_update, load_critic
from learners.finite import SkipLog, guarded_step
from learners.step_metrics import step_row
from learners.trainer import Learner
from learners.update import StepStats, UpdateHooks, policy_update
from tests.unit.learner_samples import Sample, batch, fake_learner
from verl_async.algos import AGG_MODES, policy_loss_names
from verl_async.algos.correction.settings import PRESETS
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, KLConfig, RolloutCorrectionConfig, TinyModelConfig

HOOKS = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)  # one rank
EMPTY = {
    "length_0": [Sample(0, 1.0, ()), Sample(0, 0.0, ()), Sample(1, 1.0, ()), Sample(1, 0.5, ())],
    "mask_0": [
        Sample(0, 1.0, (0, 0, 0)),
        Sample(0, 0.0, ()),
        Sample(1, 1.0, (0, 0)),
        Sample(1, 0.5, (0,)),
    ],
}
SAMPLED = [Sample(0, 1.0, (1, 1, 1)), Sample(0, 0.0, (1, 0, 1)), Sample(1, 0.2), Sample(1, 0.9)]
# Sampled samples plus empty ones, in groups of their own and in the sampled ones' groups.
MIXED = SAMPLED + [Sample(2, 1.0, ()), Sample(2, 0.0, (0, 0)), Sample(0, 0.0, ())]
ONE_TOKEN = [Sample(0, 1.0, (0, 1)), Sample(0, 0.0, ()), Sample(1, 1.0, ()), Sample(1, 0.0, ())]
ESTIMATORS = {
    "grpo": {"adv_estimator": "grpo"},
    "dr_grpo": {"adv_estimator": "grpo", "normalize_adv_std": False},
    "rloo": {"adv_estimator": "rloo"},
    "gdpo": {"adv_estimator": "gdpo"},
    "reinforce_plus_plus": {"adv_estimator": "reinforce_plus_plus"},
    "reinforce_plus_plus_centred": {
        "adv_estimator": "reinforce_plus_plus",
        "normalize_adv_std": False,
    },
    "gae": {"adv_estimator": "gae"},
    "gae_centred": {"adv_estimator": "gae", "normalize_adv_std": False},
}
IN_REWARD = KLConfig(in_reward=True, coef=0.1, controller="adaptive", target_kl=0.1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy, critic) of the tiny model, fresh copies per use."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("m") / "m", TinyModelConfig())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), load_critic(path)


def learner_for(models, estimator: str, in_reward: bool, **algo):
    """A fake learner with this estimator: the policy and (in-reward KL) a reference, and
    (gae) a critic, each a fresh copy."""
    policy, critic = models
    kw = {**ESTIMATORS[estimator], **algo}
    if in_reward:
        kw["kl"] = IN_REWARD
    learner = fake_learner(**kw)
    learner.model = copy.deepcopy(policy)
    learner.reference = copy.deepcopy(policy) if in_reward else None
    learner.critic = copy.deepcopy(critic) if kw["adv_estimator"] == "gae" else None
    return learner


def train_step(learner, b):
    """compute_advantages, the critic's update (gae), the actor's update: AdamW with weight
    decay, which moves the weights even at a zero gradient if it steps at all."""
    adv = Learner.compute_advantages(learner, b, b)
    critic_stats = None
    if learner.critic is not None:
        opt = torch.optim.AdamW(learner.critic.parameters(), lr=0.1, weight_decay=0.1)
        critic_stats = critic_update(
            learner.critic, opt, b, b.values, adv.returns, learner.algo, HOOKS,
            cliprange_value=0.5,
        )  # fmt: skip
    opt = torch.optim.AdamW(learner.model.parameters(), lr=0.1, weight_decay=0.1)
    stats = policy_update(learner.model, opt, b, adv.advantages, learner.algo, HOOKS)
    return adv, stats, critic_stats


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


# Every estimator with and without the KL in the reward (gdpo refuses one at config load).
KL_CASES = [(e, kl) for e in ESTIMATORS for kl in (False, True) if not (kl and e == "gdpo")]


def _kl_id(case) -> str:
    return f"{case[0]}-{'kl_in_reward' if case[1] else 'no_kl'}"


@pytest.mark.parametrize("empty", list(EMPTY))
@pytest.mark.parametrize(("estimator", "in_reward"), KL_CASES, ids=map(_kl_id, KL_CASES))
def test_a_step_without_sampled_tokens_trains_as_nothing(models, estimator, in_reward, empty):
    learner = learner_for(models, estimator, in_reward)
    b = batch(EMPTY[empty])
    actor, critic = weights(learner.model), learner.critic and weights(learner.critic)
    coef = learner.kl_ctrl.value
    adv, stats, critic_stats = train_step(learner, b)
    assert torch.equal(adv.advantages, torch.zeros_like(b.loss_mask))
    assert adv.returns is None or torch.equal(adv.returns, torch.zeros_like(b.loss_mask))
    assert learner.kl_ctrl.value == coef  # no KL was observed: the coefficient stays
    assert unchanged(learner.model, actor)
    assert (stats.optimizer_steps, stats.skipped_empty) == (0, learner.algo.minibatches)
    assert stats.skipped_nonfinite_loss == stats.skipped_nonfinite_grad == 0
    if critic_stats is not None:
        assert unchanged(learner.critic, critic)
        assert critic_stats.skipped_empty == learner.algo.minibatches


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_one_sampled_token_in_the_step_trains_without_whitening_it(models, estimator):
    """One token has nothing to be compared with: a whitened advantage is 0/0, so 0."""
    learner = learner_for(models, estimator, False)
    b = batch(ONE_TOKEN)
    adv, stats, _ = train_step(learner, b)
    assert torch.isfinite(adv.advantages).all()
    if ESTIMATORS[estimator].get("normalize_adv_std", True) and estimator not in ("grpo", "rloo"):
        assert torch.equal(adv.advantages, torch.zeros_like(b.loss_mask))
    assert stats.skipped_empty + stats.optimizer_steps == learner.algo.minibatches


@pytest.mark.parametrize(("estimator", "in_reward"), KL_CASES, ids=map(_kl_id, KL_CASES))
def test_empty_samples_beside_sampled_ones_change_nothing(models, estimator, in_reward):
    """One minibatch, token-mean: the step with empty samples added trains the sampled ones
    to the weights the step without them reaches. The empty samples sit in a group of
    their own; for the token-level estimators one more sits in a sampled group. (For the
    group estimators such a sample joins its group's baseline with a return of 0, as it
    always did, so it would change that group's advantages by design.)"""
    group_level = ESTIMATORS[estimator]["adv_estimator"] in ("grpo", "rloo", "gdpo")
    mixed = MIXED[:-1] if group_level else MIXED
    runs = []
    for samples in (SAMPLED, mixed):
        learner = learner_for(models, estimator, in_reward, minibatches=1)
        adv, stats, _ = train_step(learner, batch(samples))
        assert stats.optimizer_steps == 1
        runs.append((adv, stats, weights(learner.model)))
    (adv, stats, after), (adv_mixed, stats_mixed, after_mixed) = runs
    n = len(SAMPLED)
    torch.testing.assert_close(adv_mixed.advantages[:n, : adv.advantages.shape[1]], adv.advantages)
    assert stats_mixed.loss == pytest.approx(stats.loss, rel=1e-5, abs=1e-7)
    for a, b in zip(after_mixed, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- every loss and correction


CORRECTIONS = {
    "none": {"correction": "none"},
    "tis": {"correction": "tis"},
    "decoupled": {"correction": "decoupled"},
    **{
        f"rollout_{name}": {
            "correction": "rollout",
            "rollout_correction": RolloutCorrectionConfig(preset=name),
        }
        for name in PRESETS
    },
    "rollout_batch_normalized": {
        "correction": "rollout",
        "rollout_correction": RolloutCorrectionConfig(
            preset="decoupled_token_is", rollout_is_batch_normalize=True
        ),
    },
}


def _update_on_empty(models, **algo):
    policy, _ = models
    model = copy.deepcopy(policy)
    before = weights(model)
    b = batch(EMPTY["mask_0"])
    b.logp_ref = torch.zeros_like(b.loss_mask)
    cfg = msgspec.structs.replace(
        AlgoConfig(), entropy_coeff=0.01, kl=KLConfig(loss_coef=0.1), dro_beta=0.1, **algo
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    stats = policy_update(model, opt, b, torch.zeros_like(b.loss_mask), cfg, HOOKS)
    assert unchanged(model, before)
    assert (stats.optimizer_steps, stats.skipped_empty) == (0, cfg.minibatches)
    for name in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "is_weight_mean"):
        assert torch.isfinite(torch.tensor(getattr(stats, name))), name
    return stats


BASIC = ["none", "tis", "decoupled", "rollout_decoupled_seq_is_rs", "rollout_bypass_pg_is"]
EVERY_CASE = [(agg, c) for agg in AGG_MODES for c in BASIC]
EVERY_CASE += [("token-mean", c) for c in CORRECTIONS if c not in BASIC]


@pytest.mark.parametrize(("agg", "correction"), EVERY_CASE)
def test_every_aggregation_and_correction_skips_an_empty_step(models, agg, correction):
    kw = {"loss_agg_mode": agg, **CORRECTIONS[correction]}
    if agg == "seq-mean-token-sum-norm":
        kw["loss_scale_factor"] = 8.0
    stats = _update_on_empty(models, **kw)
    for name, value in (stats.rollout_corr or {}).items():
        assert torch.isfinite(torch.tensor(value)), name


@pytest.mark.parametrize("mode", policy_loss_names())
def test_every_loss_mode_skips_an_empty_step(models, mode):
    _update_on_empty(models, loss_mode=mode)


# ----------------------------------------------------------------------------- pieces


def test_an_empty_minibatch_steps_nothing_and_asks_no_collective():
    class Opt:
        steps = zeroed = 0

        def step(self):
            self.steps += 1

        def zero_grad(self, set_to_none=True):
            self.zeroed += 1

    def refuse(*_):
        raise AssertionError("an empty minibatch reached a collective")

    opt = Opt()
    assert guarded_step(opt, refuse, 0.0, refuse, empty=True) == (0.0, "empty")
    assert (opt.steps, opt.zeroed) == (0, 1)


def test_the_first_empty_skip_is_logged_and_each_is_counted(caplog):
    skips = SkipLog()
    actor = StepStats(*[0.0] * 11, skipped_empty=2)
    with caplog.at_level(logging.WARNING, logger="verl_async.learner"):
        skips.report(7, actor)
        skips.report(8, actor)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("step 7: the actor skipped 2 optimizer step(s) whose minibatch held")
    assert "(skipped_steps/empty)" in line
    b = batch(EMPTY["length_0"])
    b.rewards = torch.zeros(4)
    assert step_row(0, 0, 2, b, actor, 0.0, 0.0, 0.0)["skipped_steps/empty"] == 2


def _stats() -> StepStats:
    return StepStats(*[0.0] * 11)


def test_staleness_counts_samples_with_a_sampled_token_only():
    """At step 6 (eta 2): samples of versions 5, 4 and 4 with tokens, an empty response and
    one whose loss mask is all 0 (of version 1, which must not count either)."""
    samples = [
        Sample(0, 1.0, version=5),
        Sample(0, 0.0, version=4),
        Sample(1, 1.0, (1, 0, 1), version=4),
        Sample(1, 0.0, ()),
        Sample(2, 0.0, (0, 0), version=1),
    ]
    b = batch(samples, step=6)
    b.rewards = torch.zeros(len(samples))
    row = step_row(6, 6, 2, b, _stats(), 0.0, 0.0, 0.0)
    assert row["staleness_mean"] == pytest.approx(5 / 3)  # (1 + 2 + 2) / 3
    assert row["staleness_max"] == 2
    assert row["staleness_hist"] == [0, 1, 2]
    assert row["inflight_update_samples"] == 0
    none = batch(EMPTY["length_0"], step=6)
    none.rewards = torch.zeros(4)
    row = step_row(6, 6, 2, none, _stats(), 0.0, 0.0, 0.0)
    assert (row["staleness_mean"], row["staleness_max"]) == (0.0, 0)
    assert row["staleness_hist"] == [0, 0, 0] and row["inflight_update_samples"] == 0
