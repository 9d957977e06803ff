"""Everything one GPU lease should measure, in one command of at most ~8 minutes.

    python benchmarks/gpu_check.py [--out runs/gpu_check] [--budget-s 440] [--only PART,...]
    python benchmarks/gpu_check.py --dry-run     # the same plan at tiny sizes on the CPU

The parts run one after another, each in its own process under its own time limit, in
order of what matters most (a lease cut short still leaves the first ones):

- ``ipc``: the weight update of a Qwen2.5-0.5B-shaped model (bf16, 0.99 GB) from the
  learner's process to a generator's process on the same GPU, through the weight-sync
  group's same-device channel (CUDA IPC; a memory file on the CPU): seconds per update,
  every byte compared with what was sent. A member process that dies is reported by its
  exit code or signal and its faulthandler traceback.
- ``e2e-tiny``: the whole loop on one GPU: ``verl-async train`` with the buffer, a
  transformers-engine generator and the learner sharing ``cuda:0``
  (``placement.colocate``), bf16, the tiny model on the tiny task (which it learns
  within a few dozen steps on a CPU): reward first and last, step time, weight-sync
  time, the learner's peak GPU memory and the log-prob gap between the generator's and
  the learner's (``rollout_logp_diff_max``).
- ``learner-*-chunked`` and ``learner-*-fsdp2``, at Qwen2.5-0.5B's and SmolLM2-135M's
  shapes: ``benchmarks/gpu.py``, the step a one-rank learner runs (Accelerate, not
  sharded, the chunked head; also with the batch copied on a side stream), then the same
  step under FSDP2 at one rank. Each of 10 timed steps: wall seconds, device seconds of
  its phases (pi_prox, forwards, backwards, optimizer) from CUDA events, the garbage
  collector's seconds; medians and spread, MFU (matrix weights and causal attention) with
  the former count beside it, peak memory.
- ``delta-device``: a sparse weight update of one 64 MiB bf16 bucket with 4 % of its
  words changed, on the GPU (``benchmarks/delta_device.py``): finding the changed words
  and applying them against copying the bucket whole (why CUDA IPC sends whole updates).
- ``profile``: one SmolLM2-shaped step under torch.profiler: kernel launches per step,
  wall and kernel seconds, the operators by device and by host time.
- the other ``learner-*`` variants at both shapes: the fused head, full logits, each
  option (compile, padding-free packing, Liger's kernels) alone and all together, then
  responses of unequal lengths without and with padding-free packing.
- ``e2e-smollm2``: the whole loop again with a random model of SmolLM2-135M's shape.

Liger's kernels need ``liger-kernel`` (a small pure-Python wheel, with Triton); where it
is missing its two parts fail and the rest run. With a 15-minute lease: ``--budget-s
440`` (the default on a GPU; ``--budget-s 450`` took 475 s on an H200, the command's own
start and the last part's end being outside the budget) keeps the command within 8
minutes and leaves time for the machine's start and a rerun of what failed (``--only
PART,...``; a prefix such as ``learner`` selects a family). The parts' own limits add up
to more than the budget: what it leaves out is the end of the list, recorded as "no
time". A dry run has no budget unless given one (its parts' limits bound it).

Writes ``OUT/results.json`` (every part: command, exit code, seconds, its figures) and
``OUT/summary.md`` (one table) after each part, and each part's own output under
``OUT/<part>/``. A part that fails or runs out of time is recorded as such and the next
one starts. ``--dry-run`` runs every part at tiny sizes on the CPU (gloo, float32, a
memory file instead of CUDA IPC): what ``tests/integration/test_benchmarks.py`` runs, so
the script cannot rot between leases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

SMOLLM2 = (
    "--layers 30 --hidden 576 --kv-heads 3 --intermediate 1536 --vocab 49152 "
    "--samples 64 --seq-len 512 --response-len 256"
)
QWEN = (
    "--layers 24 --hidden 896 --kv-heads 2 --intermediate 4864 --vocab 151936 "
    "--samples 64 --seq-len 512 --response-len 256"
)
TINY_LEARNER = (
    "--device cpu --layers 2 --hidden 64 --intermediate 128 --vocab 512 "
    "--samples 16 --seq-len 32 --response-len 8"
)
# The learner's options, one flag set each (benchmarks/gpu.py), most telling first:
# "chunked" is the production path (one rank: Accelerate, no sharding; the default
# chunked head), timed also with the batch copied on a side stream; "fsdp2" the same step
# sharded at one rank; "full-logits" the learner before chunking (the head over every
# kept position at once).
VARIANTS = {
    "chunked": "--overlap",
    "fsdp2": "--fsdp2",
    "fused-head": "--fused-head",
    "full-logits": "--chunk-tokens 0",
    "compile": "--compile",
    "padding-free": "--padding-free",
    "liger": "--liger",
    "all": "--compile --padding-free --liger",
    "ragged": "--ragged",
    "ragged-padding-free": "--ragged --padding-free",
}
FIRST = ("chunked", "fsdp2")  # at every shape before any other variant runs
STEPS = 10  # timed steps of each learner part (3 in a dry run)
# SmolLM2-135M's shape as the tiny model's fields (a random model with the tiny vocabulary).
SMOLLM2_TINY = [
    "model.tiny.hidden_size=576", "model.tiny.num_layers=30", "model.tiny.num_heads=9",
    "model.tiny.num_kv_heads=3", "model.tiny.intermediate_size=1536",
]  # fmt: skip


@dataclass
class Part:
    name: str
    argv: list[str]  # run from the repository root
    timeout_s: float
    figures: str = ""  # file under the part's directory holding its figures (JSON)


def e2e_part(name: str, out: Path, dry: bool, steps: int, extra: list[str], timeout_s: float):
    device = "cpu" if dry else "cuda:0"
    overrides = [
        f"trainer.total_steps={steps}", "generators.engine=hf", "checkpoint.every_steps=0",
        f"placement.generators=[{device}]", f"placement.learners=[{device}]",
        "model.dtype=float32" if dry else "model.dtype=bfloat16",
        *([] if dry else ["placement.colocate=true"]), *extra,
    ]  # fmt: skip
    argv = [
        sys.executable, "-m", "verl_async.launch.cli", "train", "configs/tiny.yaml",
        "--run-dir", str(out / name), *overrides,
    ]  # fmt: skip
    return Part(name, argv, timeout_s, figures="metrics.jsonl")


def learner_part(out: Path, dry: bool, shape: str, dims: str, variant: str) -> Part | None:
    """benchmarks/gpu.py at one shape with one variant's flags (None: not on a CPU)."""
    flags = VARIANTS[variant]
    if dry and "--liger" in flags:  # Liger's kernels are Triton's: CUDA only
        if variant == "liger":
            return None
        flags = flags.replace("--liger", "")
    name = f"learner-{shape}-{variant}"
    argv = [sys.executable, "benchmarks/gpu.py", *dims.split(), *flags.split()]
    argv += ["--steps", str(3 if dry else STEPS), "--out", str(out / name)]
    limit = 240 if dry else (120 if "--compile" in flags else 60)  # compiling: two shapes
    if "--overlap" in flags:
        limit *= 2  # the steps run twice
    return Part(name, argv, limit, figures="gpu.json")


