"""The sharded layout: with several learner ranks, each rank writes its own shards.

A learner job of L > 1 ranks (FSDP2) saves with torch.distributed.checkpoint (DCP)
instead of gathering the whole state into rank 0's memory: each rank hands its shards of
the model, the optimizer state (and the critic's) to ``ShardWriter``, which copies them
into host buffers kept from one checkpoint to the next (the step waits for that copy
only) and writes them with DCP on a thread of its own, one file per rank. The writes coordinate
over a gloo group of their own (``ShardWriter.group``), so they never interleave with the
training collectives. Rank 0 writes the rest (``trainer_state.json``, the buffer's files)
as with one rank and commits the manifest only after DCP's ``.metadata`` is written,
which DCP does once every rank's file is.

Files of ``checkpoints/step_NNNNNNNN/learner/`` in this form::

    shards/__<rank>_0.distcp   rank <rank>'s shards: "model.<name>" weights,
                               "optim.<name>.<key>" optimizer state, "critic.<name>" and
                               "critic_optim.<name>.<key>" (gae only), "rng.torch"
    shards/.metadata           DCP's index of every shard (a torch pickle, written by torch)
    trainer_state.json         as with one rank, the optimizer's param groups by name

One save is in flight at a time: a checkpoint first waits for the previous one to be
written (on rank 0: committed), then reuses its host buffers. Loading reshards (DCP reads
whatever part of each tensor a rank owns), so a run saved on 2 ranks resumes on 1, 2 or 3;
``verl-async export`` reads the model's tensors with no process group at all
(verl_async/checkpoint.py ``read_sharded_model``).
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch

from learners.checkpoints.state import LearnerState, Staged
from learners.checkpoints.writer import Checkpointer
from verl_async.checkpoint import SHARDS, read_shards, step_dir
from verl_async.weight_sync import tied_names, with_tied


class Shards:
    """Several ranks: every rank stages its shards and writes them behind the step;
    rank 0 (the one with a ``writer``) commits once every rank's are written."""

    critic_key = "critic_optimizer_groups"  # in trainer_state.json when the run has a critic

    def __init__(self, run_dir: Path, writer: Checkpointer | None, timeout_s: float) -> None:
        self.run_dir = run_dir
        self.writer = writer  # rank 0's
        self.timeout_s = timeout_s
        self.shards = ShardWriter(timeout_s)  # a collective: every rank makes it at start

    @property
    def group(self):
        """The gloo group DCP saves and loads over."""
        return self.shards.group

    def ready(self, step: int) -> None:
        """Wait for the save in flight (on rank 0: until it is committed); rank 0 then
        empties the step directory. No rank writes into it before that, since DCP's writes
        wait for a plan that needs every rank's save."""
        if self.writer is not None:
            self.writer.wait()
        if not self.shards.wait(self.timeout_s):
            raise TimeoutError(
                f"checkpoint shards not written after checkpoint.write_timeout_s="
                f"{self.timeout_s:.0f}s; is the disk full or very slow?"
            )
        if self.writer is not None:
            clear_step_dir(step_dir(self.run_dir, step))

    def stage(self, step: int, state: LearnerState) -> Staged:
        tensors, groups = shard_tensors(state.model, state.optimizer, ACTOR)
        staged = Staged({"optimizer_groups": groups})
        if state.critic is not None:
            critic, staged.json[self.critic_key] = shard_tensors(*state.critic, CRITIC)
            tensors |= critic
        path = step_dir(self.run_dir, step) / SHARDS
        staged.shards = self.shards.save(tensors | rng_tensors(), path)
        return staged

    def wait(self, timeout_s: float) -> bool:
        return self.shards.wait(timeout_s)

    def close(self) -> None:
        self.shards.close()


def clear_step_dir(ckpt: Path) -> None:
    """Make ``ckpt`` empty before a sharded save writes into it (what an uncommitted write
    of the same step left before a crash goes)."""
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)


def load(ckpt: Path, saved: dict, state: LearnerState, world: int, group=None) -> dict:
    """Restore the shards of ``ckpt`` (verified) into ``state``, resharded to this job's
    ranks (``group``: the gloo group DCP reads over). Returns the torch RNG states."""
    load_shards(ckpt, state.model, state.optimizer, saved["optimizer_groups"], ACTOR, world, group)
    if state.critic is not None:
        groups = saved["critic_optimizer_groups"]
        load_shards(ckpt, *state.critic, groups, CRITIC, world, group)
    return load_rng(ckpt, world, group)


