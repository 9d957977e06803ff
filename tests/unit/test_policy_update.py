"""The learner's update on a tiny model: the one-minibatch shortcut for pi_prox."""

import copy
import math

import msgspec
import numpy as np
import pytest
import torch

from learners.batching import collate
from learners.logprobs import logits_of
from learners.update import UpdateHooks, policy_update, prox_pass
from verl_async import protocol as P
from verl_async.algos import actor_inputs, policy_loss, token_logprobs
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, KLConfig, TinyModelConfig

HOOKS = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)  # one rank


def _batch(prompts=(5, 5, 5, 5), responses=(3, 3, 3, 3)):
    rng = np.random.default_rng(0)
    n, p, r = len(prompts), sum(prompts), sum(responses)
    frames = P.Frames()
    body = P.Batch(
        step=0,
        group_ids=[0],
        sample_group=[0] * n,
        prompt_lengths=list(prompts),
        response_lengths=list(responses),
        prompt_ids=frames.add(rng.integers(3, 14, p, dtype=np.int32)),
        response_ids=frames.add(rng.integers(3, 14, r, dtype=np.int32)),
        behav_logprobs=frames.add(rng.uniform(-3, -1, r).astype(np.float32)),
        token_versions=frames.add(np.zeros(r, np.int32)),
        scores=[[float(i % 2 == 0)] for i in range(n)],
        failed=[0],
        data_sources=["default"],
        dropped_stale=0,
        buffer_size=0,
    )
    return collate(body, [bytes(b) for b in frames.buffers], pad_id=0)


