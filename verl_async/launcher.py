"""``verl-async train``: start buffer, generators and learner; watch them; stop them cleanly.

Each role is ``python -m <role> --run-dir DIR`` in its own session (so a Ctrl-C in the
terminal reaches only the launcher, which then stops the roles in order: the learner
first, so that a checkpoint write in progress is finished), with its output in
``logs/<role>.log``. Roles also die with the launcher (PR_SET_PDEATHSIG). A role that
exits non-zero stops the run with a message naming it; nothing is left running.
``launcher: ray`` starts the same roles inside Ray actors (``ray_launcher.py``).

Resume (``--resume RUN_DIR`` or ``checkpoint.resume=true``): the newest checkpoint that
verifies is chosen (each one skipped is reported with why); newer checkpoint directories
are set aside (uncommitted ones deleted, damaged ones renamed ``damaged_step_*``);
``metrics.jsonl`` and ``trained.jsonl`` lose the lines of steps after the checkpoint,
which will be trained again; and buffer and learner restore from it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
from rich.markup import escape

from verl_async import placement
from verl_async.checkpoint import MANIFEST, list_checkpoints
from verl_async.config import ConfigError, RunConfig, to_yaml
from verl_async.metrics import read_metrics
from verl_async.progress import ProgressReport, summarize
from verl_async.reward_config import ModelReward
from verl_async.run_dir import (
    RoleFailed,
    open_run_dir,
    resolve_data_paths,
)
from verl_async.runtime import Endpoints, device_env, free_port, ranks_env, write_endpoints
from verl_async.startup import mark, report_start_up


class RoleProcess(Protocol):
    """What watching and stopping a role needs of its process: a ``LocalProcess`` here,
    or a ``ray_launcher.RayProcess`` inside a Ray actor (``launcher: ray``)."""

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def signal_group(self, sig: int) -> None: ...


class LocalProcess(subprocess.Popen):
    """A role started here, in a session of its own."""

    def signal_group(self, sig: int) -> None:
        """Signal the role's whole process group (vLLM's engine processes included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


@dataclass
class Role:
    name: str
    proc: RoleProcess
    log_path: Path
    restart: Callable[[], RoleProcess] | None = None  # start it again (if it may be)
    restarts: int = 0
    max_restarts: int = 0


MAX_RESTARTS = 5  # per reward-model process; a model that keeps dying stops the run


def model_dir(key: str, value: str) -> str:
    """``value`` (the config key ``key``) as an absolute path to a Hugging Face model
    directory; a ``ConfigError`` naming the key if it holds no config.json."""
    path = Path(value).resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"bad value for '{key}': '{path}' is not a Hugging Face model directory "
            "(no config.json)"
        )
    return str(path)


def resolve_reward_models(cfg: RunConfig) -> RunConfig:
    """Reward-model directories made absolute, each checked to be a model directory."""
    sources = []
    for i, src in enumerate(cfg.rewards.sources):
        if isinstance(src, ModelReward):
            src = msgspec.structs.replace(
                src, path=model_dir(f"rewards.sources.{i}.path", src.path)
            )
        sources.append(src)
    return msgspec.structs.replace(
        cfg, rewards=msgspec.structs.replace(cfg.rewards, sources=sources)
    )


def resolve_learner_models(cfg: RunConfig) -> RunConfig:
    """``critic.path`` and ``algo.kl.ref_path`` made absolute, each checked (when set and
    used) to be a model directory."""
    resolve = lambda key, value: model_dir(key, value) if value else value  # noqa: E731
    algo, critic = cfg.algo, cfg.critic
    if algo.adv_estimator == "gae":
        critic = msgspec.structs.replace(critic, path=resolve("critic.path", critic.path))
    if algo.uses_reference:
        kl = msgspec.structs.replace(
            algo.kl, ref_path=resolve("algo.kl.ref_path", algo.kl.ref_path)
        )
        algo = msgspec.structs.replace(algo, kl=kl)
    return msgspec.structs.replace(cfg, algo=algo, critic=critic)


def check_data(cfg: RunConfig) -> None:
    """Read the prompt files: a missing, empty or malformed file (or a missing column) is a
    ``ConfigError`` naming the key, the file and the line."""
    from verl_async.data import load_prompts

    data = resolve_data_paths(cfg.data)
    load_prompts(data.path)
    if data.val_path:
        load_prompts(data.val_path, "data.val_path")


