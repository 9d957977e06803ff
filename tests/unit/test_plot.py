"""``verl-async plot``: PNG figures from run directories whose rows have the shape of a real
run's (every key a tiny-config run writes, values made up but plausible)."""

import json
import random
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from verl_async.launch import cli
from verl_async.launch.plot import (
    PlotError,
    load_runs,
    output_dir,
    plot_runs,
    staleness_shares,
    trailing_mean,
)

PNG = b"\x89PNG\r\n\x1a\n"
FIGURES = ("reward", "eval", "staleness", "throughput", "kl_entropy")
ORANGE = np.array([1.0, 0.498, 0.055])  # matplotlib's C1: the second run's color


def _metrics_row(step: int, eta: int, rng: random.Random) -> dict:
    """A metrics.jsonl line with the keys of a ``configs/tiny.yaml`` run."""
    reward = min(0.1 + 0.02 * step + rng.uniform(-0.05, 0.05), 1.0)
    lag = min(step, eta)
    return {
        "step": step,
        "version": step + 1,
        "wall_s": 0.5 + 0.12 * step,
        "step_s": rng.uniform(0.07, 0.2),
        "reward_mean": reward,
        "samples": 64,
        "tokens": 790 + rng.randint(-20, 20),
        "response_tokens": 295,
        "staleness_mean": lag * 0.9,
        "staleness_max": lag,
        "staleness_hist": [
            6 if k < lag else 64 - 6 * lag if k == lag else 0 for k in range(eta + 1)
        ],
        "inflight_update_samples": 0,
        "dropped_stale": 0,
        "gen_tokens_per_s": 120.0 + 45 * step,
        "buffer_size": 0,
        "learner_wait_s": rng.uniform(0, 0.15),
        "weight_sync_s": 0.0019,
        "loss": rng.uniform(-0.05, 0.05),
        "kl": rng.uniform(0, 0.1),
        "entropy": 2.7 - 0.03 * step,
        "clip_fraction": 0.0,
        "is_weight_mean": 0.99,
        "is_weight_max": 1.68,
        "is_clipped_fraction": 0.0,
        "grad_norm": 0.97,
        "learner_peak_rss_mib": 469,
        "actor/pg_loss": 0.044,
        "actor/pg_clipfrac": 0.0,
        "actor/pg_clipfrac_lower": 0.0,
        "actor/ppo_kl": rng.uniform(0, 0.02),
        "actor/entropy": 2.7 - 0.03 * step,
        "actor/grad_norm": 0.97,
        "critic/advantages/mean": -0.04,
        "critic/advantages/std": 0.64,
        "gen_blocked_s": 0.04,
        "gen_idle_s": 0.0,
        "prompts_skipped": 0,
        "reward/correct": reward,
        "reward_failed/correct": 0,
        "reward_ds/default": reward,
        "reward_unrouted": 0,
        "weight_broadcast_s": 0.004,
        "lr": 0.0005,
    }


def _eval_row(step: int) -> dict:
    score = 0.125 + 0.02 * step
    return {
        "step": step,
        "version": step,
        "eval/reward/correct": score,
        "eval/reward_failed/correct": 0,
        "eval/reward_ds/default": score,
        "eval/reward_unrouted": 0,
        "eval/reward_mean": score,
        "eval/response_length": 4.75,
        "eval/version_min": step,
        "eval/version_max": step,
        "eval/seconds": 0.5,
        "eval/prompts": 16,
    }


def make_run(path, steps=30, eta=2, seed=0, evals=True):
    rng = random.Random(seed)
    path.mkdir(parents=True)
    lines = [json.dumps(_metrics_row(s, eta, rng)) + "\n" for s in range(steps)]
    (path / "metrics.jsonl").write_text("".join(lines))
    if evals:
        rows = [_eval_row(s) for s in range(0, steps + 1, 10)]
        (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000, path


def _has_orange(path) -> bool:
    pixels = imread(path)[..., :3]  # [H, W, 3]
    return bool((np.abs(pixels - ORANGE).max(axis=-1) < 0.05).any())


def test_one_run_gets_every_figure_in_its_plots_dir(tmp_path, capsys):
    run = make_run(tmp_path / "tiny-1")
    assert cli.main(["plot", str(run)]) == 0
    out = capsys.readouterr().out
    for name in FIGURES:
        path = run / "plots" / f"{name}.png"
        _assert_png(path)
        assert f"wrote {path}" in out
        assert not _has_orange(path), "one run is drawn in one color"


def test_several_runs_are_overlaid(tmp_path, capsys):
    a = make_run(tmp_path / "runs" / "eta0", eta=0, seed=1)
    b = make_run(tmp_path / "runs" / "eta2", eta=2, seed=2, steps=20, evals=False)
    written = plot_runs([a, b], window=5)
    assert written == [tmp_path / "runs/compare-eta0+eta2" / f"{n}.png" for n in FIGURES]
    for path in written:
        _assert_png(path)
    # The second run's color shows wherever it has data: all figures but eval.
    assert [_has_orange(p) for p in written] == [True, False, True, True, True]

    out = tmp_path / "chosen"
    assert cli.main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in FIGURES)


def test_a_figure_without_data_is_skipped_with_one_line(tmp_path):
    run = make_run(tmp_path / "run", evals=False)
    lines = []
    written = plot_runs([run], say=lines.append)
    assert [p.name for p in written] == [f"{n}.png" for n in FIGURES if n != "eval"]
    assert "skipped eval.png: no run has eval.jsonl rows" in lines
    assert not (run / "plots/eval.png").exists()


def test_a_dir_without_metrics_is_one_clear_error(tmp_path, capsys):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    with pytest.raises(PlotError, match="holds no metrics.jsonl rows"):
        plot_runs([empty])
    assert cli.main(["plot", str(make_run(tmp_path / "ok")), str(empty)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("verl-async: ") and str(empty) in err and "\n" not in err
    assert cli.main(["plot", str(tmp_path / "missing")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "ok" / "plots").exists(), "nothing is written before the check"


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(PlotError, match=r"pip install 'verl-async\[plot\]'"):
        plot_runs([make_run(tmp_path / "run")])


def test_default_output_dirs(tmp_path):
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    assert output_dir([a], None) == a / "plots"
    assert output_dir([a, b], None) == tmp_path / "runs" / "compare-a+b"
    assert output_dir([a, b], tmp_path / "x") == tmp_path / "x"
    many = [tmp_path / f"a-very-long-run-name-{i:03d}" for i in range(8)]
    assert output_dir(many, None).name == "compare-a-very-long-run-name-000+7-more"


def test_trailing_mean_and_staleness_shares(tmp_path):
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    run = load_runs([make_run(tmp_path / "run", steps=3, eta=2)])[0]
    # steps 0, 1, 2 at lag 0, 1, 2: 64 + (6 + 58) + (6 + 6 + 52) samples
    assert staleness_shares(run) == pytest.approx([76 / 192, 64 / 192, 52 / 192])


def test_a_distillation_run_gets_its_figure(tmp_path):
    """Rows with distill/* keys (teacher processes: the wait and busy seconds) add
    distillation.png; runs without them skip it (the tests above)."""
    run = make_run(tmp_path / "distill")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row.update({"distill/math/reverse_kl": 3.0 / (1 + i), "distill/math/tokens": 300,
                    "distill/loss": 1.0 / (1 + i), "distill/scored_fraction": 1.0,
                    "distill/teacher_wait_s": 0.3, "distill/teacher_busy_s": 0.1})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_runs([run], say=lambda line: None)
    assert run / "plots/distillation.png" in written
    _assert_png(run / "plots/distillation.png")
