"""A sandbox for the model's Python code, and the ``python`` tool that calls it.

    sandbox = Sandbox(SandboxLimits(cpu_s=5, wall_s=10), max_concurrent=4)
    result = await sandbox.run("print(2 + 2)")     # SandboxResult(stdout="4\\n", ...)
    tool = PythonTool(sandbox)
    text = await tool(code)                        # "4\\n"; raises ToolError on a fault

One run, from the parent's side (``run_code``, blocking, in one of the pool's threads):

1. a fresh directory (``mkdtemp``) holds ``main.py``; it is the program's cwd, HOME and
   TMPDIR, owned by the sandbox user, and removed at the end;
2. when a pids cgroup is writable (root, cgroup v2 with the pids controller or the v1 pids
   hierarchy) the run gets its own cgroup with ``pids.max = processes``;
3. ``_sandbox_child.py`` starts in a new session (its own process group), stdin /dev/null,
   a minimal environment, a status pipe and a stop pipe. It stays outside the program, as
   its supervisor: it confines the program's process before that execs
   ``python -I -u main.py`` (cgroup, network namespace, rlimits, uid 65534 when we are
   root, no new privileges), and it ends whatever the program started: with PID and mount
   namespaces (root) the program runs as PID 2 of a namespace whose PID 1 exits with it,
   which makes the kernel kill the rest, and its /tmp and /dev/shm are a private tmpfs;
   without them the supervisor is the program's child subreaper and kills every
   descendant it finds (its docstring has the order and why);
4. the parent reads stdout and stderr as they come, keeping at most ``output_bytes`` of
   both together: the first byte over the cap, the wall-clock deadline or a cancel closes
   the stop pipe, and the supervisor kills the run at once, so a flood never sits in our
   memory;
5. the supervisor exits once every process of the run is dead, which closes the output
   pipes: the run ends when the program's main process does, whatever it left running
   (reported as ``left_behind`` and as an error). Its process group and its cgroup are
   killed after that as a backstop; the supervisor is reaped only after these kills, so
   its pid (the group's id) cannot have been reused by then;
6. the result says what happened; a limit that stopped the program is named in
   ``error`` (``SandboxResult.ok`` is False), never raised.

What runs the program depends on what we may do (``HostPlan.probe``); precisely what each
case protects against is in docs/security.md ("The Python sandbox"):

- as root: uid/gid 65534 (``nobody``), a fresh network namespace with only a loopback
  interface that is down, PID and mount namespaces where the kernel allows them (it does
  not in a container without CAP_SYS_ADMIN), and a pids cgroup if one is writable;
  RLIMIT_NPROC as well (it counts every process of uid 65534 on the machine, so it is set
  to those that exist plus ``processes``: a backstop, the cgroup is the exact per-run
  bound);
- not root: the caller's own uid, no namespace at all (``network_isolated=False``,
  ``namespaces=False``), and RLIMIT_NPROC alone (set the same way, counting the caller's
  own processes and threads).

``Sandbox`` bounds concurrent runs with an asyncio.Semaphore and runs each in a thread of
its own pool, so nothing blocks the event loop. ``run`` raises only for our side's
faults (``SandboxError``: the interpreter cannot be run, a setup step failed) and for
misuse (code that is not a string).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from verl_async.config_base import ConfigError
from verl_async.tools._sandbox_host import (
    CGROUP_PREFIX,
    CHILD,
    SANDBOX_GID,
    Capture,
    Child,
    HostPlan,
    PidsCgroup,
    SandboxError,
    read_output,
    reap,
    tasks_of,
    wait_until_dead,
)

log = logging.getLogger("verl_async.tools.sandbox")


class ToolError(Exception):
    """A tool call that failed in a contained way (a limit stopped the program); the text
    is what the model should read, ending in a line that starts with ``Error:``."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. ``SandboxLimits.from_mapping(cfg)`` builds it from a config
    section (a dict from YAML), refusing unknown keys."""

    cpu_s: int = 5
    """CPU seconds of each process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL 1 s later."""
    wall_s: float = 10.0
    """Wall-clock seconds of the whole run; at the deadline every process of it is killed."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS): a bigger allocation raises MemoryError."""
    file_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE): a bigger write fails with EFBIG."""
    processes: int = 8
    """Processes of the run at once, its main process included (cgroup pids.max when a
    cgroup is available; always RLIMIT_NPROC as well, see the module docstring)."""
    output_bytes: int = 65536
    """stdout and stderr kept, together; the first byte over it stops the program."""
    network: bool = False
    """False: a fresh network namespace with no usable interface (when running as root)."""
    tmp_mb: int = 64
    """Size of the private tmpfs behind /tmp, /var/tmp, /dev/shm and the program's
    directory, all it may write, when it has a mount namespace (root)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "network":
                if not isinstance(value, bool):
                    raise ConfigError(f"sandbox limit 'network' must be true or false: {value!r}")
                continue
            number = (int, float) if f.type == "float" else int
            if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
                raise ConfigError(
                    f"sandbox limit '{f.name}' must be a positive {f.type}: got {value!r}"
                )

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> SandboxLimits:
        """The limits of a config section; an unknown key is an error naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(
                    f"unknown sandbox limit '{key}': expected some of {', '.join(sorted(known))}"
                )
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. ``error`` is None unless a limit (or a crash) stopped it."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The main process's exit status; None when a signal killed it."""
    signal: str | None
    """The signal that killed the main process ("SIGKILL", "SIGXCPU"), if one did."""
    timed_out: bool
    """The wall-clock limit expired while the main process ran."""
    truncated: bool
    """The output passed ``output_bytes``: what was kept is the first ``output_bytes``."""
    seconds: float
    error: str | None
    """Why the run failed, in words for the model: each limit hit, "; "-separated."""
    network_isolated: bool
    """The program ran in a network namespace of its own (no network at all)."""
    left_behind: int = 0
    """Processes still running when the main process exited (each killed; an error)."""
    namespaces: bool = False
    """The program ran in PID and mount namespaces of its own: private /tmp, /dev/shm."""

    @property
    def ok(self) -> bool:
        """The program ran to its end, exited 0 and hit no limit."""
        return self.exit_code == 0 and self.error is None


