"""On-policy distillation against RL alone, from the same student, on held-out prompts.

    python benchmarks/distillation.py [--teacher-steps 300] [--steps 400] [--seeds 1,2]
                                      [--teacher RUN_DIR] [--val PATH] [--eval-every 10]
                                      [--eval-prompts 0] [--fraction 0.9]
                                      [--out runs/distillation]
                                      [--plot PATH] [--replot JSON] [key=value ...]

First the teacher: ``verl-async train configs/tiny.yaml`` for --teacher-steps steps with
evaluation rounds on --val (greedy, every --eval-every steps), then ``verl-async export``.
Its held-out score is its last round's ``eval/reward_mean``. ``--teacher RUN_DIR`` reuses
such a run directory instead (its eval.jsonl and newest checkpoint).

Then three arms of ``configs/tiny_distill.yaml`` per seed of --seeds, one run at a time,
the arms of a seed back to back:

  rl              distillation.enabled=false (the config is configs/tiny.yaml's otherwise)
  distill         the teacher alone: distillation.use_task_rewards=false
  distill+task    the task's GRPO loss plus the config's coefficient times the teacher's term

A seed S sets the student's initial weights (model.tiny.seed), the prompt order
(data.shuffle_seed) and the learner's and generators' torch seeds (learner.seed), the same
for the three arms. ``key=value`` overrides go to every student run.

Per run: the first evaluation round whose held-out score reaches the teacher's (and
--fraction of it), as a step and as the learner's wall-clock (``wall_s`` of the step that
made those weights), the held-out curve, ``distill/<teacher>/reverse_kl`` and
``reward_mean`` over the first and last 10 steps, the median step time and the machine's
mean 1-minute load average while it ran (other work on the cores slows the wall-clock). Writes
``distillation.json``, ``distillation.md`` (the tables) and, with matplotlib, the plot.
``--replot JSON`` draws the tables and the plot again from a saved ``distillation.json``
(--fraction may differ), running nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT,
    machine,
    mean,
    read_jsonl,
    rolling,
    run_to_end,
    run_train,
    sampled_load,
)

TEACHER = "trained"  # the teacher's name in the student runs: metrics distill/trained/...
ARMS = {
    "rl": ["distillation.enabled=false"],
    "distill": ["distillation.use_task_rewards=false"],
    "distill+task": ["distillation.use_task_rewards=true"],
}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "verl_async.launch.cli", *args]


def eval_curve(run_dir: Path, rows: list[dict]) -> list[dict]:
    """Every evaluation round as {step, score, wall_s}: wall_s is the learner's clock when
    the step that made the round's weights ended (0 for the initial weights)."""
    wall = {r["version"]: r["wall_s"] for r in rows}
    return [
        {"step": e["step"], "score": e["eval/reward_mean"], "wall_s": wall.get(e["version"], 0.0)}
        for e in read_jsonl(run_dir / "eval.jsonl")
    ]


def first_reaching(curve: list[dict], target: float) -> tuple[int | None, float | None]:
    """(step, wall_s) of the first round scoring at least ``target`` (None, None if none)."""
    for point in curve:
        if point["score"] >= target:
            return point["step"], point["wall_s"]
    return None, None


def teacher(args) -> tuple[Path, float, dict]:
    """Train (or reuse) and export the teacher; (exported dir, held-out score, its record)."""
    run_dir = args.teacher or args.out / "teacher"
    seconds, load = None, []
    if args.teacher is None:
        steps = args.teacher_steps
        overrides = [
            f"trainer.total_steps={steps}",
            f"checkpoint.every_steps={steps}",
            *eval_overrides(args),
        ]
        with sampled_load() as load:
            _, seconds = run_train(ROOT / "configs/tiny.yaml", run_dir, overrides)
    exported = args.out / "teacher_hf"
    run_to_end(cli_command("export", str(run_dir), str(exported), "--force"), "export")
    rounds = read_jsonl(run_dir / "eval.jsonl")
    if not rounds:
        raise SystemExit(f"{run_dir} has no eval.jsonl: train the teacher with eval rounds")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    record = {
        "run_dir": str(run_dir),
        "steps": len(rows),
        "score": rounds[-1]["eval/reward_mean"],
        "score_step": rounds[-1]["step"],
        "curve": eval_curve(run_dir, rows),
        "reward_last10": mean(r["reward_mean"] for r in rows[-10:]),
        "wall_s": seconds,
        "load_mean": mean(load) if load else None,
    }
    return exported, record["score"], record


