"""Generation throughput with a reward model attached, against the same run without one.

    python benchmarks/rewards.py [--config configs/tiny.yaml] [--repeats 2] [--prefill 3]
                                 [--reward-model DIR] [--out runs/rewards] [key=value ...]

Each run is ``verl-async train CONFIG`` with ``trainer.prefill_steps = P`` and
``trainer.total_steps = P`` (eta = P - 1): the learner waits until the generators have
filled the buffer with P steps of scored groups, so ``prefill_s`` in metrics.jsonl is
generation alone (sampling and scoring, nothing else). Both arms use the config's reward
sources; the "with" arm adds a ``model`` source served by its own reward-model process
(``placement.reward_model_devices``). Runs go in ABBA order; the summary is the ratio of
generated tokens per second, with / without (target >= 0.9).

The reward model: ``--reward-model DIR``, or else one built here. For the tiny default
it is the tiny sequence classifier; for a real policy it is the policy's own backbone with
a fresh scalar head (same size as the policy, so the scoring cost is realistic; its
scores mean nothing, which does not matter for a throughput measurement).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, run_train  # noqa: E402


def build_reward_model(args) -> Path:
    if args.reward_model:
        return Path(args.reward_model)
    out = args.out / "reward_model"
    from verl_async.config import load_config

    policy = load_config(args.config, args.override).model.path
    if not policy:
        from verl_async.tiny_reward_model import build_tiny_reward_model

        return build_tiny_reward_model(out)
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(policy)
        model = AutoModelForSequenceClassification.from_pretrained(
            policy, num_labels=1, dtype=torch.float32
        )
        model.config.pad_token_id = tok.pad_token_id
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return out


def sources_with_model(args, rm: Path) -> str:
    from verl_async.config import load_config

    cfg = load_config(args.config, args.override)
    import msgspec

    sources = [msgspec.to_builtins(s) for s in cfg.rewards.sources]
    sources.append({"name": "rm", "kind": "model", "path": str(rm), "weight": 0.1})
    return "rewards.sources=" + json.dumps(sources)


def generation_run(name: str, extra: list[str], args) -> dict:
    p = args.prefill
    rows, _ = run_train(
        args.config,
        args.out / name,
        [
            f"staleness.max={p - 1}",
            f"trainer.total_steps={p}",
            f"trainer.prefill_steps={p}",
            "checkpoint.every_steps=0",
            "eval.every_steps=0",
            *args.override,
            *extra,
        ],
    )
    seconds = rows[0]["prefill_s"]
    tokens = sum(r["response_tokens"] for r in rows)
    samples = sum(r["samples"] for r in rows)
    failed = sum(r.get("reward_failed/rm", 0) for r in rows)
    return {
        "run": name,
        "prefill_s": seconds,
        "tokens_per_s": tokens / seconds,
        "samples_per_s": samples / seconds,
        "rm_failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    parser.add_argument("--repeats", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--prefill", type=int, default=3, help="steps of groups per run")
    parser.add_argument("--reward-model", help="reward-model directory (default: built)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/rewards")
    parser.add_argument("override", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    with_model = [sources_with_model(args, build_reward_model(args))]
    results = []
    for i in range(args.repeats):
        order = [("without", []), ("with", with_model)]
        for arm, extra in order if i % 2 == 0 else order[::-1]:
            res = generation_run(f"{arm}{i}", extra, args)
            results.append({**res, "arm": arm})
            print(
                f"{res['run']:>9}: {res['prefill_s']:7.2f} s  {res['tokens_per_s']:8.1f} tok/s  "
                f"{res['samples_per_s']:7.2f} samples/s  reward-model failures {res['rm_failed']}",
                flush=True,
            )
    without = mean(r["tokens_per_s"] for r in results if r["arm"] == "without")
    with_rm = mean(r["tokens_per_s"] for r in results if r["arm"] == "with")
    summary = {
        "config": str(args.config),
        "machine": machine(),
        "runs": results,
        "ratio": with_rm / without,
    }
    (args.out / "rewards.json").write_text(json.dumps(summary, indent=1))
    print(
        f"summary: generation with a reward model: {with_rm:.1f} tok/s vs {without:.1f} without = "
        f"{with_rm / without:.3f}x (target >= 0.9; {args.repeats} ABBA pairs, {machine()})"
    )


if __name__ == "__main__":
    main()
