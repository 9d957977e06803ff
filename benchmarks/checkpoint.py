"""What checkpointing every step costs: the same job with and without, one invocation.

    python benchmarks/checkpoint.py [--steps 200] [--repeats 2] [--every 1] [--learner-only]
                                    [--alternate B] [--out runs/ckpt-bench] [override ...]

Real ``verl-async train configs/tiny.yaml`` runs, equal steps, in pairs ordered
(off, every), (every, off), (off, every), ... so that a machine drifting in speed during
the invocation hits both settings alike:

  off    checkpoint.every_steps=0
  every  checkpoint.every_steps=N (--every; default 1: a snapshot at every barrier, the
         writer running behind)

Per run: median learner step time (wall, what a step costs end to end), median learner
busy time (step minus waiting for a batch), median time the step spent on the
checkpoint (host snapshot + buffer snapshot + waiting for the previous write), median
background write time, and the checkpoint size. The first 10 % of steps are warm-up and
left out; the medians are over the warm steps of all repeats. Each pair also gives a
ratio of its two run medians; the median of those is robust to drift between pairs.

``--learner-only`` fills the buffer with every step's rollouts before the learner starts
(benchmarks/bench_learner.py ``--prefill-steps`` = steps, staleness.max = steps - 1), so
the learner trains with the generator idle and the step times carry no generation noise.
The buffer then holds the whole backlog (1,600 groups at the start of 200 steps), and
every checkpoint encodes and writes all of it: a worst case for the buffer's part, far
above the (η + 1) × B groups that admission allows in a normal run. Overrides (e.g. a
larger ``model.tiny.*``) apply to every run. Ends with one summary line: median step time
with / without.

``--alternate B`` measures both settings inside each run instead: the learner checkpoints
at every barrier of every other block of B steps and at none of the rest
(benchmarks/bench_learner.py ``--alternate B``), so the steps with and without
checkpoints share one process, one memory layout and one stretch of the machine's speed.
A step counts as "every" when the barriers before and after it both checkpointed (a write
running behind it, a snapshot at its end; so only with --every 1) and as "off" when
neither did; the step where the setting changes is left out. Reported: the pooled ratio, each run's ratio
and the median ratio of adjacent blocks (off/every and every/off alike, so drift within
a run cancels).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_train  # noqa: E402

WARM = 0.1


def warm(rows: list[dict]) -> list[dict]:
    """A run's rows after warm-up (the first ``WARM`` of its steps are left out)."""
    return rows[int(len(rows) * WARM) :]


def one_run(name: str, every: int, args, alternate: int = 0) -> tuple[list[dict], Path]:
    run_dir = args.out / name
    learner = [f"--alternate={alternate}"] if alternate else []
    if args.learner_only:
        learner.append(f"--prefill-steps={args.steps}")
    rows, _ = run_train(
        args.config,
        run_dir,
        [
            f"trainer.total_steps={args.steps}",
            f"checkpoint.every_steps={every}",
            "checkpoint.keep_last=2",
            *([f"staleness.max={args.steps - 1}"] if args.learner_only else []),
            *args.override,
        ],
        learner or None,
    )
    return rows, run_dir


def summarize(runs: list[tuple[list[dict], Path]], every: int) -> dict:
    steps = [r for rows, _ in runs for r in warm(rows)]
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    out = {
        "every_steps": every,
        "runs": len(runs),
        "steps": len(runs[0][0]),
        "step_s": med("step_s"),
        "run_step_s": [statistics.median(r["step_s"] for r in warm(rows)) for rows, _ in runs],
        "busy_s": statistics.median(r["step_s"] - r["learner_wait_s"] for r in steps),
        "samples_per_s": statistics.mean(
            sum(r["samples"] for r in rows) / rows[-1]["wall_s"] for rows, _ in runs
        ),
        "final_reward": statistics.mean(r["reward_mean"] for rows, _ in runs for r in rows[-10:]),
    }
    if every:
        ckpt_rows = [r for r in steps if "checkpoint_s" in r]
        out["checkpoint_s"] = statistics.median(r["checkpoint_s"] for r in ckpt_rows)
        out["checkpoint_write_s"] = statistics.median(r["checkpoint_write_s"] for r in ckpt_rows)
        manifests = sorted((runs[0][1] / "checkpoints").glob("step_*/manifest.json"))
        files = json.loads(manifests[-1].read_text())["files"]
        out["checkpoint_mib"] = sum(f["bytes"] for f in files.values()) / 2**20
    return out


