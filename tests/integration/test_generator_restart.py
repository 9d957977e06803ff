"""Generators SIGKILLed mid-run: the launcher starts each again and the run goes on.

``verl-async train configs/tiny.yaml`` runs with two generators, on each engine. This test
SIGKILLs generator 1's process (with vLLM, its engine processes end with it:
test_engine_lifetime.py), and later generator 0's (on the transformers engine: a vLLM engine's start is the
most expensive part of the test, and a second kill takes the same path as the first). The
launcher must start each again; the buffer must
issue the groups a dead process held to the next generator that asks (not wait out their
lease, set here far beyond the test's length); the learner must rebuild the weight-sync
group with the surviving generator and the new one (epoch 1), then with both new ones
(epoch 2), and send them its weights. The run must finish every step, train every group
0..N-1 exactly once, and every token must carry the learner's own log-probs: the run is
on-policy (``staleness.max=0``), so each one is compared (``rollout_logp_diff_max``), and
after the second rebuild (transformers) every group comes from a restarted process.

The learner is gated (tests/slow_learner.py): it waits at each kill until the new process
has joined, so the rebuilds land where the test says, on any machine. A second test holds
the learner in a step three times ``weights.timeout_s`` long while a restarted generator
waits for the group to be rebuilt: the wait is no failure, and the process stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from .conftest import cmdline, launch_gated, processes_mentioning, wait_for

B = 8  # configs/tiny.yaml: 8 groups a step
STEPS, FIRST, SECOND = 14, 3, 7  # kill generator 1 after FIRST steps, generator 0 after SECOND
# (generator, after how many steps, the weight-sync epoch its restart joins), by engine
KILLS = {"hf": ((1, FIRST, 1), (0, SECOND, 2)), "vllm": ((1, FIRST, 1),)}
LOGP_ATOL = 1e-4  # float32 engine against float32 learner (tests/integration/test_weight_push.py)
RESTART_S = 300  # an engine's start on 2 slow cores, vLLM's included


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _loaded(run_dir: Path, version: int) -> bool:
    """Both generators' processes have loaded ``version`` (their last lines say so)."""
    line = f"loaded version {version} "
    logs = [run_dir / "logs" / f"generator{i}.log" for i in (0, 1)]
    return all(log.is_file() and line in log.read_text().split("engine up")[-1] for log in logs)


def _generator_pid(run_dir: Path, index: int) -> int:
    """The ``python -m generators --run-dir RUN_DIR --index <index>`` process."""
    pids = [
        p
        for p in processes_mentioning(str(run_dir))
        if " -m generators " in cmdline(p) and cmdline(p).split()[-2:] == ["--index", str(index)]
    ]
    assert len(pids) == 1, pids
    return pids[0]


@contextlib.contextmanager
def _interrupted_if_left(proc):
    """Run the block; a run still going after it (a failed check) is stopped with Ctrl-C."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)


def _two_generators(engine: str, steps: int) -> list[str]:
    """Overrides of a run with two generators on ``engine`` and one learner rank, in which
    only a restart hands a dead generator's groups on (no lease runs out)."""
    return [
        f"generators.engine={engine}",
        f"trainer.total_steps={steps}",
        "checkpoint.every_steps=0",
        "placement.generators=[cpu, cpu]",
        "placement.learners=[cpu]",
        "buffer.lease_timeout_s=3600",
    ]


