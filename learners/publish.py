"""Publishing weights: full tensors from (possibly sharded) parameters, bucket by bucket;
learner rank 0 announces each version, broadcasts it (in the background, overlapping the
next step), and rebuilds the weight-sync group when its membership changed.

A generator that dies leaves the group broken: gloo fails the next broadcast at once
("Connection closed by peer"), NCCL hangs until ``weights.timeout_s``. The launcher starts
the generator again; its new workers cannot enter the old group, so the group is built
anew under the next epoch (buffer/sync_epochs.py numbers them). Before each publish rank 0
asks the buffer whether a new epoch is wanted (a restarted generator asked for one, or the
last broadcast failed); if so it drops the old group (members blocked in it fail at
once), announces the weights with the new epoch so the surviving generators rejoin, waits
for every member, and broadcasts. Every generator then holds the same, whole version.

What crosses the wire is what the generators hold (``wire_specs``): floating tensors in
``model.dtype``, cast once here whatever the learner keeps, and with ``weights.delta``
only the words that changed (weight_sync.py, weight_delta.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

import msgspec
import torch

from verl_async import lora
from verl_async import protocol as P
from verl_async.transport import BufferClient
from verl_async.weight_sync import (
    Bucket,
    DeltaPolicy,
    Sent,
    SyncGroup,
    failure_line,
    pack_bucket,
    param_specs,
    plan_buckets,
    send_update,
)

log = logging.getLogger("verl_async.learner")


class BackgroundBroadcast:
    """At most one weight broadcast in flight on a thread; its error surfaces at ``wait``.

    The learner packs a copy of the new weights, announces them and starts this; the next
    step trains while generators pause and receive. Before announcing the next version the
    learner waits for this one, so generators never skip a version.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # duration of the last finished broadcast
        self.sent: Sent | None = None  # what it cost (weight_sync.send_update)

    def start(self, group: SyncGroup, buffers: list[torch.Tensor], plan: list[Bucket]) -> None:
        self.wait()
        self.thread = threading.Thread(
            target=self._run, args=(group, buffers, plan), name="weight-broadcast", daemon=True
        )
        self.thread.start()

    def _run(self, group: SyncGroup, buffers: list[torch.Tensor], plan: list[Bucket]) -> None:
        t0 = time.monotonic()
        try:
            self.sent = send_update(group, buffers, plan)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self.error = exc
        self.seconds = time.monotonic() - t0

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join(self.timeout_s)
            if self.thread.is_alive():
                raise TimeoutError(
                    f"weight broadcast not finished after weights.timeout_s={self.timeout_s:.0f}s; "
                    "is every generator alive? (see logs/generator*.log)"
                )
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error


