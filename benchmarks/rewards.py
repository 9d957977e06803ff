"""Generation throughput with a reward model attached, against the same run without one.

    python benchmarks/rewards.py [--config configs/tiny.yaml] [--repeats 2] [--prefill 3]
                                 [--reward-model DIR] [--out runs/rewards] [--whole-rows]
                                 [--fill-only] [key=value ...]

Each run is ``verl-async train CONFIG`` with ``trainer.total_steps = P`` (eta = P - 1)
and the learner of benchmarks/bench_learner.py with ``--prefill-steps P``: it waits until
the generators have filled the buffer with P steps of scored groups, so ``prefill_s`` in
metrics.jsonl is generation alone (sampling and scoring, nothing else). Both arms use the
config's reward sources; the "with" arm adds a ``model`` source served by its own
reward-model process (``placement.reward_models``); ``--whole-rows`` adds a third arm whose
reward model forwards every conversation whole (``share_prefix: false``). Runs go in ABBA
order (ABC CBA with three arms); the summary is the ratio of generated tokens per second,
with / without (target >= 0.9).

The reward model: ``--reward-model DIR``, or else one built here. For the tiny default
it is the tiny sequence classifier; for a real policy it is the policy's own backbone with
a fresh scalar head (same size as the policy, so the scoring cost is realistic; its
scores mean nothing, which does not matter for a throughput measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, interrupt, machine, mean, run_train, train_command  # noqa: E402

from verl_async.metrics import read_metrics  # noqa: E402


def build_reward_model(args) -> Path:
    if args.reward_model:
        return Path(args.reward_model)
    out = args.out / "reward_model"
    from verl_async.config import load_config

    policy = load_config(args.config, args.override).model.path
    if not policy:
        from tiny_reward_model import build_tiny_reward_model  # benchmarks/ is on sys.path

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


def sources_with_model(args, rm: Path, share_prefix: bool = True) -> str:
    from verl_async.config import load_config

    cfg = load_config(args.config, args.override)
    import msgspec

    sources = [msgspec.to_builtins(s) for s in cfg.rewards.sources]
    sources.append(
        {
            "name": "rm",
            "kind": "model",
            "path": str(rm),
            "weight": 0.1,
            "share_prefix": share_prefix,
        }
    )
    return "rewards.sources=" + json.dumps(sources)


def fill_only(run_dir: Path, overrides: list[str], learner: list[str], args) -> list[dict]:
    """The run stopped (SIGINT, as Ctrl-C) once its first step is logged: that row holds
    ``prefill_s``, and the learner's P - 1 further steps would only cost time."""
    proc = subprocess.Popen(
        train_command(args.config, run_dir, overrides, learner),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 1800
    try:
        while not read_metrics(run_dir / "metrics.jsonl"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"run {run_dir.name} ended or timed out before its first step")
            time.sleep(0.5)
    finally:
        interrupt(proc)
    return read_metrics(run_dir / "metrics.jsonl")[:1]


def generation_run(name: str, extra: list[str], args) -> dict:
    p = args.prefill
    overrides = [
        f"staleness.max={p - 1}",
        f"trainer.total_steps={p}",
        "checkpoint.every_steps=0",
        "eval.every_steps=0",
        *args.override,
        *extra,
    ]
    learner = [f"--prefill-steps={p}"]
    if args.fill_only:
        rows = fill_only(args.out / name, overrides, learner, args)
        samples = p * rows[0]["samples"]  # every step holds the same number of samples
        tokens = p * rows[0]["response_tokens"]  # an estimate: step 0's responses
    else:
        rows, _ = run_train(args.config, args.out / name, overrides, learner)
        samples = sum(r["samples"] for r in rows)
        tokens = sum(r["response_tokens"] for r in rows)
    seconds = rows[0]["prefill_s"]
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
    parser.add_argument(
        "--whole-rows",
        action="store_true",
        help="a third arm: the reward model forwards every row whole (share_prefix=false)",
    )
    parser.add_argument(
        "--fill-only",
        action="store_true",
        help="stop each run at its first step (long fills of a real model); the ratio is "
        "then of samples/s, exact, where tokens/s would be estimated from step 0",
    )
    parser.add_argument("override", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    rm = build_reward_model(args)
    order = [("without", []), ("with", [sources_with_model(args, rm)])]
    if args.whole_rows:
        order.append(("whole", [sources_with_model(args, rm, share_prefix=False)]))
    results = []
    for i in range(args.repeats):
        for arm, extra in order if i % 2 == 0 else order[::-1]:
            res = generation_run(f"{arm}{i}", extra, args)
            results.append({**res, "arm": arm})
            print(
                f"{res['run']:>9}: {res['prefill_s']:7.2f} s  {res['tokens_per_s']:8.1f} tok/s  "
                f"{res['samples_per_s']:7.2f} samples/s  reward-model failures {res['rm_failed']}",
                flush=True,
            )
    measure = "samples_per_s" if args.fill_only else "tokens_per_s"
    rate = {arm: mean(r[measure] for r in results if r["arm"] == arm) for arm, _ in order}
    summary = {
        "config": str(args.config),
        "machine": machine(),
        "runs": results,
        "measure": measure,
        "ratio": rate["with"] / rate["without"],
    }
    if args.whole_rows:
        summary["ratio_whole_rows"] = rate["whole"] / rate["without"]
    (args.out / "rewards.json").write_text(json.dumps(summary, indent=1))
    print(
        f"summary: generation with a reward model: {rate['with']:.2f} vs "
        f"{rate['without']:.2f} {measure} without = {summary['ratio']:.3f}x "
        f"(target >= 0.9; {args.repeats} ABBA rounds, {machine()})"
    )
    if args.whole_rows:
        print(
            f"  whole rows (share_prefix=false): {rate['whole']:.2f} {measure} = "
            f"{summary['ratio_whole_rows']:.3f}x"
        )


if __name__ == "__main__":
    main()
