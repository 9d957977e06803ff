"""Learner ranks and prefetch in whole runs: step time, learner tokens/s, wait, memory.

    python benchmarks/learner_scaling.py [--config configs/tiny.yaml] [--steps 150]
                                         [--cases one_unpinned,two,one_unpinned_noprefetch]
                                         [--repeats 2]
                                         [--out runs/learner_scaling] [key=value ...]

Runs ``verl-async train CONFIG`` once per case and repeat, in the order ABC CBA ... (so
drift in the machine hits every case alike), with the same config except:

  one_unpinned     placement.learners=[cpu] (one rank, torch's default two threads,
                   sharing core 0 with the generator)
  two              placement.learners=[cpu, cpu] (two FSDP2 ranks over gloo, one thread
                   each, unpinned: the same two cores)
  *_noprefetch     the case with learner.prefetch=false (each batch fetched when the
                   step needs it: the wait the prefetch thread hides)
  one              placement.learners=[cpu:1] (one rank on core 1, one thread: the tiny
                   default's placement; it leaves core 0 to the generator alone)

The generator is on core 0 in every case. Per case it reports the median of
``step_s`` (the learner's step, publication included), learner tokens/s (``tokens`` /
``step_s``), the median ``learner_wait_s`` (time the step waited for its batch), the
learner's peak RSS (rank 0) and the final reward. Steps before ``--skip`` are left out
(start-up). Writes ``learner_scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, run_train  # noqa: E402

CASES = {
    "one_unpinned": ["placement.learners=[cpu]"],
    "two": ["placement.learners=[cpu, cpu]"],
    "one": ["placement.learners=[cpu:1]"],
}
CASES.update({f"{k}_noprefetch": [*v, "learner.prefetch=false"] for k, v in list(CASES.items())})


def summarize(rows: list[dict], seconds: float, skip: int) -> dict:
    warm = rows[skip:] or rows
    step = statistics.median(r["step_s"] for r in warm)
    return {
        "steps": len(rows),
        "step_s": step,
        "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in warm),
        "learner_wait_s": statistics.median(r["learner_wait_s"] for r in warm),
        "peak_rss_mib": max(r["learner_peak_rss_mib"] for r in rows),
        "reward_final": mean([r["reward_mean"] for r in rows[-20:]]),
        "wall_s": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--cases", default="one_unpinned,two,one_unpinned_noprefetch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip", type=int, default=10, help="start-up steps left out")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/learner_scaling")
    args, extra = ap.parse_known_args(argv)
    cases = args.cases.split(",")
    common = [f"trainer.total_steps={args.steps}", "checkpoint.every_steps=0", *extra]
    common.append("placement.generators=[cpu:0]")
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for k in range(args.repeats):
        for case in cases if k % 2 == 0 else reversed(cases):
            run_dir = args.out / f"{case}{k}"
            rows, seconds = run_train(args.config, run_dir, [*common, *CASES[case]])
            results[case].append(summarize(rows, seconds, args.skip))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learner_scaling.json").write_text(json.dumps(results, indent=1))
    base = statistics.median(r["step_s"] for r in results[cases[0]])
    print(f"machine: {machine()}; config: {args.config.name}; {args.steps} steps x {args.repeats}")
    print(
        "| case | median step | vs first | learner tokens/s | batch wait | peak RSS | final reward |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        runs = results[case]
        med = lambda key, runs=runs: statistics.median(r[key] for r in runs)  # noqa: E731
        print(
            f"| {case} | {med('step_s'):.3f} s | {med('step_s') / base:.2f}x "
            f"| {med('tokens_per_s'):,.0f} | {med('learner_wait_s') * 1000:.1f} ms "
            f"| {max(r['peak_rss_mib'] for r in runs)} MiB | {med('reward_final'):.2f} |"
        )
    parts = [
        f"{c} {statistics.median(r['step_s'] for r in results[c]) / base:.2f}x" for c in cases[1:]
    ]
    print(f"summary: median learner step vs {cases[0]}: {', '.join(parts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
