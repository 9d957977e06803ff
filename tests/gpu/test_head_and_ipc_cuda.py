"""On CUDA: the fused head (learners/fused_head.py) against the chunked head under bf16
autocast, with the peak memory of each from the caching allocator's counters; and the
same-GPU weight channel opened by a process spawned fresh, which has not touched CUDA
before ``DeviceMemory.accept`` (the case that killed the receiving process on an H200
before ``accept`` initialised CUDA)."""

import multiprocessing as mp

import msgspec
import pytest
import torch

from learners.fused_head import head_values
from learners.logprobs import Asked, _head_values
from verl_async.device_memory import DeviceMemory
from verl_async.protocol import MemoryOffer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

M, H, V, CHUNK = 4096, 256, 32_000, 1024


def _chunked(hidden, weight, targets):
    from torch.utils.checkpoint import checkpoint

    parts = []
    for start in range(0, M, CHUNK):
        args = (hidden[start : start + CHUNK], weight, None, targets[start : start + CHUNK],
                0.7, Asked(entropy=True), None)  # fmt: skip
        parts.append(checkpoint(_head_values, *args, use_reentrant=False) if start else
                     _head_values(*args))  # fmt: skip
    return torch.cat(parts)  # [M, 2]: log-prob, entropy


def _run(head):
    """(values, gradients of hidden and weight, peak bytes above the start) of one
    forward and backward under bf16 autocast."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(M, H, device="cuda", generator=g, requires_grad=True)
    weight = torch.randn(V, H, device="cuda", generator=g, requires_grad=True)
    targets = torch.randint(0, V, (M,), device="cuda", generator=g)
    upstream = torch.randn(M, 2, device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        values = head(hidden, weight, targets)
    (values * upstream).sum().backward()
    torch.cuda.synchronize()
    return values.detach(), hidden.grad, weight.grad, torch.cuda.max_memory_allocated() - start


def test_the_fused_head_on_cuda_equals_the_chunked_one_in_less_memory():
    ref = _run(_chunked)
    fused = _run(lambda h, w, t: head_values(h, w, None, t, 0.7, True, CHUNK))
    torch.testing.assert_close(fused[0], ref[0], atol=1e-3, rtol=1e-3)
    for got, want in zip(fused[1:3], ref[1:3], strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 products
    # The chunked head keeps its first chunk's [1024 x 32,000] logits (bf16 and float32)
    # and log-softmax for the backward; the fused head keeps none.
    assert fused[3] < ref[3] - CHUNK * V * 4


def _member(offer: dict, nbytes: int, go, out) -> None:
    """A process spawned fresh: its first CUDA call is the one ``accept`` makes."""
    memory = DeviceMemory.accept(msgspec.convert(offer, MemoryOffer))
    out.put(memory is not None)  # accepted: the token was there
    if memory is None:
        return
    go.get(timeout=120)  # rank 0 has written the update over the token
    buf = torch.empty(nbytes, dtype=torch.uint8)
    memory.read_into(buf, 0)
    out.put(bytes(buf.numpy()))


def test_a_process_spawned_fresh_opens_the_device_memory():
    memory = DeviceMemory.create(torch.device("cuda", 0), 1 << 20)
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda")
    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    offer = msgspec.to_builtins(memory.offer)
    child = ctx.Process(target=_member, args=(offer, 4096, go, out))
    child.start()
    try:
        accepted = out.get(timeout=120)
        if accepted:
            memory.write([data])
            go.put(True)
            got = out.get(timeout=120)
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert accepted and child.exitcode == 0
    assert got == bytes(data.cpu().numpy())
