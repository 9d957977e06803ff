"""The packing plan, and a real gloo group (two threads over a TCPStore) moving weights."""

import os
import threading

import torch

from tests.weight_sync_helpers import send_weights
from verl_async.protocol import ParamSpec
from verl_async.weight_sync import (
    SharedMemory,
    SyncGroup,
    join_group,
    param_specs,
    plan_buckets,
    receive_weights,
)


def test_plan_packs_in_order_aligned_and_splits_large():
    specs = [
        ParamSpec("a", "float32", (3,)),
        ParamSpec("b", "float32", (10,)),
        ParamSpec("c", "float32", (100,)),
    ]
    buckets = plan_buckets(specs, bucket_bytes=64)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"]]
    assert buckets[0].offsets == [0, 16]  # 12 bytes padded to 16
    assert buckets[1].nbytes == 400  # larger than a bucket: alone


def _roundtrip(port, tensors, shared_memory=True, bucket_bytes=64):
    """Rank 0 sends ``tensors`` twice to rank 1 (a thread); returns both groups and what
    rank 1 received the second time."""
    specs = param_specs(tensors.items())
    got, groups = {}, {}

    def receiver():
        group = groups[1] = join_group("127.0.0.1", port, 1, 2, "gloo", 30)
        for _ in range(2):
            got.clear()
            for bucket in receive_weights(group, specs, bucket_bytes, torch.device("cpu")):
                got.update({n: t.clone() for n, t in bucket})

    thread = threading.Thread(target=receiver)
    thread.start()
    group = groups[0] = join_group("127.0.0.1", port, 0, 2, "gloo", 30, shared_memory=shared_memory)
    sent = [send_weights(group, tensors, specs, bucket_bytes) for _ in range(2)]
    thread.join(timeout=30)
    assert sent[0] > 0 and set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype
        assert torch.equal(got[name], t)
    return groups


def _tensors():
    torch.manual_seed(0)
    return {"w": torch.randn(5, 7), "b": torch.randn(7), "h": torch.randn(3).to(torch.bfloat16)}


def test_gloo_roundtrip_over_the_network(free_port):
    groups = _roundtrip(free_port(), _tensors(), shared_memory=False)
    assert groups[0].memory is None and groups[1].memory is None


def test_same_host_updates_go_through_shared_memory_into_reused_buffers(free_port):
    tensors = _tensors()
    groups = _roundtrip(free_port(), tensors)
    sender, member = groups[0].memory, groups[1].memory
    assert sender is not None and member is not None and member.path == sender.path
    buckets = plan_buckets(param_specs(tensors.items()), 64)
    assert os.fstat(sender.fd).st_size == sum(b.nbytes for b in buckets)  # written over
    # The member's buffers are the ones the first update was received into.
    assert [b.numel() for b in groups[1].buffers] == [b.nbytes for b in buckets]
    for g in groups.values():
        g.close()


def test_a_receive_buffer_is_reused_when_it_fits():
    group = SyncGroup(None, None, 1, 2, "gloo", 1.0, 1.0)
    a = group.buffer(1, 64, torch.device("cpu"))
    assert group.buffer(1, 64, torch.device("cpu")) is a
    assert group.buffer(1, 32, torch.device("cpu")).numel() == 32  # another plan: a new one
    assert len(group.buffers) == 2


def test_a_member_that_cannot_read_the_memory_file_makes_the_group_use_the_network(
    free_port, monkeypatch
):
    monkeypatch.setattr(SharedMemory, "readable", staticmethod(lambda path, token: False))
    groups = _roundtrip(free_port(), _tensors())
    assert groups[0].memory is None and groups[1].memory is None


def test_a_member_waits_join_timeout_s_for_the_group_and_timeout_s_for_a_broadcast(free_port):
    """The rendezvous and the collectives after it have deadlines of their own: a member
    whose rank 0 comes later than ``timeout_s`` still joins (within ``join_timeout_s``),
    and a broadcast that never comes fails it after ``timeout_s``."""
    import time

    from verl_async.weight_sync import broadcast_bucket

    port, holder, done = free_port(), {}, threading.Event()

    def member():
        group = holder["group"] = join_group(
            "127.0.0.1", port, 1, 2, "gloo", 1.0, shared_memory=False, join_timeout_s=60
        )
        t0 = time.monotonic()
        try:
            broadcast_bucket(group, torch.empty(4, dtype=torch.uint8))
        except RuntimeError as exc:
            holder["failed"] = (time.monotonic() - t0, str(exc))
        done.set()

    thread = threading.Thread(target=member)
    thread.start()
    time.sleep(3.0)  # rank 0 comes three times timeout_s late
    root = join_group("127.0.0.1", port, 0, 2, "gloo", 60, shared_memory=False)
    try:
        assert done.wait(30), "the broadcast never sent did not fail the member"
        waited, message = holder["failed"]
        assert waited < 10, (waited, message)
    finally:
        thread.join(30)
        holder["group"].close()
        root.close()
