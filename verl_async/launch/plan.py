"""The roles of a run, whichever launcher starts them: what each process is (``RolePlan``),
how the launcher holds one it started (``Role``), and how they are stopped.

``local.py`` starts the plan as processes of this machine, ``ray_roles.py`` inside Ray
actors; ``train.py`` watches either through the same ``RoleProcess`` surface.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from verl_async import placement
from verl_async.checkpoint import MANIFEST, list_checkpoints
from verl_async.reward_config import ModelReward
from verl_async.runtime import device_env, ranks_env
from verl_async.schema import RunConfig


class RoleProcess(Protocol):
    """What watching and stopping a role needs of its process: a ``LocalProcess`` here,
    or a ``ray_launcher.RayProcess`` inside a Ray actor (``launcher: ray``)."""

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def signal_group(self, sig: int) -> None: ...


@dataclass
class Role:
    name: str
    proc: RoleProcess
    log_path: Path
    restart: Callable[[], RoleProcess] | None = None  # start it again (if it may be)
    restarts: int = 0
    max_restarts: int = 0
    restart_due: float | None = None  # time.monotonic() of a restart that waits (backoff_s)


MAX_RESTARTS = 5  # per reward-model or teacher process; one that keeps dying stops the run
BACKOFF_FIRST_S = 1.0  # the wait before the first restart of a role, or of the run
BACKOFF_MAX_S = 30.0


def backoff_s(restart: int) -> float:
    """The wait before restart number ``restart`` (from 1) of a role or of the run: 1 s,
    doubling, at most 30 s. A cause that passes (a port, device memory a killed process
    still held) gets the time to; one that does not uses up the restarts less quickly."""
    return min(BACKOFF_FIRST_S * 2 ** (restart - 1), BACKOFF_MAX_S)


def role_argv(module: str, run_dir: Path, extra: list[str] = ()) -> list[str]:
    """``python -m <module> --run-dir RUN_DIR *extra``: how every role is started."""
    return [sys.executable, "-m", module, "--run-dir", str(run_dir), *extra]


def learner_launch(cfg: RunConfig, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Command and environment (added to the launcher's) of the learner role.

    One learner device: ``python -m learners`` placed on it, as any role. L > 1 devices:
    ``torch.distributed.run`` starts the L ranks on this node (rank r on the r-th device,
    see ``runtime.ranks_env``) and stands in for them as one role: it exits 0 when every
    rank did, and a rank that fails ends the job and so the run.

    On CPUs the learner's OpenMP threads sleep while they wait at a barrier instead of
    spinning (``OMP_WAIT_POLICY=PASSIVE``, unless the environment sets it): they share
    cores with the generators, and a thread that spins waiting for one that was
    descheduled burns the core the generator needs (BENCHMARKS.md section 13: 5.4 s to
    4.5 s a step on the learner-bound SmolLM2 preset)."""
    devices = placement.learner_devices(cfg)
    if len(devices) == 1:
        argv, env = role_argv("learners", run_dir), device_env(devices[0])
    else:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(len(devices)), "-m", "learners", "--run-dir", str(run_dir),
        ]  # fmt: skip
        env = ranks_env(devices)
    if not placement.is_cuda(devices[0]):
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return argv, env


@dataclass(frozen=True)
class RolePlan:
    """One role process of the run, whichever launcher starts it."""

    name: str
    module: str
    env: dict[str, str]  # placement (device_env, ranks_env), added to the process's own
    extra: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # none: the buffer, which owns none
    max_restarts: int = 0  # times it is started again after dying (0: its death ends the run)
    argv: list[str] | None = None  # instead of role_argv(module, ...): the learner's job

    def command(self, run_dir: Path) -> list[str]:
        return self.argv or role_argv(self.module, run_dir, self.extra)


def plan_roles(cfg: RunConfig, run_dir: Path) -> list[RolePlan]:
    """Buffer, reward models, teachers, learner, and one generator process per device group."""
    plans = [RolePlan("buffer", "buffer", {})]
    models = [s for s in cfg.rewards.sources if isinstance(s, ModelReward)]
    for i, src in enumerate(models):
        device = placement.reward_model_device(cfg, i)
        name, extra = f"reward_model_{src.name}", ["--name", src.name]
        plans.append(
            RolePlan(name, "reward_model", device_env(device), extra, [device], MAX_RESTARTS)
        )
    for i, teacher in enumerate(cfg.distillation.processes):
        device = placement.teacher_device(cfg, i)
        name, extra = f"teacher_{teacher.name}", ["--name", teacher.name]
        plans.append(RolePlan(name, "teacher", device_env(device), extra, [device], MAX_RESTARTS))
    argv, env = learner_launch(cfg, run_dir)
    plans.append(
        RolePlan("learner", "learners", env, [], placement.learner_devices(cfg), argv=argv)
    )
    for i, group in enumerate(placement.generator_groups(cfg)):
        extra = ["--index", str(i)]
        restarts = cfg.generators.max_restarts
        plans.append(
            RolePlan(f"generator{i}", "generators", device_env(group), extra, group, restarts)
        )
    return plans


def stop_roles(
    roles: list[Role],
    grace_s: float = 10.0,
    run_dir: Path | None = None,
    write_grace_s: float = 0.0,
) -> None:
    """SIGTERM each role's whole process group (vLLM's engine processes included), then
    SIGKILL. While a checkpoint write is under way in ``run_dir`` the learner goes first,
    with the buffer still serving the cut the write fetches: the others are stopped once
    the learner has exited or the write has committed (its writer thread goes on while
    the main thread is held in native code), or after ``write_grace_s``."""
    learner = [r for r in roles if r.name == "learner" and r.proc.poll() is None]
    buffer = [r for r in roles if r.name == "buffer"]
    if learner and run_dir is not None and writing_checkpoint(run_dir):
        learner[0].proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + write_grace_s
        while (
            learner[0].proc.poll() is None
            and writing_checkpoint(run_dir)
            and all(b.proc.poll() is None for b in buffer)  # else the cut cannot come
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
    _stop(roles, grace_s)


def writing_checkpoint(run_dir: Path) -> bool:
    """Whether a checkpoint write is under way in ``run_dir``: its newest checkpoint
    directory has no manifest yet."""
    dirs = list_checkpoints(run_dir)
    return bool(dirs) and not (dirs[-1] / MANIFEST).is_file()


def _stop(roles: list[Role], grace_s: float) -> None:
    for role in roles:
        role.proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for role in roles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        role.proc.signal_group(signal.SIGKILL)  # stragglers, and children of exited roles
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=grace_s)  # SIGKILL: reaped within milliseconds