def eval_overrides(args) -> list[str]:
    return [
        f"data.val_path={args.val.resolve()}",
        f"eval.every_steps={args.eval_every}",
        f"eval.max_prompts={args.eval_prompts}",
    ]


def summarize(arm: str, seed: int, rows: list[dict], run_dir: Path, target: float, args) -> dict:
    curve = eval_curve(run_dir, rows)
    kl_key = f"distill/{TEACHER}/reverse_kl"
    kl = [r[kl_key] for r in rows if kl_key in r]
    step, wall = first_reaching(curve, target)
    step_frac, wall_frac = first_reaching(curve, args.fraction * target)
    return {
        "arm": arm,
        "seed": seed,
        "steps": len(rows),
        "reach_step": step,
        "reach_wall_s": wall,
        "reach_frac_step": step_frac,
        "reach_frac_wall_s": wall_frac,
        "eval_first": curve[0]["score"] if curve else None,
        "eval_final": curve[-1]["score"] if curve else None,
        "eval_best": max((p["score"] for p in curve), default=None),
        "reverse_kl_first10": mean(kl[:10]) if kl else None,
        "reverse_kl_last10": mean(kl[-10:]) if kl else None,
        "reverse_kl": kl,
        "reward_first10": mean(r["reward_mean"] for r in rows[:10]),
        "reward_last10": mean(r["reward_mean"] for r in rows[-10:]),
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        "train_wall_s": rows[-1]["wall_s"],
        "curve": curve,
    }


def run_arms(args, exported: Path, target: float) -> list[dict]:
    teachers = f"distillation.teachers=[{{name: {TEACHER}, path: {exported}}}]"
    results = []
    for seed in args.seeds:
        seeded = [f"model.tiny.seed={seed}", f"data.shuffle_seed={seed}", f"learner.seed={seed}"]
        for arm, arm_overrides in ARMS.items():
            run_dir = args.out / arm.replace("+", "_") / f"seed{seed}"
            overrides = [
                f"trainer.total_steps={args.steps}",
                "checkpoint.every_steps=0",
                *eval_overrides(args),
                *seeded,
                teachers,
                # the teacher in the learner, as in the runs BENCHMARKS.md section 23
                # records (a later key=value can say distillation.scoring=process)
                "distillation.scoring=learner",
                *arm_overrides,
                *args.override,
            ]
            with sampled_load() as load:
                rows, _ = run_train(ROOT / "configs/tiny_distill.yaml", run_dir, overrides)
            res = summarize(arm, seed, rows, run_dir, target, args)
            res["load_mean"] = mean(load)
            results.append(res)
            print(line(res), flush=True)
    return results


def fmt(value, spec: str = ".3f") -> str:
    return "—" if value is None else format(value, spec)


def line(res: dict) -> str:
    return (
        f"{res['arm']:>13} seed {res['seed']}: held-out {fmt(res['eval_first'])} -> "
        f"{fmt(res['eval_final'])}  teacher's score at step {fmt(res['reach_step'], 'd')} "
        f"({fmt(res['reach_wall_s'], '.0f')} s)  reverse KL {fmt(res['reverse_kl_first10'])} "
        f"-> {fmt(res['reverse_kl_last10'])}  reward {res['reward_first10']:.3f} -> "
        f"{res['reward_last10']:.3f}  step {res['step_s_median']:.3f} s  load {res['load_mean']:.1f}"
    )


def faster(mine: float | None, rl: float | None) -> str:
    """'yes' when ``mine`` got there and RL alone did later or not at all, else 'no'."""
    return "yes" if mine is not None and (rl is None or mine < rl) else "no"


def verdicts(results: list[dict], target: float) -> list[dict]:
    """Each distillation run against RL alone of its seed: reached ``target`` in fewer
    steps, and in less learner wall-clock?"""
    rl = {r["seed"]: first_reaching(r["curve"], target) for r in results if r["arm"] == "rl"}
    out = []
    for r in results:
        if r["arm"] == "rl" or r["seed"] not in rl:
            continue
        step, wall = first_reaching(r["curve"], target)
        rl_step, rl_wall = rl[r["seed"]]
        out.append(
            {
                "arm": r["arm"],
                "seed": r["seed"],
                "steps": faster(step, rl_step),
                "wall": faster(wall, rl_wall),
                "step": step,
                "rl_step": rl_step,
                "wall_s": wall,
                "rl_wall_s": rl_wall,
            }
        )
    return out


def reach(r: dict, target: float) -> str:
    step, wall = first_reaching(r["curve"], target)
    return f"{fmt(step, 'd')} ({fmt(wall, '.0f')})"


