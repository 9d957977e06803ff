"""The sandbox's child: confine the run, start the program, and end everything it started.

``sandbox.py`` starts this file as ``python -I -S _sandbox_child.py SPEC_JSON`` in a new
session, with the run's directory as cwd, a minimal environment, stdin closed and two
extra file descriptors: the status pipe, where every process of ours writes JSON lines,
and the stop pipe, which reaches end-of-file when the parent asks the run to end (a
deadline, a cancel, the output cap) or dies. This process, the *supervisor*, keeps the
parent's privileges, never runs the program's code and is the last of the run to exit:

1. it enters a fresh network namespace when asked (a failure is reported, not fatal);
2. with ``namespaces`` (root, decided by ``HostPlan.probe``) it unshares a PID namespace,
   which only its next child enters, and forks that child, the *init*: PID 1 there. The
   init takes a mount namespace of its own (``private_files``: a fresh /proc that shows
   only the run's processes; one tmpfs of ``tmp_mb`` for /tmp, /var/tmp, /dev/shm and the
   program's directory, nothing of which reaches the host), starts the program as PID 2
   and reaps what gets orphaned. When the program exits, the init reports its status and
   how many processes it left running, and exits: the kernel then kills every process of
   the namespace, ``setsid`` or not, before the init's exit completes. The program is not
   PID 1 itself because PID 1 ignores every signal it has no handler for (SIGXCPU, SIGTERM
   sent to itself), which would change what the program sees;
   without namespaces the supervisor becomes a child subreaper (PR_SET_CHILD_SUBREAPER)
   instead and forks the program itself: whatever the program orphans, ``setsid`` and
   double forks included, is re-parented to the supervisor and stays findable;
3. the program's process (``exec_program``) joins the run's cgroup, sets the resource
   limits, drops to the sandbox user (root parent), forbids gaining privileges, asks for
   SIGKILL if its parent dies, and execs the program's interpreter;
4. the supervisor reaps its children until its own child (the init, or the program)
   exits or the stop pipe closes, then kills every descendant still alive, found in
   /proc, and reaps until it has no child left (``sweep``); then it exits. With a PID
   namespace, killing the init is what ends the rest.

Status lines: the supervisor's setup report first, then ``{"exit": STATUS, "left": N}``
from whichever process reaped the program (its wait status; the processes still running
when it exited, all killed). A failure in any step of ours writes ``{"error": ...}``: the
program does not run, or its run is reported as our failure.

Standard library only: this file is run by path, outside the package, under ``-I -S``.
``python -I -S _sandbox_child.py --probe`` only tries the namespaces and says whether they
work (exit status 0), without running anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125
SWEEP_S = 10.0  # how long killed processes may take to die before we report them
INODES_PER_MB = 1024  # tmpfs inodes cost kernel memory that its size does not count


class Status:
    """The status pipe. Each line is one write() shorter than PIPE_BUF, so the lines of
    several processes never interleave."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, **fields: object) -> None:
        line = json.dumps(fields)
        if len(line) > 3000:
            line = json.dumps({k: str(v)[:1000] for k, v in fields.items()})
        os.write(self.fd, (line + "\n").encode())


# --- system calls ----------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int, what: str) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
    else:
        _check(_libc().unshare(flags), f"unshare({what})")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    encode = lambda s: s.encode() if s else None  # noqa: E731
    result = _libc().mount(encode(source), encode(target), encode(fstype), flags, encode(data))
    _check(result, f"mount {target}")


def prctl(option: int, value: int, what: str) -> None:
    _check(_libc().prctl(option, value, 0, 0, 0), f"prctl({what})")


# --- the program's process --------------------------------------------------------------


