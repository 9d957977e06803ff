"""Two learner ranks (FSDP2 over gloo) and two generators as real processes.

What this shape must show: both ranks train every step, both engines follow the pushed
weights to the end, every group is trained once, and generators on the learner's cores
sample nothing during its first step. The learner is gated (tests/slow_learner.py): its
first step waits until a generator has logged that it holds back, so the deferral is seen
on any machine. The crash-and-resume audit in this shape is in test_checkpoint_resume.py;
the gradient equality of one and two ranks in test_data_parallel.py.
"""

from __future__ import annotations

import json
import re

from .conftest import launch_gated, wait_for

STEPS = 30
HOLDS = "nothing sampled during its first step"


def test_two_learner_ranks_and_two_generators_train_every_group_once(tmp_path):
    run_dir, gate, out = tmp_path / "run", tmp_path / "gate", tmp_path / "out.txt"
    logs = run_dir / "logs"
    proc = launch_gated(
        [
            "train", "configs/tiny.yaml", "--run-dir", str(run_dir),
            f"trainer.total_steps={STEPS}", "checkpoint.every_steps=0",
            "placement.generators=[cpu, cpu]", "placement.learners=[cpu, cpu]",
        ],
        gate, out,
    )  # fmt: skip
    try:

        def held_back() -> bool:
            return any(
                (logs / f"generator{i}.log").is_file()
                and HOLDS in (logs / f"generator{i}.log").read_text()
                for i in (0, 1)
            )

        wait_for(proc, held_back, "generator holding back during the first step", out)
        gate.write_text(str(STEPS))
        assert proc.wait(timeout=600) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    # rank 0 logs the whole step: every sample of the 8 groups of 8
    assert all(r["samples"] == 64 for r in rows)
    log = (logs / "learner.log").read_text()
    assert "FSDP2 over 2 ranks (gloo)" in log
    deferred = 0
    for i in (0, 1):  # both engines took part to the end, following the pushed weights
        gen = (logs / f"generator{i}.log").read_text()
        # On the learner's cores: nothing sampled during its first step, then on again.
        held = gen.count(HOLDS)
        assert held == gen.count("the learner's first step is done") <= 1, (i, held)
        deferred += held
        loaded = [int(v) for v in re.findall(r"loaded version (\d+)", gen)]
        assert max(loaded) >= STEPS // 2, (i, loaded[-5:])
    assert deferred >= 1
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [g for t in trail for g, _ in t["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * 8
