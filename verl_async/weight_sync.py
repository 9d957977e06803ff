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
  sides system CPU on the cores training uses. With rank 0 on a GPU that its members
  share (``placement.colocate``: NCCL refuses two ranks on one device, so the group is
  gloo) the same steps go through a device buffer of rank 0's that members open by its
  CUDA IPC handle (``device_memory.py``): device-to-device copies, no host round trip.

Both ends reuse their memory from one update to the next (rank 0's memory file, each
member's receive buffers, ``SyncGroup.buffers``): fresh pages would be zeroed by the
kernel at every update, which on a CPU costs more than copying the bytes.

Whether the group uses shared memory is decided once per epoch, at its first update.
Rank 0 makes a memory file per epoch holding a random token, and its path, token and pid
(``MemoryOffer``) travel with every ``WeightUpdate`` it announces: learner to buffer in a
learner-only request, buffer to generators in ``VersionStatus``, both over the buffer's
authenticated connections. The TCPStore carries nothing about it: any local process can
write there. A member opens the offered path and keeps it only if what it opened is a
memory file named ``verl-async-weights``, owned by its own user, under the pid the
learner announced, holding the token (``SharedMemory.accept``); then one all-reduce makes
every member agree, and a single refusal (or a member given no offer: another host, an
engine that got none) sends the epoch's updates over the network. The group's
membership, failures and epochs are the same either way.

Membership changes by epochs. The group of epoch e is built under the store prefix
``verl_async/weights/e`` (epoch 0: every member at start). When a generator dies and is
restarted, learner rank 0 drops the group of epoch e, which fails every member's pending
broadcast at once, and everyone builds epoch e + 1 over the same TCPStore
(``learners/publish.py`` decides when; the buffer hands out the epoch numbers).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
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

from verl_async.device_memory import DeviceMemory
from verl_async.protocol import MemoryOffer, ParamSpec
from verl_async.shared_memory import Memory, accept_memory, new_memory

log = logging.getLogger("verl_async.weight_sync")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_backend(backend: str, colocated: bool = False) -> str:
    """``weights.backend``'s 'auto': NCCL with CUDA, unless generators share the learner's
    GPU (``placement.colocate``; NCCL refuses two ranks on one device), then gloo (the
    bytes go by CUDA IPC), as everywhere without CUDA."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and not colocated else "gloo"
    return backend


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
    # Rank 0: the memory it offers this epoch; a member: the one it accepted. Once
    # ``memory_agreed`` (the epoch's first update), every member holds it or none does.
    memory: Memory | None = None
    memory_agreed: bool = False
    offers_memory: bool = True  # rank 0: offer shared memory again when rebuilt
    device: torch.device | None = None  # rank 0's; a CUDA one offers device memory
    reserved: int = 0  # rank 0: bytes of an update (``reserve``)
    buffers: list[torch.Tensor] = field(default_factory=list)  # a member's, one per bucket

    @property
    def offer(self) -> MemoryOffer | None:
        """Rank 0: the memory file announced with each update of this epoch (None: the
        network only)."""
        return self.memory.offer if self.memory is not None else None

    def new_memory(self) -> Memory | None:
        """Rank 0: memory for the next epoch, when this group offers one (its offer is
        announced before the group is built, ``rebuild(epoch, memory)``)."""
        if not (self.offers_memory and self.backend == "gloo"):
            return None
        return new_memory(self.device, self.reserved)

    def reserve(self, nbytes: int) -> None:
        """Rank 0: allocate the memory of updates of ``nbytes`` now (a device buffer is
        offered from then on), and for the epochs to come."""
        self.reserved = nbytes
        if self.memory is not None:
            self.memory.reserve(nbytes)

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

    def rebuild(self, epoch: int, memory: Memory | None = None) -> SyncGroup:
        """Drop this group and build the group of ``epoch`` with the same rank and members
        over the same store (rank 0 is its server, offering ``memory``, from
        ``new_memory``). Blocks until every member has joined."""
        self.drop()
        out = _build(
            self.store, self.rank, self.world_size, self.backend, self.timeout_s, epoch, memory,
            self.join_timeout_s,
        )  # fmt: skip
        out.offers_memory, out.device, out.reserved = self.offers_memory, self.device, self.reserved
        return out


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
    device: torch.device | None = None,
) -> SyncGroup:
    """Create (rank 0) or join the weight-sync group of ``epoch`` over a new store
    connection (a restarted generator joins a later epoch this way; members of an earlier
    epoch use ``SyncGroup.rebuild``). Blocks until all ranks have joined, at most
    ``join_timeout_s`` (default ``timeout_s``, the bound of each collective).
    ``shared_memory`` (rank 0's say; ``weights.shared_memory``): offer the same-host
    channel (``SyncGroup.offer``, announced with each update): a device buffer when
    rank 0's ``device`` is a GPU, else a memory file."""
    join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
    store = TCPStore(
        host, port, world_size, is_master=(rank == 0),
        timeout=dt.timedelta(seconds=join_timeout_s), wait_for_workers=epoch == 0,
    )  # fmt: skip
    offers = shared_memory and rank == 0 and backend == "gloo"
    memory = new_memory(device) if offers else None
    out = _build(store, rank, world_size, backend, timeout_s, epoch, memory, join_timeout_s)
    out.offers_memory, out.device = shared_memory, device
    return out


class GroupFailed(RuntimeError):
    """The group of an epoch did not form: a member missing or late, or the store's keys
    not what the members wrote (anyone who reaches the store can write there)."""


def _build(
    store: TCPStore,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    epoch: int,
    memory: Memory | None = None,
    join_timeout_s: float | None = None,
) -> SyncGroup:
    """The process group of ``epoch`` over ``store`` (its keys under an epoch's prefix);
    rank 0 offers ``memory`` (gloo only), which the epoch's first update settles. Its
    rendezvous may take ``join_timeout_s`` (default ``timeout_s``), each collective after
    it ``timeout_s``. Raises ``GroupFailed`` (one line) when it does not form."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown weight-sync backend '{backend}'")
    join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
    prefixed = PrefixStore(f"verl_async/weights/{epoch}", store)
    try:
        group = _process_group(prefixed, rank, world_size, backend, join_timeout_s, store.host)
    except Exception as exc:  # gloo and the store raise RuntimeErrors, and C++ ones
        raise GroupFailed(
            f"weight-sync epoch {epoch}: the group did not form within {join_timeout_s:g}s "
            f"(rank {rank} of {world_size}): {failure_line(exc)}"
        ) from exc
    group.set_timeout(dt.timedelta(seconds=timeout_s))  # formed: the bound of a collective
    return SyncGroup(
        group, store, rank, world_size, backend, timeout_s, join_timeout_s, epoch, memory
    )


def _process_group(
    store: PrefixStore, rank: int, world_size: int, backend: str, timeout_s: float, host: str
) -> ProcessGroup:
    timeout = dt.timedelta(seconds=timeout_s)
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [gloo_device(host)]
    return ProcessGroupGloo(store, rank, world_size, options)


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


def _agree_on_memory(group: SyncGroup, memory: Memory | None) -> None:
    """The epoch's first update: rank 0 offers its memory file, each member says whether
    it accepted the offer it was announced; one all-reduce (minimum) makes them agree, and
    the group keeps the file only if all did."""
    flag = torch.tensor([int(memory is not None)], dtype=torch.int32)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MIN
    group.group.allreduce([flag], opts).wait()
    if int(flag) != 1 and memory is not None:
        memory.close()
        memory = None
    group.memory = memory
    _settled(group)


def _settled(group: SyncGroup) -> None:
    """The epoch's way for updates is settled (rank 0 says which, once per epoch)."""
    group.memory_agreed = True
    if group.rank == 0:
        route = "the network"
        if group.memory is not None:
            route = "CUDA IPC" if isinstance(group.memory, DeviceMemory) else "shared memory"
        log.info("weight-sync epoch %d: updates go through %s", group.epoch, route)


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


NETWORK, MEMORY, AGREE = 0, 1, 2  # a header's first value: how the update travels


def _header(group: SyncGroup, values: list[int] | None = None) -> list[int]:
    """Rank 0 sends ``values`` ([route, bytes]: ``NETWORK``, ``MEMORY`` with the update's
    size, or ``AGREE``, which comes first in an epoch's first update when rank 0 offers
    its memory file), the others receive them."""
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

    The epoch's first update settles whether its memory file is used (``AGREE``). Through
    shared memory the buckets are written first, then announced, and the call returns
    once every member has read them; over the network each is broadcast as it comes. A
    member that fails either way fails the call (RuntimeError with gloo)."""
    if group.memory is not None and not group.memory_agreed:
        _header(group, [AGREE, 0])
        _agree_on_memory(group, group.memory)
    elif not group.memory_agreed:  # nothing offered: the network, with nothing to agree
        _settled(group)
    if group.memory is not None:
        nbytes = group.memory.write(buffers)
        _header(group, [MEMORY, nbytes])
        _all_read(group)
        return "memory"
    _header(group, [NETWORK, 0])
    for buf in buffers:
        broadcast_bucket(group, buf)
    return "network"


def receive_weights(
    group: SyncGroup,
    specs: list[ParamSpec],
    bucket_bytes: int,
    device: torch.device,
    offer: MemoryOffer | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rank > 0: yield each received bucket as (name, tensor) views, in send order.

    ``offer`` is the memory file the update was announced with (``WeightUpdate.memory``,
    from the buffer); it is used only if accepted (``SharedMemory.accept``) at the
    epoch's first update. Each bucket has a buffer of its own (the consumer may keep
    references until its layer is complete), reused by the next update
    (``SyncGroup.buffer``): the consumer must be done with one update's tensors before it
    receives the next.
    """
    buckets = plan_buckets(specs, bucket_bytes)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # its buffers are reused by device
        device = torch.device("cuda", torch.cuda.current_device())
    route, nbytes = _header(group)
    if route == AGREE:
        _agree_on_memory(group, accept_memory(offer) if offer is not None else None)
        route, nbytes = _header(group)
    if route == MEMORY:
        expected = sum(b.nbytes for b in buckets)
        if group.memory is None:
            raise RuntimeError("a weight update in a memory file this member did not accept")
        if nbytes != expected:
            raise RuntimeError(f"a weight update of {nbytes} bytes, where its plan says {expected}")
    elif route != NETWORK:
        raise RuntimeError(f"a weight update header of route {route}")
    offset = 0
    for i, bucket in enumerate(buckets):
        if route == MEMORY:  # a memory file: through a CPU buffer; CUDA IPC: on the device
            on = device if isinstance(group.memory, DeviceMemory) else torch.device("cpu")
            buf = group.buffer(i, bucket.nbytes, on)
            group.memory.read_into(buf, offset)
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
    if route == MEMORY:
        _all_read(group)
