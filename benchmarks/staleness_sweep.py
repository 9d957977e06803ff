"""Staleness bound x off-policy correction on the tiny task, at an equal sample budget.

    python benchmarks/staleness_sweep.py [--etas 0,1,2,4,8] [--corrections none,tis,decoupled]
                                         [--seeds 0] [--steps 400] [--out runs/sweep]
                                         [--config configs/tiny.yaml] [--target 0.6]
                                         [--plot FILE.png] [--from-json A.json,B.json]
                                         [--from-runs]
                                         [--variant 'LABEL=key=value key=value' ...]
                                         [dotted.key=value ...]

Each cell is one real ``verl-async train CONFIG`` run (buffer, generator, learner), run
one after another so they never share the CPU; the trailing ``dotted.key=value`` arguments
are config overrides given to every cell. Every cell trains
``steps x groups_per_step x group_size`` samples. The generator may hold (eta + 1) steps of
groups in flight, so the staleness bound, not the generator's capacity, limits how far
ahead it runs.

Prints one table row per (eta, correction), averaged over seeds: final reward (mean of the
last 10 steps), train time and time to ``--target`` (the first step whose trailing 20-step
mean reward reaches it), each also as a ratio to eta = 0 of the same correction; for a
multi-turn config, turns and weights versions spanned per episode; for a config that
evaluates (``eval.every_steps``), the held-out reward at the first, best and last rounds;
with dynamic sampling, the groups it dropped and those it kept past its bound. The last
column is the machine's 1-minute load average during each run (a run alone adds about
2–3). Writes ``OUT/sweep.json`` after every cell, draws reward curves against steps and
against train time (and the held-out rounds) to ``--plot``, and ends with one summary
line.

``--from-runs`` reports the run directories already under ``--out`` instead, each cut to
its first ``--steps`` steps (a sweep stopped in the middle of a cell, or runs compared
over a common horizon).

``--variant`` (repeatable) sweeps named override sets instead of ``--corrections``: e.g.
``--variant 'gspo=algo.loss_mode=gspo' --variant 'cispo=algo.loss_mode=cispo'`` gives the
columns "gspo" and "cispo", each with the config's own ``algo.correction`` unless the set
names one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT,
    machine,
    mean,
    read_jsonl,
    rolling,
    run_train,
    sampled_load,
    time_to_target,
)

UPDATE_PARTS = ("prox", "forward", "backward", "optimizer")
CORRECTIONS = ("none", "tis", "decoupled", "rollout")  # algo.correction; other labels: --variant
LAST = 10  # final reward = mean over the last LAST steps
WINDOW = 20  # time to the target reward: trailing mean over WINDOW steps


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
    wall_s: float | None  # the whole command: model build, engine start, training
    train_s: float  # learner start -> last step
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    inflight_steps: int  # steps whose batch holds a sample generated across a weight swap
    is_clipped_fraction: float  # mean share of tokens truncated (tis) or masked (decoupled)
    gen_idle_share: float  # generator idle (admission) / train_s
    learner_wait_share: float  # learner waiting for its batch / train_s
    rewards: list[float]
    # Defaults: sweep.json files written before these fields existed still load.
    step_wall_s: list[float] | None = None  # learner start -> each step's end
    turns_mean: float | None = None  # sampled turns per episode (multi-turn runs only)
    versions_spanned_mean: float | None = None  # per episode: newest - oldest version
    versions_spanned_max: int | None = None
    load_mean: float | None = None  # the machine's 1-minute load average during the run
    # Median seconds of the learner's update (pi_prox pass, forwards, backwards, optimizer)
    # per step: what a loss mode costs, without the waits for batches.
    update_s_median: float | None = None
    # Held-out evaluation rounds (eval.jsonl, when the config evaluates): the step of each
    # round and its mean reward; the fair comparison where dynamic sampling leaves groups
    # out of the training reward.
    eval_steps: list[int] | None = None
    eval_rewards: list[float] | None = None
    filtered_groups: int | None = None  # groups dynamic sampling dropped (filter_groups)
    past_bound_groups: int | None = None  # ... and kept past filter_groups.max_in_a_row

    def reach(self, target: float) -> tuple[int | None, float | None]:
        """(steps done, seconds from the learner's start) at the first step whose trailing
        WINDOW-step mean reward reaches ``target``; (None, None) if no step does. The
        seconds are None too where no step times were kept."""
        times = self.step_wall_s or [None] * len(self.rewards)
        index, seconds = time_to_target(self.rewards, times, WINDOW, target)
        return (None, None) if index is None else (index + 1, seconds)

    def time_to(self, target: float) -> float | None:
        """The seconds of ``reach(target)``."""
        return self.reach(target)[1]


def run_cell(eta: int, correction: str, seed: int, args) -> Cell:
    """One run; ``correction`` is an ``algo.correction`` value or a ``--variant`` label."""
    variant = args.variants.get(correction)
    overrides = [
        f"learner.seed={seed}",
        f"data.shuffle_seed={seed}",
        f"staleness.max={eta}",
        *([f"algo.correction={correction}"] if variant is None else variant),
        f"trainer.total_steps={args.steps}",
        f"weights.mode={args.mode}",
        f"generators.max_inflight_groups={max(16, args.groups_per_step * (eta + 1))}",
        f"learner.groups_per_step={args.groups_per_step}",
        *args.override,
    ]
    path = run_dir(args.out, eta, correction, seed)
    with sampled_load() as load:
        rows, wall = run_train(args.config, path, overrides)
    return cell_of(rows, path, eta, correction, seed, wall=wall, load=mean(load))


def cell_of(
    rows: list[dict],
    path: Path,
    eta: int,
    correction: str,
    seed: int,
    wall: float | None = None,
    load: float | None = None,
) -> Cell:
    """The cell of a run: its metrics ``rows`` and the held-out rounds in ``path`` up to
    its last row's step."""
    rewards = [r["reward_mean"] for r in rows]
    train_s = rows[-1]["wall_s"]
    # A single-turn run's rows have no multiturn/ metrics.
    multiturn = [r for r in rows if "multiturn/turns_mean" in r]
    # A run cut short (--from-runs --steps): its rounds up to its last step.
    evals = held_out(path, up_to=rows[-1]["step"] + 1)
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
        step_wall_s=[r["wall_s"] for r in rows],
        turns_mean=mean(r["multiturn/turns_mean"] for r in multiturn) if multiturn else None,
        versions_spanned_mean=(
            mean(r["multiturn/versions_spanned_mean"] for r in multiturn) if multiturn else None
        ),
        versions_spanned_max=(
            max(r["multiturn/versions_spanned_max"] for r in multiturn) if multiturn else None
        ),
        load_mean=load,
        update_s_median=median(
            sum(r.get(f"timing/{part}_s", 0.0) for part in UPDATE_PARTS) for r in rows
        ),
        **filtered(rows),
        **evals,
    )


