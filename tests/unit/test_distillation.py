"""On-policy distillation's losses against verl's own at commit 1dda039
(tests/fixtures/verl_1dda039_distillation.json, made by tests/reference/verl_1dda039.py
--part distillation), hand-worked cases of how the term joins the task's loss, and the
``distillation`` section's checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
import torch

from learners.update import actor_loss
from verl_async.algos.distillation import (
    clamp_losses,
    combine,
    distillation_loss,
    estimator_losses,
    forward_kl_topk,
    student_topk_logp,
)
from verl_async.algos.losses import GlobalBatch
from verl_async.algos.policy_losses import LossInputs
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.schema import AlgoConfig, DistillationConfig, TeacherConfig

FIXTURE = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "verl_1dda039_distillation.json").read_text()
)
MAIN = {k: torch.tensor(v, dtype=torch.float64) for k, v in FIXTURE["inputs"]["main"].items()}
TOPK = {k: torch.tensor(v, dtype=torch.float64) for k, v in FIXTURE["inputs"]["topk"].items()}
GLOBAL = GlobalBatch(dp_size=2, batch_num_tokens=40.0, global_batch_size=8.0)
CLIP = {"clip_ratio_low": 0.15, "clip_ratio_high": 0.25}  # the script's DISTILL_CLIP


def settings(**kw) -> DistillationConfig:
    return DistillationConfig(enabled=True, **CLIP, **kw)


def inputs_of(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, weights=None):
    return LossInputs(
        logp=logp, logp_old=old, logp_behav=old, advantages=torch.zeros_like(logp),
        mask=mask, is_weights=weights,
    )  # fmt: skip


def estimator_id(case: dict) -> str:
    pg = "pg" if case["use_policy_gradient"] else "loss"
    return f"{case['loss_mode']}/{pg}/clamp={case['loss_max_clamp']}/{case['loss_agg_mode']}"


@pytest.mark.parametrize("case", FIXTURE["distillation"]["estimators"], ids=estimator_id)
def test_estimators_equal_verl(case):
    if case["raises"] is not None:  # verl refuses k1 as a loss; the config refuses it too
        assert case["loss_mode"] == "k1" and not case["use_policy_gradient"]
        with pytest.raises(ConfigError, match="distillation.loss_mode"):
            load_config(None, ["distillation.enabled=true", "distillation.loss_mode=k1",
                               "distillation.teachers=[{name: t}]"])  # fmt: skip
        return
    cfg = settings(
        loss_mode=case["loss_mode"], use_policy_gradient=case["use_policy_gradient"],
        loss_max_clamp=case["loss_max_clamp"],
    )  # fmt: skip
    algo = AlgoConfig(loss_agg_mode=case["loss_agg_mode"])
    logp = MAIN["log_prob"].clone().requires_grad_(True)
    mask = MAIN["response_mask"]
    inputs = inputs_of(logp, MAIN["old_log_prob"], mask, MAIN["rollout_is_weights"])
    losses = estimator_losses(logp, MAIN["ref_log_prob"], case["loss_mode"])
    out = distillation_loss(losses, inputs, cfg, algo, GLOBAL)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(case["loss"], rel=1e-12, abs=1e-12)
    want = torch.tensor(case["grad_log_prob"], dtype=torch.float64)
    torch.testing.assert_close(logp.grad * mask, want * mask, rtol=1e-12, atol=1e-12)


def topk_id(case: dict) -> str:
    pg = "pg" if case["use_policy_gradient"] else "loss"
    return f"min={case['log_prob_min_clamp']}/max={case['loss_max_clamp']}/{pg}"


@pytest.mark.parametrize("case", FIXTURE["distillation"]["topk"], ids=topk_id)
def test_forward_kl_topk_equals_verl(case):
    cfg = settings(
        loss_mode="forward_kl_topk", use_policy_gradient=case["use_policy_gradient"],
        loss_max_clamp=case["loss_max_clamp"],
    )  # fmt: skip
    logits = TOPK["student_logits"].clone().requires_grad_(True)
    logp = TOPK["log_prob"].clone().requires_grad_(True)
    ids = TOPK["teacher_topk_ids"].long()
    student = student_topk_logp(logits, ids)
    top = forward_kl_topk(student, TOPK["teacher_topk_log_probs"], case["log_prob_min_clamp"])
    # verl's logits processor returns the sum before its clamp at 0 (applied afterwards)
    raw = torch.tensor(case["per_token_loss"], dtype=torch.float64)
    torch.testing.assert_close(top.loss.double(), raw.clamp_min(0.0), rtol=1e-6, atol=1e-6)
    for name in ("student_mass", "teacher_mass"):
        want = torch.tensor(case[name], dtype=torch.float64)
        torch.testing.assert_close(getattr(top, name), want, rtol=1e-12, atol=1e-12)
    inputs = inputs_of(logp, TOPK["old_log_prob"], TOPK["response_mask"])
    out = distillation_loss(top.loss, inputs, cfg, AlgoConfig(), GLOBAL)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(case["loss"], rel=1e-6, abs=1e-7)
    grad_logits = torch.zeros_like(logits) if logits.grad is None else logits.grad
    want = torch.tensor(case["grad_student_logits"], dtype=torch.float64)
    torch.testing.assert_close(grad_logits, want, rtol=1e-5, atol=1e-7)
    grad_logp = torch.zeros_like(logp) if logp.grad is None else logp.grad
    want = torch.tensor(case["grad_log_prob"], dtype=torch.float64)
    torch.testing.assert_close(grad_logp, want, rtol=1e-6, atol=1e-7)


def test_k1_as_reward_is_teacher_minus_student_per_token():
    # One row, two kept tokens, ratio 1 (old = new): the vanilla loss is -mean(A) and its
    # gradient -A_t / n per token, A_t = t - s.
    s = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    t = torch.tensor([[-0.25, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = settings(loss_mode="k1", use_policy_gradient=True)
    out = distillation_loss(
        estimator_losses(s, t, "k1"), inputs_of(s, s.detach(), mask), cfg, AlgoConfig(),
        GlobalBatch(),
    )  # fmt: skip
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-((0.75 + -1.0) / 2))
    assert s.grad[0].tolist() == pytest.approx([-0.375, 0.5, 0.0])


def test_k3_as_loss_hand_worked_and_clamped():
    s = torch.tensor([[-1.0, -2.0]])
    t = torch.tensor([[-1.0 + 0.5, -2.0]])  # x = t - s = 0.5 and 0
    k3 = estimator_losses(s, t, "k3")
    assert k3[0].tolist() == pytest.approx([torch.e**0.5 - 1.5, 0.0])
    assert clamp_losses(torch.tensor([-3.0, 0.5, 4.0]), 1.0).tolist() == [-1.0, 0.5, 1.0]
    mask = torch.ones_like(s)
    out = distillation_loss(k3, inputs_of(s, s, mask), settings(), AlgoConfig(), GlobalBatch())
    assert float(out.loss.detach()) == pytest.approx((torch.e**0.5 - 1.5) / 2)
    assert out.pg is None


def test_combine_with_and_without_task_rewards():
    task, term = torch.tensor(2.0), torch.tensor(0.5)
    with_task = settings(distillation_loss_coef=0.1)
    assert float(combine(task, term, with_task)) == pytest.approx(2.05)
    alone = settings(use_task_rewards=False, distillation_loss_coef=0.1)  # coef unused, as verl
    assert float(combine(task, term, alone)) == pytest.approx(0.5)


def test_actor_loss_adds_the_term_on_sampled_tokens_only():
    # The teacher's value at a masked position must not change the loss or its gradient.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    inputs = inputs_of(logp, logp.detach(), mask)
    inputs.advantages = torch.ones_like(logp)
    algo = AlgoConfig(correction="none")
    teacher_a = torch.tensor([[-0.5, -2.5, -1.0]])
    teacher_b = torch.tensor([[-0.5, -2.5, -30.0]])
    cfg = settings(distillation_loss_coef=0.5)
    a = actor_loss(inputs, algo, logp_teacher=teacher_a, distill=cfg)
    b = actor_loss(inputs, algo, logp_teacher=teacher_b, distill=cfg)
    plain = actor_loss(inputs, algo)
    assert float(a.total) == pytest.approx(float(b.total))
    assert float(a.total) == pytest.approx(float(plain.total) + 0.5 * float(a.distill))
    assert float(a.distill) > 0


def base(*extra: str) -> list[str]:
    return ["distillation.enabled=true", *extra]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (base(), "distillation.teachers"),
        (base("distillation.teachers=[{name: a}, {name: a}]"), "distillation.teachers[1].name"),
        (base("distillation.teachers=[{name: 'a b'}]"), "distillation.teachers[0].name"),
        (
            base(
                "distillation.teachers=[{name: a, data_sources: [x]}, {name: b, data_sources: [x]}]"
            ),
            "distillation.teachers[1].data_sources",
        ),  # fmt: skip
        (
            base("distillation.teachers=[{name: a}, {name: b}]"),
            "distillation.teachers[1].data_sources",
        ),  # fmt: skip
        (
            base("distillation.teachers=[{name: a}]", "distillation.loss_mode=kl"),
            "distillation.loss_mode",
        ),  # fmt: skip
        (
            base(
                "distillation.teachers=[{name: a}]",
                "distillation.loss_mode=forward_kl_topk",
                "learner.fused_head=true",
            ),
            "learner.fused_head",
        ),  # fmt: skip
        (
            base("distillation.teachers=[{name: a}]", "model.path=models/x"),
            "distillation.teachers[0].path",
        ),  # fmt: skip
    ],
)
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
        load_config(None, overrides)


def test_teacher_routing_by_data_source():
    d = DistillationConfig(
        enabled=True,
        teachers=[TeacherConfig(name="math", data_sources=["gsm8k"]), TeacherConfig(name="rest")],
    )
    assert d.teacher_of("gsm8k") == 0
    assert d.teacher_of("anything") == 1
    only = msgspec.structs.replace(d, teachers=d.teachers[:1])
    with pytest.raises(ConfigError, match="no teacher serves data source 'other'"):
        only.teacher_of("other")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from verl_async.launch.tiny_model import VOCAB, build_tokenizer
    from verl_async.teachers import check_tokenizer

    student, same, other = tmp_path / "student", tmp_path / "same", tmp_path / "other"
    build_tokenizer(student)
    build_tokenizer(same)
    build_tokenizer(other, [*VOCAB, "teacher-only"])
    check_tokenizer(str(student), str(same), "twin")  # the same vocabulary passes
    with pytest.raises(ConfigError) as err:
        check_tokenizer(str(student), str(other), "wide")
    assert str(other) in str(err.value) and str(student) in str(err.value)
    assert "teacher 'wide'" in str(err.value) and "1 (token, id) pairs" in str(err.value)


def test_unserved_data_source_is_refused_at_launch(tmp_path):
    from verl_async.launch.prepare import check_data

    data = tmp_path / "p.jsonl"
    data.write_text(
        json.dumps({"prompt": "a b", "answer": "b", "data_source": "gsm8k"}) + "\n"
        + json.dumps({"prompt": "c d", "answer": "d", "data_source": "math"}) + "\n"
    )  # fmt: skip
    cfg = load_config(
        "configs/tiny.yaml",
        [f"data.path={data}", "distillation.enabled=true",
         "distillation.teachers=[{name: t, data_sources: [gsm8k]}]"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="no teacher serves data source 'math'"):
        check_data(cfg)


def test_teachers_score_sampled_tokens_routed_by_data_source(tmp_path):
    # Two tiny teachers of other seeds: "a" goes to the first, every other source to the
    # second. Each row's log-probs are its own teacher's, at sampled tokens only.
    from learners.critic import load_reference, reference_logprobs
    from learners.distributed import DataParallel
    from learners.logprobs import PassOptions
    from learners.teacher import LocalTeachers, score_step
    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig

    from .learner_samples import Sample, batch

    paths = [build_tiny_model(tmp_path / f"t{s}", TinyModelConfig(seed=s)) for s in (1, 2)]
    models = [load_reference(str(p), torch.device("cpu"), torch.float32) for p in paths]
    cfg = DistillationConfig(
        enabled=True,
        teachers=[TeacherConfig(name="ta", data_sources=["a"]), TeacherConfig(name="rest")],
    )
    step = batch([Sample(0, 1.0, (1, 1, 1)), Sample(1, 0.0, (1, 0, 1)), Sample(2, 1.0, (1, 1))])
    step.sample_sources = ["a", "b", "a"]
    teachers = LocalTeachers(models, cfg, temperature=1.0, options=PassOptions())
    row = score_step(teachers, step, step, DataParallel(), cfg)
    mask = step.loss_mask
    own = [reference_logprobs(m, step, 1.0) for m in models]
    for r, t in enumerate([0, 1, 0]):
        torch.testing.assert_close(step.logp_teacher[r], own[t][r])
    assert (step.logp_teacher[mask == 0] == 0).all()
    assert not torch.equal(own[0][1], own[1][1])  # the two teachers do differ
    assert row["distill/ta/tokens"] == 5 and row["distill/rest/tokens"] == 2
    assert row["distill/scored_fraction"] == 1.0
    gap = (step.behav_logprobs - own[1])[1][mask[1] > 0].mean()
    assert row["distill/rest/reverse_kl"] == pytest.approx(float(gap))
