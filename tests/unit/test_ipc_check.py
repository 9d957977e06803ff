"""benchmarks/ipc_check.py's report of a member process that dies: a real spawned child
killed by a fatal signal (no Python error anywhere) is reported with its signal and the
traceback faulthandler wrote, and the wait for its report ends when it is seen dead."""

import faulthandler
import importlib.util
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ipc_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # where a spawned child finds the module
    try:
        spec = importlib.util.spec_from_file_location("ipc_check", ROOT / "benchmarks/ipc_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["ipc_check"] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("ipc_check", None)


def _spawned(ipc_check, target, fault_path: Path):
    child = mp.get_context("spawn").Process(
        target=ipc_check.in_child, args=(str(fault_path), target)
    )
    child.start()
    return child


@pytest.mark.parametrize(
    ("target", "signal_name"), [(faulthandler._sigsegv, "SIGSEGV"), (os.abort, "SIGABRT")]
)
def test_a_member_killed_by_a_signal_is_reported_with_its_traceback(
    ipc_check, tmp_path, target, signal_name
):
    faults = tmp_path / "member_fault.txt"
    child = _spawned(ipc_check, target, faults)
    died = ipc_check.death_of(child, faults, wait_s=60)
    assert died is not None and died.startswith(f"signal {signal_name}; faulthandler: ")
    assert "Fatal Python error" in died and "in_child" in died  # the stack it died on


def test_a_clean_exit_is_no_death(ipc_check, tmp_path):
    faults = tmp_path / "member_fault.txt"
    child = _spawned(ipc_check, time.sleep, faults)  # sleep() with no argument: TypeError
    died = ipc_check.death_of(child, faults, wait_s=60)
    assert died == "exit code 1; no traceback was written"  # an exception, not a signal
    ok = mp.get_context("spawn").Process(target=ipc_check.in_child, args=(str(faults), print))
    ok.start()
    assert ipc_check.death_of(ok, faults, wait_s=60) is None


def test_waiting_for_a_dead_members_report_ends_when_it_is_seen_dead(ipc_check, tmp_path):
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    child = _spawned(ipc_check, faulthandler._sigsegv, tmp_path / "faults.txt")
    child.join(60)
    t0 = time.monotonic()
    with pytest.raises(ChildProcessError, match="exited before it reported"):
        ipc_check._get(reports, child, timeout_s=600)
    assert time.monotonic() - t0 < 60  # not the report's whole timeout