def from_runs(args) -> list[Cell]:
    """The cells of the run directories under ``args.out`` (``eta{E}-{LABEL}-s{SEED}``),
    each cut to its first ``args.steps`` steps: a sweep stopped in the middle of a cell,
    or runs compared over a common horizon. No command time or load: not measured."""
    cells = []
    for path in sorted(args.out.glob("eta*-*-s*")):
        eta, _, rest = path.name[3:].partition("-")
        label, _, seed = rest.rpartition("-s")
        rows = read_jsonl(path / "metrics.jsonl")[: args.steps]
        if rows:
            cells.append(cell_of(rows, path, int(eta), label, int(seed)))
    return cells


def backfill(cell: Cell, path: Path) -> None:
    """The held-out and filtering fields of a cell read from a sweep.json written before
    they existed, from its run directory if it is still there."""
    if cell.eval_rewards is None:
        for key, value in held_out(path).items():
            setattr(cell, key, value)
    rows = read_jsonl(path / "metrics.jsonl")
    if cell.filtered_groups is None and rows:
        for key, value in filtered(rows).items():
            setattr(cell, key, value)


def run_dir(out: Path, eta: int, correction: str, seed: int) -> Path:
    return out / f"eta{eta}-{correction}-s{seed}"


def held_out(path: Path, up_to: int | None = None) -> dict:
    """``eval_steps`` and ``eval_rewards`` of the run at ``path``, the rounds after at most
    ``up_to`` steps (none: it did not evaluate)."""
    rows = [r for r in read_jsonl(path / "eval.jsonl") if up_to is None or r["step"] <= up_to]
    if not rows:
        return {}
    return {
        "eval_steps": [r["step"] for r in rows],
        "eval_rewards": [r["eval/reward_mean"] for r in rows],
    }