class ShardWriter:
    """This rank's side of sharded saves: a gloo group for DCP's collectives (made at
    start, a collective itself), host buffers for this rank's shards kept from one
    checkpoint to the next, and a writer thread with at most one save in flight.

    Staging is ours, not DCP's: one ``copy_`` per tensor into its buffer, and DTensors
    with the same layout made around the buffers; DCP's own staging walks every tensor in
    Python on the training thread (about 40 ms a checkpoint for a 4-layer model's 160
    tensors here). ``dcp.save`` then runs on the writer thread, planning cached (the
    tensors are the same every time)."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        # Its collectives give up after ``timeout_s`` (a rank that died mid-write).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.staged: dict[str, torch.Tensor] = {}
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-shards")
        self.future: Future | None = None

    def save(self, tensors: dict[str, torch.Tensor], path: Path) -> Future:
        """Stage ``tensors`` (this rank's shards; the caller may change them as soon as
        this returns) and write them to ``path`` on the writer thread."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        if self.future is not None:
            raise RuntimeError("a sharded checkpoint save is still in flight")
        staged = self.stage(tensors)
        self.future = self.writer.submit(
            dcp.save,
            staged,
            checkpoint_id=str(path),
            process_group=self.group,
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
        return self.future

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in this writer's host buffers (made on first use, and
        again if the tensors change), DTensors kept as DTensors of the same layout."""
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        shapes = {name: (local(t).shape, local(t).dtype) for name, t in tensors.items()}
        if shapes != {name: (b.shape, b.dtype) for name, b in self.staged.items()}:
            pin = torch.cuda.is_available()
            self.staged = {
                name: torch.empty(shape, dtype=dtype, pin_memory=pin)
                for name, (shape, dtype) in shapes.items()
            }
        out = {}
        for name, t in tensors.items():
            buf = self.staged[name]
            buf.copy_(local(t).detach(), non_blocking=True)
            if isinstance(t, DTensor):
                buf = DTensor.from_local(
                    buf,
                    t.device_mesh,
                    t.placements,
                    run_check=False,
                    shape=t.shape,
                    stride=t.stride(),
                )
            out[name] = buf
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def wait(self, timeout_s: float | None) -> bool:
        """Wait for the save in flight; False when it is still running after ``timeout_s``.
        A failed write raises here."""
        if self.future is None:
            return True
        try:
            self.future.result(timeout_s)
        except TimeoutError:
            return False
        finally:
            if self.future.done():
                self.future = None
        return True

    def close(self) -> None:
        self.writer.shutdown(wait=False)
        self.staged = {}


# Checkpoint names: "<weights>.<parameter>" and "<optimizer>.<parameter>.<key>".
ACTOR = ("model", "optim")
CRITIC = ("critic", "critic_optim")


def shard_tensors(
    model: torch.nn.Module, optimizer, prefixes: tuple[str, str]
) -> tuple[dict, list[dict]]:
    """(this rank's tensors of ``model`` and its optimizer, by checkpoint name; the
    optimizer's param groups, parameters by name, JSON-able). Tied names are left out
    (SmolLM2's head is its embedding): each tensor is written once."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    prefix, optim_prefix = prefixes
    tied = tied_names(model)
    tensors = {
        f"{prefix}.{name}": t for name, t in get_model_state_dict(model).items() if name not in tied
    }
    optim = get_optimizer_state_dict(model, optimizer)  # a fresh optimizer's state is made
    for name, entries in optim["state"].items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}.{key} is not a tensor: {value!r}")
            tensors[f"{optim_prefix}.{name}.{key}"] = value
    return tensors, optim["param_groups"]


def load_shards(
    ckpt: Path,
    model: torch.nn.Module,
    optimizer,
    groups: list[dict],
    prefixes: tuple[str, str],
    world: int,
    group=None,
) -> None:
    """Load ``model`` and its optimizer from the shards of ``ckpt`` (every rank calls it;
    with ``world`` == 1 the model is a plain module and no process group is used)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    prefix, optim_prefix = prefixes
    tensors, _ = shard_tensors(model, optimizer, prefixes)  # the shapes to read into
    dcp.load(tensors, checkpoint_id=str(ckpt / SHARDS), process_group=group, no_dist=world == 1)
    weights = {
        name[len(prefix) + 1 :]: t for name, t in tensors.items() if name.startswith(f"{prefix}.")
    }
    state: dict[str, dict] = {}
    for name, t in tensors.items():
        if name.startswith(f"{optim_prefix}."):
            param, _, key = name[len(optim_prefix) + 1 :].rpartition(".")
            state.setdefault(param, {})[key] = t
    set_model_state_dict(model, with_tied(model, weights))
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})


def rng_tensors() -> dict[str, torch.Tensor]:
    """Torch's RNG states as checkpoint tensors (one rank's are kept, as with one rank;
    Python's go in trainer_state.json)."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def load_rng(ckpt: Path, world: int, group=None) -> dict:
    """The RNG states of ``ckpt`` in ``state.set_rng_state``'s form (no Python one);
    a CUDA state saved by a GPU run is left out on a machine without CUDA."""
    cuda = torch.cuda.is_available()
    tensors = read_shards(
        ckpt, lambda name: name == "rng.torch" or (cuda and name == "rng.cuda"), group, world == 1
    )
    rng = {"torch": tensors["rng.torch"]}
    if "rng.cuda" in tensors:
        rng["cuda"] = [tensors["rng.cuda"]]
    return rng
