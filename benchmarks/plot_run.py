"""Reward and evaluation curves of one run directory, as a PNG.

    python benchmarks/plot_run.py RUN_DIR OUT.png [--window 10] [--title TEXT] [--metric KEY ...]

Left: every reward source's raw batch mean (``reward/<name>`` in metrics.jsonl, trailing
mean over ``--window`` steps), the combined reward and each ``--metric`` (any key of
metrics.jsonl, e.g. ``multiturn/tool_calls``, drawn dashed). Right: the evaluation rounds of
``eval.jsonl`` (each source's mean score on the validation prompts) against the step they
were started at. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import read_jsonl, rolling  # noqa: E402


def source_names(rows: list[dict], prefix: str) -> list[str]:
    skip = ("reward_failed/", "reward_ds/", "reward_unrouted")
    names = {k[len(prefix) :] for r in rows for k in r if k.startswith(prefix)}
    return sorted(n for n in names if not any((prefix + n).startswith(s) for s in skip))


def plot(run_dir: Path, out: Path, window: int, title: str, metrics: tuple[str, ...] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    left.plot(steps, rolling([r["reward_mean"] for r in rows], window), label="combined", lw=2)
    for name in source_names(rows, "reward/"):
        values = [r.get(f"reward/{name}") for r in rows]
        values = [v if v is not None else float("nan") for v in values]
        left.plot(steps, rolling(values, window), label=name)
    for key in metrics:
        values = [r.get(key, float("nan")) for r in rows]
        left.plot(steps, rolling(values, window), "--", label=key)
    left.set(xlabel="step", ylabel=f"batch mean (trailing {window})", title="training reward")
    left.legend()
    for name in source_names(evals, "eval/reward/"):
        right.plot(
            [e["step"] for e in evals], [e[f"eval/reward/{name}"] for e in evals], "o-", label=name
        )
    right.set(xlabel="step", ylabel="mean on validation prompts", title="evaluation")
    right.set_ylim(0, 1.05)
    if evals:
        right.legend()
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--title", default="")
    parser.add_argument("--metric", action="append", default=[], help="another metric to draw")
    args = parser.parse_args()
    plot(args.run_dir, args.out, args.window, args.title, tuple(args.metric))


if __name__ == "__main__":
    main()
