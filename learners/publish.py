"""Publishing weights: full tensors from (possibly sharded) parameters, and the background
broadcast that overlaps the next training step."""

from __future__ import annotations

import threading
import time

import torch

from verl_async.weight_sync import SyncGroup, broadcast_packed


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


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded tensors by HF name; DTensor shards are gathered (a collective on every rank)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach()
    return out
