"""The weight-sync group: learner rank 0 broadcasts packed weight buckets to every generator.

One group per run: a TCPStore whose master lives on learner rank 0, and a process group
built directly over it (ProcessGroupNCCL with CUDA, ProcessGroupGloo otherwise, same code).
Each vLLM worker joins through the worker extension in ``generators/vllm_extension.py``
with rank ``1 + rank_offset``. The group never touches torch.distributed's default group,
so it lives beside vLLM's own and the learner's Accelerate/FSDP group. A gloo member
listens on its address on the route to the store's host (``gloo_device``), so members on
other hosts reach it whatever the machine's host name resolves to.

One update = one control message over ZeroMQ (``WeightUpdate``: names, dtypes, shapes,
bucket size), then a header broadcast saying how the bytes travel, then the bytes. Both
sides derive the same bucket plan from the control message, so no sizes travel in-band.
The bytes go one of two ways (``send_update``, ``receive_weights``):

- network: ``len(plan_buckets(...))`` broadcasts of uint8 buckets;
- shared memory, when every member runs on learner rank 0's host (a gloo group only):
  rank 0 writes the buckets into a memory file of its own (``memfd``), members read them
  from it through ``/proc/<pid>/fd/<n>``, and a one-number all-reduce tells rank 0 that
  every member has read them. No byte crosses the loopback's TCP stack, which cost both
  sides system CPU on the cores training uses.

Both ends reuse their memory from one update to the next (rank 0's memory file, each
member's receive buffers, ``SyncGroup.buffers``): fresh pages would be zeroed by the
kernel at every update, which on a CPU costs more than copying the bytes.
  Whether the group can do this is decided once per epoch, when it is built: rank 0
  writes a random token into the file and each member must read it back through the
  path (same host, same process namespace, permission to open it). The group's
  membership, failures and epochs are the same either way.

Membership changes by epochs. The group of epoch e is built under the store prefix
``verl_async/weights/e`` (epoch 0: every member at start). When a generator dies and is
restarted, learner rank 0 drops the group of epoch e, which fails every member's pending
broadcast at once, and everyone builds epoch e + 1 over the same TCPStore
(``learners/publish.py`` decides when; the buffer hands out the epoch numbers).
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    ReduceOp,
    TCPStore,
)

from verl_async.protocol import ParamSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


class SharedMemory:
    """The same-host channel of a gloo group: a memory file of rank 0's (``fd``, rank 0
    only) that members open by ``path``. It keeps the size of the largest update sent (its
    pages are written over, not allocated again) and goes away with rank 0's process, so
    a crash leaves nothing behind."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def offer(cls) -> tuple[SharedMemory, str] | None:
        """Rank 0: a new memory file holding a random token; None where Linux's
        ``memfd_create`` is missing."""
        if not hasattr(os, "memfd_create"):
            return None
        fd = os.memfd_create("verl-async-weights", os.MFD_CLOEXEC)
        token = secrets.token_hex(16)
        os.pwrite(fd, token.encode(), 0)
        return cls(f"/proc/{os.getpid()}/fd/{fd}", fd), token

    @staticmethod
    def readable(path: str, token: str) -> bool:
        """Member: whether ``path`` opens here and holds ``token``."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            return os.pread(fd, len(token), 0) == token.encode()
        finally:
            os.close(fd)

    def reserve(self, nbytes: int) -> None:
        """Rank 0: allocate the file's pages for an update of ``nbytes`` now (what is in
        them is written over)."""
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self.fd, 0, nbytes)

    def write(self, buffers: Iterable[torch.Tensor]) -> int:
        """Rank 0: the packed buckets one after another from offset 0; returns bytes."""
        offset = 0
        for buf in buffers:
            view = memoryview(buf.detach().cpu().numpy()).cast("B")
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        return offset

    def read_into(self, fd: int, buf: torch.Tensor, offset: int) -> None:
        view = memoryview(buf.numpy()).cast("B")
        while view:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise RuntimeError(f"the weight update in shared memory ended at byte {offset}")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class SyncGroup:
    """The process group plus the store it was built over (which must outlive it)."""

    group: ProcessGroup | None  # None once dropped
    store: TCPStore
    rank: int
    world_size: int
    backend: str
    timeout_s: float  # of each collective
    join_timeout_s: float  # of its rendezvous (this epoch's and the next ones')
    epoch: int = 0
    memory: SharedMemory | None = None  # every member on rank 0's host: updates go through it
    offers_memory: bool = True  # rank 0: offer shared memory again when rebuilt
    buffers: list[torch.Tensor] = field(default_factory=list)  # a member's, one per bucket

    def buffer(self, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A member's receive buffer for bucket ``index`` of an update, the one of the last
        update when it fits (a consumer lets go of an update's tensors before the next)."""
        while len(self.buffers) <= index:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
        buf = self.buffers[index]
        if buf.numel() != nbytes or buf.device != torch.device(device):
            buf = self.buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def close(self) -> None:
        """Shut the group down while the interpreter is fully alive. Left to interpreter
        teardown, gloo's destructor can run after Python's finalization has begun and
        abort the process ("terminate called without an active exception"), turning a
        finished run into exit code -6."""
        if self.group is not None:
            self.group.shutdown()
        if self.memory is not None:
            self.memory.close()

    def drop(self) -> None:
        """Destroy the process group, keeping the store for the next epoch. Destroying
        closes its connections, so a member blocked in a broadcast of this group fails at
        once ("Connection closed by peer") instead of waiting out the timeout (``shutdown``
        alone leaves gloo's connections open). NCCL communicators are aborted first."""
        group, self.group = self.group, None
        if (
            group is not None
            and hasattr(group, "abort")
            and not isinstance(group, ProcessGroupGloo)
        ):
            group.abort()
        del group
        if self.memory is not None:
            self.memory.close()
            self.memory = None

    def rebuild(self, epoch: int) -> SyncGroup:
        """Drop this group and build the group of ``epoch`` with the same rank and members
        over the same store (rank 0 is its server). Blocks until every member has joined."""
        offer = self.offers_memory
        self.drop()
        return _build(
            self.store, self.rank, self.world_size, self.backend, self.timeout_s, epoch, offer,
            self.join_timeout_s,
        )  # fmt: skip


