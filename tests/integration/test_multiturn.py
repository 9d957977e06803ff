"""Multi-turn episodes through real processes: buffer, generator (both engines), learner.

The tiny model learns ``configs/tiny_multiturn.yaml`` (max-digit prompts, up to three
attempts with "wrong" as feedback) in a synchronous run, whose bars hold with room over
several seeds (``benchmarks/margins.py --suite multiturn``); episodes run asynchronously on
both engines; hostile environments (one that raises, one that hangs in
a plain method, one that hangs in a coroutine, one that answers 1 MB) cost only their own
episodes. Exactly-once across SIGKILL with episodes in flight is in
test_checkpoint_resume.py.
"""

import json
import time
from pathlib import Path

import pytest

from .conftest import ROOT, processes_mentioning, run_cli
from .learning import Case, Check, fall, rise, rows, train_and_check

CONFIG = "configs/tiny_multiturn.yaml"


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


LEARN_STEPS, WINDOW = 200, 10


def measure(run_dir: Path) -> list[Check]:
    """The episode's return (the final answer's score plus -0.25 per wrong attempt) rises;
    attempts fall once the policy reads the digits; greedy held-out episodes improve."""
    evals = rows(run_dir / "eval.jsonl")
    first_eval, last_eval = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    return [
        rise(run_dir, "reward_mean", WINDOW, 0.5),
        fall(run_dir, "multiturn/turns_mean", WINDOW, 0.3),
        rise(run_dir, "multiturn/env_reward", WINDOW, 0.05),
        Check(f"eval reward rise ({first_eval:.3f} -> {last_eval:.3f})",
              last_eval - first_eval, 0.3),
    ]  # fmt: skip


CASES = {"hf": Case(CONFIG, (f"trainer.total_steps={LEARN_STEPS}",), measure)}


def test_tiny_multiturn_learns(tmp_path):
    """Synchronous (tests/integration/learning.py), on the transformers engine; the
    asynchronous path of episodes on both engines is the test below."""
    run_dir = tmp_path / "run"
    metrics = train_and_check(CASES["hf"], run_dir, LEARN_STEPS, timeout=600)
    _assert_episodes_are_well_formed(metrics)
    # Synchronous: every turn of an episode is sampled by one version's weights.
    assert all(r["multiturn/versions_spanned_max"] == 0 for r in metrics)
    assert all("eval/turns_mean" in e for e in rows(run_dir / "eval.jsonl"))
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_episodes_run_asynchronously_on_both_engines(tmp_path, engine):
    """The config as it is (staleness.max 2), for a few steps: episodes, their
    evaluation, and weights that may change between an episode's turns (never by more
    than the staleness bound)."""
    run_dir = tmp_path / engine
    steps = 10
    res = run_cli(
        ["train", CONFIG, "--run-dir", str(run_dir), f"generators.engine={engine}",
         f"trainer.total_steps={steps}", "eval.every_steps=10", "checkpoint.every_steps=0"],
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))
    _assert_episodes_are_well_formed(metrics)
    for r in metrics:
        assert r["staleness_max"] <= 2 and r["dropped_stale"] == 0
        assert 0 <= r["multiturn/versions_spanned_max"] <= 2
    evals = rows(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 10] and all(
        e["eval/prompts"] == 64 and 1 <= e["eval/turns_mean"] <= 3 for e in evals
    ), evals
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"


def _assert_episodes_are_well_formed(metrics: list[dict]) -> None:
    for r in metrics:
        assert 1 <= r["multiturn/turns_max"] <= 3
        assert r["multiturn/tool_errors"] == r["multiturn/tool_timeouts"] == 0
        # Sampled tokens only: a turn is at most max_new_tokens = 4.
        assert r["multiturn/sampled_tokens"] <= 4 * r["multiturn/turns_mean"] + 1e-6
    assert any(r["multiturn/observation_tokens"] > 0 for r in metrics)


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
