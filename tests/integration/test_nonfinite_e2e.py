"""Rewards float32 cannot hold, through the real processes (buffer, generator with its
scoring process, learner): a reward function that returns 1e39, NaN, inf, -inf or -1e39
on every fifth call (tests/unit/reward_fns.py ``sometimes_not_finite``). 1e39 is a finite
float64: before rewards were checked in float32 it reached the learner as an infinity,
the step wrote NaN into the weights and the generator could not sample with them."""

import json

import numpy as np
from safetensors.numpy import load_file

from verl_async.checkpoint import list_checkpoints, verify

from .conftest import run_cli

STEPS = 60
FN = "function: 'tests.unit.reward_fns:sometimes_not_finite', default_score: -1.0"
# The same function twice: raw into the reward, and through running statistics (which must
# not absorb the poison either). Both share the scoring process and its count of calls.
POISON = (
    "rewards.sources=[{name: correct, kind: exact, extract: first_word},"
    f"{{name: poison, kind: function, {FN}, weight: 0.5}},"
    f"{{name: running, kind: function, {FN}, weight: 0.5, normalize: running}}]"
)


def _finite(value) -> bool:
    return value is None or np.isfinite(np.asarray(value, np.float64)).all()


def test_rewards_float32_cannot_hold_cost_their_samples_not_the_run(tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli(
        [
            "train", "configs/tiny.yaml", "--run-dir", str(run_dir),
            f"trainer.total_steps={STEPS}", "checkpoint.every_steps=20", "checkpoint.keep_last=3",
            # No process may die: a restart would hide a crash.
            "trainer.max_restarts=0", "generators.max_restarts=0", POISON,
        ],
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not np.isfinite(v)}
        assert not bad, (row["step"], bad)
        # Nothing that is not finite reached the learner's update.
        assert row["skipped_steps/nonfinite_loss"] == row["skipped_steps/nonfinite_grad"] == 0
        assert row["reward_failed/correct"] == 0
    # One call in five is poisoned, by the scoring process's count of calls: on a machine of
    # any speed. The trained samples are most of the scored ones.
    samples = sum(r["samples"] for r in rows)
    failed = sum(r["reward_failed/poison"] + r["reward_failed/running"] for r in rows)
    assert 0.15 < failed / (2 * samples) < 0.25, failed
    log = (run_dir / "logs/generator0.log").read_text()
    for name in ("poison", "running"):
        assert sum(r[f"reward_failed/{name}"] for r in rows) > 0.1 * samples
        assert log.count(f"reward source '{name}' failed") == 1  # then only counted
    assert "not a finite float32" in log

    checkpoints = list_checkpoints(run_dir)
    assert [c.name for c in checkpoints] == ["step_00000020", "step_00000040", "step_00000060"]
    for ckpt in checkpoints:
        assert verify(ckpt) == []
        for name in ("model", "state"):
            tensors = load_file(ckpt / f"learner/{name}.safetensors")
            floats = {k: t for k, t in tensors.items() if t.dtype.kind == "f"}
            assert floats and all(np.isfinite(t).all() for t in floats.values()), ckpt.name
        state = json.loads((ckpt / "learner/trainer_state.json").read_text())
        running = state["reward_running"]["running"]
        assert running["count"] > 0 and _finite(list(running.values())), running
