"""The sandbox's host side: where its programs may be confined on this machine, and how
the parent watches and ends one run's child.

``HostPlan.probe`` decides once per ``Sandbox`` who runs the programs, whether they get a
network namespace, PID and mount namespaces, and a pids cgroup (``PidsCgroup``, one per
run) if one is writable. The parent never enters a namespace or a cgroup itself:
``_sandbox_child.py`` does, after the fork (``sandbox.py`` has the whole sequence).

Also here, what the parent reads from /proc about processes: a user's threads
(``tasks_of``, for RLIMIT_NPROC), a process group's live members (``live_group_members``,
to know a killed run has ended), waits for a child's exit that leave it unreaped
(``has_exited``, ``wait_for_exit``); and one run's child seen from the parent
(``Child``): its output read under the cap, the deadline and a cancel (``read_output``),
its end asked for, then backed up by SIGKILL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("verl_async.tools.sandbox")

SANDBOX_UID = SANDBOX_GID = 65534  # nobody/nogroup: what a root parent runs the program as
CGROUP_PREFIX = "verl-async-sandbox-"
CHILD = Path(__file__).with_name("_sandbox_child.py")
POLL_S = 0.1  # how often a run looks at its deadline and at a cancel
READ_CHUNK = 65536
REAP_S = 15.0  # how long the child may take to end the run (its own sweep gives up at 10 s)


class SandboxError(RuntimeError):
    """Our side failed (not the program): the interpreter cannot be run, setup failed."""


PROBE_S = 10.0  # how long the namespace probe may take


@dataclass(frozen=True)
class HostPlan:
    """How runs are confined here, decided once per Sandbox."""

    uid: int | None
    """Run the program as this uid (root parent) or as ourselves (None)."""
    unshare_net: bool
    """Ask the child for a fresh network namespace."""
    cgroup_parent: Path | None
    """Where each run's pids cgroup is made, if anywhere."""
    cgroup_version: int = 0
    namespaces: bool = False
    """Run the program in PID and mount namespaces of its own (root with CAP_SYS_ADMIN):
    its processes all die with it, and /tmp, /var/tmp and /dev/shm are private to it.
    Without them the child sweeps the program's descendants as their subreaper."""

    @classmethod
    def probe(cls, network: bool) -> HostPlan:
        """What we may do here; ``network``: the programs keep the host's network."""
        root = os.geteuid() == 0
        cgroup = _writable_pids_cgroup() if root else None
        return cls(
            uid=SANDBOX_UID if root else None,
            unshare_net=root and not network,
            cgroup_parent=cgroup[0] if cgroup else None,
            cgroup_version=cgroup[1] if cgroup else 0,
            namespaces=root and _namespaces_work(),
        )

    def describe(self) -> str:
        who = f"uid {self.uid}" if self.uid is not None else f"our own uid ({os.geteuid()})"
        net = "a fresh network namespace" if self.unshare_net else "the host's network"
        cg = (
            f"a pids cgroup (v{self.cgroup_version}) under {self.cgroup_parent}"
            if self.cgroup_parent
            else "no cgroup (RLIMIT_NPROC only)"
        )
        ns = (
            "PID and mount namespaces of their own (private /tmp and /dev/shm)"
            if self.namespaces
            else "no PID namespace (their processes swept at the end; /tmp and /dev/shm shared)"
        )
        return f"programs run as {who}, in {net}, with {cg}, in {ns}"


