"""How long the processes of a run live: none outlives the process that started it, and a
run directory holds one live run at a time.

Parent death. A launcher starts every role through ``tethered``: a small wrapper asks
Linux for SIGTERM at the launcher's death (``PR_SET_PDEATHSIG``, which ``exec`` keeps),
checks that the launcher is still its parent (it may have died before the request
counted), and only then runs the role's command in its place. The request must come
before the command runs: a role that made it in its own start-up left a window of seconds
(its imports), and torchrun, which never makes it, kept every learner rank alive after
the launcher was SIGKILLed. When the launcher dies, torchrun's SIGTERM handler stops its
ranks. Each rank (every role, in ``die_with_parent``) makes the same request about its
own parent and, when ``TETHER_PID`` names a parent that is already gone, exits; and a
thread of its own kills the process ``ORPHAN_GRACE_S`` after its parent died, in case
SIGTERM was not enough (a Python handler cannot run while native code holds the main
thread: a collective waiting for a dead peer, a hung user function).

Processes a role's libraries start (vLLM's engine core and its workers, started by the
engine inside a generator) are tied to the role with ``die_with``: a thread of theirs
waits on a pidfd of the role's process and ends theirs the moment it dies, even while
their main thread is blocked in a weight broadcast that will never complete.

Run directory lock. Two ``flock`` locks in the run directory::

    launcher.lock   exclusive, held by the launcher of the run for its life
    run.lock        shared, held by every process of the run (the launcher, each role)

A launcher (``claim_run_dir``) needs ``launcher.lock`` and then ``run.lock`` exclusively
for a moment, before it changes anything in the directory: a live launcher, or any role
still running after its launcher died, makes it refuse with one sentence naming the
directory. The locks go with the processes (the kernel drops a lock when its last
descriptor closes), so a run killed by any means leaves nothing to clean up; locks are
advisory and local to what the file system supports (network file systems may not).

A run that is ending is waited for, up to ``EXIT_WAIT_S``, before the claim is refused:
``--resume`` typed right after the run was killed finds its processes still on their way
out for a few seconds (a large process takes time to free its memory, a role whose
launcher died gets SIGTERM and unwinds). Ending means: ``launcher.lock`` held only by
processes in exit (a zombie, the kernel's exit flag set, SIGKILL pending), or
``run.lock`` held with no launcher left (``launcher.lock`` free: the run's roles die with
their launcher, each within ``ORPHAN_GRACE_S``). A live launcher is refused at once; roles
that outlast the wait are refused after it, with the same sentence.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("verl_async.lifetime")

PR_SET_PDEATHSIG = 1
TETHER_PID = "VERL_ASYNC_TETHER_PID"
"""Set by ``tethered`` to the pid of the process it becomes: that process, or a child of
it that is none of ours (torchrun's ranks), must have it as its parent at start-up."""
ORPHAN_GRACE_S = 30.0  # after the parent's death: SIGTERM at once, SIGKILL this much later

# Runs in a bare interpreter (-I -S: no site, no user path), before the role's command.
_TETHER = """\
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 15)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.environ["VERL_ASYNC_TETHER_PID"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""


def tethered(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM when this process dies, from its first
    instruction on (the process keeps its pid: the wrapper execs the command)."""
    return [sys.executable, "-I", "-S", "-c", _TETHER, str(os.getpid()), *argv]


def die_with_parent(grace_s: float = ORPHAN_GRACE_S) -> None:
    """Ask for SIGTERM when this process's parent dies, exit now if it has died already,
    and kill this process ``grace_s`` after the parent's death if it is still there."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.getppid()
    tether = os.environ.pop(TETHER_PID, "")  # for this process alone, not its children
    if tether and int(tether) != os.getpid() and parent != int(tether):
        os._exit(1)  # started by a process that is gone (torchrun killed at once)
    watcher = threading.Thread(
        target=_outlive_parent, args=(parent, grace_s), name="parent-watch", daemon=True
    )
    watcher.start()


class Interrupted(KeyboardInterrupt):
    """What ``interrupt_once`` raises: a stop asked for by signal ``signum``, told apart
    from a KeyboardInterrupt that code of the role raised itself."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(SystemExit):
    """A role's end after a stop it was asked for (a signal, a stop message): exit
    ``code``, logged as one INFO line saying ``why`` (``runtime.report_exit``)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(code)
        self.why = why


def interrupt_once(*signals: int) -> None:
    """The first of ``signals`` to come raises ``Interrupted`` (a KeyboardInterrupt) in
    the main thread (a role's loop unwinds, cleaning up on the way, as after Ctrl-C);
    every later one is ignored. A stop often comes twice: a launcher signals the learner
    again once its checkpoint write has committed, a Ctrl-C in a terminal reaches torchrun
    and each of its ranks and torchrun passes it on, and a rank's parent-death signal
    follows torchrun's exit. Raised again, it would cut the clean-up short or, once the
    role's main function has returned, come out of an exit handler as a traceback."""

    def interrupt(signum, frame) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    for sig in signals:
        signal.signal(sig, interrupt)


def _outlive_parent(parent: int, grace_s: float) -> None:
    """SIGKILL this process ``grace_s`` after its parent is gone (re-parented)."""
    wait_for_exit(parent, still=lambda: os.getppid() == parent)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with(pid: int) -> None:
    """Exit this process (``os._exit``) as soon as process ``pid`` ends, whatever its main
    thread is doing, from a daemon thread. When ``pid`` is not this process's parent (a
    vLLM worker under the engine-core process of the generator ``pid``), that parent is
    SIGKILLed first, so nothing between the two is left either."""
    parent = os.getppid()
    between = None
    if parent != pid:
        with contextlib.suppress(AttributeError, OSError):
            between = os.pidfd_open(parent)

    def watch() -> None:
        wait_for_exit(pid)
        if between is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(between, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()


def wait_for_exit(pid: int, still: Callable[[], bool] = lambda: True) -> None:
    """Return once process ``pid`` has ended (at once when there is none). Blocks on a
    pidfd of it (Linux 5.3+), else polls. ``still``: checked once the pidfd is open, False
    when ``pid`` already ended before (its number may name another process by then)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd on this kernel or Python: poll
        while still() and _exists(pid):
            time.sleep(0.5)
        return
    try:
        if still():
            select.select([fd], [], [])  # readable once the process has ended
    finally:
        os.close(fd)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    return True


# ----------------------------------------------------------------------------- run lock

LAUNCHER_LOCK = "launcher.lock"
RUN_LOCK = "run.lock"


class RunDirInUse(RuntimeError):
    """The run directory belongs to a live run (the message says which and what to do)."""


@dataclass
class RunLock:
    """The locks a launcher holds on its run directory (``claim_run_dir``)."""

    fds: list[int]

    def keep_across_exec(self) -> None:
        """Keep the locks when this process becomes a role (``verl-async buffer``)."""
        for fd in self.fds:
            os.set_inheritable(fd, True)

    def release(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


EXIT_WAIT_S = 10.0  # how long a claim waits for the processes of a run that is ending
POLL_S = 0.2


def claim_run_dir(
    run_dir: Path, wait_s: float = EXIT_WAIT_S, say: Callable[[str], None] = log.info
) -> RunLock:
    """Make ``run_dir`` if needed and claim it for this launcher: ``RunDirInUse`` when a
    live launcher or any process of an earlier run still holds it. Processes of a run
    that is ending (the module docstring) are waited for, up to ``wait_s``; ``say`` gets
    one line when the wait begins."""
    run_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        claimed = _try_claim(run_dir)
        if isinstance(claimed, RunLock):
            return claimed
        pids = holders(claimed)
        if time.monotonic() >= deadline or not _ending(claimed, pids):
            raise _in_use(run_dir, claimed)
        if not waiting:
            waiting = True
            say(
                f"run directory '{run_dir}': waiting up to {wait_s:g} s for the processes "
                f"of the run that is ending there ({', '.join(map(str, pids)) or 'unknown'}) "
                "to exit"
            )
        time.sleep(POLL_S)


def _try_claim(run_dir: Path) -> RunLock | Path:
    """Both locks (the claim), or the path of the lock another process holds."""
    held: list[int] = []
    try:
        for name, mode in ((LAUNCHER_LOCK, fcntl.LOCK_EX), (RUN_LOCK, fcntl.LOCK_EX)):
            fd = _open(run_dir / name)
            held.append(fd)
            if not _lock(fd, mode | fcntl.LOCK_NB):
                RunLock(held).release()
                return run_dir / name
        # Roles share run.lock from now on; launcher.lock keeps other launchers out.
        fcntl.flock(held[1], fcntl.LOCK_SH)
    except BaseException:
        RunLock(held).release()
        raise
    return RunLock(held)


def _ending(lock: Path, pids: list[int]) -> bool:
    """Whether the holders ``pids`` of ``lock`` belong to a run that is ending: the
    launcher's lock held by processes in exit only, or the roles' lock held with no
    launcher left (``_try_claim`` got ``launcher.lock``)."""
    if lock.name == RUN_LOCK:
        return True
    return bool(pids) and all(exiting(pid) for pid in pids)


PF_EXITING = 0x4  # include/linux/sched.h: the process is in exit
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone or on its way out: a zombie, in exit (the kernel's
    flag, set while it frees its memory and files), or with SIGKILL pending."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    if stat[0] in ("Z", "X") or int(stat[6]) & PF_EXITING:
        return True
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & SIGKILL_BIT)


def hold_run_dir(run_dir: str | Path) -> None:
    """Hold ``run.lock`` shared until this process exits (every role, at start-up): a
    launcher then refuses the directory while this process lives, even when the launcher
    that started it is gone."""
    fd = _open(Path(run_dir) / RUN_LOCK)
    _lock(fd, fcntl.LOCK_SH)  # blocks only while a launcher checks, a moment


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _lock(fd: int, mode: int) -> bool:
    """flock; False when another holder has it. A file system without locks counts as
    unlocked, with a warning (nothing would be refused there)."""
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        log.warning("no file locks here (%s): a second run in this directory is not refused", exc)
    return True


def _in_use(run_dir: Path, lock: Path) -> RunDirInUse:
    pids = holders(lock)
    who = f" (process{'es' if len(pids) > 1 else ''} {', '.join(map(str, pids))})" if pids else ""
    what = "its launcher" if lock.name == LAUNCHER_LOCK else "a process of it"
    return RunDirInUse(
        f"run directory '{run_dir}' is in use by a live run: {what} still runs{who}; wait "
        "for it to end or stop it, or choose another --run-dir"
    )


def holders(lock: Path) -> list[int]:
    """The pids holding an flock on ``lock``, from /proc/locks (empty where unknown)."""
    try:
        st = lock.stat()
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    for line in text.splitlines():
        fields = line.split()
        if "->" not in fields and len(fields) > 5 and fields[5] == key:
            pids.add(int(fields[4]))
    return sorted(p for p in pids if p != os.getpid() and p > 0)
