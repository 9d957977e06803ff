"""``Checkpoints``: the learner's one way to save a checkpoint and one way to load one.

    save(step):  nothing non-finite is written   (every rank, NonFiniteWeights)
                 -> layout.ready                 (a free staging slot; with shards, the
                                                  previous save written and committed)
                 -> the buffer takes its cut     (rank 0: SnapshotBuffer, one round trip)
                 -> layout.stage                 (host copies: the step waits for these)
                 -> writer.save                  (rank 0: JSON state, then behind the step
                                                  the learner's files, the buffer's files,
                                                  every rank's shards, the manifest)
    load(ckpt):  the manifest verifies before any file is read (CheckpointError)
                 -> trainer_state.json, the layout's files, RNG
                 -> nothing non-finite is resumed from (every rank, NonFiniteWeights)

The layout is the one thing that differs between one learner rank and several: one rank
stages every tensor whole into safetensors files (full.py); several ranks each stage their
own shards and write them with DCP (shards.py). A checkpoint loads whatever layout wrote
it, on any number of ranks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from learners.checkpoints import full, shards, writer
from learners.checkpoints.state import LearnerState, rng_state, set_rng_state
from learners.distributed import DataParallel
from learners.finite import require_finite
from verl_async import protocol as P
from verl_async.auth import Credentials
from verl_async.checkpoint import is_sharded, require_valid
from verl_async.schema import CheckpointConfig
from verl_async.transport import BufferClient


class Checkpoints:
    """Saves and loads the learner's checkpoints (every rank has one; rank 0, ``main``,
    owns the writer thread and talks to the buffer).

    ``buffer`` is the learner's buffer client (``send``/``receive`` of the cut at the
    barrier); ``fetch(step)`` returns the buffer's files of that cut, called on the
    writer thread (``buffer_fetch``)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        state: LearnerState,
        dp: DataParallel,
        main: bool,
        buffer,
        fetch: Callable[[int], dict],
        meta: dict,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.dp = dp
        self.buffer = buffer
        self.fetch = fetch
        self.writer = None  # rank 0's writer thread (writer.py)
        if main and cfg.every_steps:
            # looked up when built, so a custom learner can replace it (tests/slow_learner.py)
            self.writer = writer.Checkpointer(run_dir, cfg.keep_last, cfg.write_timeout_s, meta)
        self.layout: full.FullFiles | shards.Shards | None = None
        if cfg.every_steps and dp.world > 1:
            self.layout = shards.Shards(run_dir, self.writer, cfg.write_timeout_s)
        elif self.writer is not None:
            self.layout = full.FullFiles(self.writer)
        self.wait_s = 0.0  # of the last save: waiting for a staging slot (checkpoint_wait_s)

    def due(self, step: int) -> bool:
        """Whether a checkpoint is taken after ``step`` steps (every ``every_steps``)."""
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def save(self, step: int, version: int, info: Callable[[], dict]) -> float:
        """At the barrier after ``step`` steps: snapshot the learner's state and the
        buffer's into host memory and hand them to the writers; returns the seconds the
        step spent on it. ``info()``: counters and running state for trainer_state.json.

        A state that is not finite is never written: every rank raises
        ``NonFiniteWeights`` instead, before anything is staged."""
        t0 = time.monotonic()
        named = self.state.named_tensors()
        require_finite(f"checkpoint step {step}", named, self.dp.any_rank)
        self.layout.ready(step)
        self.wait_s = time.monotonic() - t0
        main = self.writer is not None
        # The buffer takes its cut (of state as of ``step``, whenever it runs) while the
        # learner stages its own; the reply must be in before the writer may fetch the cut.
        cut = self.buffer.send(P.SnapshotBuffer(step=step, version=version)) if main else None
        staged = self.layout.stage(step, self.state)
        if main:
            scheduler = self.state.scheduler
            saved = {
                "step": step,
                "version": version,
                **info(),
                **staged.json,
                "python_rng": rng_state()["python"],
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            }
            trainer_state = json.dumps(saved, indent=1).encode()
            files = {**staged.files, "learner/trainer_state.json": [trainer_state]}
            self.buffer.receive(cut)
            self.writer.save(
                writer.Snapshot(step, version, files, self._buffer_files(step), staged.shards)
            )
        return time.monotonic() - t0

    def _buffer_files(self, step: int) -> Callable[[], dict[str, list]]:
        fetch = self.fetch
        return lambda: {f"buffer/{name}": [data] for name, data in fetch(step).items()}

    def load(self, ckpt: Path) -> dict:
        """Restore ``ckpt`` into the learner's objects (every rank calls it and keeps its
        own shards); returns its trainer_state.json.

        The learner's files are verified against the manifest before any is opened (a
        ``CheckpointError`` otherwise): DCP's ``.metadata`` is a pickle. A checkpoint
        written without a critic cannot resume a run with one (and the other way round).
        What it restores must be finite, or every rank raises ``NonFiniteWeights``."""
        require_valid(ckpt, "learner")
        saved = json.loads((ckpt / "learner" / "trainer_state.json").read_text())
        sharded = is_sharded(ckpt)
        layout = shards.Shards if sharded else full.FullFiles
        has_critic = layout.critic_key in saved
        if has_critic != (self.state.critic is not None):
            raise ValueError(
                f"{ckpt} was written {'with' if has_critic else 'without'} a critic and this "
                f"run has {'one' if self.state.critic is not None else 'none'} "
                "(algo.adv_estimator changed?)"
            )
        scheduler = self.state.scheduler
        if scheduler is not None and saved["scheduler"] is not None:
            scheduler.load_state_dict(saved["scheduler"])
        world = self.dp.world
        if sharded:
            group = self.layout.group if isinstance(self.layout, shards.Shards) else None
            rng = shards.load(ckpt, saved, self.state, world, group)
        else:
            rng = full.load(ckpt, saved, self.state, world)
        set_rng_state({**rng, "python": saved["python_rng"]})
        require_finite(
            f"resume from {ckpt.name}",
            self.state.named_tensors(),
            self.dp.any_rank,
            advice="an older checkpoint may be finite",
        )
        return saved

    def metrics(self, seconds: float) -> dict:
        """A checkpoint step's timings for its metrics line (rank 0)."""
        return {
            "checkpoint_s": round(seconds, 4),
            "checkpoint_wait_s": round(self.wait_s, 4),
            "checkpoint_write_s": round(self.writer.last_write_s, 4),  # the last finished
            "checkpoint_write_cpu_s": round(self.writer.last_write_cpu_s, 4),
        }

    def interrupted(self) -> None:
        """Ctrl-C or SIGTERM: rank 0 lets the write in flight commit if it ends within
        ``write_timeout_s``, else abandons it; another rank waits as long for its shards
        (rank 0 decides whether the write commits)."""
        if self.writer is not None:
            self.writer.close(grace_s=self.cfg.write_timeout_s)
        elif self.layout is not None:
            self.layout.wait(self.cfg.write_timeout_s)

    def finish(self) -> None:
        """At the end of training: the last checkpoint is committed before the run is done."""
        if self.writer is not None:
            self.writer.wait()
        if self.layout is not None and not self.layout.wait(self.cfg.write_timeout_s):
            raise TimeoutError("checkpoint shards not written before exit")

    def close(self) -> None:
        """At exit, however the loop ended: stop the writer threads."""
        if self.writer is not None:
            self.writer.stop()
        if self.layout is not None:
            self.layout.close()


def buffer_fetch(
    endpoint: str, timeout_s: float, curve: Credentials | None = None
) -> Callable[[int], dict[str, memoryview]]:
    """``fetch`` for ``Checkpoints``: the buffer's files of the cut taken at a step."""
    return lambda step: fetch_buffer_files(endpoint, timeout_s, step, curve)


def fetch_buffer_files(
    endpoint: str, timeout_s: float, step: int, curve: Credentials | None = None
) -> dict[str, memoryview]:
    """The buffer's files of the cut taken at ``step`` (on the checkpoint writer's thread,
    with a socket of its own: the buffer encodes them while training goes on), as views
    on the received frames: written and hashed from there without a copy."""
    client = BufferClient(endpoint, timeout_s, curve)
    try:
        reply, frames = client.request(P.FetchSnapshot(step=step))
    finally:
        client.close()
    return {name: memoryview(P.tensor(ref, frames)) for name, ref in reply.files.items()}
