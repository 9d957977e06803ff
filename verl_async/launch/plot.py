"""``verl-async plot RUN_DIR [RUN_DIR ...] [--out DIR] [--window N]``: PNG figures of runs.

Reads each run directory's ``metrics.jsonl`` (and ``eval.jsonl`` when there is one); a
run still training can be plotted too (only lines written whole are read). One PNG per
figure; with several runs every panel overlays them, labelled by run directory name:

- ``reward.png``: ``reward_mean``, each ``reward/<source>`` and ``reward_ds/<data_source>``.
- ``eval.png``: each ``eval/...`` score of ``eval.jsonl`` per evaluation round.
- ``staleness.png``: the staleness of every trained sample over the whole run (each
  step's ``staleness_hist`` summed, as a share of samples), and the version lag per step.
- ``throughput.png``: generation tokens/s, learner tokens/s and samples/s (a step's
  tokens and samples over its ``step_s``), seconds per step, learner wait, generator idle.
- ``kl_entropy.png``: ``entropy``, ``kl``, ``actor/ppo_kl`` and the KL terms to the
  reference when they are on.
- ``distillation.png`` (distillation runs): the reverse KL to each teacher, the
  distillation loss, the share of sampled tokens scored, and what scoring cost (per group
  a teacher process scored, the wait and the teacher's busy part; or the learner's
  scoring seconds).

Step series are drawn faint as they are and solid as a trailing mean over ``--window``
steps. A figure whose data no run has is skipped, with one line saying so. Output:
``<RUN_DIR>/plots`` for one run; for several, ``--out`` or
``<parent of the first RUN_DIR>/compare-<name>+<name>...``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from verl_async.metrics import read_metrics

WINDOW = 10  # default trailing-mean window, steps
# eval.jsonl keys that describe a round rather than score it.
EVAL_BOOKKEEPING = (
    "eval/prompts",
    "eval/seconds",
    "eval/version_",
    "eval/reward_failed/",
    "eval/reward_unrouted",
)
KL_ENTROPY = (
    "entropy",
    "kl",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
)


class PlotError(Exception):
    """A problem a user can fix (no run there, matplotlib missing); one sentence."""


@dataclass(frozen=True)
class Run:
    label: str  # the legend entry: the run directory's name
    rows: list[dict]  # metrics.jsonl
    evals: list[dict]  # eval.jsonl ([] without one)


@dataclass(frozen=True)
class Series:
    """One panel: ``value(row)`` per row of ``source`` ('rows' or 'evals') against step."""

    title: str
    value: Callable[[dict], float | None]
    source: str = "rows"


def load_runs(run_dirs: list[Path]) -> list[Run]:
    """Every run's rows; a directory without metrics rows is a ``PlotError``."""
    runs = []
    for run_dir, label in zip(run_dirs, _labels(run_dirs), strict=True):
        if not run_dir.is_dir():
            raise PlotError(f"'{run_dir}' is not a directory")
        rows = read_metrics(run_dir / "metrics.jsonl")
        if not rows:
            raise PlotError(
                f"'{run_dir}' holds no metrics.jsonl rows: not a run directory, or its run "
                "has not finished a step yet"
            )
        runs.append(Run(label, rows, read_metrics(run_dir / "eval.jsonl")))
    return runs


def _labels(run_dirs: list[Path]) -> list[str]:
    """Directory names, with their parent's name in front where two would read the same."""
    names = [d.resolve().name for d in run_dirs]
    return [
        f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for d, n in zip(run_dirs, names, strict=True)
    ]


def output_dir(run_dirs: list[Path], out: Path | None) -> Path:
    """``out``; else ``RUN_DIR/plots`` for one run, ``<parent>/compare-a+b...`` for several."""
    if out is not None:
        return out
    if len(run_dirs) == 1:
        return run_dirs[0] / "plots"
    names = "+".join(d.resolve().name for d in run_dirs)
    if len(names) > 100:
        names = f"{run_dirs[0].resolve().name}+{len(run_dirs) - 1}-more"
    return run_dirs[0].resolve().parent / f"compare-{names}"


def _key(name: str) -> Callable[[dict], float | None]:
    return lambda row: row.get(name)


def _per_step_s(name: str) -> Callable[[dict], float | None]:
    """``row[name] / row['step_s']`` (a rate over the step's learner time)."""

    def rate(row: dict) -> float | None:
        seconds = row.get("step_s")
        return row[name] / seconds if seconds and name in row else None

    return rate


def _keys(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix)})


def reward_series(runs: list[Run]) -> list[Series]:
    rows = [r for run in runs for r in run.rows]
    keys = ["reward_mean", *_keys(rows, "reward/"), *_keys(rows, "reward_ds/")]
    return [Series(k, _key(k)) for k in keys]


def eval_series(runs: list[Run]) -> list[Series]:
    evals = [e for run in runs for e in run.evals]
    first = ["eval/reward_mean", *_keys(evals, "eval/reward/"), *_keys(evals, "eval/reward_ds/")]
    rest = [k for k in _keys(evals, "eval/") if k not in first]
    keys = [k for k in first + rest if not k.startswith(EVAL_BOOKKEEPING)]
    return [Series(k, _key(k), source="evals") for k in keys]


def throughput_series(runs: list[Run]) -> list[Series]:
    return [
        Series("generation tokens/s (gen_tokens_per_s)", _key("gen_tokens_per_s")),
        Series("learner tokens/s (tokens / step_s)", _per_step_s("tokens")),
        Series("learner samples/s (samples / step_s)", _per_step_s("samples")),
        Series("seconds per step (step_s)", _key("step_s")),
        Series("learner waiting for its batch (learner_wait_s)", _key("learner_wait_s")),
        Series("generator idle s (gen_idle_s)", _key("gen_idle_s")),
    ]


