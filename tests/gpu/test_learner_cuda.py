"""Learner device path on CUDA: pinned collation, async copy, loss, optimizer step."""

import numpy as np
import pytest
import torch

from learners.batching import collate
from verl_async import protocol as P
from verl_async.algos import actor_inputs, policy_loss, token_logprobs
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, TinyModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch_message():
    frames = P.Frames()
    body = P.Batch(
        step=0,
        group_ids=[0],
        sample_group=[0, 0],
        prompt_lengths=[3, 3],
        response_lengths=[2, 1],
        scores=[[1.0], [0.0]],
        failed=[0],
        data_sources=["default"],
        prompt_ids=frames.add(np.array([1, 3, 9, 1, 3, 8], np.int32)),
        response_ids=frames.add(np.array([13, 2, 7], np.int32)),
        behav_logprobs=frames.add(np.array([-1.0, -2.0, -1.5], np.float32)),
        token_versions=frames.add(np.zeros(3, np.int32)),
        dropped_stale=0,
        buffer_size=0,
    )
    return body, [bytes(b) for b in frames.buffers]


def test_update_on_cuda_from_pinned_batch(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    body, frames = _batch_message()
    batch = collate(body, frames, pad_id=0, pin=True)
    assert batch.input_ids.is_pinned()
    batch = batch.to(torch.device("cuda"))
    before = [p.detach().clone() for p in model.parameters()]
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(logits, batch.input_ids[:, 1:])
    adv = torch.tensor([[1.0], [-1.0]], device="cuda")
    algo = AlgoConfig(correction="decoupled")
    inputs, _ = actor_inputs(logp, logp.detach(), batch.behav_logprobs, adv, batch.loss_mask, algo)
    out = policy_loss(inputs, algo)
    out.loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    assert torch.isfinite(out.loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.fixture(scope="module")
def process_group():
    """A one-rank NCCL group: FSDP2 needs one, and the code under test is the multi-rank one."""
    import torch.distributed as dist

    from verl_async.runtime import free_port

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _tiny(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_fsdp2_learner_step_in_bf16_keeps_fp32_parameters(tmp_path, process_group):
    from learners.plan import plan_update
    from learners.setup import fsdp2
    from learners.update import UpdateHooks, policy_update
    from verl_async.schema import AlgoConfig

    model = fsdp2(_tiny(tmp_path).cuda(), torch.bfloat16)
    assert all(
        type(p).__name__ == "DTensor" and p.dtype == torch.float32 for p in model.parameters()
    )
    body, frames = _batch_message()
    batch = collate(body, frames, pad_id=0, pin=True).to(torch.device("cuda"))
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = plan_update(
        batch.loss_mask, batch.attention_mask, [2], 0, 1, max_tokens_per_microbatch=5
    )
    assert len(plan[0].micro) == 2  # one row per micro-batch: gradient accumulation

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()

    adv = torch.tensor([1.0, -1.0], device="cuda")
    hooks = UpdateHooks(backward=torch.Tensor.backward, clip_grad=clip)
    stats = policy_update(model, opt, batch, adv, AlgoConfig(), hooks, plan=plan)
    assert np.isfinite(stats.loss) and stats.grad_norm > 0
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_fsdp2_gather_gives_the_unsharded_tensors(tmp_path, process_group):
    from learners.publish import gathered_buckets
    from learners.setup import fsdp2
    from verl_async.weight_sync import param_specs, plan_buckets

    plain = _tiny(tmp_path).cuda()
    expected = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    state = fsdp2(plain, torch.float32).state_dict()
    buckets = plan_buckets(param_specs(state.items()), 1 << 16)  # several buckets
    assert len(buckets) > 1
    gathered = {k: v for _, part in gathered_buckets(state, buckets) for k, v in part.items()}
    assert gathered.keys() == expected.keys()
    for name, tensor in gathered.items():
        assert not hasattr(tensor, "full_tensor")
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_pinned_batch_is_copied_on_a_side_stream():
    from learners.batching import copy_to_device, wait_for_copy

    body, frames = _batch_message()
    batch = collate(body, frames, pad_id=0, pin=True)
    assert all(t.is_pinned() for t in (batch.input_ids, batch.loss_mask, batch.behav_logprobs))
    side = torch.cuda.Stream()
    moved, copied = copy_to_device(batch, torch.device("cuda"), side)
    assert copied is not None
    moved = wait_for_copy(moved, copied)
    torch.cuda.current_stream().synchronize()
    assert copied.query()
    for name in ("input_ids", "attention_mask", "loss_mask", "behav_logprobs", "token_versions"):
        got = getattr(moved, name)
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), getattr(batch, name), rtol=0, atol=0)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_shared_prefix_pass_on_cuda_equals_the_padded_pass(attn_impl, padding_free):
    """The learner's packed pass (each group's prompt once, a block mask keeping samples
    apart; ``padding_free``: the groups end to end in one packed row) on CUDA, where sdpa
    picks its own kernels for a boolean mask: log-probs, entropies and gradients equal
    the padded pass's, float32."""
    from learners.logprobs import PassOptions, token_stats

    from ..unit.test_logprobs import _groups, _model

    model = _model(tie=True).cuda()
    model.config._attn_implementation = attn_impl
    ids, attn, mask = (t.cuda() for t in _groups())
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)).cuda()

    def run(share: bool):
        model.zero_grad()
        options = PassOptions(share_prefix=share, padding_free=share and padding_free)
        stats = token_stats(model, ids, attn, mask, 0.8, entropy=True, options=options)
        ((stats.logp * weights + 0.1 * stats.entropy) * mask).sum().backward()
        return stats, [p.grad.clone() for p in model.parameters()]

    (plain, plain_grads), (shared, shared_grads) = run(False), run(True)
    on = mask > 0
    assert shared.computed < plain.computed  # it did pack
    torch.testing.assert_close(shared.logp[on], plain.logp[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.entropy[on], plain.entropy[on], atol=1e-5, rtol=1e-5)
    for got, ref in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_padding_free_pass_with_flash_attention_equals_the_padded_pass():
    """Flash attention, rows end to end in one packed row told apart by position ids
    alone (learners/logprobs.py): the same log-probs and gradients as flash attention
    over the padded rows, to bf16's precision (a row seeing another's tokens would move
    its log-probs by far more)."""
    pytest.importorskip("flash_attn")
    from learners.logprobs import PassOptions, token_stats

    from ..unit.test_logprobs import _groups, _model

    model = _model(tie=True).to(device="cuda", dtype=torch.bfloat16)
    model.config._attn_implementation = "flash_attention_2"
    ids, attn, mask = (t.cuda() for t in _groups())

    def run(padding_free: bool):
        model.zero_grad()
        options = PassOptions(share_prefix=False, padding_free=padding_free)
        stats = token_stats(model, ids, attn, mask, entropy=True, options=options)
        ((stats.logp + 0.1 * stats.entropy) * mask).sum().backward()
        return stats, [p.grad.float().clone() for p in model.parameters()]

    (plain, plain_grads), (free, free_grads) = run(False), run(True)
    on = mask > 0
    assert free.computed == int(attn.sum()) < plain.computed  # one packed row, no padding
    torch.testing.assert_close(free.logp[on], plain.logp[on], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(free.entropy[on], plain.entropy[on], atol=2e-2, rtol=2e-2)
    for got, ref in zip(free_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)
