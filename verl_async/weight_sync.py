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
sides derive the same bucket plan from the control message (weight_plan.py), so no sizes
travel in-band. The dtypes are the generators' (the learner casts as it packs).

With rank 0's ``DeltaPolicy`` (``weights.delta``) an update is sparse (weight_delta.py):
a ``DELTA`` header first, with rank 0's digest of each bucket when a check is due, and
one all-reduce in which every member says which buckets it needs whole (it holds no
complete copy, or its digest differs); then each bucket goes with a [kind, count]
header as nothing, a delta on what members hold, or whole. A new epoch's group holds no
copy on either side, so its first update is whole. The bytes go one of two ways
(``send_update``, ``receive_weights``):

- network: one broadcast of uint8 bytes per bucket (none for an unchanged one);
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

from verl_async import weight_delta as wd
from verl_async.device_memory import DeviceMemory
from verl_async.protocol import MemoryOffer, ParamSpec
from verl_async.shared_memory import Memory, accept_memory, new_memory

# The packing plan (weight_plan.py), imported here too for the roles that send and load.
from verl_async.weight_plan import (  # noqa: F401
    Bucket,
    dtype_of,
    nbytes_of,
    pack_bucket,
    param_specs,
    plan_buckets,
    tied_names,
    with_tied,
    without_tied,
    word_bytes,
)

log = logging.getLogger("verl_async.weight_sync")


def resolve_backend(backend: str, colocated: bool = False) -> str:
    """``weights.backend``'s 'auto': NCCL with CUDA, unless generators share the learner's
    GPU (``placement.colocate``; NCCL refuses two ranks on one device), then gloo (the
    bytes go by CUDA IPC), as everywhere without CUDA."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and not colocated else "gloo"
    return backend


@dataclass(frozen=True)
class DeltaPolicy:
    """Rank 0's sparse updates (``weights.delta``; weight_delta.py)."""

    full_every: int  # every this many updates of an epoch go whole (0: only when needed)
    digest_every: int  # members' copies are checked every this many updates (0: never)
    # Deltas through the same-host memory file too. Copying whole buckets there costs less
    # than finding the changed words (BENCHMARKS.md section 24), so runs keep it off.
    memory: bool = True


@dataclass(frozen=True)
class Sent:
    """What one update cost on the wire (rank 0's ``send_update``)."""

    route: str  # 'memory' or 'network'
    nbytes: int  # bytes that crossed: buckets whole, deltas, nothing for unchanged ones
    whole: int  # buckets that went whole
    healed: int  # of those, buckets a member's digest showed wrong
    forms: tuple[int, ...] = ()  # buckets sent as each kind: SAME, INDICES, BITMAP, WHOLE
    # Of a sparse update's words (in the generators' dtype), how many changed since the
    # last; -1 when some bucket went whole (its changed words were not all counted).
    changed: int = -1
    words: int = 0


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
    # Sparse updates (weight_delta.py). Rank 0: its policy (None: whole updates), the
    # bytes of each bucket as last sent, and the updates sent this epoch. A member:
    # whether its buffers hold the whole of the last update (a delta's base).
    delta: DeltaPolicy | None = None
    sent: dict[int, torch.Tensor] = field(default_factory=dict)  # by bucket index
    updates: int = 0
    complete: bool = False

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
        out.delta = self.delta  # a new epoch holds no copy yet: its first update is whole
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