def learner_parts(out: Path, dry: bool) -> tuple[list[Part], list[Part]]:
    """(the production path and FSDP2 at one rank at each shape; every other variant at
    each shape), Qwen first: its target is the higher."""
    shapes = {"tiny": TINY_LEARNER} if dry else {"qwen0.5b": QWEN, "smollm2": SMOLLM2}
    first = [learner_part(out, dry, s, d, v) for s, d in shapes.items() for v in FIRST]
    rest = [
        learner_part(out, dry, s, d, v)
        for s, d in shapes.items()
        for v in VARIANTS
        if v not in FIRST
    ]
    return first, [p for p in rest if p is not None]


def plan(args) -> list[Part]:
    """The parts in the order they run: what matters most first."""
    out, dry = args.out, args.dry_run
    ipc = [sys.executable, "benchmarks/gpu_check.py", "--ipc", "--out", str(out / "ipc")]
    dims = TINY_LEARNER if dry else SMOLLM2
    profile = [sys.executable, "benchmarks/gpu.py", *dims.split(), "--steps", "1", "--profile"]
    first, rest = learner_parts(out, dry)
    delta = [sys.executable, "benchmarks/delta_device.py", "--out", str(out / "delta-device")]
    parts = [
        Part("ipc", ipc + (["--dry-run"] if dry else []), 60 if dry else 90, figures="ipc.json"),
        e2e_part("e2e-tiny", out, dry, 8 if dry else 100, [], 150 if dry else 120),
        *first,
        Part("delta-device", delta + (["--dry-run"] if dry else []), 60, "delta_device.json"),
        Part("profile", profile + ["--out", str(out / "profile")], 60, figures="gpu.json"),
        *rest,
    ]
    if not dry:
        smollm2 = [*SMOLLM2_TINY, "learner.lr=1e-4"]
        parts.append(e2e_part("e2e-smollm2", out, dry, 30, smollm2, 120))
    if args.only:
        wanted = set(args.only.split(","))
        parts = [p for p in parts if p.name in wanted or p.name.split("-")[0] in wanted]
    return parts


