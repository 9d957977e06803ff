"""``verl-async train``: start buffer, generators and learner; watch them; stop them cleanly.

Each role is ``python -m <role> --run-dir DIR`` in its own session (so a Ctrl-C in the
terminal reaches only the launcher, which then stops the roles in order: the learner
first, so that a checkpoint write in progress is finished), with its output in
``logs/<role>.log``. Roles also die with the launcher (PR_SET_PDEATHSIG). A role that
exits non-zero stops the run with a message naming it; nothing is left running.

Resume (``--resume RUN_DIR`` or ``checkpoint.resume=true``): the newest checkpoint that
verifies is chosen (each one skipped is reported with why); newer checkpoint directories
are set aside (uncommitted ones deleted, damaged ones renamed ``damaged_step_*``);
``metrics.jsonl`` and ``trained.jsonl`` lose the lines of steps after the checkpoint,
which will be trained again; and buffer and learner restore from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import msgspec
from rich.markup import escape

from verl_async import placement
from verl_async.checkpoint import MANIFEST, list_checkpoints, newest_valid, spare_dir
from verl_async.config import ConfigError, DataConfig, RunConfig, load_config, to_yaml
from verl_async.metrics import complete_lines, read_metrics
from verl_async.progress import ProgressReport, summarize
from verl_async.reward_config import ModelReward
from verl_async.runtime import Endpoints, device_env, free_port, ranks_env, write_endpoints


class RoleFailed(RuntimeError):
    pass


@dataclass
class Role:
    name: str
    proc: subprocess.Popen
    log_path: Path
    restart: Callable[[], subprocess.Popen] | None = None  # reward models: start it again
    restarts: int = 0


MAX_RESTARTS = 5  # per reward-model process; a model that keeps dying stops the run


def make_run_dir(cfg: RunConfig, run_dir: str | None) -> Path:
    if run_dir is None:
        run_dir = f"runs/{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    path = Path(run_dir).resolve()
    if (path / "metrics.jsonl").exists():
        raise RoleFailed(f"run directory '{path}' already holds a run; choose another --run-dir")
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    return path


def resumable(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a run with a committed checkpoint (checkpoint.resume=true
    resumes it; else the run starts, or starts over: ``start_over``)."""
    return (run_dir / "config.yaml").is_file() and any(
        (d / MANIFEST).is_file() for d in list_checkpoints(run_dir)
    )


PARTIAL = ("metrics.jsonl", "trained.jsonl", "eval.jsonl", "tensorboard")


def start_over(run_dir: Path, console) -> None:
    """checkpoint.resume=true on a run stopped before its first checkpoint: nothing to resume
    from, so the run starts again in ``run_dir``. What it wrote per step (metrics, trail,
    uncommitted checkpoint directories) goes; every log gets a note, and the new run's
    output is appended below it."""
    if not any((run_dir / name).exists() for name in PARTIAL):
        return  # stopped before its first step: nothing to clear
    note = (
        f"no checkpoint in '{run_dir}' to resume from: the run starts over there "
        "(its metrics and trail so far are cleared)"
    )
    console.print(f"[yellow]{escape(note)}[/]")
    for name in PARTIAL:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for d in list_checkpoints(run_dir):
        if not (d / MANIFEST).is_file():
            shutil.rmtree(d)
    shutil.rmtree(spare_dir(run_dir), ignore_errors=True)
    for log in sorted((run_dir / "logs").glob("*.log")):
        with open(log, "a") as f:
            f.write(f"\n--- {datetime.now():%Y-%m-%d %H:%M:%S} verl-async: {note} ---\n\n")


def open_run_dir(
    cfg: RunConfig, run_dir_arg: str | None, console, resume: bool
) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume from (None: the run starts)."""
    if run_dir_arg is not None and cfg.checkpoint.resume and not resume:
        path = Path(run_dir_arg).resolve()
        resume = resumable(path)
        if not resume and path.is_dir():
            start_over(path, console)
    if resume:
        run_dir = Path(run_dir_arg).resolve()
        return run_dir, choose_checkpoint(cfg, run_dir, console)
    return make_run_dir(cfg, run_dir_arg), None


def choose_checkpoint(cfg: RunConfig, run_dir: Path, console) -> Path:
    """The checkpoint to resume ``run_dir`` from; the run directory is made to match it."""
    if not (run_dir / "config.yaml").is_file():
        raise RoleFailed(f"cannot resume: '{run_dir}' holds no run (no config.yaml)")
    check_resumable(load_config(run_dir / "config.yaml"), cfg)
    found = newest_valid(run_dir, report=lambda m: console.print(f"[yellow]{escape(m)}[/]"))
    if found is None:
        raise RoleFailed(
            f"cannot resume: no checkpoint in '{run_dir / 'checkpoints'}' verifies "
            "(see `verl-async ckpt verify`); start a new run instead"
        )
    ckpt, manifest = found
    for later in [d for d in list_checkpoints(run_dir) if d > ckpt]:
        if (later / MANIFEST).is_file():
            later.rename(later.with_name(f"damaged_{later.name}"))
        else:
            shutil.rmtree(later)
    for name in ("metrics.jsonl", "trained.jsonl", "eval.jsonl"):
        truncate_steps(run_dir / name, manifest.step)
    console.print(
        f"resuming from [bold]{escape(ckpt.name)}[/] (step {manifest.step}, version {manifest.version})"
    )
    return ckpt


def check_resumable(old: RunConfig, new: RunConfig) -> None:
    """The keys a checkpoint's ledger and weights depend on must not change on resume."""
    for key in ("model", "data", "learner.groups_per_step"):
        a, b = old, new
        for part in key.split("."):
            a, b = getattr(a, part), getattr(b, part)
        if key == "data":  # the stored paths are resolved; compare like with like
            a, b = resolve_data_paths(a), resolve_data_paths(b)
        if a != b:
            raise ConfigError(f"'{key}' differs from the run being resumed; it cannot change")


