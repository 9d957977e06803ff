"""The learner's side of asynchronous checkpoints: snapshot at the barrier, write behind.

At the barrier after step s-1 (s steps done, version s published) the learner

1. copies model, optimizer, scheduler, RNG and counters into host memory (``snapshot``),
2. asks the buffer for its snapshot as of step s (``SnapshotBuffer``; the bytes come back
   in the reply),
3. hands both to ``Checkpointer.save``, which writes them from a thread while training
   goes on, then commits the manifest (verl_async/checkpoint.py) and prunes old ones.

One write is in flight at most: a snapshot that comes due while the previous write is
still running waits for it (the wait is part of the ``checkpoint_s`` metric). An error
in the writer is raised in the training thread at the next save or at ``close``.

Files of ``checkpoints/step_NNNNNNNN/``::

    learner/model.safetensors     full (unsharded) weights by Hugging Face name
    learner/optimizer.pt          optimizer state_dict (tensors, ints, floats)
    learner/trainer_state.pt      scheduler state_dict, RNG states
    learner/trainer_state.json    step, version, wall_s, generator clocks (readable)
    buffer/ledger.json            buffer/snapshot.py
    buffer/rollouts.arrow
    manifest.json                 written last: the commit

``VERL_ASYNC_FAULT_CKPT_WRITE_DELAY_S`` (fault injection, used by the crash tests) makes
the writer sleep that long after the learner files and before the buffer files and the
manifest, so a kill can land in the middle of a write.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_async.checkpoint import commit, prune, step_dir

log = logging.getLogger("verl_async.learner")

_FAULT_DELAY = "VERL_ASYNC_FAULT_CKPT_WRITE_DELAY_S"


@dataclass
class Snapshot:
    """Everything one checkpoint holds, in host memory (owned copies, not views)."""

    step: int
    version: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    trainer_state: dict  # scheduler, rng (tensors and plain values)
    info: dict  # JSON-able counters: wall_s, generator clocks, ...
    buffer_files: dict[str, bytes]


def host_copy(obj):
    """Deep copy with every tensor cloned to CPU memory (so training can go on)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(host_copy(v) for v in obj)
    return obj


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Background writer: one checkpoint write in flight at a time."""

    def __init__(self, run_dir: Path, keep_last: int, timeout_s: float, meta: dict) -> None:
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.meta = meta
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_write_s = 0.0  # duration of the last finished write

    def save(self, snap: Snapshot) -> None:
        self.wait()
        self.thread = threading.Thread(
            target=self._run, args=(snap,), name="checkpoint-writer", daemon=True
        )
        self.thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the write in flight; True when none is left. Re-raises a writer error."""
        if self.thread is not None:
            self.thread.join(self.timeout_s if timeout_s is None else timeout_s)
            if self.thread.is_alive():
                if timeout_s is None:
                    raise TimeoutError(
                        f"checkpoint write not finished after checkpoint.write_timeout_s="
                        f"{self.timeout_s:.0f}s; is the disk full or very slow?"
                    )
                return False
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return True

    def close(self, grace_s: float) -> None:
        """At exit: finish the write in flight if it ends within ``grace_s``, else abandon it
        (no manifest: it never counts, and the next run's prune deletes it)."""
        if self.thread is None:
            return
        if self.wait(grace_s):
            log.info("checkpoint write finished before exit")
        else:
            log.warning(
                "checkpoint write abandoned at exit (not committed; the previous one stands)"
            )

    def _run(self, snap: Snapshot) -> None:
        t0 = time.monotonic()
        try:
            self.write(snap)
        except BaseException as exc:  # raised in the training thread by wait()
            self.error = exc
        self.last_write_s = time.monotonic() - t0

    def write(self, snap: Snapshot) -> None:
        from safetensors.torch import save_file

        ckpt = step_dir(self.run_dir, snap.step)
        if ckpt.exists():  # an uncommitted write of the same step from before a crash
            shutil.rmtree(ckpt)
        (ckpt / "learner").mkdir(parents=True)
        save_file(snap.model, ckpt / "learner" / "model.safetensors", metadata={"format": "pt"})
        torch.save(snap.optimizer, ckpt / "learner" / "optimizer.pt")
        torch.save(snap.trainer_state, ckpt / "learner" / "trainer_state.pt")
        info = {"step": snap.step, "version": snap.version, **snap.info}
        (ckpt / "learner" / "trainer_state.json").write_text(json.dumps(info, indent=1))
        delay = float(os.environ.get(_FAULT_DELAY, "0"))
        if delay:
            time.sleep(delay)
        (ckpt / "buffer").mkdir()
        for name, data in snap.buffer_files.items():
            (ckpt / "buffer" / name).write_bytes(data)
        commit(ckpt, snap.step, snap.version, self.meta)
        removed = prune(self.run_dir, self.keep_last)
        log.info(
            "checkpoint step %d committed%s",
            snap.step,
            f"; pruned {', '.join(p.name for p in removed)}" if removed else "",
        )


def load(ckpt: Path, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Restore a checkpoint's learner files into live objects; returns the info dict."""
    from safetensors.torch import load_file

    learner = ckpt / "learner"
    model.load_state_dict(load_file(learner / "model.safetensors"))
    optimizer.load_state_dict(torch.load(learner / "optimizer.pt", weights_only=True))
    state = torch.load(learner / "trainer_state.pt", weights_only=True)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return json.loads((learner / "trainer_state.json").read_text())
