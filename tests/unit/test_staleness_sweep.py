"""benchmarks/staleness_sweep.py's report (time to target, ratios to eta = 0, multi-turn
columns) and benchmarks/latency_env.py's environment, without a training run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from verl_async.envs import EnvRow, load_environment
from verl_async.schema import EnvironmentConfig

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sweep = _load("staleness_sweep")
latency_env = _load("latency_env")


def _cell(eta: int, correction: str, rewards: list[float], step_s: float, **extra):
    steps = len(rewards)
    return sweep.Cell(
        eta=eta, correction=correction, seed=extra.pop("seed", 0), steps=steps,
        samples=64 * steps, reward_first=rewards[0], reward_final=rewards[-1],
        wall_s=step_s * steps + 5, train_s=step_s * steps, staleness_mean=eta / 2,
        staleness_max=eta, dropped_stale=0, inflight_steps=0, is_clipped_fraction=0.0,
        gen_idle_share=0.0, learner_wait_share=0.0, rewards=rewards,
        step_wall_s=[step_s * (i + 1) for i in range(steps)], **extra,
    )  # fmt: skip


def _row(table: str, eta: int, correction: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {eta} | {correction} |"))
    return [x.strip() for x in line.strip("|").split("|")]


def test_time_to_target_counts_full_windows_only():
    # The trailing 20-step mean first reaches 0.5 at step 29 (10 low steps, then 20 high).
    cell = _cell(0, "none", [0.0] * 10 + [0.5] * 30, step_s=2.0)
    assert cell.reach(0.5) == (30, 60.0)
    assert cell.reach(0.6) == (None, None)
    # Already high from the start: the first full window, step 19.
    assert _cell(0, "none", [1.0] * 25, step_s=1.0).reach(0.5) == (20, 20.0)
    # A cell from a sweep.json without step times still has its steps.
    cell.step_wall_s = None
    assert cell.reach(0.5) == (30, None)


def test_table_ratios_against_eta0_of_the_same_correction():
    rewards = [0.0] * 10 + [0.5] * 30
    cells = [
        _cell(0, "none", rewards, step_s=2.0),
        _cell(2, "none", rewards, step_s=1.0),
        _cell(0, "decoupled", rewards, step_s=4.0),
        _cell(2, "decoupled", rewards, step_s=1.0),
        _cell(8, "decoupled", [0.0] * 40, step_s=1.0),
    ]
    table = sweep.table(cells, target=0.5)
    header = [x.strip() for x in table.splitlines()[0].strip("|").split("|")]
    assert "turns" not in header  # single-turn cells: no multi-turn columns
    train, train_ratio = header.index("train s"), header.index("train ÷ η=0")
    reach = header.index("time to 0.5 (trailing 20), s (steps)")
    row = _row(table, 2, "none")
    assert (row[train], row[train_ratio]) == ("40.0", "0.50×")
    assert (row[reach], row[reach + 1]) == ("30.0 (30)", "0.50×")
    row = _row(table, 2, "decoupled")
    assert (row[train_ratio], row[reach + 1]) == ("0.25×", "0.25×")
    row = _row(table, 8, "decoupled")
    assert (row[reach], row[reach + 1]) == ("reached in 0 of 1", "—")
    # Cells without step times (older sweep.json files) still show their steps.
    for cell in cells:
        cell.step_wall_s = None
    assert _row(sweep.table(cells, target=0.5), 2, "none")[reach : reach + 2] == ["— (30)", "—"]


def test_table_multiturn_columns_and_seeds_averaged():
    rewards = [0.5] * 20
    cells = [
        _cell(0, "none", rewards, step_s=1.0, turns_mean=2.0, versions_spanned_mean=0.0,
              versions_spanned_max=0),
        _cell(8, "none", rewards, step_s=1.0, turns_mean=1.5, versions_spanned_mean=0.5,
              versions_spanned_max=2),
        _cell(8, "none", rewards, step_s=3.0, seed=1, turns_mean=1.0, versions_spanned_mean=1.5,
              versions_spanned_max=3),
    ]  # fmt: skip
    table = sweep.table(cells, target=0.5)
    header = [x.strip() for x in table.splitlines()[0].strip("|").split("|")]
    row = _row(table, 8, "none")
    assert row[header.index("seeds")] == "2"
    assert row[header.index("turns")] == "1.25"
    assert row[header.index("versions spanned mean/max")] == "1.00/3"
    # time to 0.5: 20 s and 60 s (step 19 of each seed), mean 40 against eta=0's 20.
    reach = header.index("time to 0.5 (trailing 20), s (steps)")
    assert (row[reach], row[reach + 1]) == ("40.0 (20)", "2.00×")


ARGS = {"max_attempts": 3, "feedback": "wrong", "right_reward": 0.0, "wrong_reward": -0.25}


def test_latency_env_judges_as_retry_env_after_its_latency():
    spec = EnvironmentConfig(env="benchmarks.latency_env:LatencyEnv", args={})
    assert load_environment(spec, "multiturn.environments[0]").__name__ == "LatencyEnv"
    env = latency_env.LatencyEnv(median_s=0.02, sigma=0.0, max_s=0.02, **ARGS)
    env.reset(EnvRow("max 3 7 1 =", "7", "default"))
    t0 = time.perf_counter()
    step = env.step("3")
    assert time.perf_counter() - t0 >= 0.02
    assert (step.observations, step.reward, step.done) == (
        [{"role": "user", "content": "wrong"}], -0.25, False,
    )  # fmt: skip
    step = env.step("7")
    assert (step.observations, step.reward, step.done) == ([], 0.0, True)


def test_latency_is_deterministic_heavy_tailed_and_capped():
    def latencies(seed: int) -> list[float]:
        env = latency_env.LatencyEnv(seed=seed, **ARGS)
        out = []
        for i in range(400):
            env.reset(EnvRow(f"max {i} =", str(i), "default"))
            out += [env.latency(attempt) for attempt in (1, 2, 3)]
        return out

    first = latencies(0)
    assert first == latencies(0)  # same prompt and attempt, same latency
    assert first != latencies(1)
    ordered = sorted(first)
    assert ordered[len(ordered) // 2] == pytest.approx(0.005, rel=0.3)  # the median
    assert max(first) == 0.3  # the cap is reached
    assert 0.01 < sum(x >= 0.3 for x in first) / len(first) < 0.05  # about one in 50


@pytest.mark.parametrize(
    "args", [{"median_s": 0}, {"sigma": -1}, {"median_s": 0.5, "max_s": 0.1}, {"max_attempts": 0}]
)
def test_latency_env_refuses_bad_args(args):
    with pytest.raises(ValueError):
        latency_env.LatencyEnv(**args)


def test_variants_are_named_override_sets_and_update_time_is_a_column():
    assert sweep._variant("dapo=algo.loss_mode=vanilla algo.clip_eps_high=0.28") == (
        "dapo",
        ["algo.loss_mode=vanilla", "algo.clip_eps_high=0.28"],
    )
    for bad in ("dapo", "=algo.x=1", "dapo= "):
        with pytest.raises(SystemExit, match="--variant wants"):
            sweep._variant(bad)
    rewards = [0.5] * 20
    cells = [
        _cell(0, "gspo", rewards, step_s=1.0, update_s_median=0.02),
        _cell(0, "gspo", rewards, step_s=1.0, seed=1, update_s_median=0.04),
        _cell(4, "gspo", rewards, step_s=1.0),  # an older cell: no update time
    ]
    table = sweep.table(cells, target=0.5)
    header = [x.strip() for x in table.splitlines()[0].strip("|").split("|")]
    column = header.index("update s (median)")
    assert _row(table, 0, "gspo")[column] == "0.0300"
    assert _row(table, 4, "gspo")[column] == "—"


def test_held_out_and_filtered_columns_read_the_runs_files(tmp_path):
    run = sweep.run_dir(tmp_path, 0, "dapo", 0)
    run.mkdir()
    rounds = [(0, 0.25), (5, 0.75), (10, 0.5)]
    (run / "eval.jsonl").write_text(
        "".join(f'{{"step": {s}, "eval/reward_mean": {r}}}\n' for s, r in rounds)
    )
    rows = [{"filter_groups/dropped": d, "filter_groups/admitted_past_bound": p} for d, p in
            [(3, 0), (40, 1), (33, 2)]]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    dapo = _cell(0, "dapo", [0.5] * 30, step_s=1.0)
    sweep.backfill(dapo, run)  # a sweep.json cell from before these fields
    assert (dapo.eval_steps, dapo.eval_rewards) == ([0, 5, 10], [0.25, 0.75, 0.5])
    assert (dapo.filtered_groups, dapo.past_bound_groups) == (76, 3)
    plain = _cell(0, "vanilla", [0.5] * 30, step_s=1.0)
    sweep.backfill(plain, tmp_path / "gone")  # no run directory: nothing read
    assert plain.eval_rewards is None and plain.filtered_groups is None
    table = sweep.table([plain, dapo], target=0.5)
    header = [x.strip() for x in table.splitlines()[0].strip("|").split("|")]
    held, filtered = (
        header.index("held-out first→best→last"),
        header.index("groups filtered / past bound"),
    )
    assert _row(table, 0, "dapo")[held] == "0.25→0.75→0.50"
    assert _row(table, 0, "dapo")[filtered] == "76 / 3"
    assert _row(table, 0, "vanilla")[held] == _row(table, 0, "vanilla")[filtered] == "—"
    # Without any cell that evaluated or filtered, neither column is there.
    bare = sweep.table([plain], target=0.5).splitlines()[0]
    assert "held-out" not in bare and "filtered" not in bare


def test_from_runs_rebuilds_cells_cut_to_a_common_horizon(tmp_path):
    def write_run(eta: int, label: str, steps: int) -> None:
        run = sweep.run_dir(tmp_path, eta, label, 0)
        run.mkdir()
        rows = [
            {"step": i, "wall_s": 2.0 * (i + 1), "reward_mean": i / steps, "samples": 32,
             "staleness_mean": 0.0, "staleness_max": eta, "dropped_stale": 0,
             "inflight_update_samples": 0, "is_clipped_fraction": 0.0, "gen_idle_s": 0.5,
             "learner_wait_s": 1.0}
            for i in range(steps)
        ]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in rows))
        evals = "".join(
            f'{{"step": {s}, "eval/reward_mean": {s / 100}}}\n' for s in range(0, steps + 1, 5)
        )
        (run / "eval.jsonl").write_text(evals)

    write_run(0, "dapo", 28)  # stopped at step 28
    write_run(4, "dapo", 20)
    args = argparse.Namespace(out=tmp_path, steps=20)
    cells = {(c.eta, c.correction): c for c in sweep.from_runs(args)}
    assert set(cells) == {(0, "dapo"), (4, "dapo")}
    cut = cells[(0, "dapo")]
    assert (cut.steps, cut.train_s, cut.wall_s, cut.load_mean) == (20, 40.0, None, None)
    assert cut.eval_steps == [0, 5, 10, 15, 20]  # the round after step 20, not those past it
    assert cells[(4, "dapo")].staleness_max == 4