def set_limits(limits: dict) -> None:
    """Soft and hard limits alike (the CPU's hard limit one second later: SIGXCPU first,
    then SIGKILL if the program catches SIGXCPU)."""
    mb = 1024 * 1024
    pairs = {
        resource.RLIMIT_CPU: (limits["cpu_s"], limits["cpu_s"] + 1),
        resource.RLIMIT_AS: (limits["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (limits["file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (limits["nproc"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, values in pairs.items():
        resource.setrlimit(which, values)


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"still uid {os.geteuid()} after setuid({uid})")


def no_new_privileges(parent_pid: int) -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")
    # Set after setuid, which clears it; kept across exec. The check after it closes the
    # race with a parent that died before the call.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    if os.getppid() != parent_pid:
        raise OSError("the parent process is gone")


def exec_program(spec: dict, parent_pid: int) -> None:
    """Step 3, in the forked process that becomes the program; never returns."""
    if spec["cgroup_procs"]:
        with open(spec["cgroup_procs"], "w") as f:
            f.write("0")  # this process (a pid here would be read in our PID namespace)
    os.chdir(spec["workdir"])
    set_limits(spec["limits"])
    if spec["uid"] is not None:
        drop_privileges(spec["uid"], spec["gid"])
    no_new_privileges(parent_pid)
    argv = spec["argv"]
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        raise OSError(f"{exc} (executing {argv[0]} as uid {os.getuid()})") from None


# --- the init of the run's PID namespace ------------------------------------------------


def private_files(workdir: str, uid: int | None, gid: int, tmp_mb: int) -> None:
    """A mount namespace for this process and its descendants: /proc of our PID namespace,
    and one fresh tmpfs mounted on /tmp, /var/tmp and /dev/shm (one directory under three
    names, so ``tmp_mb`` bounds all they write), holding the program's directory at the
    path the host gave it, with ``main.py`` copied in. Nothing mounted here is seen by the
    host, and all of it goes when the namespace's last process does."""
    with open("main.py", "rb") as f:  # our cwd is still the host's directory
        code = f.read()
    unshare(CLONE_NEWNS, "CLONE_NEWNS")
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # no mount of ours propagates out
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    options = f"size={tmp_mb}m,nr_inodes={tmp_mb * INODES_PER_MB},mode=1777"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
    for place in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(place) and not os.path.islink(place):
            mount("/tmp", place, None, MS_BIND)
    home = os.path.join("/tmp", os.path.basename(workdir))
    os.mkdir(home, 0o700)
    with open(os.path.join(home, "main.py"), "wb") as f:
        f.write(code)
        if uid is not None:
            os.fchown(f.fileno(), uid, gid)
    if uid is not None:
        os.chown(home, uid, gid)
    if workdir != home:  # a directory outside /tmp (another TMPDIR): the same path
        os.makedirs(workdir, exist_ok=True)
        mount(home, workdir, None, MS_BIND)


def init_main(spec: dict, status: Status) -> None:
    """PID 1 of the run's namespace (step 2): the program's files, the program as PID 2,
    every orphan reaped; at the program's exit, its status and what it left running."""
    os.close(spec["stop_fd"])
    # The supervisor killed (by the OOM killer, say) takes the namespace with it. (Its pid
    # is 0 from here, so the race with an earlier death cannot be checked; it is a fork.)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    private_files(spec["workdir"], spec["uid"], spec["gid"], spec["limits"]["tmp_mb"])
    program = fork_into(exec_program, status, spec, os.getpid())
    while True:
        pid, wait_status = os.waitpid(-1, 0)
        if pid == program:
            break
    left = [pid for pid in descendants(0) if pid != os.getpid()]
    status.send(exit=wait_status, left=len(left))
    # Our exit (the caller's os._exit) makes the kernel kill the rest of the namespace.


# --- the supervisor ---------------------------------------------------------------------


def fork_into(body, status: Status, *args: object) -> int:
    """``body(*args)`` in a child process that never comes back here; the child's pid.
    An exception there is reported on the status pipe and ends the child."""
    pid = os.fork()
    if pid == 0:
        code = SETUP_FAILED
        try:
            body(*args)
            code = 0
        except BaseException as exc:
            status.send(error=f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(code)
    return pid


def descendants(root: int) -> list[int]:
    """The live (not zombie) processes below ``root`` in /proc; 0: every process there."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            state, ppid = stat.rpartition(")")[2].split()[:2]
            children.setdefault(int(ppid), []).append((int(entry.name), state))
    found, todo = [], [root]
    while todo:
        for pid, state in children.get(todo.pop(), ()):
            todo.append(pid)
            if state not in ("Z", "X"):
                found.append(pid)
    return found


def reap(statuses: dict[int, int]) -> bool:
    """Reap every child that has exited into ``statuses``; whether any child is left."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        statuses[pid] = wait_status


def wait_for(child: int, stop_fd: int, wake_fd: int, statuses: dict[int, int]) -> None:
    """Reap children (orphans included) until ``child`` has exited, the stop pipe is
    closed, or SIGTERM came (our parent died: PR_SET_PDEATHSIG)."""
    while reap(statuses) and child not in statuses:
        ready, _, _ = select.select([stop_fd, wake_fd], [], [])
        if stop_fd in ready or signal.SIGTERM in os.read(wake_fd, 512):
            return


def sweep(statuses: dict[int, int]) -> int:
    """SIGKILL every descendant, in rounds, until we have no child left; how many were
    alive. Whatever the killed ones had started is re-parented to us (the subreaper, or
    the init for a namespace), so a round finds what the previous one orphaned."""
    me, killed = os.getpid(), set()
    give_up = time.monotonic() + SWEEP_S
    while reap(statuses):
        alive = descendants(me)
        if alive and time.monotonic() > give_up:
            raise OSError(f"processes {sorted(alive)} survive SIGKILL")
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):  # died meanwhile
                os.kill(pid, signal.SIGKILL)
        killed.update(alive)
        time.sleep(0.001)
    return len(killed)


def watch_signals(parent_pid: int) -> int:
    """A pipe that receives a byte per SIGCHLD and SIGTERM (our parent's death, by
    PR_SET_PDEATHSIG), so that ``wait_for`` blocks in one select."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM, "PR_SET_PDEATHSIG")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)  # it died before the call: stop at once
    return read_end


def supervise(spec: dict, status: Status) -> None:
    """Steps 1, 2 and 4 (this module's docstring)."""
    report: dict = {"network_isolated": False, "namespaces": spec["namespaces"]}
    if spec["unshare_net"]:
        try:
            unshare(CLONE_NEWNET, "CLONE_NEWNET")
            report["network_isolated"] = True
        except OSError as exc:
            report["network_error"] = str(exc)
    if spec["namespaces"]:
        unshare(CLONE_NEWPID, "CLONE_NEWPID")
        status.send(**report)
        child = fork_into(init_main, status, spec, status)
    else:
        prctl(PR_SET_CHILD_SUBREAPER, 1, "PR_SET_CHILD_SUBREAPER")
        status.send(**report)
        child = fork_into(exec_program, status, spec, os.getpid())
    statuses: dict[int, int] = {}
    wait_for(child, spec["stop_fd"], watch_signals(spec["parent_pid"]), statuses)
    exited = child in statuses
    left = sweep(statuses)
    if not spec["namespaces"] and child in statuses:  # the init reports for a namespace
        status.send(exit=statuses[child], left=left if exited else 0)


# --- the probe --------------------------------------------------------------------------


def probe() -> int:
    """Exit status 0 if a PID namespace, a mount namespace, /proc and a tmpfs can be had
    here (root with CAP_SYS_ADMIN, and no seccomp filter refusing ``unshare``)."""
    try:
        unshare(CLONE_NEWPID, "CLONE_NEWPID")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                unshare(CLONE_NEWNS, "CLONE_NEWNS")
                mount("none", "/", None, MS_REC | MS_PRIVATE)
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
            except OSError as exc:
                print(exc, file=sys.stderr)
                code = 1
            os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except OSError as exc:
        print(exc, file=sys.stderr)
        return 1


def main() -> None:
    if sys.argv[1] == "--probe":
        sys.exit(probe())
    spec = json.loads(sys.argv[1])
    status = Status(spec["status_fd"])
    for fd in (status.fd, spec["stop_fd"]):
        os.set_inheritable(fd, False)  # the program's exec closes them
    try:
        supervise(spec, status)
    except Exception as exc:  # our failure: report it; the parent kills what is left
        status.send(error=f"{type(exc).__name__}: {exc}")
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
