"""The sandbox's child entry point: confine this process, then become the program.

``sandbox.py`` starts this file as ``python -I -S _sandbox_child.py SPEC_JSON`` in a new
session, with the run's directory as cwd, a minimal environment, stdin closed and one
extra file descriptor, the status pipe. It runs with the parent's privileges and, in
this order:

1. joins the run's cgroup (so everything the program starts is counted and killed with it);
2. enters a fresh network namespace (only a loopback interface, down) when asked;
3. sets the resource limits (CPU, address space, file size, processes, no core files);
4. drops to the sandbox user (when the parent is root): no groups, then gid, then uid;
5. forbids gaining privileges again (``PR_SET_NO_NEW_PRIVS``: setuid binaries stay
   unprivileged) and asks for SIGKILL if the parent dies;
6. writes one JSON line to the status pipe (what it achieved) and execs the program's
   interpreter. The pipe is close-on-exec, so the program never holds it.

Steps 1 to 5 must happen in this process, after the fork and before the exec; doing them
here instead of in a ``preexec_fn`` keeps the parent safe to fork from a threaded process.
A failure in any step (except the network namespace, which is reported instead) writes
``{"error": ...}`` to the status pipe and exits with status 125 without running the code.

Standard library only: this file is run by path, outside the package, under ``-I -S``.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter_network_namespace() -> str | None:
    """A fresh network namespace for this process; None on success, else why not."""
    try:
        if hasattr(os, "unshare"):  # Python 3.12+
            os.unshare(CLONE_NEWNET)
        else:
            _check(_libc().unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    except OSError as exc:
        return str(exc)
    return None


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
    libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # Set after setuid, which clears it; kept across exec. The check after it closes the
    # race with a parent that died before the call.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        raise OSError("the parent process is gone")


def setup(spec: dict) -> dict:
    """Steps 1 to 5; the report for the status pipe."""
    report: dict = {"network_isolated": False}
    if spec["cgroup_procs"]:
        with open(spec["cgroup_procs"], "w") as f:
            f.write(str(os.getpid()))
    if spec["unshare_net"]:
        why_not = enter_network_namespace()
        report["network_isolated"] = why_not is None
        if why_not:
            report["network_error"] = why_not
    set_limits(spec["limits"])
    if spec["uid"] is not None:
        drop_privileges(spec["uid"], spec["gid"])
    no_new_privileges(spec["parent_pid"])
    return report


def main() -> None:
    spec = json.loads(sys.argv[1])
    status = os.fdopen(spec["status_fd"], "w")
    os.set_inheritable(status.fileno(), False)  # closed by the exec below
    try:
        status.write(json.dumps(setup(spec)) + "\n")
        status.flush()
        what = f"executing {spec['argv'][0]} as uid {os.getuid()}"
        os.execv(spec["argv"][0], spec["argv"])
    except Exception as exc:  # any failure: report it, run nothing
        where = f" ({what})" if "what" in locals() else ""
        status.write(json.dumps({"error": f"{type(exc).__name__}: {exc}{where}"}) + "\n")
        status.flush()
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