def filtered(rows: list[dict]) -> dict:
    """What dynamic sampling dropped and kept past its bound (none: it was off)."""
    if "filter_groups/dropped" not in rows[-1]:
        return {}
    return {
        "filtered_groups": sum(r["filter_groups/dropped"] for r in rows),
        "past_bound_groups": sum(r["filter_groups/admitted_past_bound"] for r in rows),
    }


def median(values) -> float:
    return statistics.median(list(values))


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


def time_to(cells: list[Cell], target: float) -> float | None:
    """Mean over seeds of the time to ``target``; None unless every seed reached it."""
    times = [c.time_to(target) for c in cells]
    return None if None in times else mean(times)


def ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``0.63×``; a dash where either is missing."""
    return f"{value / base:.2f}×" if value is not None and base else "—"


def table(cells: list[Cell], target: float) -> str:
    """The markdown table: one row per (eta, correction), seeds averaged; ratios against
    eta = 0 of the same correction."""
    by = groups(cells)
    base = {corr: cs for (eta, corr), cs in by.items() if eta == 0}
    multiturn = any(c.turns_mean is not None for c in cells)
    evals = any(c.eval_rewards for c in cells)
    filtering = any(c.filtered_groups is not None for c in cells)
    header = [
        "η", "correction", "seeds", "reward first→final (± sd over seeds)", "Δ final vs η=0",
        *(["held-out first→best→last"] if evals else []),
        "train s", "train ÷ η=0", "update s (median)", f"time to {target} (trailing {WINDOW}), s (steps)", "÷ η=0",
        "staleness mean/max",
        *(["turns", "versions spanned mean/max"] if multiturn else []),
        "dropped", *(["groups filtered / past bound"] if filtering else []),
        "in-flight steps", "IS limited", "gen idle", "learner wait", "load",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (eta, corr), cs in by.items():
        final = [c.reward_final for c in cs]
        spread = f" ± {sd(final):.3f}" if len(cs) > 1 else ""
        b = base.get(corr)
        train_s = mean(c.train_s for c in cs)
        reach = time_to(cs, target)
        steps = [c.reach(target)[0] for c in cs]
        reached = sum(n is not None for n in steps)
        row = [
            str(eta),
            corr,
            str(len(cs)),
            f"{mean(c.reward_first for c in cs):.3f}→{mean(final):.3f}{spread}",
            f"{mean(final) - mean(c.reward_final for c in b):+.3f}" if b else "—",
            *([_held_out(cs)] if evals else []),
            f"{train_s:.1f}",
            ratio(train_s, mean(c.train_s for c in b)) if b else "—",
            _update_s(cs),
            # Cells from sweep.json files without step times have steps only.
            f"{f'{reach:.1f}' if reach is not None else '—'} ({mean(steps):.0f})"
            if reached == len(cs)
            else f"reached in {reached} of {len(cs)}",
            ratio(reach, time_to(b, target)) if b else "—",
            f"{mean(c.staleness_mean for c in cs):.2f}/{max(c.staleness_max for c in cs)}",
        ]
        if multiturn:
            mt = [c for c in cs if c.turns_mean is not None]
            row += (
                [
                    f"{mean(c.turns_mean for c in mt):.2f}",
                    f"{mean(c.versions_spanned_mean for c in mt):.2f}/"
                    f"{max(c.versions_spanned_max for c in mt)}",
                ]
                if mt
                else ["—", "—"]
            )
        row += [
            str(sum(c.dropped_stale for c in cs)),
            *([_filtered(cs)] if filtering else []),
            f"{sum(c.inflight_steps for c in cs)}/{sum(c.steps for c in cs)}",
            f"{mean(c.is_clipped_fraction for c in cs):.3f}",
            f"{mean(c.gen_idle_share for c in cs):.0%}",
            f"{mean(c.learner_wait_share for c in cs):.0%}",
            " / ".join(f"{c.load_mean:.1f}" if c.load_mean is not None else "—" for c in cs),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _held_out(cells: list[Cell]) -> str:
    """The seeds' mean held-out reward at the first round, the best round and the last."""
    curves = [c.eval_rewards for c in cells if c.eval_rewards]
    if not curves:
        return "—"
    n = min(len(curve) for curve in curves)
    means = [mean(curve[i] for curve in curves) for i in range(n)]
    return f"{means[0]:.2f}→{max(means):.2f}→{means[-1]:.2f}"


