"""Where the sandbox's programs may be confined on this machine: who runs them, whether
they get a network namespace, and the pids cgroup each run gets if one is writable.

``HostPlan.probe`` decides once per ``Sandbox``; ``PidsCgroup`` is one run's cgroup. The
parent never enters a namespace or a cgroup itself: ``_sandbox_child.py`` does, after
the fork (``sandbox.py`` has the whole sequence). Also here, what the parent reads from
/proc about processes: a user's threads (``tasks_of``, for RLIMIT_NPROC) and a process
group's live members (``live_group_members``, to know a killed run has ended).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("verl_async.tools.sandbox")

SANDBOX_UID = SANDBOX_GID = 65534  # nobody/nogroup: what a root parent runs the program as
CGROUP_PREFIX = "verl-async-sandbox-"


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
        )

    def describe(self) -> str:
        who = f"uid {self.uid}" if self.uid is not None else f"our own uid ({os.geteuid()})"
        net = "a fresh network namespace" if self.unshare_net else "the host's network"
        cg = (
            f"a pids cgroup (v{self.cgroup_version}) under {self.cgroup_parent}"
            if self.cgroup_parent
            else "no cgroup (RLIMIT_NPROC only)"
        )
        return f"programs run as {who}, in {net}, with {cg}"


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
