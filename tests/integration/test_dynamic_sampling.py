"""DAPO's dynamic sampling through the real processes (buffer, generator with its scoring
process, learner) on the tiny default, with a reward under which most groups score alike
(tests/unit/reward_fns.py ``mostly_constant``) or all of them do.

Each run shows: groups dropped and the steps refilled with others, every step full
(``learner.groups_per_step`` groups), exactly-once (every group up to the last one trained
was trained or dropped, once; no prompt twice), and the staleness bound held."""

import json

from .conftest import run_cli

STEPS, B, N, ETA = 6, 4, 4, 1
FN = "{name: r, kind: function, function: 'tests.unit.reward_fns:%s'}"
SETTINGS = [
    f"trainer.total_steps={STEPS}", f"learner.groups_per_step={B}", f"generators.group_size={N}",
    f"staleness.max={ETA}", "generators.max_inflight_groups=8", "checkpoint.every_steps=0",
    "trainer.max_restarts=0", "generators.max_restarts=0", "algo.filter_groups.enable=true",
]  # fmt: skip


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(run_dir, *overrides):
    res = run_cli(
        ["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *SETTINGS, *overrides],
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return _rows(run_dir / "metrics.jsonl"), _rows(run_dir / "trained.jsonl")


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
    totals = [r["filter_groups/dropped_total"] for r in rows]
    assert totals[-1] == len(dropped) == sum(r["filter_groups/dropped"] for r in rows)
    past = [r["filter_groups/admitted_past_bound_total"] for r in rows]
    assert past[-1] == sum(r["filter_groups/admitted_past_bound"] for r in rows)
    return dropped, past[-1]


def test_groups_scoring_alike_are_dropped_and_steps_refilled(tmp_path):
    rows, trail = _train(tmp_path / "run", f"rewards.sources=[{FN % 'mostly_constant'}]")
    dropped, _ = _audit(rows, trail)
    # About three groups in four score 0 throughout; the learner still gets full steps.
    assert len(dropped) >= STEPS * B, dropped
    assert sum(1 for r in rows if r["filter_groups/dropped"] > 0) >= STEPS // 2


def test_when_every_group_is_filtered_the_bound_keeps_the_run_going(tmp_path):
    bound = 2
    run_dir = tmp_path / "run"
    rows, trail = _train(
        run_dir,
        "rewards.sources=[{name: r, kind: overlong, len: 1, penalty_factor: 1, max_resp_len: 64}]",
        f"algo.filter_groups.max_in_a_row={bound}",
    )
    dropped, past = _audit(rows, trail)
    # Every group scores 0: each kept one came past the bound, after `bound` drops.
    assert past == STEPS * B and len(dropped) >= bound * (STEPS * B - 1)
    assert all(r["filter_groups/admitted_past_bound"] == B for r in rows)
    assert "kept and trains with zero advantage" in (run_dir / "logs/buffer.log").read_text()