def test_one_minibatch_takes_pi_prox_from_the_gradient_pass(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    batch = _batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    algo = msgspec.structs.replace(AlgoConfig(), minibatches=1)
    temperature = 0.7

    # By hand: a separate no-grad pass for pi_prox, then one step.
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    logp_prox, _ = prox_pass(reference, batch, temperature)
    logits = logits_of(reference, batch.input_ids, batch.attention_mask, temperature)
    logp = token_logprobs(logits, batch.input_ids[:, 1:])
    inputs, _ = actor_inputs(
        logp, logp_prox, batch.behav_logprobs, adv[:, None], batch.loss_mask, algo
    )
    out = policy_loss(inputs, algo)
    out.loss.backward()
    opt.step()

    opt2 = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = policy_update(model, opt2, batch, adv, algo, HOOKS, temperature=temperature)
    assert abs(stats.loss - out.loss.item()) < 1e-6
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    moved = [
        (a - b).abs().max() for a, b in zip(model.parameters(), initial.parameters(), strict=True)
    ]
    assert max(moved) > 1e-3  # the step really changed the weights
    assert stats.kl > 0  # pi_prox differs from pi_behav (random behaviour log-probs)


ESTIMATORS = ("grpo", "gae", "rloo", "reinforce_plus_plus")
CORRECTIONS = ("none", "tis", "decoupled")


def test_every_estimator_composes_with_every_correction(tmp_path):
    """One update per (estimator, correction) on per-token advantages from
    learners/advantages.py, with a KL loss and an entropy bonus: finite, and it moves."""
    import itertools

    from transformers import AutoModelForCausalLM

    from learners.advantages import estimate

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    batch.logp_ref, _ = prox_pass(base, batch, 1.0)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    values = torch.full_like(batch.loss_mask, 0.25)
    for estimator, correction in itertools.product(ESTIMATORS, CORRECTIONS):
        algo = msgspec.structs.replace(
            AlgoConfig(),
            adv_estimator=estimator,
            correction=correction,
            entropy_coeff=0.01,
            kl=KLConfig(loss_coef=0.1),
        )
        adv = estimate(algo, rewards, groups, batch.loss_mask, values)
        assert adv.advantages.shape == batch.loss_mask.shape
        assert torch.all(adv.advantages[batch.loss_mask == 0] == 0)
        model = copy.deepcopy(base)
        before = [p.clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        stats = policy_update(model, opt, batch, adv.advantages, algo, HOOKS)
        label = f"{estimator}/{correction}"
        assert np.isfinite(stats.loss) and stats.kl_loss is not None, label
        moved = max((a - b).abs().max() for a, b in zip(model.parameters(), before, strict=True))
        assert moved > 0, label


def test_entropy_bonus_subtracts_coeff_times_entropy(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    plain = msgspec.structs.replace(AlgoConfig(), minibatches=1)
    bonus = msgspec.structs.replace(plain, entropy_coeff=0.5)
    a = policy_update(model, None, batch, adv, plain, HOOKS, step=False)
    b = policy_update(model, None, batch, adv, bonus, HOOKS, step=False)
    assert b.loss == pytest.approx(a.loss - 0.5 * a.entropy, abs=1e-5)
    # verl's actor/pg_loss is the policy-gradient part alone: unchanged by the bonus.
    assert b.pg_loss == pytest.approx(a.pg_loss, abs=1e-6) and a.pg_loss == pytest.approx(a.loss)


def test_pg_loss_leaves_out_the_kl_loss_term(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    algo = msgspec.structs.replace(AlgoConfig(), minibatches=1, kl=KLConfig(loss_coef=0.1))
    # A reference that disagrees with the policy, so the KL term is not zero.
    batch.logp_ref = prox_pass(model, batch, 1.0)[0] - 0.3 * batch.loss_mask
    s = policy_update(model, None, batch, adv, algo, HOOKS, step=False)
    assert s.kl_loss > 1e-3
    assert s.loss == pytest.approx(s.pg_loss + 0.1 * s.kl_loss, abs=1e-6)


def test_rollout_logp_gap_is_measured_on_tokens_of_the_trained_version_only(tmp_path):
    """Tokens of the learner's version: |pi_prox - pi_behav|'s maximum; others left out."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    logp_prox, _ = prox_pass(model, batch, 1.0)
    mask = batch.loss_mask > 0
    # Behaviour log-probs: pi_prox exactly, except one token 0.25 off; sample 3 is of an
    # older version and 5.0 off (ignored: other weights sampled it).
    behav = torch.where(mask, logp_prox, batch.behav_logprobs)
    rows, cols = mask.nonzero(as_tuple=True)
    behav[rows[0], cols[0]] += 0.25
    behav[3][mask[3]] -= 5.0
    versions = torch.where(mask, 7, -1)
    versions[3][mask[3]] = 6
    batch.behav_logprobs, batch.token_versions = behav, versions
    algo = msgspec.structs.replace(AlgoConfig(), minibatches=1)
    adv = torch.zeros(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = policy_update(model, opt, batch, adv, algo, HOOKS, version=7)
    assert stats.rollout_logp_diff_max == pytest.approx(0.25, abs=1e-5)
    assert stats.rollout_fresh_fraction == pytest.approx(0.75)  # 3 of 4 samples, same lengths
    none = policy_update(model, opt, batch, adv, algo, HOOKS)
    assert (none.rollout_logp_diff_max, none.rollout_fresh_fraction) == (0.0, 0.0)


@pytest.mark.parametrize("minibatches", [2, 3])
def test_later_minibatches_read_pi_prox_from_before_the_first_step(tmp_path, minibatches):
    """pi_prox of every row is the weights' before the update: the first minibatch's
    gradient pass gives its rows', a no-grad pass the others'. Equal to a full pass over
    all rows first, then one step per minibatch, computed by hand."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = copy.deepcopy(model)
    batch = _batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    algo = msgspec.structs.replace(AlgoConfig(), minibatches=minibatches, correction="decoupled")
    temperature = 0.7

    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with torch.no_grad():
        whole = logits_of(reference, batch.input_ids, batch.attention_mask, temperature)
        logp_prox = token_logprobs(whole, batch.input_ids[:, 1:])
    for rows in np.array_split(np.arange(4), minibatches):
        rows = torch.as_tensor(rows)
        logits = logits_of(
            reference, batch.input_ids[rows], batch.attention_mask[rows], temperature
        )
        logp = token_logprobs(logits, batch.input_ids[rows, 1:])
        inputs, _ = actor_inputs(
            logp, logp_prox[rows], batch.behav_logprobs[rows], adv[rows, None],
            batch.loss_mask[rows], algo,
        )  # fmt: skip
        out = policy_loss(inputs, algo)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    opt2 = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = policy_update(model, opt2, batch, adv, algo, HOOKS, temperature=temperature)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    mask = batch.loss_mask
    expected_kl = float(
        ((logp_prox - batch.behav_logprobs).exp() - 1 - (logp_prox - batch.behav_logprobs))
        .mul(mask)
        .sum()
        / mask.sum()
    )
    assert stats.kl == pytest.approx(expected_kl, rel=1e-4)


def test_length_bucketed_micro_batches_take_the_full_width_step(tmp_path):
    """Rows of unlike lengths in micro-batches of at most 24 padded tokens, each pass cut
    to its longest row: the same weights as one full-width pass per minibatch."""
    from transformers import AutoModelForCausalLM

    from learners.plan import plan_update

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = copy.deepcopy(model)
    batch = _batch(prompts=(3, 6, 2, 5, 4, 3), responses=(2, 7, 1, 4, 6, 3))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -2.0])
    algo = msgspec.structs.replace(AlgoConfig(), minibatches=2, correction="decoupled")

    def run(m, plan):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        return policy_update(m, opt, batch, adv, algo, HOOKS, plan=plan)

    mask, attn = batch.loss_mask, batch.attention_mask
    bucketed = plan_update(mask, attn, [6], 0, 2, max_tokens_per_microbatch=24)
    assert [len(mb.micro) for mb in bucketed] == [2, 2]
    whole = run(reference, plan_update(mask, attn, [6], 0, 2))
    cut = run(model, bucketed)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert cut.loss == pytest.approx(whole.loss, abs=1e-6)
    assert cut.padding_fraction < whole.padding_fraction


PASS_OPTIONS = [
    {"padding_free": True},
    {"padding_free": True, "share_prefix": False},
    {"logprob_chunk_tokens": 0},
    {"logprob_chunk_tokens": 3},
]


@pytest.mark.parametrize("keys", PASS_OPTIONS)
def test_logprob_pass_options_train_as_the_padded_pass(tmp_path, keys):
    """learner.padding_free and learner.logprob_chunk_tokens change how the passes run,
    not the update: the weights after two minibatches (pi_prox from a separate pass for
    the second) equal the padded, default-chunked run's to 1e-6."""
    from transformers import AutoModelForCausalLM

    from verl_async.schema import LearnerConfig

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    batch = _batch(prompts=(3, 6, 2, 5, 4, 3), responses=(2, 7, 1, 4, 6, 3))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -2.0])
    algo = msgspec.structs.replace(AlgoConfig(), minibatches=2, entropy_coeff=0.01)

    def run(learner: LearnerConfig):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        return policy_update(model, opt, batch, adv, algo, HOOKS, learner=learner), model

    (plain, plain_model), (other, model) = run(LearnerConfig()), run(LearnerConfig(**keys))
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert other.loss == pytest.approx(plain.loss, abs=1e-6)
    if keys.get("padding_free"):
        assert other.padding_fraction == 0 < plain.padding_fraction