def join_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    epoch: int = 0,
    shared_memory: bool = True,
    join_timeout_s: float | None = None,
) -> SyncGroup:
    """Create (rank 0) or join the weight-sync group of ``epoch`` over a new store
    connection (a restarted generator joins a later epoch this way; members of an earlier
    epoch use ``SyncGroup.rebuild``). Blocks until all ranks have joined, at most
    ``join_timeout_s`` (default ``timeout_s``, the bound of each collective).
    ``shared_memory`` (rank 0's say; ``weights.shared_memory``): offer the same-host
    channel."""
    join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
    store = TCPStore(
        host, port, world_size, is_master=(rank == 0),
        timeout=dt.timedelta(seconds=join_timeout_s), wait_for_workers=epoch == 0,
    )  # fmt: skip
    return _build(store, rank, world_size, backend, timeout_s, epoch, shared_memory, join_timeout_s)


def _build(
    store: TCPStore,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    epoch: int,
    shared_memory: bool = True,
    join_timeout_s: float | None = None,
) -> SyncGroup:
    """The process group of ``epoch`` over ``store`` (its keys under an epoch's prefix),
    with its same-host channel when every member can use it (gloo only). Its rendezvous
    may take ``join_timeout_s``; each collective after it ``timeout_s``."""
    join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
    timeout = dt.timedelta(seconds=join_timeout_s)
    prefixed = PrefixStore(f"verl_async/weights/{epoch}", store)
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = ProcessGroupNCCL(prefixed, rank, world_size, options)
    elif backend == "gloo":
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [gloo_device(store.host)]
        group = ProcessGroupGloo(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"unknown weight-sync backend '{backend}'")
    out = SyncGroup(group, store, rank, world_size, backend, timeout_s, join_timeout_s, epoch)
    out.offers_memory = shared_memory
    if backend == "gloo":
        out.memory = _probe_memory(out, prefixed, shared_memory)
    group.set_timeout(dt.timedelta(seconds=timeout_s))  # formed: the bound of a collective
    return out


def gloo_device(store_host: str):
    """The gloo device of this process: ``GLOO_SOCKET_IFNAME``'s interface when set, else
    the local address of the route to the store's host (the one the other members reach
    this host by). Gloo's own default resolves the machine's host name, which on a host
    with several interfaces (or in a network namespace) may name an address the other
    hosts cannot reach, or none at all."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return ProcessGroupGloo.create_default_device()
    return ProcessGroupGloo.create_device(hostname=route_source(store_host))


def route_source(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent: a UDP socket's
    connect only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _probe_memory(group: SyncGroup, store: PrefixStore, offer: bool) -> SharedMemory | None:
    """Rank 0 offers a memory file (its path and a token in the store); every member says
    whether it reads the token there; one all-reduce (minimum) makes them agree."""
    mine = None
    if group.rank == 0:
        offered = SharedMemory.offer() if offer else None
        mine = offered[0] if offered else None
        store.set("memory", f"{mine.path} {offered[1]}" if mine else "")
        ok = mine is not None
    else:
        found = store.get("memory").decode().split()
        ok = bool(found) and SharedMemory.readable(*found)
        mine = SharedMemory(found[0]) if ok else None
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MIN
    group.group.allreduce([flag], opts).wait()
    if int(flag) == 1:
        return mine
    if mine is not None:
        mine.close()
    return None


def failure_line(exc: BaseException) -> str:
    """An exception of a failed broadcast or join as one short line for a log (gloo's
    messages run over several lines)."""
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


def without_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model``'s ``state`` with each tensor once, under its first name: tied weights (an
    output head sharing the input embedding, as SmolLM2's does) are one parameter under two
    names, and every receiver ties them again on load (vLLM skips ``lm_head`` when the
    config ties it; a transformers model's two names hold one parameter). Decided by the
    module tree, not by memory, so every FSDP2 rank leaves out the same names."""
    unique = {name for name, _ in model.named_parameters()}  # duplicates removed
    unique |= {name for name, _ in model.named_buffers()}
    return {name: t for name, t in state.items() if name in unique}


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each second (third...) name of a parameter -> its first name (``without_tied``)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def with_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``without_tied``: ``state`` with each tied name given the tensor of
    the name it shares (a name ``state`` holds already is kept)."""
    for name, first in tied_names(model).items():
        state.setdefault(name, state[first])
    return state


def param_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    return [ParamSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def _nbytes(spec: ParamSpec) -> int:
    numel = 1
    for d in spec.shape:
        numel *= d
    return numel * dtype_of(spec.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    specs: list[ParamSpec]
    offsets: list[int]  # byte offset of each spec inside the bucket
    nbytes: int


def plan_buckets(specs: list[ParamSpec], bucket_bytes: int) -> list[Bucket]:
    """Greedy packing in spec order; a tensor larger than a bucket gets a bucket of its own."""
    buckets: list[Bucket] = []
    cur: list[ParamSpec] = []
    offsets: list[int] = []
    size = 0
    for spec in specs:
        n = _nbytes(spec)
        if cur and size + n > bucket_bytes:
            buckets.append(Bucket(cur, offsets, size))
            cur, offsets, size = [], [], 0
        # Keep every tensor 16-byte aligned inside the bucket so views are cheap.
        pad = -size % 16
        size += pad
        cur.append(spec)
        offsets.append(size)
        size += n
    if cur:
        buckets.append(Bucket(cur, offsets, size))
    return buckets


def broadcast_bucket(group: SyncGroup, buf: torch.Tensor) -> None:
    """One packed bucket from rank 0 to every member (rank 0 sends ``buf``, others fill it)."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    group.group.broadcast([buf], opts).wait()


