"""The same-GPU weight channel (verl_async/device_memory.py) where this machine can check
it: which channel a group gets, the backend a colocated run resolves to, and the refusals
of a member that cannot open the offer. Its copies need a GPU: benchmarks/gpu_check.py
runs them there; on a machine with CUDA the last test opens a real handle."""

import logging

import pytest
import torch

from verl_async.device_memory import DeviceMemory
from verl_async.protocol import CudaIpc, MemoryOffer
from verl_async.shared_memory import SharedMemory, accept_memory, new_memory
from verl_async.weight_sync import resolve_backend

CUDA = torch.cuda.is_available()


def _offer(device: int = 0) -> MemoryOffer:
    ipc = CudaIpc(
        device=device, handle=b"h" * 64, size=1 << 20, offset=0, ref_counter_handle=b"r" * 64,
        ref_counter_offset=0, event_handle=b"", event_sync_required=False,
    )  # fmt: skip
    return MemoryOffer(path="", token="ab" * 16, pid=1, cuda=ipc)


def test_a_colocated_run_syncs_over_gloo():
    assert resolve_backend("auto", colocated=True) == "gloo"
    assert resolve_backend("auto") == ("nccl" if CUDA else "gloo")
    assert resolve_backend("nccl", colocated=True) == "nccl"  # what the user set


def test_a_cpu_rank_zero_offers_a_memory_file():
    for device in (None, torch.device("cpu")):
        memory = new_memory(device)
        assert isinstance(memory, SharedMemory)
        memory.close()
    assert DeviceMemory.create(torch.device("cpu"), 1024) is None


@pytest.mark.skipif(CUDA, reason="the refusal of a machine without CUDA")
def test_a_member_without_cuda_refuses_a_device_offer(caplog):
    with caplog.at_level(logging.WARNING, logger="verl_async.weight_sync"):
        assert accept_memory(_offer()) is None
    assert "refused: this process has no CUDA device" in caplog.text


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_forged_handle_is_refused_and_a_real_one_accepted(caplog):
    with caplog.at_level(logging.WARNING, logger="verl_async.weight_sync"):
        assert accept_memory(_offer(device=torch.cuda.device_count())) is None
        assert accept_memory(_offer()) is None  # not a handle CUDA gave anyone
    memory = DeviceMemory.create(torch.device("cuda", 0), 4096)
    assert memory.offer is not None and memory.offer.cuda.size >= 4096
    # Another process opens the handle in benchmarks/gpu_check.py (CUDA refuses the
    # owner's own); here: an update is written where the members read it.
    data = torch.arange(256, dtype=torch.uint8, device="cuda")
    assert memory.write([data]) == 256
    assert torch.equal(memory.buffer[:256], data)


def test_a_member_initialises_cuda_on_the_device_before_it_opens_the_handle(monkeypatch):
    """A member spawned fresh has not touched CUDA: ``accept`` initialises it and makes the
    handle's device current before ``_new_shared_cuda`` (which does neither) runs. CUDA's
    calls are recorded here in order; the handle then fails to open and is refused."""
    calls = []

    class Device:  # torch.cuda.device: the current device inside the block
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            calls.append(f"enter cuda:{self.index}")

        def __exit__(self, *exc):
            calls.append("exit")

    def empty(*shape, device=None, **kw):
        calls.append(f"empty on {device}")
        return torch.zeros(0)

    def opened(*args):
        calls.append(f"open handle of device {args[0]}")
        raise RuntimeError("invalid resource handle")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", opened, raising=False)
    assert DeviceMemory.accept(_offer(device=1)) is None
    assert calls == [
        "init", "enter cuda:1", "empty on cuda:1", "open handle of device 1", "exit"
    ]  # fmt: skip