def run_part(part: Part, out: Path, budget_left: float) -> dict:
    """One part in its own process group, killed at its limit; its output saved."""
    where = out / part.name
    where.mkdir(parents=True, exist_ok=True)
    limit = min(part.timeout_s, budget_left)
    t0 = time.monotonic()
    with open(where / "output.log", "w") as log:
        proc = subprocess.Popen(
            part.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
    result = {
        "part": part.name, "argv": part.argv, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
        "limit_s": round(limit, 1), "figures": read_figures(where / part.figures),
    }  # fmt: skip
    tail = (where / "output.log").read_text(errors="replace").splitlines()[-3:]
    result["tail"] = tail
    return result


def read_figures(path: Path) -> dict:
    """A part's figures: its JSON file, or a training run's summary from metrics.jsonl."""
    if not path.is_file():
        return {}
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        keep = (
            "device", "sharding", "params", "mfu", "old_mfu", "tflops_per_device", "peak_gib",
            "step_s_median", "step_s", "phases_median_s", "profile", "update_s", "bytes",
            "route", "identical", "member_died", "sender_error", "options", "warmup_s",
            "kind", "changed", "encode_s", "apply_s", "copy_s", "delta_over_copy",
        )  # fmt: skip
        return {k: v for k, v in data.items() if k in keep}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not rows:
        return {}
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    k = max(1, min(5, len(rewards) // 4))
    return {
        "steps": len(rows),
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "step_s_median": sorted(r["step_s"] for r in rows)[len(rows) // 2],
        "rollout_logp_diff_max": max(r.get("rollout_logp_diff_max", 0.0) for r in rows),
        "weight_sync_s_median": sorted(r["weight_sync_s"] for r in rows)[len(rows) // 2],
        "learner_peak_gpu_mib": rows[-1].get("learner_peak_gpu_mib"),  # CUDA runs only
    }


BRIEF = ("device", "params", "options", "step_s")  # in results.json, not in the table


def summary_md(results: list[dict], dry: bool) -> str:
    lines = [
        f"# gpu_check{' (dry run, CPU)' if dry else ''}",
        "",
        f"machine: {machine()}",
        "",
        "| part | exit | s | figures |",
        "|---|---|---:|---|",
    ]
    for r in results:
        shown = {k: v for k, v in r["figures"].items() if k not in BRIEF and v is not None}
        figs = ", ".join(f"{k} {_short(v)}" for k, v in shown.items())
        lines.append(f"| {r['part']} | {r['rc']} | {r['seconds']} | {figs} |")
    return "\n".join(lines) + "\n"


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and v and isinstance(v[0], float):
        return "[" + ", ".join(f"{x:.4g}" for x in v[:5]) + (", ...]" if len(v) > 5 else "]")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {_short(x)}" for k, x in v.items()) + "}"
    return str(v)[:80]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs/gpu_check")
    ap.add_argument(
        "--budget-s", type=float, default=None,
        help="all parts together (default: 440 on a GPU, none in a dry run)",
    )  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--only", default="", help="comma-separated part names or prefixes")
    ap.add_argument("--ipc", action="store_true", help="run the ipc part in this process")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    if args.ipc:
        from ipc_check import ipc_check

        return ipc_check(args.out, args.dry_run)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("summary: skipped, no CUDA device (--dry-run runs the plan on the CPU)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (float("inf") if args.dry_run else 440.0)
    deadline = time.monotonic() + budget
    results = []
    for part in plan(args):
        left = deadline - time.monotonic()
        if left < 10:
            results.append({"part": part.name, "argv": part.argv, "rc": "no time", "seconds": 0,
                            "figures": {}})  # fmt: skip
            continue
        print(f"[gpu_check] {part.name} (at most {min(part.timeout_s, left):.0f} s)", flush=True)
        result = run_part(part, args.out, left)
        results.append(result)
        print(f"[gpu_check] {part.name}: exit {result['rc']} in {result['seconds']} s "
              f"{json.dumps(result['figures'])[:300]}", flush=True)  # fmt: skip
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "summary.md").write_text(summary_md(results, args.dry_run))
    failed = [r["part"] for r in results if r["rc"] != 0]
    print(
        f"summary: {len(results) - len(failed)} of {len(results)} parts passed"
        + (f"; failed or cut: {', '.join(failed)}" if failed else "")
        + f"; {args.out / 'summary.md'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