def kl_entropy_series(runs: list[Run]) -> list[Series]:
    return [Series(k, _key(k)) for k in KL_ENTROPY]


def distill_series(runs: list[Run]) -> list[Series]:
    rows = [r for run in runs for r in run.rows]
    teachers = [k for k in _keys(rows, "distill/") if k.endswith("/reverse_kl")]
    rest = ("distill/loss", "distill/scored_fraction", "distill/teacher_wait_s",
            "distill/teacher_busy_s", "distill/score_s")  # fmt: skip
    return [Series(k, _key(k)) for k in (*teachers, *rest)]


def lag_series(runs: list[Run]) -> list[Series]:
    return [
        Series("version lag per step, mean (staleness_mean)", _key("staleness_mean")),
        Series("version lag per step, max (staleness_max)", _key("staleness_max")),
    ]


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _points(run: Run, series: Series) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a finite value."""
    pairs = [(r["step"], series.value(r)) for r in getattr(run, series.source)]
    pairs = [(s, v) for s, v in pairs if _finite(v)]
    return [s for s, _ in pairs], [float(v) for _, v in pairs]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def staleness_shares(run: Run) -> list[float]:
    """Share of the run's samples at each staleness 0, 1, ... (every step's histogram summed)."""
    hists = [r["staleness_hist"] for r in run.rows if r.get("staleness_hist")]
    counts = [0] * max((len(h) for h in hists), default=0)
    for h in hists:
        for k, n in enumerate(h):
            counts[k] += n
    total = sum(counts)
    return [n / total for n in counts] if total else []


# name, title, panels; the staleness figure also gets the histogram panel first.
FIGURES = (
    ("reward", "training reward (batch mean)", reward_series),
    ("eval", "evaluation rounds (eval.jsonl)", eval_series),
    ("staleness", "staleness (version lag of trained samples)", lag_series),
    ("throughput", "stage throughput", throughput_series),
    ("kl_entropy", "KL and entropy", kl_entropy_series),
    ("distillation", "on-policy distillation", distill_series),
)


def plot_runs(
    run_dirs: list[Path],
    out: Path | None = None,
    window: int = WINDOW,
    say: Callable[[str], None] = print,
) -> list[Path]:
    """Write every figure some run has data for; return the paths written."""
    _figure_class()  # matplotlib missing: say so before reading anything
    runs = load_runs(run_dirs)
    out = output_dir(run_dirs, out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, build in FIGURES:
        series = [s for s in build(runs) if any(_points(run, s)[0] for run in runs)]
        hist = name == "staleness" and any(staleness_shares(run) for run in runs)
        if not series and not hist:
            what = "eval.jsonl rows" if name == "eval" else "rows with these metrics"
            say(f"skipped {name}.png: no run has {what}")
            continue
        path = out / f"{name}.png"
        _draw(path, title, runs, series, window, hist)
        written.append(path)
        say(f"wrote {path}")
    return written


def _figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(
            "matplotlib is not installed; run `pip install 'verl-async[plot]'`"
        ) from None
    return Figure, FigureCanvasAgg


def _draw(
    path: Path, title: str, runs: list[Run], series: list[Series], window: int, hist: bool
) -> None:
    """One PNG: the histogram panel (``hist``) then one panel per series, 3 per row.
    A Figure with its own Agg canvas: no pyplot, so no global figure state."""
    figure, canvas = _figure_class()
    panels = len(series) + hist
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig = figure(figsize=(4.8 * cols, 3.4 * rows + 0.5), layout="constrained")
    canvas(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[panels:]:
        ax.set_visible(False)
    if hist:
        _draw_staleness_hist(axes.pop(0), runs)
    for ax, s in zip(axes, series, strict=False):
        _draw_series(ax, runs, s, window)
    fig.suptitle(title if len(runs) > 1 else f"{title}: {runs[0].label}")
    fig.savefig(path, dpi=100)


def _draw_series(ax, runs: list[Run], series: Series, window: int) -> None:
    for i, run in enumerate(runs):
        steps, values = _points(run, series)
        if not steps:
            continue  # no legend entry for a run this panel has nothing of
        color = f"C{i}"  # one color per run in every panel
        if series.source == "evals":
            ax.plot(steps, values, "o-", color=color, label=run.label)
        elif window > 1 and len(values) > window:
            ax.plot(steps, values, color=color, alpha=0.3, lw=0.8)
            ax.plot(steps, trailing_mean(values, window), color=color, label=run.label)
        else:
            ax.plot(steps, values, color=color, label=run.label)
    ax.set_title(series.title, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=7)


def _draw_staleness_hist(ax, runs: list[Run]) -> None:
    """Grouped bars: one group per staleness value, one bar per run."""
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        shares = staleness_shares(run)
        if not shares:
            continue
        x = [k - 0.4 + width * (i + 0.5) for k in range(len(shares))]
        ax.bar(x, shares, width, color=f"C{i}", label=run.label)
    ax.set_title("trained samples per staleness (share of the run)", fontsize=9)
    ax.set_xlabel("staleness (versions behind the step)")
    ax.set_xticks(range(max(len(staleness_shares(run)) for run in runs)))
    ax.grid(alpha=0.3, axis="y")
    if len(runs) > 1:
        ax.legend(fontsize=7)