def prepare(
    cfg: RunConfig, run_dir: Path, resume_from: Path | None = None, data_checked: bool = False
) -> Endpoints:
    """Resolve paths, check the data (unless ``data_checked``), build the tiny model if
    asked, write config.yaml and endpoints.json."""
    cfg = msgspec.structs.replace(cfg, data=resolve_data_paths(cfg.data))
    cfg = resolve_reward_models(cfg)
    cfg = resolve_learner_models(cfg)
    cfg = placement.resolve_count(cfg)
    if not data_checked:
        check_data(cfg)
    if cfg.model.path:
        model_path = Path(cfg.model.path).resolve()
        if not (model_path / "config.json").is_file():
            raise RoleFailed(
                f"model.path '{model_path}' is not a Hugging Face model directory (no config.json)"
            )
    else:
        from verl_async.tiny_model import build_tiny_model

        model_path = build_tiny_model(run_dir / "model", cfg.model.tiny)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    host = cfg.buffer.host
    endpoints = Endpoints(
        buffer=f"tcp://{host}:{cfg.buffer.port or free_port(host)}",
        weights_host=cfg.weights.host or host,
        weights_port=cfg.weights.port or free_port(cfg.weights.host or host),
        model_path=str(model_path),
        resume_from=str(resume_from or ""),
        reward_models={
            src.name: f"tcp://{host}:{free_port(host)}"
            for src in cfg.rewards.sources
            if isinstance(src, ModelReward)
        },
    )
    write_endpoints(run_dir, endpoints)
    return endpoints


def role_argv(module: str, run_dir: Path, extra: list[str] = ()) -> list[str]:
    """``python -m <module> --run-dir RUN_DIR *extra``: how every role is started."""
    return [sys.executable, "-m", module, "--run-dir", str(run_dir), *extra]


