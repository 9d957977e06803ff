"""A run's processes die with whoever started them, and a run directory holds one live run
(verl_async/lifetime.py), with real processes: a few small Python children each."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verl_async.lifetime import (
    TETHER_PID,
    RunDirInUse,
    claim_run_dir,
    exiting,
    tethered,
)

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` has left (or is a zombie, dead and waiting to be reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _middle(child_code: str) -> subprocess.Popen:
    """A process that starts ``child_code`` tethered to itself, prints the child's pid,
    and sleeps (the test SIGKILLs it, as a launcher killed with -9)."""
    return _python(f"""
        import subprocess, sys, time
        from verl_async.lifetime import tethered
        child = subprocess.Popen(tethered([sys.executable, "-c", {child_code!r}]))
        print(child.pid, flush=True)
        time.sleep(600)
    """)


def test_a_tethered_child_dies_with_the_process_that_started_it():
    """The parent-death signal is asked for before the command runs: the child here
    never asks for it itself (as torchrun never does)."""
    middle = _middle("import time; time.sleep(600)")
    child = int(middle.stdout.readline())
    assert not _gone(child, 0.5)
    middle.kill()
    middle.wait()
    assert _gone(child, 10), "the child outlived its SIGKILLed parent"


def test_the_tether_keeps_the_pid_and_names_it_for_the_command():
    out = subprocess.run(
        tethered(
            [sys.executable, "-c", f"import os; print(os.getpid(), os.environ['{TETHER_PID}'])"]
        ),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == out[1]


def test_a_child_whose_tethered_parent_is_already_gone_exits_at_start_up():
    """A rank started by a torchrun that died before the rank asked for the signal."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    code = "from verl_async.lifetime import die_with_parent; die_with_parent(); print('ran')"
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, TETHER_PID: str(dead.pid)},
        capture_output=True,
        text=True,
    )
    assert (res.returncode, res.stdout) == (1, "")
    alive = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert alive.stdout == "ran\n"


def test_an_orphan_that_ignores_sigterm_is_killed_after_the_grace():
    """SIGTERM cannot stop a process whose main thread is held by native code (or that
    ignores it): its own watcher kills it once the parent is gone."""
    stubborn = """
import signal, time
from verl_async.lifetime import die_with_parent
signal.signal(signal.SIGTERM, signal.SIG_IGN)
die_with_parent(grace_s=5.0)
print("ready", flush=True)
time.sleep(600)
"""
    middle = _python(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {stubborn!r}])
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    lines = {middle.stdout.readline().strip() for _ in range(2)}  # the child shares stdout
    lines.discard("ready")  # the child has asked for the signal and ignores SIGTERM
    child = int(lines.pop())
    middle.kill()
    middle.wait()
    assert not _gone(child, 0.5)  # SIGTERM came and was ignored; the grace runs
    assert _gone(child, 60), "the orphan was not killed after its grace"


def test_a_second_launcher_is_refused_while_the_first_holds_the_run_dir(tmp_path):
    first = claim_run_dir(tmp_path / "run")
    with pytest.raises(RunDirInUse, match="in use by a live run: its launcher still runs"):
        claim_run_dir(tmp_path / "run")
    first.release()
    claim_run_dir(tmp_path / "run").release()


def test_a_role_left_of_a_dead_launcher_keeps_the_run_dir_taken(tmp_path):
    """A role shares the directory with its launcher; once the launcher is gone, a role
    of its run still running keeps any new run out, until it dies too."""
    run_dir = tmp_path / "run"
    launcher = claim_run_dir(run_dir)
    role = _python(f"""
        import time
        from verl_async.lifetime import hold_run_dir
        hold_run_dir({str(run_dir)!r})
        print("holding", flush=True)
        time.sleep(600)
    """)
    try:
        assert role.stdout.readline() == "holding\n"  # beside its launcher's claim
        launcher.release()  # the launcher died
        with pytest.raises(
            RunDirInUse, match=f"a process of it still runs \\(process {role.pid}\\)"
        ):
            claim_run_dir(run_dir, wait_s=0.5)  # the role lives on past the wait
    finally:
        role.send_signal(signal.SIGKILL)
        role.wait()
    claim_run_dir(run_dir).release()  # it died: the directory is free again