def truncate_steps(path: Path, step: int) -> None:
    """Keep the lines of steps < ``step`` (atomically: a crash leaves old or new file)."""
    if not path.is_file():
        return
    keep = [line for line in complete_lines(path.read_text()) if json.loads(line)["step"] < step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def resolve_data_paths(data: DataConfig) -> DataConfig:
    """Data paths made absolute (roles run from the run directory's point of view)."""
    resolve = lambda p: str(Path(p).resolve()) if p else ""  # noqa: E731
    return msgspec.structs.replace(data, path=resolve(data.path), val_path=resolve(data.val_path))


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
    restartable: bool = False,
    argv: list[str] | None = None,
) -> Role:
    """Start role ``name`` (``role_argv(module, ...)``, or ``argv`` when given) in a session
    of its own, with ``env`` (placement: ``device_env``) added to the launcher's
    environment and its output in ``logs/<name>.log``."""
    log_path = run_dir / "logs" / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = argv or role_argv(module, run_dir, extra)

    def start() -> subprocess.Popen:
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    return Role(name, start(), log_path, start if restartable else None)


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


def start_roles(cfg: RunConfig, run_dir: Path) -> list[Role]:
    """Buffer, reward models, learner, and one generator process per device group."""
    roles = [spawn("buffer", "buffer", run_dir)]
    models = [s for s in cfg.rewards.sources if isinstance(s, ModelReward)]
    for i, src in enumerate(models):
        env = device_env(placement.reward_model_device(cfg, i))
        name = f"reward_model_{src.name}"
        roles.append(spawn(name, "reward_model", run_dir, env, ["--name", src.name], True))
    argv, env = learner_launch(cfg, run_dir)
    roles.append(spawn("learner", "learners", run_dir, env, argv=argv))
    for i, group in enumerate(placement.generator_groups(cfg)):
        roles.append(
            spawn(f"generator{i}", "generators", run_dir, device_env(group), ["--index", str(i)])
        )
    return roles


def stop_roles(roles: list[Role], grace_s: float = 10.0) -> None:
    """SIGTERM each role's whole process group (vLLM's engine processes included), then SIGKILL."""
    for role in roles:
        _signal_group(role.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for role in roles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        _signal_group(role.proc, signal.SIGKILL)  # stragglers, and children of exited roles
        role.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def watch(roles: list[Role], cfg: RunConfig, run_dir: Path, console) -> None:
    """Show progress until the learner finishes; raise RoleFailed if any role dies first."""
    learner = next(r for r in roles if r.name == "learner")
    with ProgressReport(console, cfg.trainer.total_steps, cfg.trainer.log_every) as report:
        while True:
            for role in roles:
                code = role.proc.poll()
                if code is not None and restarted(role, code, console):
                    continue
                if code is not None and (
                    code != 0 or role is not learner and learner.proc.poll() is None
                ):
                    raise RoleFailed(
                        f"the {role.name} process exited with code {code} before the run finished; "
                        f"last lines of {role.log_path}:\n{_tail(role.log_path)}"
                    )
            finished = learner.proc.poll() == 0  # before reading: its last row is then in
            report.update(read_metrics(run_dir / "metrics.jsonl"))
            if finished:
                return
            time.sleep(0.5)


def restarted(role: Role, code: int, console) -> bool:
    """Start a reward-model process again after it died (its clients' requests meanwhile
    time out and score the source's default); False for every other role, or past the limit."""
    if role.restart is None or role.restarts >= MAX_RESTARTS:
        return False
    role.restarts += 1
    console.print(
        f"the {role.name} process exited with code {code}; restarting it "
        f"({role.restarts}/{MAX_RESTARTS}); see {role.log_path}",
        style="yellow",
        markup=False,
        soft_wrap=True,
    )
    _signal_group(role.proc, signal.SIGKILL)  # anything it left behind
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
    placement.check_devices_exist(cfg)  # before anything is written or started
    check_data(cfg)
    run_dir, ckpt = open_run_dir(cfg, run_dir_arg, console, resume)
    console.print(f"run directory: [bold]{escape(str(run_dir))}[/]", soft_wrap=True)
    prepare(cfg, run_dir, ckpt, data_checked=True)
    roles = start_roles(cfg, run_dir)
    try:
        watch(roles, cfg, run_dir, console)
        wait_for_exit(roles, timeout_s=30)  # generators see `stop` within a poll and exit
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: finishing a checkpoint write in progress...[/]")
        learner = [r for r in roles if r.name == "learner"]
        stop_roles(learner, grace_s=cfg.checkpoint.write_timeout_s)
        console.print("[yellow]stopping every process...[/]")
        if any((d / MANIFEST).is_file() for d in list_checkpoints(run_dir)):
            console.print(
                f"resume with: verl-async train --resume {run_dir}", markup=False, soft_wrap=True
            )
        raise
    finally:
        stop_roles(roles)
    summarize(run_dir, console)
    return run_dir
