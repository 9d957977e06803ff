"""The weight-sync group: learner rank 0 broadcasts packed weight buckets to every generator.

One group per run: a TCPStore whose master lives on learner rank 0, and a process group
built directly over it (ProcessGroupNCCL with CUDA, ProcessGroupGloo otherwise, same code).
Each vLLM worker joins through the worker extension in ``generators/vllm_extension.py``
with rank ``1 + rank_offset``. The group never touches torch.distributed's default group,
so it lives beside vLLM's own and the learner's Accelerate/FSDP group.

One update = one control message over ZeroMQ (``WeightUpdate``: names, dtypes, shapes,
bucket size), then ``len(plan_buckets(...))`` broadcasts of uint8 buckets. Both sides
derive the same bucket plan from the control message, so no sizes travel in-band.

Membership changes by epochs. The group of epoch e is built under the store prefix
``verl_async/weights/e`` (epoch 0: every member at start). When a generator dies and is
restarted, learner rank 0 drops the group of epoch e, which fails every member's pending
broadcast at once, and everyone builds epoch e + 1 over the same TCPStore
(``learners/publish.py`` decides when; the buffer hands out the epoch numbers).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    TCPStore,
)

from verl_async.protocol import ParamSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


@dataclass
class SyncGroup:
    """The process group plus the store it was built over (which must outlive it)."""

    group: ProcessGroup | None  # None once dropped
    store: TCPStore
    rank: int
    world_size: int
    backend: str
    timeout_s: float  # of its rendezvous and of each collective
    epoch: int = 0

    def close(self) -> None:
        """Shut the group down while the interpreter is fully alive. Left to interpreter
        teardown, gloo's destructor can run after Python's finalization has begun and
        abort the process ("terminate called without an active exception"), turning a
        finished run into exit code -6."""
        if self.group is not None:
            self.group.shutdown()

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

    def rebuild(self, epoch: int) -> SyncGroup:
        """Drop this group and build the group of ``epoch`` with the same rank and members
        over the same store (rank 0 is its server). Blocks until every member has joined."""
        self.drop()
        return _build(self.store, self.rank, self.world_size, self.backend, self.timeout_s, epoch)


def join_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    epoch: int = 0,
) -> SyncGroup:
    """Create (rank 0) or join the weight-sync group of ``epoch`` over a new store
    connection (a restarted generator joins a later epoch this way; members of an earlier
    epoch use ``SyncGroup.rebuild``). Blocks until all ranks have joined."""
    store = TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=dt.timedelta(seconds=timeout_s),
        wait_for_workers=epoch == 0,
    )  # fmt: skip
    return _build(store, rank, world_size, backend, timeout_s, epoch)


def _build(
    store: TCPStore, rank: int, world_size: int, backend: str, timeout_s: float, epoch: int
) -> SyncGroup:
    """The process group of ``epoch`` over ``store`` (its keys under an epoch's prefix)."""
    timeout = dt.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(f"verl_async/weights/{epoch}", store)
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = ProcessGroupNCCL(prefixed, rank, world_size, options)
    elif backend == "gloo":
        group = ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        raise ValueError(f"unknown weight-sync backend '{backend}'")
    return SyncGroup(group, store, rank, world_size, backend, timeout_s, epoch)


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


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors (by name, at least those of the bucket) copied into one uint8 buffer."""
    first = tensors[bucket.specs[0].name]
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=first.device)
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        flat = tensors[spec.name].detach().contiguous().view(-1).view(torch.uint8)
        buf[offset : offset + flat.numel()].copy_(flat)
    return buf


def broadcast_packed(group: SyncGroup, buffers: list[torch.Tensor]) -> int:
    """Rank 0: broadcast buckets made by ``pack_bucket``, in plan order; returns bytes sent."""
    for buf in buffers:
        broadcast_bucket(group, buf)
    return sum(b.numel() for b in buffers)


def receive_weights(
    group: SyncGroup, specs: list[ParamSpec], bucket_bytes: int, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rank > 0: yield each received bucket as (name, tensor) views, in send order.

    A fresh buffer per bucket: the consumer may keep references until its layer is complete.
    """
    for bucket in plan_buckets(specs, bucket_bytes):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        broadcast_bucket(group, buf)
        out = []
        for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
            n = _nbytes(spec)
            t = buf[offset : offset + n].view(dtype_of(spec.dtype)).view(spec.shape)
            out.append((spec.name, t))
        yield out
