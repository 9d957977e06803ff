"""Nothing in the learner's update waits for the device but the one read of its metrics
at its end: real ``policy_update`` steps on the tiny model (GRPO-shaped batches, fused
AdamW, the gradient clip the learner runs), with every call that makes the host wait
for a CUDA device counted while the update runs (``benchmarks.learner_ops.HostSyncs``:
scalar reads, ``nonzero``, boolean-mask indexing, ``tolist``/``numpy``/``cpu``,
``torch.cuda.synchronize``, tensors made from Python numbers). The step's shapes are
planned from the host copy of the batch before the update (``plan_step``), as the
learner does before its copy to the device."""

from __future__ import annotations

import msgspec
import pytest
import torch

from benchmarks.learner_ops import HostSyncs, Step, grpo_batch
from learners.update import policy_update
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, LearnerConfig, TinyModelConfig

ONE_READ = {"Tensor.tolist": 1}  # the metrics, read once at the end of the update

CASES = {
    "default": {},
    "one minibatch": {"minibatches": 1},
    "tis, entropy bonus": {"correction": "tis", "entropy_coeff": 0.01},
    "no correction, gpg": {"correction": "none", "loss_mode": "gpg"},
    "gspo": {"loss_mode": "gspo"},
    "cispo, seq-mean-token-mean": {"loss_mode": "cispo", "loss_agg_mode": "seq-mean-token-mean"},
    "dual clip": {"clip_ratio_c": 3.0},
}
LEARNERS = {
    "default": {},
    "padded, micro-batches": {"share_prefix": False, "max_tokens_per_microbatch": 256},
    "padding-free": {"padding_free": True},
    "fused head": {"fused_head": True},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("m"), TinyModelConfig())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _syncs(model, algo: AlgoConfig, learner: LearnerConfig) -> dict:
    batch, adv = grpo_batch(groups=3, samples=4, prompt=12, vocab=model.config.vocab_size)
    step = Step(model, batch, adv, algo, learner)
    plan = step.plan()  # on the host, before the update
    with HostSyncs() as syncs:
        stats = step.run(plan)
    assert stats.optimizer_steps == algo.minibatches  # real steps were taken
    return dict(syncs.calls)


@pytest.mark.parametrize("case", CASES)
def test_the_update_reads_the_device_once(tiny, case):
    algo = msgspec.structs.replace(AlgoConfig(), **CASES[case])
    assert _syncs(tiny, algo, LearnerConfig()) == ONE_READ


@pytest.mark.parametrize("case", LEARNERS)
def test_every_pass_layout_reads_the_device_once(tiny, case):
    learner = msgspec.structs.replace(LearnerConfig(), **LEARNERS[case])
    assert _syncs(tiny, AlgoConfig(), learner) == ONE_READ


def test_the_counter_sees_what_makes_the_host_wait():
    """The harness itself: each kind of call it must see is seen."""
    x, index = torch.arange(6.0).reshape(2, 3), torch.tensor([0, 1])
    with HostSyncs() as syncs:
        x.sum().item()
        float(x.max())
        bool((x > 1).any())
        x[x > 2]
        x.nonzero()
        x.tolist()
        x.cpu()
        x + torch.tensor(2.0)  # made from a number: a copy to the device on CUDA
        torch.where(x > 2, x, 0.0)  # fixed shape: not a wait
        x[index]  # an index tensor: not a wait
    assert syncs.calls == {
        "aten._local_scalar_dense.default": 3,
        "aten.index.Tensor": 1,
        "aten.nonzero.default": 1,
        "Tensor.tolist": 1,
        "Tensor.cpu": 1,
        "aten.lift_fresh.default": 1,
    }


@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_the_guard_skips_a_nonfinite_step_without_reading_the_device(bad):
    """Fused AdamW skips the step itself (``found_inf``): weights, moments and step count
    stay, and nothing is read on the host; a finite step after it moves the weights."""
    from learners.finite import NONFINITE_GRAD, NONFINITE_LOSS, step_unless_nonfinite
    from learners.setup import adamw

    model = torch.nn.Linear(3, 2)
    opt = adamw(model, lr=0.1, weight_decay=0.1)

    def step(scale: float, grad_scale: float = 1.0):
        loss = model(torch.ones(4, 3)).sum()
        (loss * grad_scale).backward()
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
        return step_unless_nonfinite(opt, clip, loss.detach() * scale)

    step(1.0)  # moments to keep
    weights = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with HostSyncs() as syncs:
        if bad == "loss":
            norm, code = step(float("nan"))
        else:
            norm, code = step(1.0, grad_scale=float("inf"))
    assert syncs.total == 0, syncs.calls
    assert int(code) == (NONFINITE_LOSS if bad == "loss" else NONFINITE_GRAD)
    for p, w, s in zip(model.parameters(), weights, state, strict=True):
        assert torch.equal(p, w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in s.items())
    assert int(step(1.0)[1]) == 0
    assert not torch.equal(next(model.parameters()), weights[0])


@pytest.mark.parametrize("use_policy_gradient", [False, True], ids=["loss", "reward"])
def test_forward_kl_topk_reads_the_device_once(tiny, use_policy_gradient):
    """Distillation's forward_kl_topk: the teacher's top k (scored before the update, as
    the learner does) joins the student's chunked pass as index tensors."""
    from learners.logprobs import PassOptions
    from learners.teacher import teacher_pass
    from verl_async.schema import DistillationConfig, TeacherConfig

    algo, learner = AlgoConfig(), LearnerConfig()
    batch, adv = grpo_batch(groups=3, samples=4, prompt=12, vocab=tiny.config.vocab_size)
    top = teacher_pass(tiny, batch, 1.0, PassOptions.of(learner), top_k=4)  # itself as teacher
    batch.logp_teacher, batch.teacher_topk_logp, batch.teacher_topk_ids = (
        top.logp,
        top.top_logp,
        top.top_ids,
    )
    distill = DistillationConfig(
        enabled=True, loss_mode="forward_kl_topk", topk=4, teachers=[TeacherConfig(name="t")],
        use_policy_gradient=use_policy_gradient,
    )  # fmt: skip
    step = Step(tiny, batch, adv, algo, learner)
    plan = step.plan()
    with HostSyncs() as syncs:
        stats = policy_update(
            tiny, step.optimizer, batch, adv, algo, step.hooks, plan=plan, version=0,
            learner=learner, distill=distill,
        )  # fmt: skip
    assert stats.optimizer_steps == algo.minibatches and stats.distill_loss is not None
    assert dict(syncs.calls) == ONE_READ
