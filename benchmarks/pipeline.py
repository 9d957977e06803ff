"""Synchronous (eta = 0) against asynchronous (eta = 2) training, and each stage alone.

    python benchmarks/pipeline.py [--steps 400] [--stage-steps 60] [--target 0.6]
                                  [--out runs/pipeline] [--plot docs/pipeline.png]

Three real ``verl-async train configs/tiny.yaml`` runs, one after another:

  stages  eta = S - 1, --prefill-steps S (benchmarks/bench_learner.py): the generator
          fills the buffer with S steps of groups while the learner waits (generation
          alone), then the learner trains on the full buffer while the generator has no
          prompts left (training alone, weight pushes included). Gives the two stage
          rates in samples/s.
  sync    eta = 0, ``--steps`` steps.
  async   eta = 2, the same number of steps and samples.

Reports samples/s, time to the target reward (trailing mean of 20 steps), the overlap
efficiency = async samples/s / min(generation rate, training rate), and how much of the
warm asynchronous run each stage sat idle. Ends with one summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, rolling, run_train  # noqa: E402

WINDOW = 20
WARM = 0.1  # the first 10% of steps count as warm-up in the idle shares


def stage_rates(args) -> dict:
    s = args.stage_steps
    rows, _ = run_train(
        args.config,
        args.out / "stages",
        [
            f"staleness.max={s - 1}",
            f"trainer.total_steps={s}",
            *args.override,
        ],
        [f"--prefill-steps={s}"],
    )
    samples = sum(r["samples"] for r in rows)
    train_s = sum(r["step_s"] for r in rows)
    return {
        "generation_samples_per_s": samples / rows[0]["prefill_s"],
        "training_samples_per_s": samples / train_s,
        "samples": samples,
    }


def pipeline_run(name: str, eta: int, args) -> dict:
    rows, command_s = run_train(
        args.config,
        args.out / name,
        [f"staleness.max={eta}", f"trainer.total_steps={args.steps}", *args.override],
    )
    # Train time: from the learner's start to its last step (engine start excluded).
    train_s = rows[-1]["wall_s"]
    samples = sum(r["samples"] for r in rows)
    smooth = rolling([r["reward_mean"] for r in rows], WINDOW)
    hit = next((i for i, v in enumerate(smooth) if v >= args.target), None)
    warm = rows[int(len(rows) * WARM) :]
    warm_s = warm[-1]["wall_s"] - warm[0]["wall_s"] + warm[0]["step_s"]
    return {
        "eta": eta,
        "steps": len(rows),
        "samples": samples,
        "command_s": command_s,
        "train_s": train_s,
        "samples_per_s": samples / train_s,
        "time_to_target_s": rows[hit]["wall_s"] if hit is not None else None,
        "final_reward": mean(r["reward_mean"] for r in rows[-10:]),
        "learner_idle_share": sum(r["learner_wait_s"] for r in warm) / warm_s,
        "generator_idle_share": sum(r["gen_idle_s"] for r in warm) / warm_s,
        "weight_sync_share": sum(r["weight_sync_s"] for r in warm) / warm_s,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "curve": [(r["wall_s"], v) for r, v in zip(rows, smooth, strict=True)],
    }


def report(stages: dict, sync: dict, asyn: dict, target: float) -> str:
    bottleneck = min(stages["generation_samples_per_s"], stages["training_samples_per_s"])
    ttt = lambda r: f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] else "not reached"  # noqa: E731
    lines = [
        f"machine: {machine()}",
        "",
        "| stage alone | samples/s |",
        "|---|---|",
        f"| generation (learner idle) | {stages['generation_samples_per_s']:.0f} |",
        f"| training on a full buffer (generator idle) | {stages['training_samples_per_s']:.0f} |",
        "",
        "| | η = 0 (sync) | η = 2 (async) | async / sync |",
        "|---|---|---|---|",
        f"| samples | {sync['samples']} | {asyn['samples']} | |",
        f"| train time, s | {sync['train_s']:.1f} | {asyn['train_s']:.1f} "
        f"| {asyn['train_s'] / sync['train_s']:.2f}× |",
        f"| samples/s | {sync['samples_per_s']:.0f} | {asyn['samples_per_s']:.0f} "
        f"| {asyn['samples_per_s'] / sync['samples_per_s']:.2f}× |",
        f"| time to reward {target} (trailing {WINDOW}), s | {ttt(sync)} | {ttt(asyn)} | "
        + (
            f"{asyn['time_to_target_s'] / sync['time_to_target_s']:.2f}× |"
            if sync["time_to_target_s"] and asyn["time_to_target_s"]
            else "— |"
        ),
        f"| final reward (last 10 steps) | {sync['final_reward']:.3f} | {asyn['final_reward']:.3f} | |",
        f"| overlap efficiency (samples/s ÷ slower stage) | {sync['samples_per_s'] / bottleneck:.2f} "
        f"| {asyn['samples_per_s'] / bottleneck:.2f} | |",
        f"| learner idle (waiting for a batch), warm | {sync['learner_idle_share']:.0%} "
        f"| {asyn['learner_idle_share']:.0%} | |",
        f"| generator idle (held by admission), warm | {sync['generator_idle_share']:.0%} "
        f"| {asyn['generator_idle_share']:.0%} | |",
        f"| weight sync share of learner time, warm | {sync['weight_sync_share']:.0%} "
        f"| {asyn['weight_sync_share']:.0%} | |",
        f"| staleness max | {sync['staleness_max']} | {asyn['staleness_max']} | |",
    ]
    return "\n".join(lines)


def plot(sync: dict, asyn: dict, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run, label in ((sync, "η = 0 (synchronous)"), (asyn, "η = 2 (asynchronous)")):
        t, r = zip(*run["curve"], strict=True)
        ax.plot(t, r, label=label)
    ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_xlabel("wall-clock seconds since the learner started")
    ax.set_ylabel(f"reward (trailing mean of {WINDOW} steps)")
    ax.set_title("tiny task: equal samples, sync vs async")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--stage-steps", type=int, default=60)
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/pipeline")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of reward vs wall-clock")
    ap.add_argument("override", nargs="*", help="extra dotted.key=value config overrides")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()

    stages = stage_rates(args)
    sync = pipeline_run("sync", 0, args)
    asyn = pipeline_run("async", 2, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(
        json.dumps({"stages": stages, "sync": sync, "async": asyn}, indent=1)
    )
    print(report(stages, sync, asyn, args.target))
    if args.plot is not None:
        plot(sync, asyn, args.plot, args.target)
        print(f"plot: {args.plot}")
    bottleneck = min(stages["generation_samples_per_s"], stages["training_samples_per_s"])
    print(
        f"summary: async {asyn['samples_per_s'] / sync['samples_per_s']:.2f}x the sync samples/s; "
        f"overlap efficiency {asyn['samples_per_s'] / bottleneck:.2f}; "
        f"staleness max {asyn['staleness_max']} (bound 2)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
