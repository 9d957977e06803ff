"""Multi-turn episodes through real processes: buffer, generator (both engines), learner.

The tiny model learns ``configs/tiny_multiturn.yaml`` (max-digit prompts, up to three
attempts with "wrong" as feedback); hostile environments (one that raises, one that hangs in
a plain method, one that hangs in a coroutine, one that answers 1 MB) cost only their own
episodes. Exactly-once across SIGKILL with episodes in flight is in
test_checkpoint_resume.py.
"""

import json
import time

import pytest

from .conftest import ROOT, processes_mentioning, run_cli

CONFIG = "configs/tiny_multiturn.yaml"


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _mean(values):
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_tiny_multiturn_learns(tmp_path, engine):
    run_dir = tmp_path / engine
    res = run_cli(
        ["train", CONFIG, "--run-dir", str(run_dir), f"generators.engine={engine}"],
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(run_dir / "metrics.jsonl")
    assert len(rows) == 200
    first, last = rows[:10], rows[-10:]
    # The episode's return: the final answer's score plus -0.25 per wrong attempt.
    before, after = _mean(r["reward_mean"] for r in first), _mean(r["reward_mean"] for r in last)
    assert after - before > 0.5, (before, after)
    # Fewer attempts once it reads the digits: turns fall, and with them the penalties.
    assert _mean(r["multiturn/turns_mean"] for r in first) > 1.5
    assert _mean(r["multiturn/turns_mean"] for r in last) < 1.5
    assert _mean(r["multiturn/env_reward"] for r in last) > _mean(
        r["multiturn/env_reward"] for r in first
    )
    for r in rows:
        assert r["staleness_max"] <= 2 and r["dropped_stale"] == 0
        assert 1 <= r["multiturn/turns_max"] <= 3
        assert r["multiturn/tool_errors"] == r["multiturn/tool_timeouts"] == 0
        # Sampled tokens only: a turn is at most max_new_tokens = 4.
        assert r["multiturn/sampled_tokens"] <= 4 * r["multiturn/turns_mean"] + 1e-6
    assert any(r["multiturn/observation_tokens"] > 0 for r in rows)
    # Weights changed between the turns of some episodes.
    assert any(r["multiturn/versions_spanned_max"] >= 1 for r in rows)
    # Evaluation runs the episodes too (greedy), on the held-out prompts.
    evals = _rows(run_dir / "eval.jsonl")
    assert evals[-1]["eval/reward_mean"] - evals[0]["eval/reward_mean"] > 0.3, evals
    assert all("eval/turns_mean" in e for e in evals)
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"


HOSTILE = {  # data source -> (environment, its args)
    "raise": ("tests.hostile_env:HostileEnv", {"mode": "raise", "every": 1}),
    "huge": ("tests.hostile_env:HostileEnv", {"mode": "huge", "every": 1}),
    "hang": ("tests.hostile_env:HostileEnv", {"mode": "hang", "every": 1}),
    "ahang": ("tests.hostile_env:AsyncHostileEnv", {"mode": "hang", "every": 1}),
}
RETRY_ARGS = {"max_attempts": 3, "feedback": "wrong", "extract": "first_word"}


def test_hostile_environments_cost_only_their_own_episodes(tmp_path):
    # One prompt in eight goes to each hostile environment, the rest to a well-behaved one.
    lines = (ROOT / "configs/data/max_digit.jsonl").read_text().splitlines()[:160]
    kinds = [*HOSTILE, "ok", "ok", "ok", "ok"]
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps({**json.loads(line), "data_source": kinds[i % 8]}) + "\n")
    envs = [
        {"env": env, "args": {**RETRY_ARGS, **args}, "data_sources": [source]}
        for source, (env, args) in HOSTILE.items()
    ] + [{"env": "verl_async.envs.retry:RetryEnv", "args": RETRY_ARGS, "data_sources": ["ok"]}]
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    res = run_cli(
        [
            "train",
            CONFIG,
            "--run-dir",
            str(run_dir),
            f"data.path={data}",
            "eval.every_steps=0",
            "trainer.total_steps=20",
            "multiturn.step_timeout_s=1",
            f"multiturn.environments={json.dumps(envs)}",
        ],
        timeout=400,
    )
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restarting it" not in res.stderr, "the generator died"
    rows = _rows(run_dir / "metrics.jsonl")
    assert len(rows) == 20
    errors = sum(r["multiturn/tool_errors"] for r in rows)
    timeouts = sum(r["multiturn/tool_timeouts"] for r in rows)
    # 20 groups of 8 episodes of each kind: every "raise" and "huge" turn is an error (a
    # raise, or an observation cut to its budget), every hang episode times out at least once.
    assert errors >= 2 * 20 * 8, errors
    assert timeouts >= 2 * 20 * 8, timeouts
    # Every group was trained, the hostile ones included (scored like any failed answer).
    trained = [g for t in _rows(run_dir / "trained.jsonl") for g, _ in t["groups"]]
    assert sorted(trained) == list(range(160))
    log = (run_dir / "logs" / "generator0.log").read_text()
    assert "hostile environment: step raised" in log  # logged once, then counted
    assert log.count("hostile environment: step raised") == 1
    assert "timed out" in log
    # 20 steps of a run whose hang episodes each cost a 1 s timeout: the others went on.
    assert took < 300, took