def _kill_until_rejoined(proc, run_dir: Path, index: int, epoch: int, out: Path) -> None:
    """SIGKILL generator ``index``; return once its new process has joined ``epoch``."""
    os.kill(_generator_pid(run_dir, index), signal.SIGKILL)
    buffer_log = run_dir / "logs" / "buffer.log"
    joined = f"generator {index} started again: it joins weight-sync epoch {epoch}"
    wait_for(proc, lambda: buffer_log.is_file() and joined in buffer_log.read_text(),
             joined, out, timeout_s=RESTART_S)  # fmt: skip


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_killed_generators_are_restarted_and_the_run_trains_every_group_once(tmp_path, engine):
    run_dir, gate, out = tmp_path / "run", tmp_path / "gate", tmp_path / "out.txt"
    overrides = [
        *_two_generators(engine, STEPS),
        # On-policy: every token is sampled by the weights the learner trains, so each one
        # is compared with the learner's log-prob (rollout_logp_diff_max).
        "staleness.max=0",
        f"generators.max_inflight_groups={B // 2}",
    ]
    gate.write_text(str(FIRST))
    proc = launch_gated(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *overrides],
                        gate, out)  # fmt: skip
    with _interrupted_if_left(proc):
        kills = KILLS[engine]
        for k, (index, steps, epoch) in enumerate(kills):
            # The learner waits after ``steps`` steps, and both generators have loaded its
            # last version (no broadcast in flight): kill, wait for the new process to
            # join, let the learner go on (its next publication rebuilds the group).
            wait_for(proc, lambda s=steps: _loaded(run_dir, s), f"version {steps} loaded",
                     out, timeout_s=RESTART_S)  # fmt: skip
            _kill_until_rejoined(proc, run_dir, index, epoch, out)
            gate.write_text(str(kills[k + 1][1] if k + 1 < len(kills) else STEPS))
        assert proc.wait(timeout=RESTART_S) == 0, out.read_text()[-3000:]
    text = out.read_text()
    for index, _, _ in kills:
        assert f"the generator{index} process exited with code -9; restarting it (1/3)" in text

    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    trained = [g for line in _rows(run_dir / "trained.jsonl") for g, _ in line["groups"]]
    assert sorted(trained) == list(range(STEPS * B))  # each group once, none lost

    learner_log = (run_dir / "logs" / "learner.log").read_text()
    for index, _, epoch in kills:
        assert f"weight-sync group rebuilt (epoch {epoch}, 3 members)" in learner_log
        restarted = (run_dir / "logs" / f"generator{index}.log").read_text()
        assert "loaded version" in restarted.split(f"epoch {epoch}")[-1]  # got the weights
    # Every step's tokens carry the learner's log-probs: the survivor's after it rejoined
    # (epoch 1), the restarted processes' (both, from epoch 2 on).
    epochs = [r["weight_sync_epoch"] for r in rows]
    for _, steps, epoch in kills:
        assert epochs.index(epoch) >= steps, epochs
    assert epochs[-1] == len(kills), epochs
    assert all(r["rollout_fresh_fraction"] == 1.0 for r in rows)
    worst = max(r["rollout_logp_diff_max"] for r in rows)
    assert worst < LOGP_ATOL, worst


SLOW_STEP_TIMEOUT_S = 15  # weights.timeout_s of the slow-learner run: a third of its held step


def test_a_restarted_generator_waits_out_a_learner_step_longer_than_the_weights_timeout(tmp_path):
    """Generator 1 is killed and started again while the learner is held in a step three
    times ``weights.timeout_s`` long: the new process waits for the learner's next publish
    (which rebuilds the group) however long the step takes, is not restarted a second time,
    and gets the weights."""
    run_dir, gate, out = tmp_path / "run", tmp_path / "gate", tmp_path / "out.txt"
    steps, first = 4, 2
    overrides = [*_two_generators("hf", steps), f"weights.timeout_s={SLOW_STEP_TIMEOUT_S}"]
    gate.write_text(str(first))
    proc = launch_gated(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *overrides],
                        gate, out)  # fmt: skip
    again = "the generator1 process exited with code"
    with _interrupted_if_left(proc):
        wait_for(proc, lambda: _loaded(run_dir, first), f"version {first} loaded", out,
                 timeout_s=RESTART_S)  # fmt: skip
        _kill_until_rejoined(proc, run_dir, 1, 1, out)
        # The learner stays in its step (the gate) for three times weights.timeout_s: the
        # new process must still be there at the end, not started a third time.
        held_until = time.monotonic() + 3 * SLOW_STEP_TIMEOUT_S
        while time.monotonic() < held_until:
            assert out.read_text().count(again) == 1, out.read_text()[-3000:]
            time.sleep(0.2)
        gate.write_text(str(steps))
        assert proc.wait(timeout=RESTART_S) == 0, out.read_text()[-3000:]
    text = out.read_text()
    assert text.count(again) == 1, text[-3000:]
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(steps))
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "weight-sync group rebuilt (epoch 1, 3 members)" in learner_log
    restarted = (run_dir / "logs" / "generator1.log").read_text().split("epoch 1")[-1]
    assert "loaded version" in restarted, restarted[-2000:]
