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
   a minimal environment, and confines itself before it execs ``python -I -u main.py``:
   cgroup, network namespace, rlimits, uid 65534 when we are root, no new privileges
   (its docstring has the order and why);
4. the parent reads stdout and stderr as they come, keeping at most ``output_bytes`` of
   both together: the first byte over the cap, the wall-clock deadline or a cancel kills
   the run at once, so a flood never sits in our memory;
5. when the program's main process exits (or is killed) everything it started is killed:
   its process group, and its cgroup when it has one (a process that left the group
   with ``setsid`` is still in the cgroup). The main process is reaped only after these
   kills, so its pid (the group's id) cannot have been reused by then, and the run
   returns only once every killed process has exited;
6. the result says what happened; a limit that stopped the program is named in
   ``error`` (``SandboxResult.ok`` is False), never raised.

What runs the program depends on what we may do (``HostPlan.probe``); precisely what each
case protects against is in docs/security.md ("The Python sandbox"):

- as root: uid/gid 65534 (``nobody``), a fresh network namespace with only a loopback
  interface that is down, and a pids cgroup if one is writable; RLIMIT_NPROC as well
  (it counts every process of uid 65534 on the machine, so it is set to those that exist
  plus ``processes``: a backstop, the cgroup is the exact per-run bound);
- not root: the caller's own uid, no network namespace (``network_isolated=False``), and
  RLIMIT_NPROC alone (set the same way, counting the caller's own processes and threads).

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
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from verl_async.config_base import ConfigError
from verl_async.tools._sandbox_host import (
    CGROUP_PREFIX,
    SANDBOX_GID,
    HostPlan,
    PidsCgroup,
    live_group_members,
    signal_quietly,
    tasks_of,
)

log = logging.getLogger("verl_async.tools.sandbox")

CHILD = Path(__file__).with_name("_sandbox_child.py")
POLL_S = 0.1  # how often a run looks at its deadline and at a cancel
READ_CHUNK = 65536
REAP_S = 10.0  # how long a killed main process may take to die before we give up on it


class SandboxError(RuntimeError):
    """Our side failed (not the program): the interpreter cannot be run, setup failed."""


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

    @property
    def ok(self) -> bool:
        """The program ran to its end, exited 0 and hit no limit."""
        return self.exit_code == 0 and self.error is None


# --- one run ----------------------------------------------------------------------------


@dataclass
class _Capture:
    """What the supervisor collected while the program ran."""

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
        proc, status = _spawn(workdir, limits, plan, python, cgroup)
        kill = _killer(proc.pid, cgroup)
        capture = _Capture(room=limits.output_bytes)
        with proc, os.fdopen(status, "rb") as status_pipe:
            try:
                _supervise(proc, started + limits.wall_s, stop or threading.Event(), capture, kill)
            finally:
                kill()  # what is left; the main process is not reaped yet: its group id is ours
            returncode = _reap(proc)
            _wait_until_dead(proc.pid)
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
) -> tuple[subprocess.Popen, int]:
    """Start ``_sandbox_child.py``; the process and the read end of its status pipe."""
    # RLIMIT_NPROC counts the user's processes everywhere: those there now, plus the run's.
    # With a cgroup, twice the run's: pids.max then binds first (exact, and counted).
    allowance = limits.processes * (2 if cgroup else 1)
    nproc = tasks_of(plan.uid if plan.uid is not None else os.getuid()) + allowance
    read_end, write_end = os.pipe()
    spec = {
        "status_fd": write_end,
        "cgroup_procs": str(cgroup.procs) if cgroup else None,
        "unshare_net": plan.unshare_net,
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
            pass_fds=(write_end,),
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return proc, read_end


def _killer(pid: int, cgroup: PidsCgroup | None) -> Callable[[], None]:
    def kill() -> None:
        signal_quietly(os.killpg, pid)
        if cgroup is not None and not cgroup.kill():
            raise SandboxError(f"processes of cgroup {cgroup.path} survive SIGKILL")

    return kill


def _has_exited(pid: int) -> bool:
    """Whether the main process has exited, without reaping it (WNOWAIT)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    try:
        return os.waitid(os.P_PID, pid, flags) is not None
    except ChildProcessError:  # reaped by someone else (a child watcher that waits on -1)
        return True


def _supervise(
    proc: subprocess.Popen,
    deadline: float,
    stop: threading.Event,
    capture: _Capture,
    kill: Callable[[], None],
) -> None:
    """Read the output until the main process has exited and both pipes are closed.

    Kills the run at the deadline, at ``stop`` or at the first byte over the cap, and what
    the main process left behind as soon as it exits (which also closes the pipes those
    leftovers held)."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): capture.out, proc.stderr.fileno(): capture.err}
    exited = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        wake = _pidfd(proc.pid)  # readable at the main process's exit: no wait for POLL_S
        if wake is not None:
            selector.register(wake, selectors.EVENT_READ)
        try:
            while True:
                if not exited and _has_exited(proc.pid):
                    exited = True
                    kill()
                if exited and not any(fd in buffers for fd in selector.get_map()):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0 or stop.is_set():
                    capture.cancelled = stop.is_set()
                    capture.timed_out = not exited and not capture.cancelled
                    return kill()
                for key, _ in selector.select(min(POLL_S, remaining)):
                    if key.fd == wake:
                        selector.unregister(wake)  # the check at the loop's top sees the exit
                        continue
                    data = os.read(key.fd, READ_CHUNK)
                    if not data:
                        selector.unregister(key.fd)
                    elif not capture.keep(buffers[key.fd], data):
                        return kill()
        finally:
            if wake is not None:
                os.close(wake)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux before 5.3: the POLL_S checks suffice
        return None


def _reap(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"sandboxed process {proc.pid} did not die after SIGKILL") from None


def _wait_until_dead(pgid: int) -> None:
    """Return once no process of the group is alive: SIGKILL is delivered asynchronously,
    and a run ends only when its processes have. (Its group id stays ours while any
    member exists, so the repeated kill cannot reach another group.)"""
    give_up = time.monotonic() + REAP_S
    while live_group_members(pgid):
        if time.monotonic() > give_up:
            raise SandboxError(f"processes of group {pgid} survive SIGKILL")
        signal_quietly(os.killpg, pgid)
        time.sleep(0.005)


def _read_status(pipe, capture: _Capture) -> dict:
    """The child's report; raises SandboxError if it could not confine itself."""
    lines = [json.loads(line) for line in pipe.read().splitlines() if line.strip()]
    if not lines and (capture.timed_out or capture.cancelled):
        return {}  # we killed it while it was setting up
    if not lines:
        tail = capture.err.decode(errors="replace").strip()[-500:]
        raise SandboxError(f"the sandbox's child exited before confining itself: {tail}")
    failure = next((line["error"] for line in lines if "error" in line), None)
    if failure:
        raise SandboxError(f"the sandbox could not start the program: {failure}")
    if lines[0].get("network_error"):
        log.warning("no network namespace for a sandboxed run: %s", lines[0]["network_error"])
    return lines[0]


def _result(
    capture: _Capture,
    returncode: int,
    report: dict,
    refused_forks: int,
    limits: SandboxLimits,
    seconds: float,
) -> SandboxResult:
    stderr = capture.err.decode("utf-8", errors="replace")
    killed_by = signal.Signals(-returncode).name if returncode < 0 else None
    faults = _faults(capture, returncode, killed_by, stderr, refused_forks, limits)
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
    )


def _faults(
    capture: _Capture,
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
        hint = ""
        if self.plan.uid is not None:
            hint = (
                f"; as root, programs run as uid {self.plan.uid}, which must be able to execute "
                "the interpreter and read its libraries: pass Sandbox(python=...) one it can "
                "(such as /usr/bin/python3)"
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
            log.warning("sandbox: programs are NOT cut off from the network (not root)")

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