class WeightSync:
    """Rank 0's publishing: ``publish`` one version; ``rebuild_wanted`` while idle."""

    def __init__(self, group: SyncGroup, client: BufferClient, cfg) -> None:
        self.group = group
        self.client = client
        self.timeout_s = cfg.weights.timeout_s
        self.broadcast = BackgroundBroadcast(self.timeout_s) if cfg.weights.overlap else None
        self.failed = False  # the last broadcast did not reach every member
        self.packed: list[torch.Tensor] = []  # the background broadcast's buffers, reused
        group.delta = delta_policy(cfg.weights)
        self.sent: Sent | None = None  # the last update sent without overlap
        self.heals = 0  # buckets sent whole because a generator's digest differed
        self.client.request(P.SyncStatus(formed=group.epoch))

    @property
    def epoch(self) -> int:
        return self.group.epoch

    def reserve(self, plan: list[Bucket], device: torch.device) -> None:
        """Allocate, and touch, what publishing updates of ``plan`` needs: the background
        broadcast's packed buffers and the shared memory (a device buffer is offered from
        then on). Done before the first step (1.2 s of it for SmolLM2-135M's 513 MiB on 2
        CPU cores), which would pay for it otherwise."""
        if self.broadcast is not None and not self.packed:
            self.packed = [torch.zeros(b.nbytes, dtype=torch.uint8, device=device) for b in plan]
        self.group.reserve(sum(b.nbytes for b in plan))

    def publish(
        self, update: P.WeightUpdate, buckets: Iterable[tuple[Bucket, dict[str, torch.Tensor]]]
    ) -> None:
        """Announce ``update`` and broadcast ``buckets`` (every one is consumed: under FSDP2
        the other ranks gather them with this one), in the background with
        ``weights.overlap``; the group is rebuilt first when a new epoch is wanted."""
        self._finish_previous()
        plan = plan_buckets(update.params, update.bucket_bytes)
        if self.broadcast is not None:  # the last update's buffers: it has been sent
            old = self.packed
            self.packed = buffers = [
                pack_bucket(b, tensors, old[i] if i < len(old) else None)
                for i, (b, tensors) in enumerate(buckets)
            ]
            self._announce(update)
            self.broadcast.start(self.group, buffers, plan)
            return
        self._announce(update)
        packed = (pack_bucket(b, tensors) for b, tensors in buckets)
        try:
            self._count(send_update(self.group, packed, plan))
        except RuntimeError as exc:
            self._broadcast_failed(exc)
        for _ in packed:  # the other ranks' gathers go on to the last bucket
            pass

    def rebuild_wanted(self) -> bool:
        """Whether the group should be rebuilt now (asked while waiting for a batch)."""
        if self.broadcast is not None and self.broadcast.busy:
            return False
        self._finish_previous()
        status, _ = self.client.request(P.SyncStatus(regroup=self.failed))
        return status.wanted > self.epoch

    def finish(self) -> None:
        """The last broadcast, waited for; a failure now only costs the generators' last
        version (training is over), so it is logged, not raised."""
        try:
            self._finish_previous()
        except TimeoutError as exc:
            log.warning("%s", exc)
        if self.failed:
            log.warning("the last weight broadcast did not reach every generator")

    def close(self) -> None:
        self.group.close()

    def metrics(self) -> dict[str, float]:
        """The last finished update's cost on the wire, and the heals so far."""
        row: dict[str, float] = {"weight_sync_epoch": self.epoch, "weight_heals": self.heals}
        if self.broadcast is not None:
            row["weight_broadcast_s"] = round(self.broadcast.seconds, 4)
        if self.sent is not None:
            row["weight_sent_mb"] = round(self.sent.nbytes / 2**20, 3)
            row["weight_whole_buckets"] = self.sent.whole
            if self.sent.changed >= 0 and self.sent.words:
                row["weight_changed_frac"] = round(self.sent.changed / self.sent.words, 6)
        return row

    # ------------------------------------------------------------------ internals

    def _count(self, sent: Sent | None) -> None:
        if sent is not None:
            self.sent = sent
            self.heals += sent.healed

    def _finish_previous(self) -> None:
        if self.broadcast is None:
            return
        try:
            self.broadcast.wait()
            self._count(self.broadcast.sent)
            self.broadcast.sent = None
        except RuntimeError as exc:  # gloo: a member closed its connection
            self._broadcast_failed(exc)
        except TimeoutError as exc:  # NCCL (or a hung member): drop the group to end it
            self._broadcast_failed(exc)
            self.group.drop()
            self.broadcast.thread.join(self.timeout_s)
            self.broadcast.thread = self.broadcast.error = None

    def _broadcast_failed(self, exc: BaseException) -> None:
        self.failed = True
        log.warning(
            "a weight broadcast failed (a generator died?): %s; the weight-sync group will "
            "be rebuilt",
            failure_line(exc),
        )

    def _announce(self, update: P.WeightUpdate) -> None:
        """Announce ``update`` over the current group, or over a rebuilt one if wanted. The
        announcement carries the group's memory file (``MemoryOffer``): the buffer is the
        only channel members take it from."""
        status, _ = self.client.request(P.SyncStatus(regroup=self.failed))
        epoch = max(status.wanted, self.epoch)
        if epoch == self.epoch:
            update = msgspec.structs.replace(update, epoch=epoch, memory=self.group.offer)
            self.client.request(P.AnnounceWeights(update=update))
            return
        t0 = time.monotonic()
        log.warning("rebuilding the weight-sync group: epoch %d -> %d", self.epoch, epoch)
        self.group.drop()  # members still blocked in the old group fail now
        memory = self.group.new_memory()
        update = msgspec.structs.replace(
            update, epoch=epoch, memory=memory.offer if memory is not None else None
        )
        # Announced first: the surviving generators learn the epoch from it and rejoin.
        self.client.request(P.AnnounceWeights(update=update))
        try:  # the group's timeout is weights.join_timeout_s (learners/setup.py)
            self.group = self.group.rebuild(epoch, memory)
        except Exception as exc:
            if memory is not None:
                memory.close()
            raise RuntimeError(
                f"weight-sync epoch {epoch}: not every generator joined within "
                f"weights.join_timeout_s={self.group.join_timeout_s:.0f}s ({exc}); see "
                "logs/generator*.log"
            ) from exc
        self.client.request(P.SyncStatus(formed=epoch))
        self.failed = False
        log.warning(
            "weight-sync group rebuilt (epoch %d, %d members) in %.1fs; sending version %d",
            epoch, self.group.world_size, time.monotonic() - t0, update.version,
        )  # fmt: skip


def delta_policy(weights) -> DeltaPolicy | None:
    """Rank 0's sparse-update policy from ``weights.*`` (None: whole updates)."""
    if weights.delta is False:
        return None
    return DeltaPolicy(weights.full_every, weights.digest_every, memory=weights.delta is True)


def wire_specs(state: dict[str, torch.Tensor], cfg) -> list[P.ParamSpec]:
    """The specs of what a publish sends: each floating tensor of ``state`` in the
    generators' dtype (``model.dtype``; they would cast it on receipt, to the same bits),
    others as they are. A LoRA run's adapter keeps the learner's dtype."""
    specs = param_specs(state.items())
    if lora.enabled(cfg):
        return specs
    return [
        P.ParamSpec(s.name, cfg.model.dtype, s.shape) if state[s.name].is_floating_point() else s
        for s in specs
    ]


def gathered_buckets(
    state: dict[str, torch.Tensor], buckets: list[Bucket], device: torch.device | None = None
) -> Iterator[tuple[Bucket, dict[str, torch.Tensor]]]:
    """Each bucket's full tensors, one bucket at a time: under FSDP2 every rank must walk
    this (``full_tensor()`` is a collective), and only one bucket of unsharded tensors is
    alive at once. ``state`` is the model's ``state_dict()`` (DTensors or plain).
    ``device``: where the tensors are sent from (a CUDA learner's shards offloaded to
    host memory, learner.cpu_offload, are gathered there and sent from the GPU)."""
    for bucket in buckets:
        tensors = {}
        for spec in bucket.specs:
            tensor = state[spec.name]
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            tensor = tensor.detach()
            tensors[spec.name] = tensor if device is None else tensor.to(device)
        yield bucket, tensors
