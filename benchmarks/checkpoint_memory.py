"""Host memory and step time of a checkpoint on several learner ranks: sharded (each rank
writes its own shards with DCP, learners/checkpoints/shards.py) against gathering everything into
rank 0 (what a multi-rank learner did before: full model and optimizer state gathered
with ``cpu_offload``, staged into rank 0's safetensors buffers, written by rank 0).

    python benchmarks/checkpoint_memory.py [--model models/smollm2-135m] [--ranks 2]
                                           [--checkpoints 2] [--out runs/ckpt-memory]

Each way runs as its own ``torch.distributed.run`` job (gloo, CPU), so each starts from
a fresh process: every rank loads the model in float32, shards it with FSDP2
(learners/setup.py), takes one AdamW step (the optimizer state exists), and then takes
``--checkpoints`` checkpoints back to back. Per rank it reports the size of its own
shards of weights and AdamW state; the peak rise of its resident memory over the
checkpoints (VmHWM, reset through /proc/self/clear_refs before the first, minus VmRSS
then, with freed heap given back to the system first: ``malloc_trim``) and what is still
held after them (staging buffers are kept for the next checkpoint); the time the step is
held (gather and staging, or staging into DCP's buffers) and the time until every file
is written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> float:
    """A /proc/self/status memory field, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _trim() -> None:
    """Give freed heap memory back to the system, so that a rise in RSS is new memory."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _local_mib(tensors) -> float:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total / 2**20


def _gathered(model, optimizer, rank: int, out: Path, stager):
    """The gather-to-rank-0 checkpoint: full state into rank 0's memory, staged, written."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from learners.checkpoints import writer

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if rank != 0:
        return None
    tensors = {
        f"optim.{name}.{key}": v
        for name, entry in optim["state"].items()
        for key, v in entry.items()
    }
    files = {
        "learner/model.safetensors": stager.stage("model", weights, {"format": "pt"}),
        "learner/state.safetensors": stager.stage("state", tensors),
    }
    return lambda: writer.Checkpointer._write_files(out, files, {})


def rank_main(way: str, checkpoints: int, model_path: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from learners.checkpoints import shards as sharded
    from learners.setup import fsdp2
    from verl_async.checkpoint import SHARDS

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), torch.float32
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, 1000, (2, 64))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    from learners.checkpoints.writer import Stager

    writer = sharded.ShardWriter(600) if way == "sharded" else None
    stager = Stager()  # rank 0's staging buffers, kept across checkpoints
    shard = _local_mib(list(model.parameters())) * 3  # weights, exp_avg, exp_avg_sq
    held, total = [], []
    _trim()
    dist.barrier()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    for i in range(checkpoints):
        ckpt = out / way / f"step_{i}"
        dist.barrier()
        t0 = time.monotonic()
        if way == "sharded":
            tensors, _ = sharded.shard_tensors(model, optimizer, sharded.ACTOR)
            writer.save(tensors, ckpt / SHARDS)
            held.append(time.monotonic() - t0)
            assert writer.wait(600)
            del tensors
        else:
            write = _gathered(model, optimizer, rank, ckpt, stager)
            held.append(time.monotonic() - t0)
            if write is not None:
                write()
            del write
        dist.barrier()
        total.append(time.monotonic() - t0)
    peak = _status("VmHWM")
    _trim()
    row = {
        "rank": rank,
        "shard_mib": round(shard),
        "before_mib": round(before),
        "rise_mib": round(peak - before),
        "kept_mib": round(_status("VmRSS") - before),
        "held_s": [round(x, 2) for x in held],
        "written_s": [round(x, 2) for x in total],
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        (out / f"{way}.json").write_text(json.dumps(rows, indent=1))
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--checkpoints", type=int, default=2)
    parser.add_argument("--out", default="runs/ckpt-memory")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: one rank's way
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.rank_of:
        rank_main(args.rank_of, args.checkpoints, args.model, out)
        return
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    results = {}
    for way in ("gather", "sharded"):
        with tempfile.TemporaryDirectory(dir=out) as scratch:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(args.ranks), __file__, "--rank-of", way,
                "--model", args.model, "--checkpoints", str(args.checkpoints), "--out", scratch,
            ]  # fmt: skip
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=1800)
            results[way] = json.loads((Path(scratch) / f"{way}.json").read_text())
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        "| way | rank | own shards, MiB | RSS before, MiB | peak rise, MiB "
        "| still held after, MiB | step held, s | until written, s |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for way, rows in results.items():
        for r in rows:
            print(
                f"| {way} | {r['rank']} | {r['shard_mib']} | {r['before_mib']} | {r['rise_mib']} "
                f"| {r['kept_mib']} | {r['held_s']} | {r['written_s']} |"
            )
    rises = {way: max(r["rise_mib"] for r in rows) for way, rows in results.items()}
    print(
        f"summary: largest RSS rise of a rank over {args.checkpoints} checkpoints on "
        f"{args.ranks} ranks: gather-to-rank-0 {rises['gather']} MiB, sharded {rises['sharded']} MiB"
    )


if __name__ == "__main__":
    main()
