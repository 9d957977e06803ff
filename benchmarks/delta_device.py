"""What a sparse weight update costs on the device that holds the bucket, against copying
the bucket whole: the question behind the CUDA IPC route sending whole updates.

    python benchmarks/delta_device.py [--device cuda] [--mib 64] [--changed 0.04] [--out DIR]
    python benchmarks/delta_device.py --dry-run     # 1 MiB on the CPU

One bf16 bucket of ``--mib`` MiB; ``--changed`` of its words get a new value (as a small
optimizer step leaves them after the cast). Timed, each the median of 5 after a warm-up,
with the device synchronised around each: ``encode`` (learner rank 0 finds the changed
words and builds the payload, verl_async/weight_delta.py), ``apply`` (a member writes the
payload into its copy) and ``copy`` (the whole bucket copied device to device, which is
what a whole update over CUDA IPC costs the receiver). Checks that the delta left the
member's copy equal to the bucket, bit for bit. Writes ``OUT/delta_device.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

from verl_async import weight_delta as wd  # noqa: E402

REPEATS = 5


def timed(fn, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``REPEATS`` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    seconds = []
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def measure(device: torch.device, mib: float, changed: float) -> dict:
    words = int(mib * 2**20) // 2
    gen = torch.Generator().manual_seed(0)
    last = torch.randn(words, generator=gen).bfloat16().to(device)
    cur = last.clone()
    index = torch.randperm(words, generator=gen)[: int(changed * words)].to(device)
    cur[index] = (cur[index].float() * 1.01 + 1e-3).bfloat16()
    cur_b, last_b = cur.view(torch.uint8), last.view(torch.uint8)
    kind, count, payload = wd.encode(cur_b, last_b, 2)
    base = last_b.clone()
    wd.apply(base, kind, count, payload, 2)
    identical = bool(torch.equal(base, cur_b))
    dst = torch.empty_like(cur_b)
    encode_s = timed(lambda: wd.encode(cur_b, last_b, 2), device)
    apply_s = timed(lambda: wd.apply(last_b.clone(), kind, count, payload, 2), device)
    clone_s = timed(lambda: last_b.clone(), device)  # apply's own copy, taken out below
    copy_s = timed(lambda: dst.copy_(cur_b), device)
    return {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "machine": machine(),
        "bucket_mib": mib,
        "changed": count / words,
        "kind": {wd.INDICES: "indices", wd.BITMAP: "bitmap", wd.WHOLE: "whole"}.get(kind, kind),
        "payload_mib": payload.numel() / 2**20,
        "identical": identical,
        "encode_s": encode_s,
        "apply_s": max(apply_s - clone_s, 0.0),
        "copy_s": copy_s,
        "delta_over_copy": (encode_s + max(apply_s - clone_s, 0.0)) / copy_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--changed", type=float, default=0.04)
    ap.add_argument("--out", type=Path, default=ROOT / "runs/delta_device")
    ap.add_argument("--dry-run", action="store_true", help="1 MiB on the CPU")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    result = measure(device, 1.0 if args.dry_run else args.mib, args.changed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "delta_device.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