def markdown(results: list[dict], record: dict, args) -> str:
    pct, score = f"{args.fraction:.0%}", record["score"]
    out = [
        f"Teacher: {record['steps']} steps, held-out score {score:.3f} (target); "
        f"{pct} of it: {args.fraction * score:.3f}.",
        "",
        f"| arm | seed | held-out first → last (best) | teacher's score at step (s) "
        f"| {pct} at step (s) | reverse KL first → last 10 | reward_mean first → last 10 "
        "| step s (median) | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        load = r.get("load_mean")
        out.append(
            f"| {r['arm']} | {r['seed']} | {fmt(r['eval_first'])} → {fmt(r['eval_final'])} "
            f"({fmt(r['eval_best'])}) | {reach(r, score)} | {reach(r, args.fraction * score)} "
            f"| {fmt(r['reverse_kl_first10'])} → {fmt(r['reverse_kl_last10'])} "
            f"| {r['reward_first10']:.3f} → {r['reward_last10']:.3f} "
            f"| {r['step_s_median']:.3f} | {fmt(load, '.1f')} |"
        )
    out += ["", "| arm | seed | teacher's score sooner than RL alone: steps | wall-clock |"]
    out.append("|---|---|---|---|")
    for v in verdicts(results, score):
        out.append(
            f"| {v['arm']} | {v['seed']} | {v['steps']} ({fmt(v['step'], 'd')} vs "
            f"{fmt(v['rl_step'], 'd')}) | {v['wall']} ({fmt(v['wall_s'], '.0f')} s vs "
            f"{fmt(v['rl_wall_s'], '.0f')} s) |"
        )
    return "\n".join(out) + "\n"


def plot(results: list[dict], record: dict, path: Path, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install '.[plot]'): no plot", flush=True)
        return
    colours = {"rl": "tab:grey", "distill": "tab:blue", "distill+task": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        style = styles[args.seeds.index(r["seed"]) % len(styles)]
        label = f"{r['arm']} seed {r['seed']}"
        kw = {"color": colours[r["arm"]], "linestyle": style, "label": label}
        axes[0].plot([p["step"] for p in r["curve"]], [p["score"] for p in r["curve"]], **kw)
        axes[1].plot([p["wall_s"] for p in r["curve"]], [p["score"] for p in r["curve"]], **kw)
        if r["reverse_kl"]:
            axes[2].plot(rolling(r["reverse_kl"], 10), **kw)
    for ax in axes[:2]:
        ax.axhline(record["score"], color="black", linewidth=0.8, label="teacher")
        ax.set_ylabel("held-out score (greedy)")
    axes[0].set_xlabel("learner step")
    axes[1].set_xlabel("learner wall-clock (s)")
    axes[2].set_xlabel("learner step")
    axes[2].set_ylabel(f"distill/{TEACHER}/reverse_kl (trailing 10-step mean)")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"tiny student, teacher trained {record['steps']} steps by GRPO")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=400, help="steps of each student run")
    parser.add_argument("--seeds", default="1,2", help="comma-separated student seeds")
    parser.add_argument("--teacher", type=Path, help="reuse this teacher run directory")
    parser.add_argument("--val", type=Path, default=ROOT / "configs/data/max_digit_val.jsonl")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=0, help="0: every --val prompt")
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/distillation")
    parser.add_argument("--plot", type=Path, help="PNG path (default: OUT/distillation.png)")
    parser.add_argument("--replot", type=Path, help="redraw tables and plot from this JSON")
    parser.add_argument("override", nargs="*", help="dotted.key=value for every student run")
    args = parser.parse_args()
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        summary = json.loads(args.replot.read_text())
        record, results = summary["teacher"], summary["runs"]
        args.seeds = list(dict.fromkeys(r["seed"] for r in results))
        target = record["score"]
    else:
        exported, target, record = teacher(args)
        print(f"teacher: held-out {target:.3f} after {record['steps']} steps", flush=True)
        results = run_arms(args, exported, target)
        summary = {"machine": machine(), "teacher": record, "runs": results}
        (args.out / "distillation.json").write_text(json.dumps(summary, indent=1))
    table = markdown(results, record, args)
    (args.out / "distillation.md").write_text(table)
    plot(results, record, args.plot or args.out / "distillation.png", args)
    print(table)
    vs = verdicts(results, target)
    steps, wall = (sum(v[k] == "yes" for v in vs) for k in ("steps", "wall"))
    print(
        f"summary: of {len(vs)} distillation runs, {steps} reached the teacher's held-out "
        f"{target:.3f} in fewer steps than RL alone of their seed, {wall} in less "
        f"wall-clock ({summary['machine']})"
    )


if __name__ == "__main__":
    main()
