"""The Python sandbox contains what the model's code does: real child processes, small
limits (CPU 1-2 s, wall 1-5 s), each fault reported and nothing left behind.

As root the programs run as uid 65534, which cannot execute a Python installed under
/root: the ``interpreter`` fixture then falls back to /usr/bin/python3. The tests of what
a run leaves behind run under each plan this host allows and the weaker ones forced
(``plan_changes``): as probed, without a pids cgroup, and without namespaces either (the
subreaper's sweep), and once as a user other than root (a subprocess as uid 65534). The
program's processes are found by a marker in their command line or name, never by pid
(inside a PID namespace a pid means nothing on the host)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from verl_async.config_base import ConfigError
from verl_async.tools._sandbox_host import (
    SANDBOX_GID,
    SANDBOX_UID,
    HostPlan,
    pids_cgroup_candidates,
)
from verl_async.tools.sandbox import (
    PythonTool,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    ToolError,
)

ROOT = os.geteuid() == 0
RUN_UID = SANDBOX_UID if ROOT else os.getuid()
SMALL = dict(cpu_s=2, wall_s=5.0, memory_mb=256, file_mb=8, processes=8, output_bytes=4096)
REPO = Path(__file__).resolve().parents[2]
PLANS = {
    "as probed": {},
    "no cgroup": {"cgroup_parent": None, "cgroup_version": 0},
    "no cgroup, no namespaces": {"cgroup_parent": None, "cgroup_version": 0, "namespaces": False},
}


@pytest.fixture(scope="module")
def interpreter() -> str:
    """This Python if the sandbox user can run it, else the system's."""
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            Sandbox(SandboxLimits(**SMALL), python=python).close()
            return python
        except SandboxError:
            continue
    pytest.skip("no Python interpreter that the sandbox user can run")


@pytest.fixture
def shared():
    """A directory the programs may write (tmp_path's parents are closed to uid 65534)."""
    path = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(path, 0o777)
    yield Path(path)
    shutil.rmtree(path)


@pytest.fixture(params=list(PLANS))
def plan_changes(request) -> dict:
    """The plan as probed, then with what it may have taken away (a host without a
    writable pids cgroup, a container without CAP_SYS_ADMIN)."""
    return PLANS[request.param]


@pytest.fixture
def marker():
    """A name for the program's processes (in their command line, or as their name, at
    most 15 bytes) and files; at the end anything still alive with it is killed and its
    files in /tmp and /dev/shm are removed, so that a failing test leaves nothing."""
    name = f"vs{uuid.uuid4().hex[:12]}"
    yield name
    for pid in alive_with(name):
        os.kill(pid, 9)
    for path in (Path("/tmp", f"{name}.tmp"), Path("/dev/shm", f"{name}.shm")):
        path.unlink(missing_ok=True)


def make(
    interpreter: str, max_concurrent: int = 1, plan_changes: dict | None = None, **limits
) -> Sandbox:
    sandbox = Sandbox(SandboxLimits(**{**SMALL, **limits}), max_concurrent, python=interpreter)
    sandbox.plan = dataclasses.replace(sandbox.plan, **(plan_changes or {}))
    return sandbox


def run(interpreter: str, code: str, **limits) -> SandboxResult:
    sandbox = make(interpreter, **limits)
    try:
        return asyncio.run(sandbox.run(code))
    finally:
        sandbox.close()


