"""The Python sandbox contains what the model's code does: real child processes, small
limits (CPU 1-2 s, wall 1-5 s), each fault reported and nothing left behind.

As root the programs run as uid 65534, which cannot execute a Python installed under
/root: the ``interpreter`` fixture then falls back to /usr/bin/python3."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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


def make(interpreter: str, max_concurrent: int = 1, **limits) -> Sandbox:
    return Sandbox(SandboxLimits(**{**SMALL, **limits}), max_concurrent, python=interpreter)


def run(interpreter: str, code: str, **limits) -> SandboxResult:
    sandbox = make(interpreter, **limits)
    try:
        return asyncio.run(sandbox.run(code))
    finally:
        sandbox.close()


def running(pid: int) -> bool:
    """A live process (not a zombie) with this pid that belongs to the sandbox's user."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uid = Path(f"/proc/{pid}").stat().st_uid
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z" and uid == RUN_UID


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
    fake = shared / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
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


def test_a_fork_bomb_is_contained_and_leaves_nothing(interpreter, shared):
    pids = shared / "pids"
    code = f"""
import os, time
def note():
    with open({str(pids)!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
note()
while True:
    try:
        if os.fork() == 0:
            note()
    except OSError:
        time.sleep(0.01)
"""
    result = run(interpreter, code, wall_s=2.0)
    assert result.timed_out and "timed out after 2 s" in result.error
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) >= 2  # it did fork
    if ROOT:  # uid 65534 has no processes but these here: RLIMIT_NPROC is exact too
        assert len(started) <= SMALL["processes"]
    if HostPlan.probe(network=False).cgroup_parent is not None:  # pids.events counts refusals
        assert "process limit (8) reached" in result.error
    assert not [pid for pid in started if running(pid)]
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
me = str(os.getpid())
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
        sandbox = make(interpreter, max_concurrent=2, wall_s=30.0)
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


def test_no_process_outlives_its_run(interpreter, shared):
    """A child left running in the group, and (with a cgroup) one that left the group."""
    sandbox = make(interpreter)
    escape = sandbox.plan.cgroup_parent is not None
    code = f"""
import os, subprocess
pids = [subprocess.Popen(["sleep", "60"]).pid]
if {escape}:
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()  # a new session: out of the process group
        os.write(w, str(os.getpid()).encode())
        os.execvp("sleep", ["sleep", "60"])
    pids.append(int(os.read(r, 20)))
print(" ".join(map(str, pids)))
"""
    result = asyncio.run(sandbox.run(code))
    sandbox.close()
    pids = [int(p) for p in result.stdout.split()]
    assert result.ok and len(pids) == 1 + escape
    assert result.seconds < SMALL["wall_s"]  # killed at the main process's exit, no wait
    assert not [pid for pid in pids if running(pid)]


def test_a_cancelled_run_kills_its_program(interpreter, shared):
    pid_file = shared / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"

    async def drive() -> tuple[int, bool]:
        sandbox = make(interpreter, wall_s=30.0)
        task = asyncio.create_task(sandbox.run(code))
        give_up = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < give_up and not task.done()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pid = int(pid_file.read_text())
        alive = running(pid)  # at once: the cancel returns only once the program is dead
        sandbox.close()
        return pid, alive

    pid, alive = asyncio.run(drive())
    assert not alive and not running(pid)


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