def _filtered(cells: list[Cell]) -> str:
    """Groups dropped by dynamic sampling, and kept past its bound, summed over seeds."""
    known = [c for c in cells if c.filtered_groups is not None]
    if not known:
        return "—"
    return f"{sum(c.filtered_groups for c in known)} / {sum(c.past_bound_groups for c in known)}"


def _update_s(cells: list[Cell]) -> str:
    """The seeds' mean of each run's median update seconds (a dash for old sweep.json
    cells without it)."""
    known = [c.update_s_median for c in cells if c.update_s_median is not None]
    return f"{mean(known):.4f}" if known else "—"


def plot(cells: list[Cell], path: Path, target: float) -> None:
    """Reward curves (trailing WINDOW-step mean, seeds averaged): one column per
    correction, against learner steps (top) and against train time (each step at its
    seeds' mean time), and the held-out evaluation rounds (bottom) when the runs had
    them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrections = list(dict.fromkeys(c.correction for c in cells))
    timed = all(c.step_wall_s is not None for c in cells)
    evals = all(c.eval_rewards for c in cells)
    rows = 1 + timed + evals
    fig, axes = plt.subplots(
        rows, len(corrections), figsize=(5 * len(corrections), 3.8 * rows), sharey=True,
        squeeze=False,
    )  # fmt: skip
    for col, corr in enumerate(corrections):
        for (eta, c_corr), cs in groups(cells).items():
            if c_corr != corr:
                continue
            curve = rolling(
                [mean(step) for step in zip(*(c.rewards for c in cs), strict=True)], WINDOW
            )
            label = f"η={eta}" + (f" ({len(cs)} seeds)" if len(cs) > 1 else "")
            axes[0][col].plot(curve, label=label)
            if timed:
                seconds = [mean(step) for step in zip(*(c.step_wall_s for c in cs), strict=True)]
                axes[1][col].plot(seconds, curve, label=label)
            if evals:
                n = min(len(c.eval_rewards) for c in cs)
                held = [mean(c.eval_rewards[i] for c in cs) for i in range(n)]
                axes[-1][col].plot(cs[0].eval_steps[:n], held, marker="o", ms=3, label=label)
        axes[0][col].set_title(f"correction = {corr}" if corr in CORRECTIONS else corr)
        axes[0][col].set_xlabel("learner step (equal samples per step)")
        if timed:
            axes[1][col].set_xlabel("train time, s (learner start → step)")
        if evals:
            axes[-1][col].set_xlabel("learner step: held-out evaluation (greedy)")
        for ax in axes[:, col]:
            ax.axhline(target, color="grey", ls=":", lw=1)
            ax.grid(alpha=0.3)
    for ax in axes[: 1 + timed, 0]:
        ax.set_ylabel(f"reward (trailing mean of {WINDOW} steps)")
    if evals:
        axes[-1][0].set_ylabel("held-out reward")
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
    ap.add_argument(
        "--target", type=float, default=0.6, help=f"reward of the time-to-target column "
        f"(trailing {WINDOW}-step mean)",
    )  # fmt: skip
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the reward curves")
    ap.add_argument(
        "--from-json",
        default="",
        help="comma-separated sweep.json files: merge and report them instead of running",
    )
    ap.add_argument(
        "--from-runs", action="store_true",
        help="report the run directories under --out, each cut to its first --steps steps",
    )  # fmt: skip
    ap.add_argument(
        "--variant", action="append", default=[], metavar="LABEL=OVERRIDES",
        help="a named set of space-separated overrides, swept instead of --corrections",
    )  # fmt: skip
    ap.add_argument("override", nargs="*", help="extra dotted.key=value config overrides")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    etas = [int(x) for x in args.etas.split(",")]
    args.variants = dict(_variant(v) for v in args.variant)
    corrections = list(args.variants) or args.corrections.split(",")
    if args.from_runs:
        return report(from_runs(args), args)
    if args.from_json:
        cells = [
            Cell(**{"seed": 0, **c})
            for path in args.from_json.split(",")
            for c in json.loads(Path(path).read_text())
        ]
        for c in cells:  # cells from before the held-out fields: read their runs if kept
            backfill(c, run_dir(args.out, c.eta, c.correction, c.seed))
        return report(cells, args)

    seeds = [int(x) for x in args.seeds.split(",")]
    cells: list[Cell] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for corr in corrections:
        for eta in etas:
            for seed in seeds:
                cell = run_cell(eta, corr, seed, args)
                cells.append(cell)
                reach = cell.time_to(args.target)
                print(
                    f"eta={eta} {corr} seed {seed}: reward {cell.reward_final:.3f}, "
                    f"{cell.train_s:.1f}s, to {args.target}: "
                    f"{f'{reach:.1f}s' if reach is not None else 'not reached'}, "
                    f"staleness max {cell.staleness_max}",
                    flush=True,
                )
                # Written after every cell: a sweep stopped halfway keeps what it measured.
                (args.out / "sweep.json").write_text(
                    json.dumps([asdict(c) for c in cells], indent=1)
                )
    return report(cells, args)


def _variant(text: str) -> tuple[str, list[str]]:
    """'LABEL=k=v k=v' -> (LABEL, ['k=v', 'k=v'])."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest.split():
        raise SystemExit(f"--variant wants LABEL=key=value [key=value ...], got {text!r}")
    return label, rest.split()