def _namespaces_work() -> bool:
    """Whether the child can have its namespaces here: tried once, in a throwaway child."""
    try:
        tried = subprocess.run(
            [sys.executable, "-I", "-S", str(CHILD), "--probe"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    else:
        if tried.returncode == 0:
            return True
        why = tried.stderr.strip()[-300:] or f"exit {tried.returncode}"
    log.warning("sandbox: no PID and mount namespaces for the programs here (%s)", why)
    return False


def pids_cgroup_candidates(mounts: str, membership: str) -> list[tuple[Path, int]]:
    """This process's cgroup directories that can hold a pids limit, v2 first.

    ``mounts`` is /proc/self/mounts, ``membership`` /proc/self/cgroup: a v2 line is
    ``0::/PATH``, a v1 line ``N:CONTROLLERS:/PATH``."""
    v2_mount = v1_mount = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup2":
            v2_mount = fields[1]
        elif len(fields) >= 4 and fields[2] == "cgroup" and "pids" in fields[3].split(","):
            v1_mount = fields[1]
    own_v2 = own_v1 = None
    for line in membership.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            own_v2 = path
        elif "pids" in controllers.split(","):
            own_v1 = path
    found = []
    if v2_mount and own_v2 is not None:
        found.append((Path(v2_mount) / own_v2.lstrip("/"), 2))
    if v1_mount and own_v1 is not None:
        found.append((Path(v1_mount) / own_v1.lstrip("/"), 1))
    return found


def _writable_pids_cgroup() -> tuple[Path, int] | None:
    """The first candidate where a child cgroup with pids.max can really be made."""
    try:
        mounts = Path("/proc/self/mounts").read_text()
        membership = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for parent, version in pids_cgroup_candidates(mounts, membership):
        try:
            if version == 2 and "pids" not in (parent / "cgroup.subtree_control").read_text():
                (parent / "cgroup.subtree_control").write_text("+pids")
            PidsCgroup.create(parent, f"{CGROUP_PREFIX}probe-{uuid.uuid4().hex[:8]}", 1).remove()
        except OSError:
            continue
        return parent, version
    return None


class PidsCgroup:
    """One run's cgroup: at most ``max_pids`` processes, and a way to kill them all."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs = path / "cgroup.procs"

    @classmethod
    def create(cls, parent: Path, name: str, max_pids: int) -> PidsCgroup:
        path = parent / name
        path.mkdir()
        try:
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            path.rmdir()
            raise
        return cls(path)

    def refused_forks(self) -> int:
        """How many forks pids.max refused (the ``max`` line of pids.events)."""
        try:
            for line in (self.path / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self) -> bool:
        """SIGKILL every process in it: ``cgroup.kill`` (v2, Linux 5.14+) or, in rounds
        until none is left, each pid of ``cgroup.procs`` (pids.max bounds the rounds).
        False if some survived."""
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            kill_file.write_text("1")
        for _ in range(200):
            pids = [int(p) for p in self.procs.read_text().split()]
            if not pids:
                return True
            for pid in pids:
                signal_quietly(os.kill, pid)
            time.sleep(0.005)
        return False

    def remove(self) -> None:
        # Killed processes leave the cgroup as they finish dying: a short retry.
        for _ in range(200):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
        log.warning("could not remove the sandbox cgroup %s", self.path)


def signal_quietly(kill: Callable[[int, int], None], target: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        kill(target, signal.SIGKILL)


def tasks_of(uid: int) -> int:
    """Threads (what RLIMIT_NPROC counts) of the processes that belong to ``uid`` now."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:  # gone meanwhile
                pass
    return count


def live_group_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited yet (zombies, which only wait
    for their parent to reap them, do not count)."""
    try:
        os.killpg(pgid, 0)  # the common case, an empty group, without reading /proc
    except (ProcessLookupError, PermissionError):
        return []
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            state, _ppid, group = stat.rpartition(")")[2].split()[:3]
            if int(group) == pgid and state not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def has_exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it (WNOWAIT)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    try:
        return os.waitid(os.P_PID, pid, flags) is not None
    except ChildProcessError:  # reaped by someone else (a child watcher that waits on -1)
        return True


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for our child ``pid`` to exit, leaving it unreaped;
    whether it did."""
    give_up = time.monotonic() + timeout
    wake = pidfd(pid)
    try:
        while not has_exited(pid):
            left = give_up - time.monotonic()
            if left <= 0:
                return False
            if wake is not None:
                select.select([wake], [], [], left)
            else:
                time.sleep(min(0.005, left))
        return True
    finally:
        if wake is not None:
            os.close(wake)


# --- the parent's side of a run: its output, its end ------------------------------------


@dataclass
class Capture:
    """What the parent read of the program's output, and why it stopped reading."""

    room: int
    out: bytearray = dataclasses.field(default_factory=bytearray)
    err: bytearray = dataclasses.field(default_factory=bytearray)
    truncated: bool = False
    timed_out: bool = False
    cancelled: bool = False

    def keep(self, buffer: bytearray, data: bytes) -> bool:
        """Append what fits; False once the output passed the cap."""
        kept = data[: self.room]
        buffer += kept
        self.room -= len(kept)
        self.truncated = len(kept) < len(data)
        return not self.truncated


@dataclass
class Child:
    """The started ``_sandbox_child.py``: its process, the read end of its status pipe,
    the write end of its stop pipe (closing it asks the child to end the run)."""

    proc: subprocess.Popen
    status: int
    stop: int | None
    cgroup: PidsCgroup | None

    def kill(self) -> None:
        """What the child's own clean-up would miss (the child killed by its program, as
        the same user can when we are not root): its process group and its cgroup. The
        child is not reaped yet: its group id is ours."""
        signal_quietly(os.killpg, self.proc.pid)
        if self.cgroup is not None and not self.cgroup.kill():
            raise SandboxError(f"processes of cgroup {self.cgroup.path} survive SIGKILL")

    def end(self) -> None:
        """End the run if it has not ended: the child kills everything and exits; then
        ``kill`` as a backstop."""
        if self.stop is not None:
            os.close(self.stop)
            self.stop = None
        if not wait_for_exit(self.proc.pid, REAP_S):
            log.warning("the sandbox's child %d did not end its run in time", self.proc.pid)
        self.kill()


def read_output(child: Child, deadline: float, stop: threading.Event, capture: Capture) -> None:
    """Read the output until the child has exited and both pipes are closed, or until
    the deadline, ``stop`` or the first byte over the cap (the caller then ends the run).

    The child exits once the program's main process has and everything it left is dead,
    which closes the pipes; ``kill`` at its exit covers a child that was killed itself."""
    proc = child.proc
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): capture.out, proc.stderr.fileno(): capture.err}
    exited = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        wake = pidfd(proc.pid)  # readable at the child's exit: no wait for POLL_S
        if wake is not None:
            selector.register(wake, selectors.EVENT_READ)
        try:
            while True:
                if not exited and has_exited(proc.pid):
                    exited = True
                    child.kill()
                if exited and not any(fd in buffers for fd in selector.get_map()):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0 or stop.is_set():
                    capture.cancelled = stop.is_set()
                    capture.timed_out = not exited and not capture.cancelled
                    return
                for key, _ in selector.select(min(POLL_S, remaining)):
                    if key.fd == wake:
                        selector.unregister(wake)  # the check at the loop's top sees the exit
                        continue
                    data = os.read(key.fd, READ_CHUNK)
                    if not data:
                        selector.unregister(key.fd)
                    elif not capture.keep(buffers[key.fd], data):
                        return
        finally:
            if wake is not None:
                os.close(wake)


def reap(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"sandboxed process {proc.pid} did not die after SIGKILL") from None


def wait_until_dead(pgid: int) -> None:
    """Return once no process of the group is alive: SIGKILL is delivered asynchronously,
    and a run ends only when its processes have. (Its group id stays ours while any
    member exists, so the repeated kill cannot reach another group.)"""
    give_up = time.monotonic() + REAP_S
    while live_group_members(pgid):
        if time.monotonic() > give_up:
            raise SandboxError(f"processes of group {pgid} survive SIGKILL")
        signal_quietly(os.killpg, pgid)
        time.sleep(0.005)
