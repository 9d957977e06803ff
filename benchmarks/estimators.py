"""Advantage estimators side by side: reward curves, step time and learner memory.

    python benchmarks/estimators.py [--config configs/tiny.yaml] [--steps 400]
                                    [--cases grpo,gae,gae_centered,rloo,reinforce_plus_plus,grpo_kl]
                                    [--window 50] [--target 0.8] [--out runs/estimators]
                                    [key=value ...]

Runs ``verl-async train CONFIG`` once per case, back to back, with the same config,
data, rewards and hyper-parameters except the estimator:

  grpo                 the config as it is (group-relative advantages)
  gae                  PPO with a critic (fresh scalar head on the policy, critic.lr from
                       --critic-lr) and a KL loss to the reference (algo.kl.loss_coef
                       from --kl-coef), so the learner holds actor, critic and reference
  gae_centered         gae with its advantages centred over the batch, not whitened
                       (algo.normalize_adv_std=false)
  rloo, reinforce_plus_plus
  grpo_kl              grpo with the same KL loss (reference, no critic)

For each: the final reward (mean of the last --window steps), the first step whose
trailing --window mean reaches --target, the median learner step time, the learner's peak
resident memory (``learner_peak_rss_mib``; ``learner_peak_gpu_mib`` on CUDA) and the
whole command's wall time. Writes ``estimators.json`` and, with matplotlib,
``estimators.png`` (trailing-mean reward per case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, rolling, run_train  # noqa: E402


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


def summarize(name: str, rows: list[dict], seconds: float, args) -> dict:
    rewards = [r["reward_mean"] for r in rows]
    smooth = rolling(rewards, args.window)
    reached = next(
        (i for i, v in enumerate(smooth) if i >= args.window - 1 and v >= args.target), None
    )
    gpu = [r["learner_peak_gpu_mib"] for r in rows if "learner_peak_gpu_mib" in r]
    return {
        "case": name,
        "steps": len(rows),
        "reward_first": mean(rewards[: args.window]),
        "reward_final": mean(rewards[-args.window :]),
        "step_to_target": reached,
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        "peak_rss_mib": max(r["learner_peak_rss_mib"] for r in rows),
        "peak_gpu_mib": max(gpu) if gpu else None,
        "wall_s": seconds,
        "curve": smooth,
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
    for res in results:
        ax.plot(res["curve"], label=res["case"])
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
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/estimators")
    parser.add_argument("override", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = case_overrides(args)
    results = []
    for name in args.cases.split(","):
        if name not in overrides:
            raise SystemExit(f"unknown case '{name}' (choose from {', '.join(overrides)})")
        rows, seconds = run_train(
            args.config,
            args.out / name,
            [f"trainer.total_steps={args.steps}", *args.override, *overrides[name]],
        )
        res = summarize(name, rows, seconds, args)
        results.append(res)
        gpu = f"  gpu {res['peak_gpu_mib']} MiB" if res["peak_gpu_mib"] else ""
        print(
            f"{name:>20}: reward {res['reward_first']:.3f} -> {res['reward_final']:.3f}  "
            f"target at step {res['step_to_target']}  step {res['step_s_median']:.3f} s  "
            f"rss {res['peak_rss_mib']} MiB{gpu}  wall {seconds:.0f} s",
            flush=True,
        )
    summary = {"config": str(args.config), "machine": machine(), "runs": results}
    (args.out / "estimators.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "estimators.png", f"{args.config.name}, {args.steps} steps")
    base = next((r for r in results if r["case"] == "grpo"), results[0])
    for res in results:
        print(
            f"  {res['case']}: step time {res['step_s_median'] / base['step_s_median']:.2f}x "
            f"{base['case']}, peak memory {res['peak_rss_mib'] / base['peak_rss_mib']:.2f}x"
        )
    print(f"summary: {len(results)} estimators on {args.config.name} ({machine()})")


if __name__ == "__main__":
    main()