def _header(group: SyncGroup, values: list[int] | None = None) -> list[int]:
    """Rank 0 sends ``values`` (how this update travels: [1 = shared memory, bytes]), the
    others receive them."""
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else "cpu"
    buf = torch.tensor(values or [0, 0], dtype=torch.int64, device=device)
    broadcast_bucket(group, buf)
    return buf.tolist()


def _all_read(group: SyncGroup) -> None:
    """Every member has read the update from shared memory (rank 0 may free it)."""
    group.group.allreduce([torch.ones(1, dtype=torch.int32)]).wait()


def pack_bucket(
    bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The bucket's tensors (by name, at least those of the bucket) copied into one uint8
    buffer: ``out`` when it has the bucket's size and device, else a new one."""
    first = tensors[bucket.specs[0].name]
    fits = out is not None and out.numel() == bucket.nbytes and out.device == first.device
    buf = out if fits else torch.empty(bucket.nbytes, dtype=torch.uint8, device=first.device)
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        flat = tensors[spec.name].detach().contiguous().view(-1).view(torch.uint8)
        buf[offset : offset + flat.numel()].copy_(flat)
    return buf


def send_update(group: SyncGroup, buffers: Iterable[torch.Tensor]) -> str:
    """Rank 0: one update's buckets made by ``pack_bucket``, in plan order (consumed one at
    a time), to every member; returns the way they went ('memory' or 'network').

    Through shared memory the buckets are written first, then announced, and the call
    returns once every member has read them; over the network each is broadcast as it
    comes. A member that fails either way fails the call (RuntimeError with gloo)."""
    if group.memory is not None:
        nbytes = group.memory.write(buffers)
        _header(group, [1, nbytes])
        _all_read(group)
        return "memory"
    _header(group, [0, 0])
    for buf in buffers:
        broadcast_bucket(group, buf)
    return "network"


def receive_weights(
    group: SyncGroup, specs: list[ParamSpec], bucket_bytes: int, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rank > 0: yield each received bucket as (name, tensor) views, in send order.

    Each bucket has a buffer of its own (the consumer may keep references until its layer
    is complete), reused by the next update (``SyncGroup.buffer``): the consumer must be
    done with one update's tensors before it receives the next.
    """
    buckets = plan_buckets(specs, bucket_bytes)
    memory, nbytes = _header(group)
    if memory:
        expected = sum(b.nbytes for b in buckets)
        if nbytes != expected:
            raise RuntimeError(f"a weight update of {nbytes} bytes, where its plan says {expected}")
    fd = os.open(group.memory.path, os.O_RDONLY) if memory else None
    try:
        offset = 0
        for i, bucket in enumerate(buckets):
            if memory:  # gloo: a CPU buffer, moved where the consumer wants it
                buf = group.buffer(i, bucket.nbytes, torch.device("cpu"))
                group.memory.read_into(fd, buf, offset)
                buf = buf.to(device)
            else:
                buf = group.buffer(i, bucket.nbytes, device)
                broadcast_bucket(group, buf)
            offset += bucket.nbytes
            out = []
            for spec, offset_in in zip(bucket.specs, bucket.offsets, strict=True):
                n = _nbytes(spec)
                t = buf[offset_in : offset_in + n].view(dtype_of(spec.dtype)).view(spec.shape)
                out.append((spec.name, t))
            yield out
    finally:
        if fd is not None:
            os.close(fd)
    if memory:
        _all_read(group)
