"""What a weight update holds and how it is packed: each tensor's spec (name, dtype, shape),
tied names sent once, and the plan of packed buckets both ends derive from the specs
alone (no sizes travel in-band). ``pack_bucket`` casts each tensor to its spec's dtype as
it copies it in, so an update is in the generators' dtype whatever the learner keeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from verl_async.protocol import ParamSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def nbytes_of(spec: ParamSpec) -> int:
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
        n = nbytes_of(spec)
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


def pack_bucket(
    bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The bucket's tensors (by name, at least those of the bucket) copied into one uint8
    buffer, each cast to its spec's dtype (the generator's: ``copy_`` rounds as the
    generator's own ``copy_`` would on receipt, so the bytes are the same): ``out`` when it
    has the bucket's size and device, else a new one."""
    first = tensors[bucket.specs[0].name]
    fits = out is not None and out.numel() == bucket.nbytes and out.device == first.device
    buf = out if fits else torch.empty(bucket.nbytes, dtype=torch.uint8, device=first.device)
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        view = buf[offset : offset + nbytes_of(spec)].view(dtype_of(spec.dtype)).view(spec.shape)
        view.copy_(tensors[spec.name].detach())
    return buf


def word_bytes(bucket: Bucket) -> int:
    """A bucket's word for sparse updates: its smallest element size (offsets are
    16-byte aligned, so every element is whole words)."""
    return min(dtype_of(s.dtype).itemsize for s in bucket.specs)