def pair_ratios(off: dict, on: dict) -> list[float]:
    """Per pair of runs (run i of each setting, back to back): with / without median step."""
    return [b / a for a, b in zip(off["run_step_s"], on["run_step_s"], strict=True)]


def report(off: dict, on: dict) -> str:
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    runs = lambda d: ", ".join(ms(x) for x in d["run_step_s"])  # noqa: E731
    pairs = pair_ratios(off, on)
    return "\n".join(
        [
            f"machine: {machine()}",
            "",
            f"| | no checkpoints | checkpoint every {on['every_steps']} step(s) | with / without |",
            "|---|---|---|---|",
            f"| median step, ms | {ms(off['step_s'])} | {ms(on['step_s'])} "
            f"| {on['step_s'] / off['step_s']:.3f}× |",
            f"| per-run median step, ms (pair ratios) | {runs(off)} | {runs(on)} "
            f"| {', '.join(f'{x:.3f}' for x in pairs)}; median {statistics.median(pairs):.3f}× |",
            f"| median learner busy (step − batch wait), ms | {ms(off['busy_s'])} | "
            f"{ms(on['busy_s'])} | {on['busy_s'] / off['busy_s']:.3f}× |",
            f"| samples/s | {off['samples_per_s']:.0f} | {on['samples_per_s']:.0f} "
            f"| {on['samples_per_s'] / off['samples_per_s']:.3f}× |",
            f"| median time a checkpoint step spent checkpointing, ms | — | "
            f"{ms(on['checkpoint_s'])} | {on['checkpoint_s'] / off['step_s']:.1%} of a step |",
            f"| median background write, ms | — | {ms(on['checkpoint_write_s'])} | |",
            f"| checkpoint size, MiB | — | {on['checkpoint_mib']:.2f} | |",
            f"| final reward (last 10 steps) | {off['final_reward']:.3f} | {on['final_reward']:.3f} | |",
            f"| runs × steps | {off['runs']} × {off['steps']} | {on['runs']} × {on['steps']} | |",
        ]
    )