def broadcast_bucket(group: SyncGroup, buf: torch.Tensor) -> None:
    """One packed bucket from rank 0 to every member (rank 0 sends ``buf``, others fill it)."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    group.group.broadcast([buf], opts).wait()


# A header's first value: how the update travels (NETWORK, MEMORY: [route, bytes,
# encoded]), or a step before it in an epoch's first update (AGREE) or a sparse one
# (DELTA: [DELTA, check digests, 0]).
NETWORK, MEMORY, AGREE, DELTA = 0, 1, 2, 3


def _header(group: SyncGroup, values: list[int] | None = None) -> list[int]:
    """Rank 0 sends three ``values``, the others receive them (``NETWORK`` etc.; with an
    encoded update, each bucket's [kind, count, 0] too)."""
    buf = torch.tensor(values or [0, 0, 0], dtype=torch.int64, device=_control_device(group))
    broadcast_bucket(group, buf)
    return buf.tolist()


def _control_device(group: SyncGroup) -> torch.device:
    if group.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_read(group: SyncGroup) -> None:
    """Every member has read the update from shared memory (rank 0 may free it)."""
    group.group.allreduce([torch.ones(1, dtype=torch.int32)]).wait()


def send_update(
    group: SyncGroup, buffers: Iterable[torch.Tensor], plan: list[Bucket] | None = None
) -> Sent:
    """Rank 0: one update's buckets made by ``pack_bucket``, in ``plan`` order (consumed one
    at a time), to every member; returns what it cost.

    The epoch's first update settles whether its memory file is used (``AGREE``). With a
    ``group.delta`` policy and the ``plan``, buckets go as deltas against what every
    member holds (``_whole_wanted`` says which must go whole); a CUDA IPC group sends
    whole updates. Through shared memory the buckets are written first, then announced,
    and the call returns once every member has read them; over the network each is
    broadcast as it comes. A member that fails either way fails the call (RuntimeError
    with gloo), and the copies a delta builds on are forgotten."""
    if group.memory is not None and not group.memory_agreed:
        _header(group, [AGREE, 0, 0])
        _agree_on_memory(group, group.memory)
    elif not group.memory_agreed:  # nothing offered: the network, with nothing to agree
        _settled(group)
    sparse = group.delta is not None and plan is not None
    sparse = sparse and (group.memory is None or group.delta.memory)
    sparse = sparse and not isinstance(group.memory, DeviceMemory)
    heads: list[tuple[int, int]] = []  # each bucket's (kind, count), as sent

    def payloads(encoded: Iterable[tuple[int, int, torch.Tensor]]) -> Iterator[torch.Tensor]:
        for kind, count, payload in encoded:
            if sparse and group.memory is None:
                _header(group, [kind, count, 0])  # over the network: before its bytes
            heads.append((kind, count))
            yield payload

    try:
        reasons = _whole_wanted(group, plan) if sparse else None
        encoded = (
            _encode(group, i, buf, plan[i], reasons) if sparse else (wd.WHOLE, 0, buf)
            for i, buf in enumerate(buffers)
        )
        if group.memory is not None:  # one bucket held at a time, as over the network
            route = "memory"
            nbytes = group.memory.write(payloads(encoded))
            _header(group, [MEMORY, nbytes, int(sparse)])
            for kind, count in heads if sparse else ():
                _header(group, [kind, count, 0])
            _all_read(group)
        else:
            route, nbytes = "network", 0
            _header(group, [NETWORK, 0, int(sparse)])
            for payload in payloads(encoded):
                if payload.numel():
                    broadcast_bucket(group, payload)
                nbytes += payload.numel()
    except BaseException:
        group.sent.clear()  # what members hold is unknown now
        raise
    group.updates += 1
    whole = sum(kind == wd.WHOLE for kind, _ in heads)
    healed = sum(r == _MISMATCH for r in reasons) if reasons else 0
    if healed:
        log.warning(
            "weight-sync epoch %d: %d bucket(s) of a generator's weights differed from the "
            "learner's (digest); they were sent whole", group.epoch, healed,
        )  # fmt: skip
    forms = tuple(sum(k == kind for k, _ in heads) for kind in range(wd.WHOLE + 1))
    changed = sum(count for _, count in heads) if sparse and not whole else -1
    words = sum(b.nbytes // word_bytes(b) for b in plan) if sparse else 0
    return Sent(route, nbytes, whole, healed, forms, changed, words)


_OK, _NO_BASE, _MISMATCH = 0, 1, 2  # why a bucket must go whole (the largest wins)


def _whole_wanted(group: SyncGroup, plan: list[Bucket]) -> list[int]:
    """Rank 0: for each bucket, whether some member needs it whole (``_NO_BASE``: it
    joined or restarted, missed an update, or a whole update is due; ``_MISMATCH``: its
    digest differs from rank 0's copy). Rank 0 broadcasts its digests when a check is
    due, every member answers in one all-reduce (maximum)."""
    policy = group.delta
    check = policy.digest_every > 0 and group.updates % policy.digest_every == 0
    check = check and bool(group.sent)
    due = policy.full_every > 0 and group.updates % policy.full_every == 0
    _header(group, [DELTA, int(check), 0])
    if check:  # 0 for a bucket rank 0 holds no copy of (it goes whole anyway)
        digests = [wd.digest(group.sent[i]) if i in group.sent else 0 for i in range(len(plan))]
        broadcast_bucket(
            group, torch.tensor(digests, dtype=torch.int64, device=_control_device(group))
        )
    have = [i in group.sent and group.sent[i].numel() == b.nbytes for i, b in enumerate(plan)]
    own = [_OK if ok and not due else _NO_BASE for ok in have]
    members = _max_over_members(group, own)
    return [_NO_BASE if mine != _OK else theirs for mine, theirs in zip(own, members, strict=True)]


def _member_wants(group: SyncGroup, buckets: list[Bucket], check: bool, device) -> None:
    """A member's side of ``_whole_wanted``: the buckets it holds no base for, or (when
    ``check``) whose bytes differ from rank 0's digest."""
    digests = [0] * len(buckets)
    if check:
        received = torch.zeros(len(buckets), dtype=torch.int64, device=_control_device(group))
        broadcast_bucket(group, received)
        digests = received.tolist()
    own = []
    for i, bucket in enumerate(buckets):
        if not (group.complete and _holds(group, i, bucket.nbytes, device)):
            own.append(_NO_BASE)
        elif check and wd.digest(group.buffers[i]) != digests[i]:
            own.append(_MISMATCH)
        else:
            own.append(_OK)
    _max_over_members(group, own)


def _max_over_members(group: SyncGroup, values: list[int]) -> list[int]:
    flags = torch.tensor(values, dtype=torch.int32, device=_control_device(group))
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    group.group.allreduce([flags], opts).wait()
    return flags.tolist()


def _holds(group: SyncGroup, index: int, nbytes: int, device: torch.device) -> bool:
    """A member: whether receive buffer ``index`` exists with this size and device."""
    if index >= len(group.buffers):
        return False
    buf = group.buffers[index]
    return buf.numel() == nbytes and buf.device == torch.device(device)


def _encode(
    group: SyncGroup, index: int, cur: torch.Tensor, bucket: Bucket, reasons: list[int]
) -> tuple[int, int, torch.Tensor]:
    """Rank 0: bucket ``index`` as (kind, count, payload), and its bytes kept as the base
    of the next update's delta. A bucket of float32 words always goes whole, kept by no
    one: an AdamW step moves nearly every weight by about lr, which changes nearly every
    float32 word, so looking for the unchanged ones would cost time for nothing."""
    word = word_bytes(bucket)
    if word > 2:
        return wd.WHOLE, cur.numel() // word, cur
    kept = group.sent.get(index)
    last = kept if reasons[index] == _OK else None
    kind, count, payload = wd.encode(cur, last, word)
    if kept is not None and kept.numel() == cur.numel():
        kept.copy_(cur)  # after encode: a delta's payload is a new tensor
    else:
        group.sent[index] = cur.clone()
    return kind, count, payload


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
    receives the next. A sparse update is applied to those buffers, which hold the last
    update, so every bucket is yielded whole either way.
    """
    buckets = plan_buckets(specs, bucket_bytes)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # its buffers are reused by device
        device = torch.device("cuda", torch.cuda.current_device())
    memory_file = group.memory is not None and not isinstance(group.memory, DeviceMemory)
    route, nbytes, encoded = _header(group)
    if route == AGREE:
        _agree_on_memory(group, accept_memory(offer) if offer is not None else None)
        memory_file = group.memory is not None and not isinstance(group.memory, DeviceMemory)
        route, nbytes, encoded = _header(group)
    on = torch.device("cpu") if memory_file else device  # where the buffers live
    if route == DELTA:
        _member_wants(group, buckets, bool(nbytes), on)
        route, nbytes, encoded = _header(group)
    if route == MEMORY and group.memory is None:
        raise RuntimeError("a weight update in a memory file this member did not accept")
    if route not in (NETWORK, MEMORY):
        raise RuntimeError(f"a weight update header of route {route}")
    group.complete = False
    offset = 0
    for i, bucket in enumerate(buckets):
        base = _receive_bucket(group, i, bucket, route, bool(encoded), on, offset, nbytes)
        offset += base[1]
        buf = base[0].to(device)
        out = []
        for spec, offset_in in zip(bucket.specs, bucket.offsets, strict=True):
            n = nbytes_of(spec)
            t = buf[offset_in : offset_in + n].view(dtype_of(spec.dtype)).view(spec.shape)
            out.append((spec.name, t))
        yield out
    if route == MEMORY:
        if offset != nbytes:
            raise RuntimeError(
                f"a weight update of {nbytes} bytes, where its buckets make {offset}"
            )
        _all_read(group)
    group.complete = True


def _receive_bucket(
    group: SyncGroup,
    index: int,
    bucket: Bucket,
    route: int,
    encoded: bool,
    on: torch.device,
    offset: int,
    total: int,
) -> tuple[torch.Tensor, int]:
    """A member: bucket ``index`` into its buffer on ``on`` (a memory file's from
    ``offset`` of the update's ``total`` bytes), whole or as a delta on the buffer's last
    bytes; returns the buffer and the payload's size."""
    word = word_bytes(bucket)
    words = bucket.nbytes // word
    kind, count = (wd.WHOLE, words) if not encoded else _header(group)[:2]
    if kind not in (wd.SAME, wd.INDICES, wd.BITMAP, wd.WHOLE) or not 0 <= count <= words:
        raise RuntimeError(f"a weight bucket header of kind {kind}, count {count}")
    if kind != wd.WHOLE and not _holds(group, index, bucket.nbytes, on):
        raise RuntimeError(f"a weight delta for bucket {index}, which this member does not hold")
    base = group.buffer(index, bucket.nbytes, on)
    size = wd.payload_nbytes(kind, count, words, word)
    payload = base if kind == wd.WHOLE else torch.empty(size, dtype=torch.uint8, device=on)
    if route == MEMORY:
        if offset + size > total:
            raise RuntimeError(f"a weight update of {total} bytes, where its buckets need more")
        if size:
            group.memory.read_into(payload, offset)
    elif size:
        broadcast_bucket(group, payload)
    if kind != wd.WHOLE:
        wd.apply(base, kind, count, payload, word)
    return base, size
