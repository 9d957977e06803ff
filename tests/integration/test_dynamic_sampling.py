"""DAPO's dynamic sampling through the real processes (buffer, generator with its scoring
process, learner) on the tiny default, with a reward under which most groups score alike
(tests/unit/reward_fns.py ``mostly_constant``), then, after a crash, all of them.

The run shows: groups dropped and the steps refilled with others, every step full
(``learner.groups_per_step`` groups), exactly-once (every group up to the last one trained
was trained or dropped, once; no prompt twice; across a crash of the buffer too), the
staleness bound held, and ``max_in_a_row`` keeping the run going when every group is
filtered."""

import itertools
import json
import os
import signal
import time

from .conftest import (
    cmdline,
    committed_steps,
    launch_gated,
    processes_mentioning,
    wait_for,
)

STEPS, B, N, ETA, CUT, BOUND = 8, 4, 4, 1, 4, 2


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _audit(rows, trail):
    """Every step full and fresh; every group trained or dropped once; counts add up."""
    assert [r["step"] for r in rows] == [t["step"] for t in trail] == list(range(STEPS))
    for row, t in zip(rows, trail, strict=True):
        assert len(t["groups"]) == B and row["samples"] == B * N, row
        assert row["staleness_max"] <= ETA and row["dropped_stale"] == 0, row
        assert row["filter_groups/dropped"] == len(t.get("filtered", []))
    trained = [g for t in trail for g, _ in t["groups"]]
    dropped = [g for t in trail for g, _ in t.get("filtered", [])]
    assert sorted(trained + dropped) == list(range(max(trained) + 1)), "a group lost or twice"
    prompts = [p for t in trail for _, p in t["groups"] + t.get("filtered", [])]
    assert len(prompts) == len(set(prompts)), "a prompt trained or dropped twice"
    for key in ("dropped", "admitted_past_bound"):
        per_step = [r[f"filter_groups/{key}"] for r in rows]
        assert [r[f"filter_groups/{key}_total"] for r in rows] == list(
            itertools.accumulate(per_step)
        ), key
    assert rows[-1]["filter_groups/dropped_total"] == len(dropped)


def test_groups_scoring_alike_are_dropped_steps_refilled_and_the_bound_keeps_it_going(tmp_path):
    """Most groups score alike until the buffer is killed once the step-4 checkpoint is
    committed (the learner held at its gate, the generators running ahead and dropping);
    from then on every group does. The run resumes by itself from that checkpoint: groups
    dropped before the cut stay done, those after it are generated again, and steps 6 and
    7 (which no generator could start before the cut: staleness.max = 1) are made only of
    groups kept past ``max_in_a_row``."""
    run_dir, gate, out = tmp_path / "run", tmp_path / "gate", tmp_path / "out.txt"
    alike = tmp_path / "all_alike"
    fn = "tests.unit.reward_fns:mostly_constant"
    source = f"{{name: r, kind: function, function: '{fn}', kwargs: {{all_alike: '{alike}'}}}}"
    gate.write_text(str(CUT))
    proc = launch_gated(
        ["train", "configs/tiny.yaml", "--run-dir", str(run_dir),
         f"trainer.total_steps={STEPS}", f"learner.groups_per_step={B}",
         f"generators.group_size={N}", f"staleness.max={ETA}", "generators.max_inflight_groups=8",
         f"rewards.sources=[{source}]", "algo.filter_groups.enable=true",
         f"algo.filter_groups.max_in_a_row={BOUND}", f"checkpoint.every_steps={CUT}",
         "trainer.max_restarts=1"],
        gate,
        out,
    )  # fmt: skip
    try:
        wait_for(proc, lambda: CUT in committed_steps(run_dir), "the step-4 checkpoint", out)
        time.sleep(1.0)  # the generators sample (and drop) past the cut meanwhile
        alike.touch()
        buffers = [p for p in processes_mentioning(str(run_dir)) if " -m buffer " in cmdline(p)]
        assert len(buffers) == 1, buffers
        os.kill(buffers[0], signal.SIGKILL)
        gate.write_text("1000")
        assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    rows, trail = _rows(run_dir / "metrics.jsonl"), _rows(run_dir / "trained.jsonl")
    _audit(rows, trail)
    # Before the cut about three groups in four scored alike: dropped, the steps refilled.
    assert sum(r["filter_groups/dropped"] for r in rows[:CUT]) >= CUT * B // 2
    # After it every group did: each one trained came past the bound, after drops.
    for row in rows[CUT + 2 :]:
        assert row["filter_groups/admitted_past_bound"] == B, row
    assert sum(r["filter_groups/dropped"] for r in rows[CUT + 2 :]) >= B
    logs = run_dir / "logs"
    assert "kept and trains with zero advantage" in (logs / "buffer.log").read_text()
    restored = [
        line for line in (logs / "buffer.log").read_text().splitlines() if "restored step" in line
    ]
    assert len(restored) == 1 and "restored step 4," in restored[0], restored
