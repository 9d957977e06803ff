"""Writing checkpoints behind the step: rank 0's writer thread.

``Checkpointer`` (rank 0) takes ``Snapshot``s from a queue in step order. For each it
writes the learner's files, then fetches the buffer's files (``FetchSnapshot``: the buffer
encodes its cut as Arrow then, in its own process) and writes them, waits for the
shards when there are several ranks and hashes them from disk, and commits the manifest
(verl_async/checkpoint.py) before it prunes old checkpoints. The first one pruned is kept
as the spare, and the next write overwrites its files in place instead of creating new
ones.

Snapshots alternate between two staging slots (``Stager``), so a step waits only when a
write is still running two checkpoints later (that wait is part of ``checkpoint_s`` and
shown alone as ``checkpoint_wait_s``). An error in a writer is raised in the training
thread at the next checkpoint or at exit.

Each file is hashed from the bytes in memory as it is written, so the commit reads
nothing back; hashing and writing large buffers release the GIL. The writer runs at
normal priority on purpose: at nice 19 it was starved on a busy core while holding the
GIL, which stalled the training thread (a 108 MiB checkpoint every 5 steps cost 13 % of
step time that way; BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_async import runtime
from verl_async.checkpoint import (
    SHARDS,
    FileEntry,
    fsync_dir,
    prune,
    sha256_file,
    step_dir,
    take_spare,
    write_manifest,
)

log = logging.getLogger("verl_async.learner")


@dataclass
class Snapshot:
    """One checkpoint, ready to write: file name -> chunks of bytes (host memory that
    training no longer touches until the write is done)."""

    step: int
    version: int
    files: dict[str, list]  # relative path -> bytes-like chunks, in writing order
    # More files, produced on the writer thread after ``files`` are written (the buffer's,
    # fetched from the buffer process so that encoding them costs the step nothing).
    deferred: Callable[[], dict[str, list]] | None = None
    # With several ranks: the DCP save of every rank's shards (shards.py) into a
    # directory made before it started; written when it completes, committed after that.
    shards: Future | None = None


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StagedFile:
    """A safetensors file laid out once in one reusable host buffer (pinned on CUDA).

    Staging is one ``copy_`` per tensor into its slot; the file is then the header plus
    the buffer, written and hashed without any serialization step. Tensors go in order of
    decreasing element size, so every slot is aligned for its dtype with no gaps (the
    format allows none).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
        self.signature = _signature(tensors)
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset, spans = 0, {}
        for name in sorted(tensors, key=lambda n: -tensors[n].element_size()):
            t = tensors[name]
            nbytes = t.numel() * t.element_size()
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            spans[name] = (offset, offset + nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = len(raw).to_bytes(8, "little") + raw
        self.data = torch.empty(offset, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.slots = {
            name: self.data[a:b].view(tensors[name].dtype).view(tensors[name].shape)
            for name, (a, b) in spans.items()
        }

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        return _signature(tensors) == self.signature

    def stage(self, tensors: dict[str, torch.Tensor]) -> list:
        for name, tensor in tensors.items():
            self.slots[name].copy_(tensor.detach(), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return [self.head, memoryview(self.data.numpy())]


def _signature(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


class Stager:
    """Keeps one ``StagedFile`` per file name across checkpoints (rebuilt if shapes change)."""

    def __init__(self) -> None:
        self.files: dict[str, StagedFile] = {}

    def stage(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None):
        staged = self.files.get(rel)
        if staged is None or not staged.fits(tensors):
            staged = self.files[rel] = StagedFile(tensors, metadata)
        return staged.stage(tensors)


class Checkpointer:
    """Background writer with two staging slots.

    One long-lived writer thread takes snapshots from a queue in order, so checkpoints
    commit in step order and handing one over costs the step a queue put (starting a
    thread per write cost it about 1 ms: ``Thread.start`` waits until the new thread has
    been scheduled). Snapshots alternate between two ``Stager``s: a new snapshot can be
    staged while the previous write is still running, and only waits when the write
    before *that* one (which used the same buffers) is not done yet. So a write that
    takes up to a whole checkpoint interval costs the step nothing; host memory holds up
    to two staged copies of model and optimizer state.
    """

    SLOTS = 2

    def __init__(self, run_dir: Path, keep_last: int, timeout_s: float, meta: dict) -> None:
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.meta = meta
        self.stagers = [Stager() for _ in range(self.SLOTS)]
        self.queue: queue.SimpleQueue[Snapshot | None] = queue.SimpleQueue()  # None: stop
        self.thread: threading.Thread | None = None  # started by the first save
        self.done = threading.Condition()
        self.pending = 0  # snapshots saved and not yet written (or failed)
        self.count = 0  # snapshots saved so far
        self.error: BaseException | None = None
        self.last_write_s = 0.0  # duration of the last finished write
        self.last_write_cpu_s = 0.0  # CPU time the writer thread used for it

    def stager(self) -> Stager:
        """The staging buffers for the next snapshot, once no write still reads them."""
        self._settle(self.SLOTS - 1, self.timeout_s)
        return self.stagers[self.count % self.SLOTS]

    def save(self, snap: Snapshot) -> None:
        """Queue ``snap`` (staged in ``stager()``'s buffers) behind the writes in flight."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self.thread.start()
        with self.done:
            self.pending += 1
        self.count += 1
        self.queue.put(snap)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every write; True when none is left. Re-raises a writer error."""
        return self._settle(
            0, self.timeout_s if timeout_s is None else timeout_s, timeout_s is None
        )

    def _settle(self, outstanding: int, timeout_s: float, strict: bool = True) -> bool:
        with self.done:
            settled = self.done.wait_for(lambda: self.pending <= outstanding, timeout_s)
        if not settled:
            if strict:
                raise TimeoutError(
                    f"checkpoint write not finished after checkpoint.write_timeout_s="
                    f"{self.timeout_s:.0f}s; is the disk full or very slow?"
                )
            return False
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return True

    def close(self, grace_s: float) -> None:
        """At exit: finish the writes in flight if they end within ``grace_s``, else abandon
        them (no manifest: they never count, and a later prune deletes them)."""
        if not self.pending:
            return
        if self.wait(grace_s):
            log.info("checkpoint write finished before exit")
        else:
            log.warning(
                "checkpoint write abandoned at exit (not committed; the previous one stands)"
            )

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the writer thread after the writes queued before it. Joined only when none
        is left: a write abandoned by ``close`` is not waited for again."""
        if self.thread is not None:
            self.queue.put(None)
            if not self.pending:
                self.thread.join(timeout_s)
            self.thread = None

    def _run(self) -> None:
        runtime.unpin_this_thread()
        while (snap := self.queue.get()) is not None:
            t0, cpu0 = time.monotonic(), time.thread_time()
            try:
                self.write(snap)
            except BaseException as exc:  # raised in the training thread by the next settle
                self.error = self.error or exc
            # Hold no reference to the snapshot past its write: its buffer fetch closes over
            # the learner, which would then outlive the training loop.
            del snap
            self.last_write_s = time.monotonic() - t0
            self.last_write_cpu_s = time.thread_time() - cpu0
            with self.done:
                self.pending -= 1
                self.done.notify_all()

    def write(self, snap: Snapshot) -> None:
        ckpt = step_dir(self.run_dir, snap.step)
        recycled = False
        if snap.shards is None:  # (a sharded one's directory was made before its save)
            if ckpt.exists():  # an uncommitted write of the same step from before a crash
                shutil.rmtree(ckpt)
            recycled = take_spare(self.run_dir, ckpt)  # a retired checkpoint's files
        hashes: dict[str, FileEntry] = {}
        self._write_files(ckpt, snap.files, hashes)
        if snap.deferred is not None:
            self._write_files(ckpt, snap.deferred(), hashes)
        if snap.shards is not None:
            snap.shards.result(self.timeout_s)  # every rank's file and DCP's .metadata
            for path in sorted((ckpt / SHARDS).iterdir()):
                hashes[str(path.relative_to(ckpt))] = FileEntry(
                    path.stat().st_size, sha256_file(path)
                )
        if recycled:
            _remove_strays(ckpt, hashes)
        _make_durable([ckpt / rel for rel in hashes])
        write_manifest(ckpt, snap.step, snap.version, self.meta, hashes)
        # Sharded files are new files each time (DCP creates them): no spare to recycle.
        removed = prune(self.run_dir, self.keep_last, recycle=snap.shards is None)
        log.info(
            "checkpoint step %d committed%s",
            snap.step,
            f"; pruned {', '.join(p.name for p in removed)}" if removed else "",
        )

    @staticmethod
    def _write_files(ckpt: Path, files: dict[str, list], hashes: dict[str, FileEntry]) -> None:
        for rel, chunks in files.items():
            path = ckpt / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            digest, size = hashlib.sha256(), 0
            # No O_TRUNC: a file of the spare keeps its blocks and is overwritten in place,
            # then cut to length.
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                f.truncate()
            hashes[rel] = FileEntry(size, digest.hexdigest())


def _remove_strays(ckpt: Path, hashes: dict[str, FileEntry]) -> None:
    """Files a recycled directory held that this checkpoint did not write."""
    for root, _, names in os.walk(ckpt):
        for name in names:
            path = os.path.join(root, name)
            if os.path.relpath(path, ckpt) not in hashes:
                os.unlink(path)


def _make_durable(paths: list[Path]) -> None:
    """fsync every file, then their directories, once all of them are written.

    Not one fsync per file as it is written: on a journaling file system each of those
    forces a commit of its own, while here the first one flushes the transaction that
    holds them all and the rest find little left (BENCHMARKS.md section 6)."""
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    for directory in sorted({p.parent for p in paths}):
        fsync_dir(directory)