def spawn(
    name: str,
    module: str,
    run_dir: Path,
    env: dict[str, str] | None = None,
    extra: list[str] = (),
    max_restarts: int = 0,
    argv: list[str] | None = None,
) -> Role:
    """Start role ``name`` (``role_argv(module, ...)``, or ``argv`` when given) in a session
    of its own, with ``env`` (placement: ``device_env``) added to the launcher's
    environment and its output in ``logs/<name>.log``."""
    log_path = run_dir / "logs" / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = argv or role_argv(module, run_dir, extra)

    def start() -> LocalProcess:
        with open(log_path, "ab") as log_file:
            return LocalProcess(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    return Role(name, start(), log_path, start if max_restarts else None, 0, max_restarts)


def learner_launch(cfg: RunConfig, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Command and environment (added to the launcher's) of the learner role.

    One learner device: ``python -m learners`` placed on it, as any role. L > 1 devices:
    ``torch.distributed.run`` starts the L ranks on this node (rank r on the r-th device,
    see ``runtime.ranks_env``) and stands in for them as one role: it exits 0 when every
    rank did, and a rank that fails ends the job and so the run."""
    devices = placement.learner_devices(cfg)
    if len(devices) == 1:
        return role_argv("learners", run_dir), device_env(devices[0])
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(len(devices)), "-m", "learners", "--run-dir", str(run_dir),
    ]  # fmt: skip
    return argv, ranks_env(devices)


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
    """Buffer, reward models, learner, and one generator process per device group."""
    plans = [RolePlan("buffer", "buffer", {})]
    models = [s for s in cfg.rewards.sources if isinstance(s, ModelReward)]
    for i, src in enumerate(models):
        device = placement.reward_model_device(cfg, i)
        name, extra = f"reward_model_{src.name}", ["--name", src.name]
        plans.append(
            RolePlan(name, "reward_model", device_env(device), extra, [device], MAX_RESTARTS)
        )
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


def start_roles(cfg: RunConfig, run_dir: Path) -> list[Role]:
    """Every role of ``plan_roles`` as a process of this machine."""
    return [
        spawn(p.name, p.module, run_dir, p.env, p.extra, p.max_restarts, argv=p.argv)
        for p in plan_roles(cfg, run_dir)
    ]


@contextlib.contextmanager
def local_roles(cfg: RunConfig, run_dir: Path) -> Iterator[list[Role]]:
    """``launcher: local``: the roles as processes of this machine, stopped on the way out."""
    roles = start_roles(cfg, run_dir)
    try:
        yield roles
    finally:
        stop_roles(roles)


def launch(cfg: RunConfig, run_dir: Path, console) -> contextlib.AbstractContextManager:
    """The started roles of ``cfg.launcher`` (a context that stops them when left)."""
    if cfg.launcher == "ray":
        from verl_async.ray_launcher import ray_roles

        return ray_roles(cfg, run_dir, console)
    return local_roles(cfg, run_dir)


def stop_roles(roles: list[Role], grace_s: float = 10.0) -> None:
    """SIGTERM each role's whole process group (vLLM's engine processes included), then SIGKILL."""
    for role in roles:
        role.proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for role in roles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        role.proc.signal_group(signal.SIGKILL)  # stragglers, and children of exited roles
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=grace_s)  # SIGKILL: reaped within milliseconds


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def watch(
    roles: list[Role], cfg: RunConfig, run_dir: Path, console, t0: float | None = None
) -> None:
    """Show progress (and, at the first step, where start-up time went since ``t0``) until
    the learner finishes; raise RoleFailed if any role dies first.

    A generator exits with code 0 only when the buffer told it to stop, which it does
    once the learner has sent Shutdown (its last act before exiting): a generator may
    therefore be done a moment before the learner's processes are."""
    learner = next(r for r in roles if r.name == "learner")
    with ProgressReport(console, cfg.trainer.total_steps, cfg.trainer.log_every) as report:
        while True:
            for role in roles:
                code = role.proc.poll()
                if code is not None and restarted(role, code, console):
                    continue
                done = role is learner or role.name.startswith("generator")
                if code is not None and (code != 0 or not done and learner.proc.poll() is None):
                    raise RoleFailed(
                        f"the {role.name} process exited with code {code} before the run finished; "
                        f"last lines of {role.log_path}:\n{_tail(role.log_path)}"
                    )
            finished = learner.proc.poll() == 0  # before reading: its last row is then in
            rows = read_metrics(run_dir / "metrics.jsonl")
            if rows and t0 is not None:
                t0 = report_start_up(run_dir, console, t0)  # once
            report.update(rows)
            if finished:
                return
            time.sleep(0.5)


def restarted(role: Role, code: int, console) -> bool:
    """Start a role again after it died, up to its ``max_restarts``: a reward model (its
    clients' requests meanwhile time out and score the source's default) or a generator
    (the buffer issues its groups again and the learner rebuilds the weight-sync group
    with it). False for every other role, for an exit with code 0, or past the limit."""
    if role.restart is None or code == 0 or role.restarts >= role.max_restarts:
        return False
    role.restarts += 1
    console.print(
        f"the {role.name} process exited with code {code}; restarting it "
        f"({role.restarts}/{role.max_restarts}); see {role.log_path}",
        style="yellow",
        markup=False,
        soft_wrap=True,
    )
    role.proc.signal_group(signal.SIGKILL)  # anything it left behind
    role.proc = role.restart()
    return True


def wait_for_exit(roles: list[Role], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for role in roles:
        if role.name == "buffer":
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))


def train(cfg: RunConfig, run_dir_arg: str | None, console, resume: bool = False) -> Path:
    """Start (or with ``resume``, continue) the run in ``run_dir_arg``; return its directory."""
    t0 = time.time()  # the start-up breakdown counts from here
    if cfg.launcher == "ray":
        from verl_async.ray_launcher import check_installed

        check_installed()
    if cfg.launcher == "local" or not cfg.ray.address:  # a cluster's devices: Ray places them
        placement.check_devices_exist(cfg)  # before anything is written or started
    check_data(cfg)
    run_dir, ckpt = open_run_dir(cfg, run_dir_arg, console, resume)
    console.print(f"run directory: [bold]{escape(str(run_dir))}[/]", soft_wrap=True)
    prepare(cfg, run_dir, ckpt, data_checked=True)
    with launch(cfg, run_dir, console) as roles:
        mark(run_dir, "launcher", "roles started")
        try:
            watch(roles, cfg, run_dir, console, t0)
            wait_for_exit(roles, timeout_s=30)  # generators see `stop` within a poll and exit
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: finishing a checkpoint write in progress...[/]")
            learner = [r for r in roles if r.name == "learner"]
            stop_roles(learner, grace_s=cfg.checkpoint.write_timeout_s)
            console.print("[yellow]stopping every process...[/]")
            if any((d / MANIFEST).is_file() for d in list_checkpoints(run_dir)):
                console.print(
                    f"resume with: verl-async train --resume {run_dir}",
                    markup=False,
                    soft_wrap=True,
                )
            raise
    summarize(run_dir, console)
    return run_dir