# --- one run ----------------------------------------------------------------------------


def run_code(
    code: str,
    limits: SandboxLimits,
    plan: HostPlan,
    python: str,
    stop: threading.Event | None = None,
) -> SandboxResult:
    """Run ``code`` once under ``limits`` and clean up after it (blocking).

    ``stop``, when set, kills the run within ``POLL_S``: how a cancelled ``Sandbox.run``
    ends it."""
    started = time.monotonic()
    workdir = _make_workdir(code, plan.uid)
    cgroup = None
    try:
        if plan.cgroup_parent is not None:
            name = f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
            cgroup = PidsCgroup.create(plan.cgroup_parent, name, limits.processes)
        child = _spawn(workdir, limits, plan, python, cgroup)
        capture = Capture(room=limits.output_bytes)
        with child.proc, os.fdopen(child.status, "rb") as status_pipe:
            try:
                read_output(child, started + limits.wall_s, stop or threading.Event(), capture)
            finally:
                child.end()
            returncode = reap(child.proc)
            wait_until_dead(child.proc.pid)
            report = _read_status(status_pipe, capture)
        refused = cgroup.refused_forks() if cgroup else 0
    finally:
        if cgroup is not None:
            cgroup.kill()
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(capture, returncode, report, refused, limits, time.monotonic() - started)