def alive_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line or name holds ``marker``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            name, _, rest = stat.partition("(")[2].rpartition(")")
            held = marker in name or marker.encode() in cmdline
            if held and rest.split()[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


NAME_ITSELF = "import ctypes\nctypes.CDLL(None).prctl(15, {marker!r}.encode(), 0, 0, 0)\n"
"""The program's first lines: PR_SET_NAME, inherited by every process it forks."""


# --- limits and set-up ------------------------------------------------------------------


def test_limits_refuse_bad_values_naming_the_field():
    with pytest.raises(ConfigError, match="'cpu_s'"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ConfigError, match="'wall_s'"):
        SandboxLimits(wall_s=-1.0)
    with pytest.raises(ConfigError, match="'memory_mb'"):
        SandboxLimits(memory_mb=1.5)
    with pytest.raises(ConfigError, match="'network'"):
        SandboxLimits(network="no")
    with pytest.raises(ConfigError, match="unknown sandbox limit 'cpu'"):
        SandboxLimits.from_mapping({"cpu": 3})
    assert SandboxLimits.from_mapping({"cpu_s": 3, "wall_s": 4}) == SandboxLimits(cpu_s=3, wall_s=4)


def test_cgroup_candidates_from_proc_files():
    mounts = (
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
        "cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0\n"
        "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
    )
    membership = "8:pids:/job\n4:memory:/other\n0::/user.slice/me\n"
    assert pids_cgroup_candidates(mounts, membership) == [
        (Path("/sys/fs/cgroup/unified/user.slice/me"), 2),
        (Path("/sys/fs/cgroup/pids/job"), 1),
    ]
    assert pids_cgroup_candidates("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", "0::/\n") == [
        (Path("/sys/fs/cgroup"), 2)
    ]
    assert pids_cgroup_candidates("proc /proc proc rw 0 0\n", "0::/\n") == []


def test_an_interpreter_that_cannot_start_fails_at_construction(shared):
    with pytest.raises(SandboxError, match="no Python interpreter at '/nonexistent/python'"):
        Sandbox(python="/nonexistent/python")
    with pytest.raises(SandboxError, match="the sandbox cannot run /bin/false: exit 1"):
        Sandbox(python="/bin/false")
    fake = shared / "python"  # under /tmp, which a program with namespaces does not see
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    if HostPlan.probe(network=False).namespaces:
        with pytest.raises(SandboxError, match="No such file.*/tmp, /var/tmp and /dev/shm"):
            Sandbox(python=str(fake))
    else:
        with pytest.raises(SandboxError, match=f"the sandbox cannot run {fake}: exit 3"):
            Sandbox(python=str(fake))


def test_misuse_raises(interpreter):
    sandbox = make(interpreter)
    with pytest.raises(TypeError, match="code must be a str"):
        asyncio.run(sandbox.run(b"print(1)"))  # type: ignore[arg-type]
    sandbox.close()
    with pytest.raises(ValueError, match="max_concurrent"):
        Sandbox(max_concurrent=0)


# --- ordinary programs ------------------------------------------------------------------


def test_ordinary_output(interpreter):
    code = """
import os
print(sum(range(10)))
print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd() == os.environ["HOME"])
status = dict(line.split(":\t") for line in open("/proc/self/status").read().splitlines())
print(status["NoNewPrivs"], status["CapEff"])
"""
    result = run(interpreter, code)
    assert result.ok, result
    gid, groups = (SANDBOX_GID, []) if ROOT else (os.getgid(), os.getgroups())
    assert result.stdout == f"45\n{RUN_UID} {gid} {groups} True\n1 0000000000000000\n"
    assert (result.stderr, result.exit_code, result.signal, result.error) == ("", 0, None, None)
    assert not result.timed_out and not result.truncated
    assert result.network_isolated == ROOT
    assert result.namespaces == HostPlan.probe(network=False).namespaces
    assert result.left_behind == 0


def test_an_exception_is_the_programs_output_not_a_fault(interpreter):
    result = run(interpreter, "print('before')\n1 / 0")
    assert (result.exit_code, result.error, result.ok) == (1, None, False)
    assert result.stdout == "before\n"
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_the_working_directory_is_removed(interpreter):
    result = run(interpreter, "import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    workdir = Path(result.stdout.strip())
    assert result.ok and workdir.name.startswith("verl-async-sandbox-")
    assert not workdir.exists()


def test_with_namespaces_it_sees_only_its_processes_and_a_private_bounded_tmp(interpreter, marker):
    sandbox = make(interpreter, tmp_mb=4)
    if not sandbox.plan.namespaces:
        sandbox.close()
        pytest.skip("PID and mount namespaces need root with CAP_SYS_ADMIN")
    code = f"""
import errno, os
print(os.getpid(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print(os.listdir("/tmp") == [os.path.basename(os.getcwd())])
print(os.path.samefile("/tmp", "/dev/shm"), os.path.samefile("/tmp", "/var/tmp"))
try:
    with open("/dev/shm/{marker}.shm", "wb") as f:
        for _ in range(6):
            f.write(bytes(2**20))
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""
    result = asyncio.run(sandbox.run(code))
    sandbox.close()
    assert result.namespaces and result.exit_code == 0, result
    # PID 2 under its init, /proc of its own; 4 MB (tmp_mb) for all of /tmp, /dev/shm
    assert result.stdout == "2 [1, 2]\nTrue\nTrue True\nENOSPC\n"
    assert not Path("/dev/shm", f"{marker}.shm").exists()


# --- limits hit -------------------------------------------------------------------------


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(interpreter):
    result = run(interpreter, "while True:\n    pass", cpu_s=1)
    assert result.signal == "SIGXCPU" and result.exit_code is None
    assert result.error == "CPU time limit (1 s) exceeded"
    assert not result.timed_out


def test_a_sleeping_program_is_stopped_by_the_wall_clock(interpreter):
    result = run(interpreter, "import time\nprint('start')\ntime.sleep(100)", wall_s=1.0)
    assert result.timed_out and result.signal == "SIGKILL"
    assert result.error == "timed out after 1 s"
    assert result.stdout == "start\n"  # unbuffered: what was printed before the kill is kept
    assert 1.0 <= result.seconds < 5.0


def test_a_fork_bomb_is_contained_and_leaves_nothing(interpreter, plan_changes, marker):
    """Every process of it leaves the process group (``setsid``): only the cgroup, the PID
    namespace or the sweep can end them. Each prints its pid (of its namespace, if any)."""
    code = (
        NAME_ITSELF.format(marker=marker)
        + """
import os, time
print(os.getpid(), flush=True)
while True:
    try:
        if os.fork() == 0:
            os.setsid()
            print(os.getpid(), flush=True)
    except OSError:
        time.sleep(0.01)
"""
    )
    sandbox = make(interpreter, plan_changes=plan_changes, wall_s=2.0)
    result = asyncio.run(sandbox.run(code))
    sandbox.close()
    assert result.timed_out and "timed out after 2 s" in result.error
    started = result.stdout.split()
    assert len(started) >= 2  # it did fork
    if ROOT:  # uid 65534 has no processes but these here: RLIMIT_NPROC is exact too
        assert len(set(started)) <= SMALL["processes"]
    if sandbox.plan.cgroup_parent is not None:  # pids.events counts refusals
        assert "process limit (8) reached" in result.error
    assert alive_with(marker) == []  # at once: the run returns only once all are dead
    assert subprocess.run(["true"], timeout=10).returncode == 0
    assert run(interpreter, "print('still fine')").stdout == "still fine\n"


def test_a_huge_allocation_is_a_memory_error(interpreter):
    result = run(interpreter, "data = bytearray(10**10)")
    assert result.error == "memory limit (256 MB) exceeded"
    assert result.stderr.rstrip().endswith("MemoryError")


def test_a_huge_print_is_capped_while_reading(interpreter):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    result = run(interpreter, "print('x' * 10**8)", memory_mb=512)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert result.truncated and result.stdout == "x" * 4096
    assert result.error == "output truncated at 4096 bytes (the limit); the program was stopped"
    assert grown_mb < 50  # 100 MB went through the pipe, never into our memory


def test_printing_forever_is_stopped_at_the_cap_not_at_the_deadline(interpreter):
    result = run(interpreter, "while True:\n    print('y' * 100)", wall_s=30.0)
    assert result.truncated and not result.timed_out
    assert len(result.stdout) == 4096 and result.stderr == ""
    assert result.seconds < 30.0


def test_a_1_gb_file_stops_at_the_file_size_limit(interpreter):
    code = """
import os
try:
    with open("big", "wb") as f:
        for _ in range(1024):
            f.write(bytes(2**20))
finally:
    print(os.path.getsize("big"))
"""
    result = run(interpreter, code)
    assert int(result.stdout) <= 8 * 2**20
    assert result.error == "file size limit (8 MB) exceeded"
    assert "File too large" in result.stderr


# --- network ----------------------------------------------------------------------------

PROBE_NETWORK = """
import json, socket
def attempt(address):
    try:
        socket.create_connection(address, timeout=2).close()
        return "connected"
    except OSError as exc:
        return exc.errno
print(json.dumps({{
    "loopback": attempt(("127.0.0.1", {port})),
    "outside": attempt(("203.0.113.1", 80)),
    "interfaces": [name for _, name in socket.if_nameindex()],
}}))
"""


def test_no_network_as_root(interpreter, free_port):
    with socket.create_server(("127.0.0.1", free_port())) as listener:
        listener.setblocking(False)
        code = PROBE_NETWORK.format(port=listener.getsockname()[1])
        result = run(interpreter, code)
        if not ROOT:
            assert not result.network_isolated
            pytest.skip("a network namespace needs root; this run is not isolated (reported)")
        seen = json.loads(result.stdout)
        assert result.network_isolated
        assert seen == {
            "loopback": errno.ENETUNREACH,
            "outside": errno.ENETUNREACH,
            "interfaces": ["lo"],
        }
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing arrived
        # The same probe with network: true reaches the listener: the test can tell.
        opened = run(interpreter, code, network=True)
        assert not opened.network_isolated
        assert json.loads(opened.stdout)["loopback"] == "connected"


# --- the pool and clean-up ------------------------------------------------------------

WAIT_FOR_GO = """
import os, time
me = os.path.basename(os.getcwd())  # unique per run (a pid is not: 2 in every namespace)
open(os.path.join({shared!r}, "start-" + me), "w").close()
while not os.path.exists(os.path.join({shared!r}, "go-" + me)):
    time.sleep(0.005)
print(me)
"""


def test_the_pool_runs_at_most_max_concurrent(interpreter, shared):
    """Once the four tasks have had a turn, two hold a slot and two wait: a fact of the
    event loop, not of timing. Each program then blocks until the test releases it, so
    the programs alive at once (counted by their marker files) must reach 2 and never
    pass it."""

    async def drive() -> tuple[int, list[SandboxResult]]:
        # The files it shares with the programs are in /tmp: no namespaces (private /tmp).
        no_namespaces = {"namespaces": False}
        sandbox = make(interpreter, 2, plan_changes=no_namespaces, wall_s=30.0)
        code = WAIT_FOR_GO.format(shared=str(shared))
        runs = [asyncio.create_task(sandbox.run(code)) for _ in range(4)]
        await asyncio.sleep(0)
        assert sandbox.active == 2
        released: set[str] = set()
        peak, give_up = 0, time.monotonic() + 25
        while len(released) < 4:
            assert time.monotonic() < give_up, f"only {len(released)} runs got a slot"
            started = {n[6:] for n in os.listdir(shared) if n.startswith("start-")}
            alive = started - released
            peak = max(peak, len(alive))
            assert len(alive) <= 2 and sandbox.active <= 2, f"{len(alive)} ran at once"
            if len(alive) == 2 or (len(started) == 4 and alive):
                pid = min(alive)
                (shared / f"go-{pid}").touch()
                released.add(pid)
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*runs)
        sandbox.close()
        return peak, results

    peak, results = asyncio.run(drive())
    assert peak == 2
    assert all(r.ok for r in results)
    assert sorted(r.stdout.strip() for r in results) == sorted(
        n[6:] for n in os.listdir(shared) if n.startswith("start-")
    )


ESCAPE = """
import os, subprocess, sys
sleeper = [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}]
subprocess.Popen(sleeper)  # stays in the process group
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()  # a session of its own: out of the process group
    with open("/tmp/{marker}.tmp", "w") as f:
        f.write("left behind")
    with open("/dev/shm/{marker}.shm", "wb") as f:
        f.write(bytes(2**20))
    os.write(w, b"ready")
    os.execv(sys.executable, sleeper)
os.read(r, 5)
print(os.path.getsize("/dev/shm/{marker}.shm"))
"""
"""Two children left running, one of them in a session of its own, with files in /tmp and
/dev/shm; the main process exits at once."""


def check_nothing_left(result: SandboxResult, marker: str, wall_s: float) -> None:
    assert result.stdout == f"{2**20}\n", result
    assert result.seconds < wall_s / 2  # at the main process's exit, not at the deadline
    assert not result.timed_out
    assert alive_with(marker) == []  # at once: the run returns only once all are dead
    assert result.left_behind == 2 and result.exit_code == 0
    assert result.error == "the program left 2 processes running when it exited; they were killed"
    if result.namespaces:  # /tmp and /dev/shm were its own
        assert not Path("/tmp", f"{marker}.tmp").exists()
        assert not Path("/dev/shm", f"{marker}.shm").exists()


def test_no_process_outlives_its_run_nor_its_files(interpreter, plan_changes, marker):
    sandbox = make(interpreter, plan_changes=plan_changes, wall_s=30.0)
    result = asyncio.run(sandbox.run(ESCAPE.format(marker=marker)))
    sandbox.close()
    check_nothing_left(result, marker, 30.0)
    assert result.namespaces == sandbox.plan.namespaces


NOT_ROOT = """
import asyncio, dataclasses, json, sys
from verl_async.tools.sandbox import Sandbox, SandboxLimits
sandbox = Sandbox(SandboxLimits(wall_s=30.0, memory_mb=512), python=sys.executable)
result = asyncio.run(sandbox.run(sys.argv[1]))
sandbox.close()
print(json.dumps(dataclasses.asdict(result)))
"""


def test_not_root_the_sweep_ends_what_the_program_left(marker):
    """The whole sandbox as uid 65534: no namespaces, no cgroup, the subreaper's sweep."""
    if not ROOT or shutil.which("setpriv") is None:
        pytest.skip("runs the sandbox as another user: needs root and setpriv")
    as_nobody = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_GID}", "--clear-groups"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{sysconfig.get_path('purelib')}"}
    for python in (sys.executable, "/usr/bin/python3"):
        check = "import shutil, sys, verl_async.tools.sandbox\nassert shutil.which(sys.executable)"
        command = [*as_nobody, python, "-c", check]
        if subprocess.run(command, env=env, capture_output=True, timeout=60).returncode == 0:
            break
    else:
        pytest.skip("uid 65534 cannot import this package with any interpreter here")
    code = ESCAPE.format(marker=marker)
    done = subprocess.run(
        [*as_nobody, python, "-c", NOT_ROOT, code],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    check_nothing_left(SandboxResult(**result), marker, 30.0)
    assert not result["namespaces"] and not result["network_isolated"]


def test_a_cancelled_run_kills_its_program(interpreter, plan_changes, marker):
    code = NAME_ITSELF.format(marker=marker) + "import time\ntime.sleep(60)"

    async def drive() -> list[int]:
        sandbox = make(interpreter, plan_changes=plan_changes, wall_s=30.0)
        task = asyncio.create_task(sandbox.run(code))
        give_up = time.monotonic() + 20
        while not alive_with(marker):  # it has started and named itself
            assert time.monotonic() < give_up and not task.done()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        alive = alive_with(marker)  # at once: the cancel returns only once it is dead
        sandbox.close()
        return alive

    assert asyncio.run(drive()) == []


# --- the tool -----------------------------------------------------------------------------


def test_the_tool_returns_output_and_raises_on_a_limit(interpreter):
    async def drive():
        tool = PythonTool(make(interpreter, wall_s=1.0))
        ok = await tool("print(6 * 7)")
        traceback = await tool("import sys\nprint('half')\nsys.exit('bad input')")
        with pytest.raises(ToolError) as raised:
            await tool("import time\nprint('waiting')\ntime.sleep(10)")
        tool.sandbox.close()
        return ok, traceback, str(raised.value)

    ok, traceback, error = asyncio.run(drive())
    assert ok == "42\n"
    assert traceback == "half\nbad input\n"
    assert error == "waiting\nError: timed out after 1 s\n"


def test_the_tool_schema_comes_from_its_signature(interpreter):
    from transformers.utils import get_json_schema

    tool = PythonTool(make(interpreter))
    for function in (tool.python, tool.__call__):
        schema = get_json_schema(function)["function"]
        assert schema["name"] == "python"
        assert schema["description"].startswith("Run a Python 3 program")
        assert schema["parameters"]["required"] == ["code"]
        assert list(schema["parameters"]["properties"]) == ["code"]
        assert schema["parameters"]["properties"]["code"]["type"] == "string"
    tool.sandbox.close()
