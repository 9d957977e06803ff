"""forward_kl_topk as the learner runs it: the teacher's top k from its no-grad pass
(learners/teacher.py ``teacher_pass``), the student's log-probs of those ids inside its
chunked log-prob pass (learners/logprobs.py ``token_stats(at_ids=...)``), and the loss
from ``topk_term``; against the plain computation (whole logits, ``torch.topk``, the
verl-pinned ``student_topk_logp``, ``forward_kl_topk`` and ``distillation_loss`` of
tests/unit/test_distillation.py), values and gradients, in float64 on the tiny model; then
a whole ``policy_update`` with the term, and the config's checks of the new keys."""

from __future__ import annotations

import copy
import re

import msgspec
import pytest
import torch

from benchmarks.learner_ops import grpo_batch
from learners.logprobs import PassOptions, logits_of, token_stats
from learners.teacher import teacher_pass
from verl_async.algos.distillation import (
    distillation_loss,
    forward_kl_topk,
    student_topk_logp,
    topk_term,
)
from verl_async.algos.losses import GlobalBatch
from verl_async.algos.policy_losses import LossInputs
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, DistillationConfig, TeacherConfig, TinyModelConfig

K, TEMPERATURE = 5, 0.7
PASSES = {
    "chunks of 7": PassOptions(chunk_tokens=7),
    "whole logits": PassOptions(chunk_tokens=0),
    "padded, no sharing": PassOptions(chunk_tokens=7, share_prefix=False),
    "padding-free": PassOptions(chunk_tokens=7, padding_free=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student, teacher): the tiny model and one of another seed, in float64."""
    from transformers import AutoModelForCausalLM

    out = []
    for seed in (0, 1):
        path = build_tiny_model(tmp_path_factory.mktemp(f"m{seed}"), TinyModelConfig(seed=seed))
        out.append(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64))
    return out


def _batch(vocab: int):
    batch, _ = grpo_batch(groups=2, samples=3, prompt=6, vocab=vocab, seed=3)
    return batch


def _inputs(logp, batch) -> LossInputs:
    old = batch.behav_logprobs.double()
    return LossInputs(
        logp=logp, logp_old=old, logp_behav=old, advantages=torch.zeros_like(logp),
        mask=batch.loss_mask.double(),
    )  # fmt: skip


def _full(model, batch) -> torch.Tensor:
    """log-softmax [N, T-1, V] of every position at the sampling temperature."""
    logits = logits_of(model, batch.input_ids, batch.attention_mask, TEMPERATURE)[:, :-1]
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("passes", PASSES)
def test_the_teacher_pass_gives_its_top_k_at_sampled_tokens(models, passes):
    teacher = models[1]
    batch = _batch(teacher.config.vocab_size)
    stats = teacher_pass(teacher, batch, TEMPERATURE, PASSES[passes], top_k=K)
    keep = batch.loss_mask > 0
    with torch.no_grad():
        want = _full(teacher, batch).topk(K, dim=-1)
    torch.testing.assert_close(stats.top_logp[keep], want.values[keep])
    assert torch.equal(stats.top_ids[keep], want.indices[keep])
    assert stats.top_ids.dtype == torch.long
    assert (stats.top_logp[~keep] == 0).all() and (stats.top_ids[~keep] == 0).all()
    # the sampled tokens' log-probs are those of the pass without a top k
    plain = teacher_pass(teacher, batch, TEMPERATURE, PASSES[passes])
    torch.testing.assert_close(stats.logp, plain.logp, rtol=0, atol=0)


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize(
    "kw",
    [{}, {"use_policy_gradient": True}, {"log_prob_min_clamp": -4.0, "loss_max_clamp": 0.5}],
    ids=["loss", "reward", "clamped"],
)
def test_the_learners_loss_and_gradients_equal_the_plain_computation(models, passes, kw):
    student, teacher = models
    batch = _batch(student.config.vocab_size)
    top = teacher_pass(teacher, batch, TEMPERATURE, PASSES[passes], top_k=K)
    cfg = DistillationConfig(enabled=True, loss_mode="forward_kl_topk", topk=K, **kw)
    algo, agg = AlgoConfig(), GlobalBatch()
    params = [p for p in student.parameters() if p.requires_grad]

    stats = token_stats(
        student, batch.input_ids, batch.attention_mask, batch.loss_mask, TEMPERATURE,
        options=PASSES[passes], at_ids=top.top_ids,
    )  # fmt: skip
    ours = topk_term(_inputs(stats.logp, batch), stats.ids_logp, top.top_logp, cfg, algo, agg)
    grads = torch.autograd.grad(ours.loss, params, allow_unused=True)

    full = _full(student, batch)  # the plain way: every logit, then gather
    logp = full.gather(-1, batch.input_ids[:, 1:, None])[..., 0] * batch.loss_mask
    s_k = student_topk_logp(full, top.top_ids)  # log_softmax of log_softmax is itself
    loss = forward_kl_topk(s_k, top.top_logp, cfg.log_prob_min_clamp).loss
    want = distillation_loss(loss, _inputs(logp, batch), cfg, algo, agg)
    want_grads = torch.autograd.grad(want.loss, params, allow_unused=True)

    assert float(want.loss.detach()) != 0.0  # the two models differ
    # forward_kl_topk computes in float32 (as verl's): float64 paths that differ in the last
    # bits agree to float32's precision
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-6, atol=1e-9)
    for ours_g, want_g in zip(grads, want_grads, strict=True):
        if want_g is None:
            assert ours_g is None or not ours_g.any()
        else:
            torch.testing.assert_close(ours_g, want_g, rtol=1e-4, atol=1e-8)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_policy_update_with_forward_kl_topk_moves_the_student_towards_the_teacher(models):
    """Distillation alone (no task loss): a few updates of the student on one batch lower
    the forward KL to the teacher's top k."""
    from learners.setup import adamw
    from learners.update import UpdateHooks, policy_update

    # float32 as the learner runs it (the batch's dtype); the fixture's stays untrained
    student, teacher = copy.deepcopy(models[0]).float(), models[1]
    batch = _batch(student.config.vocab_size)
    top = teacher_pass(teacher, batch, TEMPERATURE, PassOptions(), top_k=K)
    batch.logp_teacher = top.logp.float()
    batch.teacher_topk_logp, batch.teacher_topk_ids = top.top_logp.float(), top.top_ids
    cfg = DistillationConfig(
        enabled=True, loss_mode="forward_kl_topk", topk=K, use_task_rewards=False,
        teachers=[TeacherConfig(name="t")],
    )  # fmt: skip
    opt = adamw(student, lr=3e-3, weight_decay=0.0)
    clip = lambda: torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)  # noqa: E731
    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=clip)
    adv = torch.zeros(len(batch.loss_mask))
    losses = []
    for version in range(4):
        stats = policy_update(
            student, opt, batch, adv, AlgoConfig(minibatches=1), hooks, version=version,
            temperature=TEMPERATURE, distill=cfg,
        )  # fmt: skip
        assert stats.optimizer_steps == 1
        losses.append(stats.distill_loss)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["distillation.topk=0"], "distillation.topk"),
        (["distillation.topk=1025"], "distillation.topk"),
        (["distillation.log_prob_min_clamp=0.5"], "distillation.log_prob_min_clamp"),
        (["learner.fused_head=true"], "learner.fused_head"),
        # a teacher process sends the sampled tokens' log-probs only, no top k
        (["distillation.scoring=process"], "distillation.scoring"),
    ],
)
def test_bad_topk_settings_are_refused_naming_the_key(overrides, key):
    base = ["distillation.enabled=true", "distillation.teachers=[{name: t}]",
            "distillation.loss_mode=forward_kl_topk", "distillation.scoring=learner"]  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config("configs/tiny.yaml", [*base, *overrides])


def test_forward_kl_topk_loads_with_its_keys():
    cfg = load_config(
        "configs/tiny.yaml",
        ["distillation.enabled=true", "distillation.teachers=[{name: t}]",
         "distillation.loss_mode=forward_kl_topk", "distillation.topk=8",
         "distillation.log_prob_min_clamp=-10", "distillation.scoring=learner"],
    )  # fmt: skip
    d = cfg.distillation
    assert (d.loss_mode, d.topk, d.log_prob_min_clamp) == ("forward_kl_topk", 8, -10.0)
    assert DistillationConfig().topk == 32 and DistillationConfig().log_prob_min_clamp is None


def test_a_topk_above_the_teachers_vocabulary_is_refused_at_load():
    from learners.teacher import check_topk

    cfg = DistillationConfig(enabled=True, loss_mode="forward_kl_topk", topk=64)
    with pytest.raises(ConfigError, match=r"'distillation.topk': 64 .* teacher 't' has \(48\)"):
        check_topk(cfg, 48, "t")
    check_topk(cfg, 64, "t")  # as many as the vocabulary: fine
    check_topk(msgspec.structs.replace(cfg, loss_mode="k3"), 48, "t")  # not read by the other modes
