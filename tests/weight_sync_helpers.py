"""Sending weights the plain way, for tests: no announcement, no gathers.

Production sends through the learner's path (``learners/publish.py``: gathered FSDP2
buckets, packed and broadcast beside the ``WeightUpdate`` announcement); tests that only
need bytes to reach a receiver (``receive_weights``, an engine's weight-sync worker) send
full tensors from one process with ``send_weights``.
"""

from __future__ import annotations

import torch

from verl_async.protocol import ParamSpec
from verl_async.weight_sync import SyncGroup, pack_bucket, plan_buckets, send_update


def send_weights(
    group: SyncGroup, tensors: dict[str, torch.Tensor], specs: list[ParamSpec], bucket_bytes: int
) -> int:
    """Rank 0: send ``tensors`` (full, unsharded) in the packed order of ``specs``, one
    bucket at a time (memory: one bucket); returns the bytes sent."""
    buckets = plan_buckets(specs, bucket_bytes)
    send_update(group, (pack_bucket(b, tensors) for b in buckets))
    return sum(b.nbytes for b in buckets)