def _make_workdir(code: str, uid: int | None) -> str:
    """The run's directory with ``main.py`` in it, both the sandbox user's. The directory
    is handed over last: until then only we can enter it, so no program of another run
    can swap ``main.py`` for a link that our chown would follow."""
    workdir = tempfile.mkdtemp(prefix="verl-async-sandbox-")
    fd = os.open(Path(workdir, "main.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as main:
        main.write(code)
        if uid is not None:
            os.fchown(fd, uid, SANDBOX_GID)
    if uid is not None:
        os.chown(workdir, uid, SANDBOX_GID)
    return workdir


def _spawn(
    workdir: str, limits: SandboxLimits, plan: HostPlan, python: str, cgroup: PidsCgroup | None
) -> Child:
    """Start ``_sandbox_child.py``."""
    # RLIMIT_NPROC counts the user's processes everywhere: those there now, plus the run's
    # (and the child itself when it runs as that user too). With a cgroup, twice the run's:
    # pids.max then binds first (exact, and counted).
    allowance = limits.processes * (2 if cgroup else 1) + (plan.uid is None)
    nproc = tasks_of(plan.uid if plan.uid is not None else os.getuid()) + allowance
    status_read, status_write = os.pipe()
    stop_read, stop_write = os.pipe()
    spec = {
        "status_fd": status_write,
        "stop_fd": stop_read,
        "cgroup_procs": str(cgroup.procs) if cgroup else None,
        "unshare_net": plan.unshare_net,
        "namespaces": plan.namespaces,
        "workdir": workdir,
        "limits": {**dataclasses.asdict(limits), "nproc": nproc},
        "uid": plan.uid,
        "gid": SANDBOX_GID,
        "parent_pid": os.getpid(),
        "argv": [python, "-I", "-u", "-B", "-X", "utf8", "main.py"],
    }
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        # Numerical libraries otherwise start a thread per core, each reserving memory.
        **{name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(CHILD), json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,  # its own session and process group, led by its pid
            pass_fds=(status_write, stop_read),
        )
    except BaseException:
        os.close(status_read)
        os.close(stop_write)
        raise
    finally:
        os.close(status_write)
        os.close(stop_read)
    return Child(proc, status_read, stop_write, cgroup)


def _read_status(pipe, capture: Capture) -> dict:
    """The child's reports, merged; raises SandboxError if something of ours failed."""
    lines = [json.loads(line) for line in pipe.read().splitlines() if line.strip()]
    if not lines and (capture.timed_out or capture.cancelled):
        return {}  # we killed it while it was setting up
    if not lines:
        tail = capture.err.decode(errors="replace").strip()[-500:]
        raise SandboxError(f"the sandbox's child exited before confining itself: {tail}")
    failure = next((line["error"] for line in lines if "error" in line), None)
    if failure:
        raise SandboxError(f"the sandbox could not run the program: {failure}")
    report = {key: value for line in lines for key, value in line.items()}
    if report.get("network_error"):
        log.warning("no network namespace for a sandboxed run: %s", report["network_error"])
    return report


def _result(
    capture: Capture,
    child_returncode: int,
    report: dict,
    refused_forks: int,
    limits: SandboxLimits,
    seconds: float,
) -> SandboxResult:
    stderr = capture.err.decode("utf-8", errors="replace")
    if "exit" in report:  # the wait status of the program's main process, from who reaped it
        returncode = os.waitstatus_to_exitcode(report["exit"])
    elif capture.timed_out or capture.cancelled or capture.truncated:
        returncode = -signal.SIGKILL  # killed with its namespace's init, which reports nothing
    else:
        returncode = child_returncode  # the child itself was killed
    killed_by = signal.Signals(-returncode).name if returncode < 0 else None
    left = int(report.get("left", 0))
    faults = _faults(capture, returncode, killed_by, stderr, refused_forks, limits)
    if left:
        faults.append(
            f"the program left {left} process{'es' if left > 1 else ''} running when it "
            f"exited; {'they were' if left > 1 else 'it was'} killed"
        )
    return SandboxResult(
        stdout=capture.out.decode("utf-8", errors="replace"),
        stderr=stderr,
        exit_code=returncode if returncode >= 0 else None,
        signal=killed_by,
        timed_out=capture.timed_out,
        truncated=capture.truncated,
        seconds=seconds,
        error="; ".join(faults) or None,
        network_isolated=bool(report.get("network_isolated")),
        left_behind=left,
        namespaces=bool(report.get("namespaces")),
    )


def _faults(
    capture: Capture,
    returncode: int,
    killed_by: str | None,
    stderr: str,
    refused_forks: int,
    limits: SandboxLimits,
) -> list[str]:
    """The limits the run hit, in words. Which limit stopped a program that exited with
    an error is read from its last stderr line (Python's own message for it)."""
    faults = []
    if capture.cancelled:
        faults.append("cancelled")
    if capture.truncated:
        faults.append(
            f"output truncated at {limits.output_bytes} bytes (the limit); the program was stopped"
        )
    if capture.timed_out:
        faults.append(f"timed out after {limits.wall_s:g} s")
    stopped_by_us = capture.cancelled or capture.truncated or capture.timed_out
    last_line = stderr.rstrip().rpartition("\n")[2]
    if killed_by == "SIGXCPU":
        faults.append(f"CPU time limit ({limits.cpu_s} s) exceeded")
    elif killed_by is not None and not stopped_by_us:
        faults.append(f"the program was killed by {killed_by}")
    elif returncode > 0 and last_line.startswith("MemoryError"):
        faults.append(f"memory limit ({limits.memory_mb} MB) exceeded")
    elif returncode > 0 and "[Errno 27]" in last_line:  # EFBIG: File too large
        faults.append(f"file size limit ({limits.file_mb} MB) exceeded")
    if (returncode != 0 or faults) and (
        refused_forks or (returncode > 0 and "[Errno 11]" in last_line)  # EAGAIN from fork
    ):
        faults.append(f"process limit ({limits.processes}) reached")
    return faults


# --- the pool and the tool ----------------------------------------------------------------


class Sandbox:
    """At most ``max_concurrent`` runs at once, each in a thread of the pool's own.

    Construction checks, with one short run, that the interpreter can be started as the
    sandbox user (raising SandboxError if not: as root, uid 65534 must be able to execute
    ``python`` and read its libraries; a Python under /root cannot be). ``python`` is the
    interpreter of the programs (default: this one, so they see the same packages)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        max_concurrent: int = 4,
        python: str | None = None,
    ) -> None:
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int):
            raise TypeError(f"max_concurrent must be an int: got {max_concurrent!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1: got {max_concurrent}")
        self.limits = limits or SandboxLimits()
        self.python = _interpreter(python or sys.executable)
        self.plan = HostPlan.probe(self.limits.network)
        self._slots = asyncio.Semaphore(max_concurrent)
        self._active = 0
        self._threads = ThreadPoolExecutor(max_concurrent, thread_name_prefix="sandbox")
        self._check()

    def _check(self) -> None:
        why_not = []
        if self.plan.uid is not None:
            why_not.append(f"as root, programs run as uid {self.plan.uid}")
        if self.plan.namespaces:
            why_not.append("the host's /tmp, /var/tmp and /dev/shm are not theirs to see")
        hint = (
            f"; {' and '.join(why_not)}: the interpreter and its libraries must be readable "
            "there; pass Sandbox(python=...) one that is (such as /usr/bin/python3)"
            if why_not
            else ""
        )
        try:
            result = run_code("print('ok')", self.limits, self.plan, self.python)
        except SandboxError as exc:
            raise SandboxError(f"{exc}{hint}") from None
        if result.stdout != "ok\n":
            why = result.error or result.stderr.strip()[-500:] or f"exit {result.exit_code}"
            raise SandboxError(f"the sandbox cannot run {self.python}: {why}{hint}")
        log.info("sandbox: %s", self.plan.describe())
        if not self.limits.network and not result.network_isolated:
            log.warning("sandbox: programs are NOT cut off from the network (no namespace here)")

    async def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a program; a cancel kills it before the slot is freed."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str: got {type(code).__name__}")
        async with self._slots:
            stop = threading.Event()
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(
                self._threads, run_code, code, self.limits, self.plan, self.python, stop
            )
            self._active += 1
            try:
                return await asyncio.shield(job)
            except asyncio.CancelledError:
                stop.set()
                await asyncio.wait([job])
                if not job.cancelled():  # retrieved: a failure while dying is not "unhandled"
                    job.exception()
                raise
            finally:
                self._active -= 1

    @property
    def active(self) -> int:
        """Runs holding a slot now (at most ``max_concurrent``); the others wait."""
        return self._active

    def close(self) -> None:
        """Wait for running programs' threads and stop the pool."""
        self._threads.shutdown(wait=True, cancel_futures=True)


def _interpreter(python: str) -> str:
    found = shutil.which(python)
    if found is None:
        raise SandboxError(f"no Python interpreter at {python!r}")
    return os.path.abspath(found)


def tool_text(result: SandboxResult) -> str:
    """What the model reads: stdout, then stderr, then ``Error: ...`` if a limit hit."""
    parts = [p if p.endswith("\n") else p + "\n" for p in (result.stdout, result.stderr) if p]
    if result.error:
        parts.append(f"Error: {result.error}\n")
    return "".join(parts)


class PythonTool:
    """The ``python`` tool: ``await tool(code)`` returns the program's output as text.

    A program that stops on a limit (time, memory, output, ...) raises ``ToolError`` whose
    text is what it printed plus ``Error: ...``: the caller sends that as the tool's
    message and counts it as a tool error. A program that raises an ordinary exception is
    not a tool error: its traceback is the text. The OpenAI function schema is
    ``transformers.utils.get_json_schema(tool.python)`` (or ``tool.__call__``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    async def python(self, code: str) -> str:
        """Run a Python 3 program and return what it printed.

        Each call is a fresh process in an empty temporary directory; nothing is kept.
        The program has no input and no network, and limits on time, memory and output.
        Print the values you want to see.

        Args:
            code: The complete Python program to run, for example "print(sum(range(10)))".

        Returns:
            The program's standard output, followed by its standard error if any.
        """
        result = await self.sandbox.run(code)
        text = tool_text(result)
        if result.error:
            raise ToolError(text)
        return text

    __call__ = python


def python_tool(max_concurrent: int = 4, python: str | None = None, **limits: object) -> PythonTool:
    """The ``python`` tool with a sandbox of its own, as a config names it::

        tools:
          - function: verl_async.tools.sandbox:python_tool
            args: {cpu_s: 5, wall_s: 10, memory_mb: 1024, python: /usr/bin/python3}

    ``limits`` are ``SandboxLimits``' fields; ``max_concurrent`` bounds its runs at once;
    ``python`` is the programs' interpreter (as root it must be one uid 65534 can run).
    Built once per generator, at start: a sandbox that cannot run fails there."""
    return PythonTool(Sandbox(SandboxLimits.from_mapping(limits), max_concurrent, python))