# ------------------------------------------------------------------ algo.correction: rollout


def _rollout_algo(preset=None, minibatches=2, loss_mode="vanilla", **keys):
    from verl_async.schema import RolloutCorrectionConfig

    section = RolloutCorrectionConfig(**({"preset": preset} if preset else {}), **keys)
    return msgspec.structs.replace(
        AlgoConfig(), correction="rollout", rollout_correction=section,
        minibatches=minibatches, loss_mode=loss_mode,
    )  # fmt: skip


def _train(path, batch, adv, algo, lr=0.5):
    """One update from the tiny model at ``path``: (stats, the model after it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    stats = policy_update(model, opt, batch, adv, algo, HOOKS)
    return stats, model


def _same_update(a, b):
    (sa, ma), (sb, mb) = a, b
    assert abs(sa.loss - sb.loss) < 1e-6
    for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "m", TinyModelConfig())


ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])


def test_rollout_decoupled_token_is_trains_as_tis_and_bypass_ppo_clip_as_none(tiny_path):
    batch = _batch()
    tis = msgspec.structs.replace(AlgoConfig(), correction="tis", is_cap=2.0)
    rollout = _rollout_algo("decoupled_token_is")
    a, b = _train(tiny_path, batch, ADV, tis), _train(tiny_path, batch, ADV, rollout)
    _same_update(a, b)
    assert a[0].rollout_corr is None
    metrics = b[0].rollout_corr
    assert metrics["rollout_corr/rollout_is_mean"] > 0 and "rollout_corr/chi2_seq" in metrics
    assert all(np.isfinite(v) for v in metrics.values())
    none = msgspec.structs.replace(AlgoConfig(), correction="none")
    c, d = (
        _train(tiny_path, batch, ADV, none),
        _train(tiny_path, batch, ADV, _rollout_algo("bypass_ppo_clip")),
    )
    _same_update(c, d)
    assert "rollout_corr/kl" in d[0].rollout_corr


def test_rollout_rejection_trains_as_a_batch_whose_mask_lost_the_rejected_rows(tiny_path):
    """verl's decoupled rejection replaces the response mask before the actor runs: the
    same update as a batch whose loss mask lost those rows, token counts included. The
    band keeps the two rows of smallest |sum of k1| (every row's pi_prox first)."""
    from transformers import AutoModelForCausalLM

    batch = _batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    logp_prox, _ = prox_pass(model, batch, 1.0)
    k1 = ((batch.behav_logprobs - logp_prox) * batch.loss_mask).sum(dim=1)  # [N]
    bound = float(k1.abs().sort().values[1:3].mean())  # between the 2nd and 3rd smallest
    band = f"{math.exp(-bound)}_{math.exp(bound)}"
    algo = _rollout_algo(None, rollout_rs="seq_sum_k1", rollout_rs_threshold=band)
    stats, trained = _train(tiny_path, batch, ADV, algo)
    kept = (k1.abs() <= bound).float()[:, None]
    assert int(kept.sum()) == 2
    plain = copy.deepcopy(batch)
    plain.loss_mask = batch.loss_mask * kept
    _same_update((stats, trained), _train(tiny_path, plain, ADV, _rollout_algo("disabled")))
    assert stats.rollout_corr["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.5
    assert stats.prox_s > 0  # every row's pi_prox before the first minibatch


def test_rollout_batch_normalisation_divides_a_token_mean_loss_by_the_mean_weight(tiny_path):
    batch = _batch()
    plain = _rollout_algo("decoupled_token_is", minibatches=1)
    normed = _rollout_algo("decoupled_token_is", minibatches=1, rollout_is_batch_normalize=True)
    a, b = _train(tiny_path, batch, ADV, plain)[0], _train(tiny_path, batch, ADV, normed)[0]
    mu = b.rollout_corr["rollout_corr/rollout_is_batch_norm_factor"]
    assert mu == pytest.approx(a.rollout_corr["rollout_corr/rollout_is_mean"], rel=1e-6)
    assert b.pg_loss == pytest.approx(a.pg_loss / mu, rel=1e-5)


def test_rollout_bypass_reinforce_weighs_minus_a_logp_by_the_sequence_weight(tiny_path):
    from transformers import AutoModelForCausalLM

    from verl_async.algos.correction.rollout import rollout_correction
    from verl_async.algos.correction.settings import preset_settings

    batch = _batch()
    algo = _rollout_algo("bypass_pg_is", minibatches=1, loss_mode="reinforce")
    stats, _ = _train(tiny_path, batch, ADV, algo)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    logp, _ = prox_pass(model, batch, 1.0)  # pi_theta before the one step
    w, _, _ = rollout_correction(
        logp, batch.behav_logprobs, batch.loss_mask, preset_settings("bypass_pg_is")
    )
    m = batch.loss_mask
    expected = (-ADV[:, None] * logp * w * m).sum() / m.sum()
    assert stats.pg_loss == pytest.approx(float(expected), rel=1e-5)
    assert "rollout_corr/rollout_is_seq_mean" in stats.rollout_corr
