"""The run directory: make it, resume it from a checkpoint, or start it over.

A run lives in one directory (docs/run_dir.md). ``open_run_dir`` decides what a
command does with the directory it is given: a new run makes it; ``--resume`` (or
``checkpoint.resume=true`` on a run that has a checkpoint) picks the newest checkpoint
that verifies, sets newer ones aside and cuts the per-step files back to it; a run stopped
before its first checkpoint starts over in place.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import datetime
from pathlib import Path

import msgspec
from rich.markup import escape

from verl_async.checkpoint import MANIFEST, list_checkpoints, newest_valid, set_aside, spare_dir
from verl_async.config import ConfigError, load_config
from verl_async.lifetime import RunDirInUse, RunLock, claim_run_dir
from verl_async.metrics import complete_lines
from verl_async.schema import DataConfig, RunConfig


class RoleFailed(RuntimeError):
    """The run cannot go on; ``role``: the role whose process died, when one did, and
    ``cause``: how, in one line (the message may go on with its log's last lines)."""

    def __init__(self, message: str, role: str | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.cause = cause or message.splitlines()[0]


def claim(cfg: RunConfig, run_dir_arg: str | None, resume: bool) -> tuple[str, RunLock]:
    """Claim the directory a command names (a new run's default one when none) for this
    launcher, before anything in it changes: (its path, the lock to hold for the run's
    life). ``RoleFailed`` when a live run, or a process left of one, holds it (a run that
    is ending is waited for a few seconds first, saying so on stderr)."""
    path = Path(run_dir_arg or default_run_dir(cfg)).resolve()
    if resume and not path.is_dir():
        raise RoleFailed(f"cannot resume: '{path}' is not a directory")
    try:
        return str(path), claim_run_dir(path, say=lambda line: print(line, file=sys.stderr))
    except RunDirInUse as exc:
        raise RoleFailed(str(exc)) from None


def default_run_dir(cfg: RunConfig) -> str:
    return f"runs/{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"


def make_run_dir(cfg: RunConfig, run_dir: str | None) -> Path:
    path = Path(run_dir or default_run_dir(cfg)).resolve()
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


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run: its ``config.yaml`` (written before any role
    starts) is a run config."""
    try:
        load_config(run_dir / "config.yaml")
    except (ConfigError, OSError):
        return False
    return True


PARTIAL = ("metrics.jsonl", "trained.jsonl", "eval.jsonl", "tensorboard")


def start_over(run_dir: Path, console) -> None:
    """checkpoint.resume=true on a run stopped before its first checkpoint: nothing to resume
    from, so the run starts again in ``run_dir``. What it wrote per step (metrics, trail,
    uncommitted checkpoint directories) goes; every log gets a note, and the new run's
    output is appended below it. Nothing is deleted from a directory that holds no run
    (its ``config.yaml`` a run config): ``RoleFailed`` says so."""
    found = [name for name in PARTIAL if (run_dir / name).exists()]
    if not found:
        return  # stopped before its first step: nothing to clear
    if not holds_run(run_dir):
        raise RoleFailed(
            f"run directory '{run_dir}' holds {', '.join(found)} but no run (no "
            "config.yaml of a run): nothing there is deleted; choose another --run-dir"
        )
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


def reopen_after_failure(cfg: RunConfig, run_dir: Path, console) -> Path | None:
    """What a run restarted by the launcher (``trainer.max_restarts``) resumes from: its
    newest checkpoint that verifies, as ``--resume`` would choose it, or None when it has
    none yet (the run then starts over in place, as with ``checkpoint.resume``)."""
    if resumable(run_dir):
        return choose_checkpoint(cfg, run_dir, console)
    start_over(run_dir, console)
    return None


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
            set_aside(later)  # damaged_step_N: kept for a look, pruned once old
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