def _role_holding(run_dir: Path, then: str) -> subprocess.Popen:
    """A process holding ``run_dir`` the way a role does (``hold_run_dir``), which prints
    "holding" and then runs ``then``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return _python(f"""
        import time
        from verl_async.lifetime import hold_run_dir
        hold_run_dir({str(run_dir)!r})
        print("holding", flush=True)
        {then}
    """)


def test_a_claim_waits_for_the_roles_of_a_run_whose_launcher_is_gone(tmp_path, caplog):
    """``--resume`` right after a run was killed: its roles are still on their way out
    (here one that takes a second). The claim waits for them, says so, and succeeds."""
    run_dir = tmp_path / "run"
    role = _role_holding(run_dir, "time.sleep(1.0)")
    try:
        assert role.stdout.readline() == "holding\n"
        with caplog.at_level(logging.INFO, logger="verl_async.lifetime"):
            lock = claim_run_dir(run_dir)  # the default wait, 10 s
    finally:
        role.kill()
        role.wait()
    lock.release()
    said = [r.getMessage() for r in caplog.records if r.name == "verl_async.lifetime"]
    assert len(said) == 1 and "waiting up to 10 s" in said[0] and str(role.pid) in said[0]


def test_a_role_that_outlives_the_wait_is_refused_with_the_same_sentence(tmp_path):
    run_dir = tmp_path / "run"
    role = _role_holding(run_dir, "time.sleep(600)")
    try:
        assert role.stdout.readline() == "holding\n"
        t0 = time.monotonic()
        with pytest.raises(
            RunDirInUse,
            match=f"in use by a live run: a process of it still runs \\(process {role.pid}\\)",
        ):
            claim_run_dir(run_dir, wait_s=1.0, say=lambda line: None)
        assert time.monotonic() - t0 >= 1.0
    finally:
        role.kill()
        role.wait()


def test_a_live_launcher_is_refused_at_once_without_waiting(tmp_path):
    run_dir = tmp_path / "run"
    launcher = _python(f"""
        import time
        from pathlib import Path
        from verl_async.lifetime import claim_run_dir
        lock = claim_run_dir(Path({str(run_dir)!r}))
        print("claimed", flush=True)
        time.sleep(600)
    """)
    said: list[str] = []
    try:
        assert launcher.stdout.readline() == "claimed\n"
        t0 = time.monotonic()
        with pytest.raises(RunDirInUse, match="its launcher still runs"):
            claim_run_dir(run_dir, wait_s=60.0, say=said.append)
        assert time.monotonic() - t0 < 30.0 and not said  # no wait for a live launcher
    finally:
        launcher.kill()
        launcher.wait()


def test_exiting_tells_a_zombie_and_a_gone_process_from_a_live_one():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert _gone(child.pid, 60)  # a zombie until waited for
    assert exiting(child.pid)
    child.wait()
    assert exiting(child.pid)  # gone
    assert not exiting(os.getpid())


def test_a_stopped_role_ignores_a_second_stop_signal_even_in_its_exit_handlers():
    """A learner's stop often comes twice (the launcher signals it again once a checkpoint
    write has committed; Ctrl-C reaches torchrun and every rank, and torchrun passes it on):
    the first unwinds the loop, a later one, here while an exit handler runs, is ignored
    instead of coming out of it as a KeyboardInterrupt traceback."""
    proc = _python(
        """
        import atexit, signal, sys
        from learners.setup import stop_on_signals

        def leave():
            print("exiting", flush=True)
            sys.stdin.readline()  # the second signal lands while this waits

        atexit.register(leave)
        stop_on_signals()
        try:
            print("ready", flush=True)  # inside: the stop may come right after it
            sys.stdin.readline()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(130) from None
        """,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)  # the launcher's stop
    assert proc.stdout.readline() == "interrupted\n"
    assert proc.stdout.readline() == "exiting\n"
    proc.send_signal(signal.SIGINT)  # the same stop again, through another way
    out, err = proc.communicate("go on\n", timeout=30)
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_process_tied_to_its_grandparent_ends_with_it_and_takes_the_parent_along():
    """The shape of a vLLM engine under a generator: generator -> engine core -> worker.
    The worker ties itself to the generator (``die_with``); the generator is SIGKILLed
    while the worker's main thread is blocked and the engine core ignores SIGTERM: both
    must be gone at once, not after any grace."""
    worker = textwrap.dedent("""
        import os, sys, time
        from verl_async.lifetime import die_with
        die_with(int(sys.argv[1]))
        print(os.getpid(), flush=True)
        time.sleep(600)  # blocked, as in a broadcast that never completes
    """)
    core = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", {worker!r}, str(os.getppid())])
        time.sleep(600)
    """)
    generator = _python(f"""
        import subprocess, sys, time
        core = subprocess.Popen([sys.executable, "-c", {core!r}])
        print(core.pid, flush=True)
        time.sleep(600)
    """)
    core_pid = int(generator.stdout.readline())
    worker_pid = int(generator.stdout.readline())
    generator.send_signal(signal.SIGKILL)
    generator.wait()
    assert _gone(worker_pid, timeout_s=10) and _gone(core_pid, timeout_s=10)