def split_alternating(rows: list[dict], block: int) -> list[tuple[bool, list[dict]]]:
    """An alternating run's warm steps by block: (checkpointing?, steps that count).

    Step s ends at barrier s + 1, so it belongs to block (s + 1) // block. A step counts
    when the barrier before it did what the one after it does (both checkpointed, or
    neither): the first step of each block still has the previous block's setting behind
    it and is left out."""
    blocks: dict[int, tuple[bool, list[dict]]] = {}
    ckpt = {r["step"]: "checkpoint_s" in r for r in rows}
    for row in warm(rows):
        s = row["step"]
        if s - 1 in ckpt and ckpt[s - 1] == ckpt[s]:
            blocks.setdefault((s + 1) // block, (ckpt[s], []))[1].append(row)
    return [blocks[k] for k in sorted(blocks)]


def summarize_alternating(runs: list[tuple[list[dict], Path]], block: int) -> dict:
    med = statistics.median
    off, on, per_run, adjacent = [], [], [], []
    for rows, _ in runs:
        blocks = split_alternating(rows, block)
        run_off = [r for ck, rs in blocks if not ck for r in rs]
        run_on = [r for ck, rs in blocks if ck for r in rs]
        off += run_off
        on += run_on
        per_run.append(med(r["step_s"] for r in run_on) / med(r["step_s"] for r in run_off))
        for (ck_a, a), (ck_b, b) in itertools.pairwise(blocks):
            if ck_a != ck_b:
                with_, without = (a, b) if ck_a else (b, a)
                adjacent.append(med(r["step_s"] for r in with_) / med(r["step_s"] for r in without))
    return {
        "block": block,
        "runs": len(runs),
        "steps": len(runs[0][0]),
        "off_steps": len(off),
        "every_steps": len(on),
        "off_step_s": med(r["step_s"] for r in off),
        "every_step_s": med(r["step_s"] for r in on),
        "off_busy_s": med(r["step_s"] - r["learner_wait_s"] for r in off),
        "every_busy_s": med(r["step_s"] - r["learner_wait_s"] for r in on),
        "run_ratios": per_run,
        "adjacent_ratios": adjacent,
        "checkpoint_s": med(r["checkpoint_s"] for r in on),
        "checkpoint_write_s": med(r["checkpoint_write_s"] for r in on),
        "checkpoint_write_cpu_s": med(r["checkpoint_write_cpu_s"] for r in on),
    }


def report_alternating(res: dict) -> str:
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    ratio = res["every_step_s"] / res["off_step_s"]
    adjacent = res["adjacent_ratios"]
    return "\n".join(
        [
            f"machine: {machine()}",
            "",
            f"| blocks of {res['block']} steps, alternating | no checkpoints "
            "| checkpoint every step | with / without |",
            "|---|---|---|---|",
            f"| median step, ms | {ms(res['off_step_s'])} | {ms(res['every_step_s'])} "
            f"| {ratio:.3f}× |",
            f"| per-run ratio | | | {', '.join(f'{x:.3f}' for x in res['run_ratios'])} |",
            f"| adjacent-block ratios | | | median {statistics.median(adjacent):.3f}× "
            f"(of {len(adjacent)}; {min(adjacent):.3f}–{max(adjacent):.3f}) |",
            f"| median learner busy (step − batch wait), ms | {ms(res['off_busy_s'])} "
            f"| {ms(res['every_busy_s'])} | {res['every_busy_s'] / res['off_busy_s']:.3f}× |",
            f"| time the step spent checkpointing, ms | — | {ms(res['checkpoint_s'])} "
            f"| {res['checkpoint_s'] / res['off_step_s']:.1%} of a step |",
            f"| background write, ms | — | {ms(res['checkpoint_write_s'])} | |",
            f"| writer thread CPU per checkpoint, ms | — | {ms(res['checkpoint_write_cpu_s'])} | |",
            f"| steps counted (runs × steps) | {res['off_steps']} | {res['every_steps']} "
            f"| {res['runs']} × {res['steps']} |",
        ]
    )


def main_alternating(args) -> int:
    if args.every != 1:
        raise SystemExit("--alternate needs --every 1")
    runs = [one_run(f"alt{i}", 1, args, args.alternate) for i in range(args.repeats)]
    res = summarize_alternating(runs, args.alternate)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(json.dumps({"alternate": res}, indent=1))
    print(report_alternating(res))
    print(
        f"summary: checkpointing every step, alternating blocks of {args.alternate} steps in "
        f"one run: median step {res['every_step_s'] / res['off_step_s']:.3f}x without "
        f"(median adjacent-block ratio {statistics.median(res['adjacent_ratios']):.3f}x)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--every", type=int, default=1, help="checkpoint.every_steps of the 'every' runs"
    )
    ap.add_argument(
        "--learner-only", action="store_true", help="pre-fill the buffer: no generation noise"
    )
    ap.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="B",
        help="within each run, checkpoint only in every other block of B steps",
    )
    ap.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/ckpt-bench")
    ap.add_argument("override", nargs="*", help="extra dotted.key=value config overrides")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    if args.alternate:
        return main_alternating(args)

    runs: dict[int, list] = {0: [], args.every: []}
    for i in range(args.repeats):
        for every in (0, args.every) if i % 2 == 0 else (args.every, 0):
            runs[every].append(one_run(f"{'every' if every else 'off'}{i}", every, args))
    off, on = summarize(runs[0], 0), summarize(runs[args.every], args.every)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(json.dumps({"off": off, "every": on}, indent=1))
    print(report(off, on))
    print(
        f"summary: checkpointing every {args.every} step(s): median step "
        f"{on['step_s'] / off['step_s']:.3f}x without (median pair ratio "
        f"{statistics.median(pair_ratios(off, on)):.3f}x); a checkpoint step spends "
        f"{on['checkpoint_s'] / off['step_s']:.1%} of a step in the snapshot"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
