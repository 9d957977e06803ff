"""Publishing weights: full tensors from (possibly sharded) parameters, bucket by bucket,
and the background broadcast that overlaps the next training step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from verl_async.weight_sync import Bucket, SyncGroup, broadcast_packed


class BackgroundBroadcast:
    """At most one weight broadcast in flight on a thread; its error surfaces at ``wait``.

    The learner packs a copy of the new weights, announces them and starts this; the next
    step trains while generators pause and receive. Before announcing the next version the
    learner waits for this one, so generators never skip a version.
    """

    def __init__(self, group: SyncGroup, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # duration of the last finished broadcast

    def start(self, buffers: list[torch.Tensor]) -> None:
        self.wait()
        self.thread = threading.Thread(
            target=self._run, args=(buffers,), name="weight-broadcast", daemon=True
        )
        self.thread.start()

    def _run(self, buffers: list[torch.Tensor]) -> None:
        t0 = time.monotonic()
        try:
            broadcast_packed(self.group, buffers)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self.error = exc
        self.seconds = time.monotonic() - t0

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join(self.timeout_s)
            if self.thread.is_alive():
                raise TimeoutError(
                    f"weight broadcast not finished after weights.timeout_s={self.timeout_s:.0f}s; "
                    "is every generator alive? (see logs/generator*.log)"
                )
            self.thread = None
        if self.error is not None:
            raise self.error


def gathered_buckets(
    state: dict[str, torch.Tensor], buckets: list[Bucket]
) -> Iterator[tuple[Bucket, dict[str, torch.Tensor]]]:
    """Each bucket's full tensors, one bucket at a time: under FSDP2 every rank must walk
    this (``full_tensor()`` is a collective), and only one bucket of unsharded tensors is
    alive at once. ``state`` is the model's ``state_dict()`` (DTensors or plain)."""
    for bucket in buckets:
        tensors = {}
        for spec in bucket.specs:
            tensor = state[spec.name]
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            tensors[spec.name] = tensor.detach()
        yield bucket, tensors
