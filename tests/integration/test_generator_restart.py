"""A generator SIGKILLed mid-run: the launcher starts it again and the run goes on.

``verl-async train configs/tiny.yaml`` runs with two generators, on each engine. Once the
learner has trained a few steps, this test SIGKILLs generator 1's process (with vLLM, its
engine processes are left behind, as after a crash). The launcher must start it again; the buffer must issue
the groups the dead process held to the next generator that asks (not wait out their
lease, set here far beyond the test's length); the learner must rebuild the weight-sync
group (epoch 1) with the surviving generator and the new one, and send them its weights.
The run must finish every step, train every group 0..N-1 exactly once, and the restarted
generator's tokens must carry the learner's own log-probs: the run is on-policy
(``staleness.max=0``), so every token is compared (``rollout_logp_diff_max``) on each step
that trained groups of the restarted generator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, cmdline, processes_mentioning

B = 8  # configs/tiny.yaml: 8 groups a step
# (steps, kill after): the restarted generator must be back (engine start-up: ~20 s for
# vLLM, ~5 s for hf) well before the end, and hf runs its steps several times faster.
RUNS = {"vllm": (40, 8), "hf": (200, 20)}
LOGP_ATOL = 1e-4  # float32 engine against float32 learner (tests/integration/test_weight_push.py)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _generator_pid(run_dir: Path, index: int) -> int:
    """The ``python -m generators --run-dir RUN_DIR --index <index>`` process."""
    pids = [
        p
        for p in processes_mentioning(str(run_dir))
        if " -m generators " in cmdline(p) and cmdline(p).split()[-2:] == ["--index", str(index)]
    ]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.parametrize("engine", sorted(RUNS))
def test_a_killed_generator_is_restarted_and_the_run_trains_every_group_once(tmp_path, engine):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    steps, kill_after = RUNS[engine]
    overrides = [
        f"generators.engine={engine}",
        f"trainer.total_steps={steps}",
        "checkpoint.every_steps=0",
        "placement.generators=[cpu, cpu]",
        "placement.learners=[cpu]",
        "buffer.lease_timeout_s=3600",  # only the restart may hand the dead one's groups on
        # On-policy: every token is sampled by the weights the learner trains, so each one
        # is compared with the learner's log-prob (rollout_logp_diff_max).
        "staleness.max=0",
        # Half a step's groups each: every step needs both generators once both are up, so
        # the restarted one trains on most steps after its return (with room for a whole
        # step, the warm one could take every group of the rest of the run).
        f"generators.max_inflight_groups={B // 2}",
    ]
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "verl_async.launch.cli", "train", "configs/tiny.yaml",
             "--run-dir", str(run_dir), *overrides],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(_rows(run_dir / "metrics.jsonl")) < kill_after:
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        killed_at = len(_rows(run_dir / "metrics.jsonl"))
        os.kill(_generator_pid(run_dir, 1), signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    text = out.read_text()
    assert "the generator1 process exited with code -9; restarting it (1/3)" in text

    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    trained = [g for line in _rows(run_dir / "trained.jsonl") for g, _ in line["groups"]]
    assert sorted(trained) == list(range(steps * B))  # each group once, none lost

    logs = run_dir / "logs"
    buffer_log = (logs / "buffer.log").read_text()
    assert "generator 1 started again: it joins weight-sync epoch 1" in buffer_log
    assert "weight-sync group rebuilt (epoch 1, 3 members)" in (logs / "learner.log").read_text()
    restarted = (logs / "generator1.log").read_text().split("epoch 1")[-1]
    assert "loaded version" in restarted  # the new process received the learner's weights
    # Steps after the rebuild with groups of the restarted generator: its tokens, sampled
    # at the learner's version, carry the learner's log-probs.
    by_step = {line["step"]: line["generators"] for line in _rows(run_dir / "trained.jsonl")}
    after = [r for r in rows if r["weight_sync_epoch"] == 1 and 1 in by_step[r["step"]]]
    rebuilt = [r["step"] for r in rows if r["weight_sync_epoch"] == 1]
    assert rebuilt and killed_at <= rebuilt[0] < steps - 10  # after the kill, mid-run
    # How steps split between the two generators varies: with vLLM the warm generator often
    # asks first (5 of 32 steps after the rebuild had the restarted one's groups in one
    # run, 1 in another before each could hold only half a step); every such step carries
    # at least 4 of its groups, each token compared.
    assert len(after) >= 1, [by_step[r["step"]] for r in rows]
    assert all(r["rollout_fresh_fraction"] == 1.0 for r in after)
    worst = max(r["rollout_logp_diff_max"] for r in after)
    assert worst < LOGP_ATOL, worst
