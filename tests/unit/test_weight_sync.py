"""The packing plan, and a real gloo group (two threads over a TCPStore) moving weights;
the memory file a member accepts (only learner rank 0's, announced over the buffer)."""

import os
import tempfile
import threading
import time

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from tests.weight_sync_helpers import send_weights
from verl_async.protocol import MemoryOffer, ParamSpec
from verl_async.shared_memory import MEMFD_NAME, SharedMemory
from verl_async.weight_sync import (
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


def _roundtrip(port, tensors, shared_memory=True, bucket_bytes=64, offer=True):
    """Rank 0 sends ``tensors`` twice to rank 1 (a thread); returns both groups and what
    rank 1 received the second time. Rank 1 is given rank 0's memory offer, as the buffer
    hands it over with each ``WeightUpdate`` (``offer``: or a function of it, or None)."""
    specs = param_specs(tensors.items())
    got, groups = {}, {}
    announced = threading.Event()

    def receiver():
        group = groups[1] = join_group("127.0.0.1", port, 1, 2, "gloo", 30)
        announced.wait(30)
        memory = groups[0].offer
        memory = memory if offer is True else offer(memory) if offer else None
        for _ in range(2):
            got.clear()
            for bucket in receive_weights(group, specs, bucket_bytes, torch.device("cpu"), memory):
                got.update({n: t.clone() for n, t in bucket})

    thread = threading.Thread(target=receiver)
    thread.start()
    group = groups[0] = join_group("127.0.0.1", port, 0, 2, "gloo", 30, shared_memory=shared_memory)
    announced.set()
    sent = [send_weights(group, tensors, specs, bucket_bytes) for _ in range(2)]
    thread.join(timeout=30)
    assert not thread.is_alive()
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
    assert sender is not None and member is not None
    assert os.fstat(member.fd).st_ino == os.fstat(sender.fd).st_ino  # the same file
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


def test_a_member_that_refuses_the_memory_file_makes_the_group_use_the_network(
    free_port, monkeypatch
):
    monkeypatch.setattr(SharedMemory, "accept", classmethod(lambda cls, offer: None))
    groups = _roundtrip(free_port(), _tensors())
    assert groups[0].memory is None and groups[1].memory is None


def test_a_member_waits_join_timeout_s_for_the_group_and_timeout_s_for_a_broadcast(free_port):
    """The rendezvous and the collectives after it have deadlines of their own: a member
    whose rank 0 comes later than ``timeout_s`` still joins (within ``join_timeout_s``),
    and a broadcast that never comes fails it after ``timeout_s``."""
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


def test_a_member_given_no_offer_makes_the_group_use_the_network(free_port):
    """Another host, or an update announced without one: the broadcast, as before."""
    groups = _roundtrip(free_port(), _tensors(), offer=None)
    assert groups[0].memory is None and groups[1].memory is None
    assert groups[0].memory_agreed and groups[1].memory_agreed


def _attacker_file(token: str, nbytes: int) -> str:
    """A local attacker's own file: its token, then bytes that are not the weights."""
    fd, path = tempfile.mkstemp(prefix="attacker-")
    os.write(fd, token.encode() + b"\xff" * nbytes)
    os.close(fd)
    return path


EPOCHS = 8  # rendezvous the attacker gets to race (the old channel lost about one in six)


def _attack_store(port: int, value: str, stop: threading.Event) -> None:
    """Write ``value`` under every key of the store a member could take an offer from,
    as fast as the store answers, until ``stop``."""
    keys = [f"verl_async/weights/{e}{sep}memory" for e in range(EPOCHS) for sep in ("/", "")]
    store = None
    while store is None and not stop.is_set():
        try:
            store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        except RuntimeError:
            time.sleep(0.01)
    try:
        while not stop.is_set():
            for key in keys:
                store.set(key, value)
    except RuntimeError:  # the store went away with rank 0
        pass


def _epochs(port: int, tensors: dict) -> tuple[list[SharedMemory | None], list[dict]]:
    """Rank 0 sends ``tensors`` once per epoch to rank 1 (a thread), rebuilding the group
    between epochs as after a generator restart; returns the memory rank 1 read each
    epoch's update from, and what it received."""
    specs = param_specs(tensors.items())
    offers: dict[int, MemoryOffer | None] = {}  # what the buffer would relay, per epoch
    first = threading.Event()  # epoch 0's offer is known (later ones: before their group)
    read, got = [], []

    def receiver():
        group = join_group("127.0.0.1", port, 1, 2, "gloo", 30)
        for epoch in range(EPOCHS):
            if epoch:
                group = group.rebuild(epoch)
            first.wait(30)
            received = {}
            for bucket in receive_weights(group, specs, 64, torch.device("cpu"), offers[epoch]):
                received.update({n: t.clone() for n, t in bucket})
            got.append(received)
            read.append(group.memory and os.fstat(group.memory.fd).st_ino)
        group.close()

    thread = threading.Thread(target=receiver)
    thread.start()
    group = join_group("127.0.0.1", port, 0, 2, "gloo", 30)
    sent = []
    for epoch in range(EPOCHS):
        if epoch:
            memory = group.new_memory()
            offers[epoch] = memory.offer  # announced before the group is built
            group = group.rebuild(epoch, memory)
        else:
            offers[0] = group.offer
            first.set()
        sent.append(os.fstat(group.memory.fd).st_ino)
        send_weights(group, tensors, specs, 64)
    group.close()
    thread.join(30)
    assert not thread.is_alive()
    return read == sent, got


def test_a_local_attackers_file_written_into_the_store_is_never_read(free_port):
    """The weight-sync store is an unauthenticated TCPStore any local process can write:
    an attacker fills it with a path and token of its own, under every key a member could
    read, all through several rendezvous. The member reads only the memory file announced
    to it over the buffer, and gets the learner's bytes every time."""
    port, tensors = free_port(), _tensors()
    token = "a" * 32
    path = _attacker_file(token, 1 << 16)
    stop = threading.Event()
    attackers = [
        threading.Thread(target=_attack_store, args=(port, f"{path} {token}", stop), daemon=True)
        for _ in range(2)
    ]
    for t in attackers:
        t.start()
    try:
        learners_file, got = _epochs(port, tensors)
    finally:
        stop.set()
        for t in attackers:
            t.join(10)
        os.unlink(path)
    assert learners_file  # every epoch's update read from the learner's own memory file
    assert len(got) == EPOCHS
    for received in got:
        assert set(received) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(received[name], t), name


def test_a_memory_file_that_is_not_rank_0s_is_refused_and_the_network_used(free_port, monkeypatch):
    """Rank 0's "memory file" is a plain file holding the right token (what a swapped or
    reused descriptor would look like): the member refuses it, so the weights go over the
    network and still arrive whole."""
    made = []

    def plain_file(name, flags=0):
        fd, path = tempfile.mkstemp(prefix="not-a-memfd-")
        os.unlink(path)
        made.append(fd)
        return fd

    monkeypatch.setattr(os, "memfd_create", plain_file)
    groups = _roundtrip(free_port(), _tensors())
    assert made and groups[0].memory is None and groups[1].memory is None


@pytest.fixture
def learner_memory():
    memory = SharedMemory.create()
    yield memory
    memory.close()


def _fd_offer(fd: int, token: str, pid: int | None = None) -> MemoryOffer:
    pid = os.getpid() if pid is None else pid
    return MemoryOffer(path=f"/proc/{os.getpid()}/fd/{fd}", token=token, pid=pid)


def test_only_the_announced_memory_file_is_accepted(learner_memory, tmp_path):
    offer = learner_memory.offer
    accepted = SharedMemory.accept(offer)
    assert accepted is not None
    assert os.fstat(accepted.fd).st_ino == os.fstat(learner_memory.fd).st_ino
    accepted.close()

    wrong_token = MemoryOffer(path=offer.path, token="b" * 32, pid=offer.pid)
    other_pid = MemoryOffer(path=offer.path, token=offer.token, pid=offer.pid + 1)
    plain = tmp_path / "weights"
    plain.write_text(offer.token)
    not_proc = MemoryOffer(path=str(plain), token=offer.token, pid=offer.pid)
    fd_plain = os.open(plain, os.O_RDONLY)
    fd_other = os.memfd_create("not-verl-async", os.MFD_CLOEXEC)
    os.write(fd_other, offer.token.encode())
    try:
        for bad in (
            wrong_token,
            other_pid,  # the path names another process than the learner announced
            not_proc,
            _fd_offer(fd_plain, offer.token),  # right token, a plain file
            _fd_offer(fd_other, offer.token),  # right token, another memory file
            MemoryOffer(path=f"/proc/{offer.pid}/fd/999999", token=offer.token, pid=offer.pid),
        ):
            assert SharedMemory.accept(bad) is None, bad
    finally:
        os.close(fd_plain)
        os.close(fd_other)


@pytest.mark.skipif(os.getuid() != 0, reason="making a file of another user needs root")
def test_a_memory_file_of_another_user_is_refused():
    """Same name, right token, the path and pid of the process that holds it: still not
    this user's file."""
    token = "c" * 32
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then gone
        try:
            os.close(hold_w)  # else its own end keeps the pipe open
            os.close(ready_r)
            os.setgid(65534)
            os.setuid(65534)
            fd = os.memfd_create(MEMFD_NAME, 0)
            os.write(fd, token.encode())
            os.write(ready_w, str(fd).encode())
            os.read(hold_r, 1)  # until the test is done
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        fd = int(os.read(ready_r, 32))
        offer = MemoryOffer(path=f"/proc/{pid}/fd/{fd}", token=token, pid=pid)
        assert os.readlink(offer.path).startswith(f"/memfd:{MEMFD_NAME}")
        assert SharedMemory.accept(offer) is None
    finally:
        os.close(hold_w)
        os.close(ready_r)
        os.waitpid(pid, 0)
