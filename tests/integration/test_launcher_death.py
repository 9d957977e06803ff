"""A SIGKILLed launcher leaves nothing running, and a run directory in use is refused.

A real tiny run with two learner ranks (torch.distributed.run) is held at its first
update (tests/slow_learner.py ``--gate``). While it lives, a second ``verl-async train``
in its directory, new or ``--resume``, is refused with one sentence. Then the launcher
alone is SIGKILLed: torchrun, both ranks, the buffer and the generator must all be gone
within a deadline (before this, torchrun and its ranks stayed, still writing into the
run directory), and the directory is free again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from verl_async.lifetime import RUN_LOCK, claim_run_dir, holders

from .conftest import cmdline, launch_gated, process_tree, processes_mentioning, run_cli, wait_for

DEADLINE_S = 60.0  # SIGTERM at the launcher's death; torchrun stops its ranks in seconds


def _reached_first_batch(run_dir: Path) -> bool:
    path = run_dir / "startup.jsonl"
    if not path.is_file():
        return False
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return any(e["role"] == "learner" and e["event"] == "first batch" for e in events)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _left(run_dir: Path, started: list[int]) -> dict[int, str]:
    """What is left of the run: its processes alive, and any process still holding its
    run directory's lock (a process exits fully only once its files are closed)."""
    pids = [p for p in started if _alive(p)] + holders(run_dir / RUN_LOCK)
    return {p: cmdline(p)[:200] for p in sorted(set(pids))}


def test_a_killed_launcher_leaves_nothing_and_its_run_dir_is_refused_while_it_lives(tmp_path):
    run_dir, gate, out = tmp_path / "run", tmp_path / "gate", tmp_path / "out.log"
    args = [
        "train", "configs/tiny.yaml", "--run-dir", str(run_dir),
        "placement.learners=[cpu, cpu]", "checkpoint.every_steps=0", "eval.every_steps=0",
    ]  # fmt: skip
    launcher = launch_gated(args, gate, out)
    started: list[int] = []
    try:
        wait_for(launcher, lambda: _reached_first_batch(run_dir), "the first batch", out)
        started = [p for p in process_tree(launcher.pid) if p != launcher.pid]
        ranks = [p for p in started if "-m tests.slow_learner" in cmdline(p)]
        assert len(ranks) == 3, [cmdline(p) for p in started]  # torchrun and its two ranks

        for again in (args[:4], ["train", "--resume", str(run_dir)]):
            res = run_cli(again, timeout=120)
            assert res.returncode == 1, res.stderr[-2000:]
            assert f"run directory '{run_dir}' is in use by a live run" in res.stderr

        started = [p for p in process_tree(launcher.pid) if p != launcher.pid]  # late ones too
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + DEADLINE_S
        while (left := _left(run_dir, started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"outlived the launcher: {left}"
        assert not processes_mentioning(str(run_dir))
        claim_run_dir(run_dir).release()  # the run is over: the directory is free
    finally:
        for pid in [launcher.pid, *started]:  # only what this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
