"""``verl-async train``: prepare the run directory, start the roles, watch them, stop them.

The roles are started by ``launcher: local`` (``local.py``) or ``launcher: ray``
(``ray_roles.py``) from the same plan (``plan.py``); a role that exits non-zero stops the
run with a message naming it, and nothing is left running. On the way out the learner is
stopped first, so that a checkpoint write in progress is finished.

Resume (``--resume RUN_DIR`` or ``checkpoint.resume=true``): the newest checkpoint that
verifies is chosen (each one skipped is reported with why); newer checkpoint directories
are set aside (uncommitted ones deleted, damaged ones renamed ``damaged_step_*``);
``metrics.jsonl`` and ``trained.jsonl`` lose the lines of steps after the checkpoint,
which will be trained again; and buffer and learner restore from it.

Automatic resume (``trainer.max_restarts``): when the learner (any of its ranks) or the
buffer dies, the launcher stops the other roles, resumes the run from its newest checkpoint
that verifies (or starts it over when it has none yet) and goes on, up to that many times.
Each restart is printed and noted in every role's log with its cause. A generator or reward
model that dies is restarted on its own (``restarted``), without stopping the run.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

from rich.markup import escape

from verl_async import placement
from verl_async.checkpoint import MANIFEST, list_checkpoints
from verl_async.launch.local import local_roles
from verl_async.launch.plan import Role, backoff_s, stop_roles
from verl_async.launch.prepare import check_data, check_loss_mode, prepare
from verl_async.launch.progress import ProgressReport, summarize
from verl_async.launch.run_dir import RoleFailed, claim, open_run_dir, reopen_after_failure
from verl_async.launch.startup import report_start_up
from verl_async.metrics import read_metrics
from verl_async.runtime import mark
from verl_async.schema import RunConfig


def launch(cfg: RunConfig, run_dir: Path, console) -> contextlib.AbstractContextManager:
    """The started roles of ``cfg.launcher`` (a context that stops them when left)."""
    if cfg.launcher == "ray":
        from verl_async.launch.ray_roles import ray_roles

        return ray_roles(cfg, run_dir, console)
    return local_roles(cfg, run_dir)


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
                    cause = f"the {role.name} process exited with code {code}"
                    raise RoleFailed(
                        f"{cause} before the run finished; "
                        f"last lines of {role.log_path}:\n{_tail(role.log_path)}",
                        role=role.name,
                        cause=cause,
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
    with it). The restart waits ``backoff_s`` (True meanwhile: the watch goes on). False
    for every other role, for an exit with code 0, or past the limit."""
    if role.restart_due is None:
        if role.restart is None or code == 0 or role.restarts >= role.max_restarts:
            return False
        role.restarts += 1
        wait_s = backoff_s(role.restarts)
        console.print(
            f"the {role.name} process exited with code {code}; restarting it "
            f"({role.restarts}/{role.max_restarts}) in {wait_s:.0f} s; see {role.log_path}",
            style="yellow",
            markup=False,
            soft_wrap=True,
        )
        role.proc.signal_group(signal.SIGKILL)  # anything it left behind
        role.restart_due = time.monotonic() + wait_s
    if time.monotonic() >= role.restart_due:
        role.restart_due = None
        role.proc = role.restart()
    return True


def wait_for_exit(roles: list[Role], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for role in roles:
        if role.name == "buffer":
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))


RUN_ROLES = ("learner", "buffer")  # their death stops the run; it may then resume


def train(cfg: RunConfig, run_dir_arg: str | None, console, resume: bool = False) -> Path:
    """Start (or with ``resume``, continue) the run in ``run_dir_arg``; return its directory.
    A run whose learner or buffer dies resumes by itself, up to ``trainer.max_restarts``."""
    t0 = time.time()  # the start-up breakdown counts from here
    if cfg.launcher == "ray":
        from verl_async.launch.ray_roles import check_installed

        check_installed()
    if cfg.launcher == "local" or not cfg.ray.address:  # a cluster's devices: Ray places them
        placement.check_devices_exist(cfg)  # before anything is written or started
    check_data(cfg)
    check_loss_mode(cfg)
    run_dir_arg, lock = claim(cfg, run_dir_arg, resume)  # held until the run ends
    try:
        return run_in(cfg, run_dir_arg, console, resume, t0)
    finally:
        lock.release()


def run_in(cfg: RunConfig, run_dir_arg: str, console, resume: bool, t0: float | None) -> Path:
    """``train`` in the directory it claimed: resume or start the run, restart it after a
    death of the learner or the buffer, summarize it."""
    run_dir, ckpt = open_run_dir(cfg, run_dir_arg, console, resume)
    console.print(f"run directory: [bold]{escape(str(run_dir))}[/]", soft_wrap=True)
    restarts = 0
    while True:
        prepare(cfg, run_dir, ckpt, data_checked=True)
        try:
            run_roles(cfg, run_dir, console, t0)
            break
        except RoleFailed as failure:
            if failure.role not in RUN_ROLES or restarts >= cfg.trainer.max_restarts:
                raise
            restarts += 1
            note_restart(run_dir, console, failure, restarts, cfg.trainer.max_restarts)
            time.sleep(backoff_s(restarts))  # every role is stopped: nothing to watch
            ckpt = reopen_after_failure(cfg, run_dir, console)
            t0 = None  # the start-up breakdown is the first start's
    summarize(run_dir, console)
    return run_dir


def run_roles(cfg: RunConfig, run_dir: Path, console, t0: float | None) -> None:
    """Start the roles, watch them until the learner finishes, and stop them."""
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


def note_restart(run_dir: Path, console, failure: RoleFailed, n: int, limit: int) -> None:
    """Say why the run restarts: on the console (with the dead role's last log lines), in
    ``startup.jsonl`` (event ``restart``) and at the end of every role's log."""
    console.print(
        f"restart {n}/{limit}: {failure}\nresuming the run from its newest checkpoint "
        f"in {backoff_s(n):.0f} s",
        style="yellow",
        markup=False,
        soft_wrap=True,
    )
    mark(run_dir, "launcher", "restart", n=n)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for log in sorted((run_dir / "logs").glob("*.log")):
        with open(log, "a") as f:
            f.write(f"\n--- {stamp} verl-async: restart {n}/{limit}: {failure.cause} ---\n\n")
