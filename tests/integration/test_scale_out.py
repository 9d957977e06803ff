"""Two learner ranks (FSDP2 over gloo) and two generators as real processes.

The crash-and-resume audit in this shape is in test_checkpoint_resume.py; the gradient
equality of one and two ranks in test_data_parallel.py.
"""

from __future__ import annotations

import json
import re

from .conftest import run_cli

STEPS, WINDOW = 80, 15


def test_two_learner_ranks_and_two_generators_learn_the_tiny_task(tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli(
        [
            "train", "configs/tiny.yaml", "--run-dir", str(run_dir),
            f"trainer.total_steps={STEPS}", "checkpoint.every_steps=0",
            "placement.generators=[cpu, cpu]", "placement.learners=[cpu, cpu]",
        ],
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    first = sum(r["reward_mean"] for r in rows[:WINDOW]) / WINDOW
    last = sum(r["reward_mean"] for r in rows[-WINDOW:]) / WINDOW
    assert last > first + 0.15, (first, last)
    # rank 0 logs the whole step: every sample of the 8 groups of 8
    assert all(r["samples"] == 64 for r in rows)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "FSDP2 over 2 ranks (gloo)" in log
    assert log.count("Loading weights: 100%") >= 2  # both ranks loaded the policy
    deferred = 0
    for i in (0, 1):  # both engines took part to the end, following the pushed weights
        gen = (run_dir / "logs" / f"generator{i}.log").read_text()
        # On the learner's cores: nothing sampled during its first step, then on again.
        held = gen.count("nothing sampled during its first step")
        assert held == gen.count("the learner's first step is done") <= 1, (i, held)
        deferred += held
        loaded = [int(v) for v in re.findall(r"loaded version (\d+)", gen)]
        assert max(loaded) >= STEPS // 2, (i, loaded[-5:])
    assert deferred >= 1
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [g for t in trail for g, _ in t["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * 8
