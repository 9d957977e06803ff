"""Advantage estimators side by side: reward curves, step time and learner memory.

    python benchmarks/estimators.py [--config configs/tiny.yaml] [--steps 400]
                                    [--cases grpo,gae,gae_centered,rloo,reinforce_plus_plus,grpo_kl]
                                    [--seeds 1,2,3] [--val PATH] [--set CASE:key=value ...]
                                    [--window 50] [--target 0.8] [--out runs/estimators]
                                    [key=value ...]

Runs ``verl-async train CONFIG`` once per case (and per seed of ``--seeds``, as
``learner.seed``), back to back, with the same config, data, rewards and hyper-parameters
except the estimator:

  grpo                 the config as it is (group-relative advantages)
  gae                  PPO with a critic (fresh scalar head on the policy, critic.lr from
                       --critic-lr) and a KL loss to the reference (algo.kl.loss_coef
                       from --kl-coef), so the learner holds actor, critic and reference
  gae_centered         gae with its advantages centred over the batch, not whitened
                       (algo.normalize_adv_std=false)
  rloo, reinforce_plus_plus
  grpo_kl              grpo with the same KL loss (reference, no critic)

``key=value`` overrides go to every run; ``--set CASE:key=value`` to one case's runs
(e.g. ``--set gae_centered:learner.lr=1e-3``). ``--val PATH`` evaluates the held-out
prompts of PATH greedily before the first step and after the last (``eval.jsonl``).

For each run: the final reward (mean of the last --window steps), the first step whose
trailing --window mean reaches --target, the held-out accuracy before and after, the
median learner step time, the learner's peak resident memory (``learner_peak_rss_mib``;
``learner_peak_gpu_mib`` on CUDA) and the whole command's wall time. With several seeds,
each case's means over them follow. Writes ``estimators.json`` and, with matplotlib,
``estimators.png`` (trailing-mean reward per case, averaged over the seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, read_jsonl, rolling, run_train  # noqa: E402


def case_overrides(args) -> dict[str, list[str]]:
    kl = [f"algo.kl.loss_coef={args.kl_coef}"]
    gae = ["algo.adv_estimator=gae", f"critic.lr={args.critic_lr}", *kl]
    return {
        "grpo": [],
        "gae": gae,
        "gae_centered": [*gae, "algo.normalize_adv_std=false"],
        "rloo": ["algo.adv_estimator=rloo"],
        "reinforce_plus_plus": ["algo.adv_estimator=reinforce_plus_plus"],
        "grpo_kl": kl,
    }


def case_settings(args, cases: list[str]) -> dict[str, list[str]]:
    """The ``--set CASE:key=value`` overrides, by case."""
    out: dict[str, list[str]] = {name: [] for name in cases}
    for item in args.set:
        name, sep, override = item.partition(":")
        if not sep or "=" not in override or name not in out:
            raise SystemExit(f"bad --set '{item}': expected CASE:key=value, CASE one of --cases")
        out[name].append(override)
    return out


def eval_scores(run_dir: Path) -> tuple[float | None, float | None]:
    """Held-out reward of the first and the last evaluation round (None without --val)."""
    rows = read_jsonl(run_dir / "eval.jsonl")
    if not rows:
        return None, None
    return rows[0]["eval/reward_mean"], rows[-1]["eval/reward_mean"]


def summarize(name: str, seed, rows: list[dict], seconds: float, run_dir: Path, args) -> dict:
    rewards = [r["reward_mean"] for r in rows]
    smooth = rolling(rewards, args.window)
    reached = next(
        (i for i, v in enumerate(smooth) if i >= args.window - 1 and v >= args.target), None
    )
    gpu = [r["learner_peak_gpu_mib"] for r in rows if "learner_peak_gpu_mib" in r]
    eval_first, eval_final = eval_scores(run_dir)
    return {
        "case": name,
        "seed": seed,
        "steps": len(rows),
        "reward_first": mean(rewards[: args.window]),
        "reward_final": mean(rewards[-args.window :]),
        "step_to_target": reached,
        "eval_first": eval_first,
        "eval_final": eval_final,
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        "peak_rss_mib": max(r["learner_peak_rss_mib"] for r in rows),
        "peak_gpu_mib": max(gpu) if gpu else None,
        "wall_s": seconds,
        "curve": smooth,
    }


def by_case(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for res in results:
        out.setdefault(res["case"], []).append(res)
    return out


def case_means(runs: list[dict]) -> dict:
    """One case over its seeds: means of the final reward and held-out accuracy, the
    median step time and the largest peak memory."""
    evals = [r["eval_final"] for r in runs if r["eval_final"] is not None]
    return {
        "case": runs[0]["case"],
        "seeds": [r["seed"] for r in runs],
        "reward_final_mean": mean(r["reward_final"] for r in runs),
        "reward_final": [r["reward_final"] for r in runs],
        "eval_final_mean": mean(evals) if evals else None,
        "eval_final": evals,
        "step_s_median": statistics.median(r["step_s_median"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
    }


def plot(results: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install '.[plot]'): no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in by_case(results).items():
        curve = [mean(points) for points in zip(*(r["curve"] for r in runs), strict=False)]
        label = name if len(runs) == 1 else f"{name} (mean of {len(runs)} seeds)"
        ax.plot(curve, label=label)
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward (trailing mean)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--cases", default="grpo,gae,gae_centered,rloo,reinforce_plus_plus,grpo_kl")
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--kl-coef", type=float, default=0.001)
    parser.add_argument("--seeds", default="", help="comma-separated learner.seed values")
    parser.add_argument("--val", type=Path, help="held-out prompts, evaluated greedily")
    parser.add_argument("--set", action="append", default=[], help="CASE:key=value")
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/estimators")
    parser.add_argument("override", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = case_overrides(args)
    cases = args.cases.split(",")
    for name in cases:
        if name not in overrides:
            raise SystemExit(f"unknown case '{name}' (choose from {', '.join(overrides)})")
    settings = case_settings(args, cases)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    every = list(args.override)
    if args.val:
        every += [f"data.val_path={args.val.resolve()}", f"eval.every_steps={args.steps}"]
    results = []
    for name in cases:
        for seed in seeds:
            run_dir = args.out / name if seed is None else args.out / name / f"seed{seed}"
            seeded = [] if seed is None else [f"learner.seed={seed}"]
            extra = [*every, *seeded, *overrides[name], *settings[name]]
            rows, seconds = run_train(
                args.config, run_dir, [f"trainer.total_steps={args.steps}", *extra]
            )
            res = summarize(name, seed, rows, seconds, run_dir, args)
            results.append(res)
            gpu = f"  gpu {res['peak_gpu_mib']} MiB" if res["peak_gpu_mib"] else ""
            held = (
                f"  held-out {res['eval_first']:.3f} -> {res['eval_final']:.3f}"
                if res["eval_final"] is not None
                else ""
            )
            label = name if seed is None else f"{name} seed {seed}"
            print(
                f"{label:>28}: reward {res['reward_first']:.3f} -> {res['reward_final']:.3f}"
                f"{held}  target at step {res['step_to_target']}  "
                f"step {res['step_s_median']:.3f} s  rss {res['peak_rss_mib']} MiB{gpu}  "
                f"wall {seconds:.0f} s",
                flush=True,
            )
    means = [case_means(runs) for runs in by_case(results).values()]
    if len(seeds) > 1:
        for m in means:
            held = (
                f", held-out {m['eval_final_mean']:.3f}" if m["eval_final_mean"] is not None else ""
            )
            print(
                f"{m['case']:>20}: mean final reward over {len(m['seeds'])} seeds "
                f"{m['reward_final_mean']:.3f}{held}"
            )
    summary = {
        "config": str(args.config),
        "machine": machine(),
        "runs": results,
        "cases": means,
    }
    (args.out / "estimators.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "estimators.png", f"{args.config.name}, {args.steps} steps")
    base = next((m for m in means if m["case"] == "grpo"), means[0])
    for m in means:
        print(
            f"  {m['case']}: step time {m['step_s_median'] / base['step_s_median']:.2f}x "
            f"{base['case']}, peak memory {m['peak_rss_mib'] / base['peak_rss_mib']:.2f}x"
        )
    print(f"summary: {len(means)} estimators on {args.config.name} ({machine()})")


if __name__ == "__main__":
    main()
