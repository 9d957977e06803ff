"""``launcher: local``: every role of the plan as a process of this machine.

Each role is ``python -m <role> --run-dir DIR`` in its own session (so a Ctrl-C in the
terminal reaches only the launcher, which then stops the roles in order), with its output
in ``logs/<role>.log``. Roles die with the launcher, torchrun's ranks included: each is
tethered to it before its command runs (verl_async/lifetime.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from verl_async.launch.plan import Role, plan_roles, role_argv, stop_roles
from verl_async.lifetime import tethered
from verl_async.schema import RunConfig


class LocalProcess(subprocess.Popen):
    """A role started here, in a session of its own."""

    def signal_group(self, sig: int) -> None:
        """Signal the role's whole process group (vLLM's engine processes included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


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
                tethered(argv),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    return Role(name, start(), log_path, start if max_restarts else None, 0, max_restarts)


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
        stop_roles(roles, run_dir=run_dir, write_grace_s=cfg.checkpoint.write_timeout_s)