def report(cells: list[Cell], args) -> int:
    print(f"machine: {machine()}")
    print(table(cells, args.target))
    if args.plot is not None:
        plot(cells, args.plot, args.target)
        print(f"plot: {args.plot}")
    bound_held = all(c.staleness_max <= c.eta and c.dropped_stale == 0 for c in cells)
    by = groups(cells)
    (eta, corr), cs = max(by.items(), key=lambda kv: mean(c.reward_final for c in kv[1]))
    reached = {key: t for key, cs in by.items() if (t := time_to(cs, args.target)) is not None}
    if reached:
        (f_eta, f_corr), f_s = min(reached.items(), key=lambda kv: kv[1])
        sync = reached.get((0, f_corr))
        fastest = f"fastest to {args.target}: eta={f_eta} {f_corr}, {f_s:.1f}s" + (
            f" ({f_s / sync:.2f}x its eta=0)" if sync else ""
        )
    else:
        fastest = f"no cell reached {args.target} in every seed"
    print(
        f"summary: {len(cells)} runs; bound held in all: {bound_held}; "
        f"best mean final reward {mean(c.reward_final for c in cs):.3f} at eta={eta} {corr}; "
        + fastest
    )
    return 0 if bound_held else 1


if __name__ == "__main__":
    sys.exit(main())
