"""Weight push into a running vLLM engine, against a raw broadcast of the same bytes.

    python benchmarks/weight_sync.py [--layers 11] [--hidden 768] [--repeats 3]
                                     [--bucket-mb 64] [--no-shared-memory] [--out runs/weight_sync]

Builds a ~100M-parameter Llama locally (float32), starts a vLLM engine on it with the
weight-sync worker extension, and loads the same checkpoint as the "learner" in this
process. Then, ``--repeats`` times:

  ours  (after one untimed warm-up push) perturb the learner's weights, announce, broadcast in packed buckets, and wait
        until the engine has swapped them in (pause, receive, layerwise reload, prefix
        cache reset, resume) and a probe request has been served with them. The probe's
        prompt logprobs must match the learner's new float32 logprobs: a push that did not
        take effect fails the benchmark.
  raw   the same bucket plan and bytes broadcast over the same backend to a bare process
        that only receives into buffers (no vLLM, no weight loading).

Reports seconds and effective GB/s (weight bytes / seconds) of both, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

PROBE = [1, 3, 5, 9, 7, 4, 13, 8, 2]


def send_weights(group, tensors: dict, specs: list, bucket_bytes: int) -> None:
    """The learner's side of both arms: ``tensors`` packed bucket by bucket in the plan of
    ``specs`` and sent from rank 0 (memory: one bucket)."""
    from verl_async.weight_sync import pack_bucket, plan_buckets, send_update

    send_update(group, (pack_bucket(b, tensors) for b in plan_buckets(specs, bucket_bytes)))


def raw_receiver(
    port: int, specs: list, bucket_bytes: int, repeats: int, backend: str, offers
) -> None:
    """Rank 1; ``offers`` brings rank 0's memory offer (as the buffer would), or None."""
    from verl_async.protocol import MemoryOffer, ParamSpec
    from verl_async.weight_sync import join_group, receive_weights

    group = join_group("127.0.0.1", port, 1, 2, backend, 120)
    offer = offers.get(timeout=120)
    offer = msgspec.convert(offer, MemoryOffer) if offer is not None else None
    specs = [ParamSpec(n, d, tuple(s)) for n, d, s in specs]
    for _ in range(repeats):
        for _bucket in receive_weights(group, specs, bucket_bytes, torch.device("cpu"), offer):
            pass


def raw_broadcast(
    tensors, specs, bucket_bytes: int, repeats: int, backend: str, shared_memory: bool
) -> list[float]:
    from verl_async.runtime import free_port
    from verl_async.weight_sync import join_group

    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    wire = [[s.name, s.dtype, list(s.shape)] for s in specs]
    offers = ctx.Queue()
    child = ctx.Process(
        target=raw_receiver, args=(port, wire, bucket_bytes, repeats, backend, offers)
    )
    child.start()
    try:
        group = join_group("127.0.0.1", port, 0, 2, backend, 120, shared_memory=shared_memory)
        offers.put(msgspec.to_builtins(group.offer) if group.offer is not None else None)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            send_weights(group, tensors, specs, bucket_bytes)
            times.append(time.perf_counter() - t0)
        child.join(60)
        return times
    finally:
        if child.is_alive():
            child.kill()


def hf_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return torch.stack([logp[i - 1, ids[i]] for i in range(1, len(ids))])


async def ours(model_path: Path, args, bucket_bytes: int) -> tuple[list[float], float, int]:
    from transformers import AutoModelForCausalLM

    from generators.vllm_engine import start_vllm_engine
    from verl_async import protocol as P
    from verl_async.config import load_config
    from verl_async.runtime import free_port
    from verl_async.weight_sync import join_group, param_specs

    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [f"weights.bucket_mb={args.bucket_mb}", "generators.kv_cache_mb=32"],
    )
    learner = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    engine = start_vllm_engine(cfg, str(model_path), seed=0)
    port = free_port("127.0.0.1")
    try:
        holder: dict = {}
        joiner = threading.Thread(
            target=lambda: holder.setdefault(
                "g",
                join_group(
                    "127.0.0.1", port, 0, 2, args.backend, 120, shared_memory=args.shared_memory
                ),
            )
        )
        joiner.start()
        await engine.join_weight_sync("127.0.0.1", port, 2, 1, args.backend)
        joiner.join(120)
        times, worst = [], 0.0
        # Push 1 is a warm-up (first pause of the engine, first reload): reported, not timed.
        for version in range(1, args.repeats + 2):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn_like(p), alpha=0.02)
            expected = hf_logprobs(learner, PROBE)
            tensors = {k: v.detach() for k, v in learner.state_dict().items()}
            specs = param_specs(tensors.items())
            update = P.WeightUpdate(
                version=version, params=specs, bucket_bytes=bucket_bytes, memory=holder["g"].offer
            )
            t0 = time.perf_counter()
            sender = threading.Thread(
                target=send_weights, args=(holder["g"], tensors, specs, bucket_bytes)
            )
            sender.start()
            await engine.apply_update(update)
            # The first request served by the new weights.
            got = torch.tensor(await engine.prompt_logprobs(PROBE))
            times.append(time.perf_counter() - t0)
            sender.join(60)
            if version == 1:
                print(f"warm-up push: {times.pop():.3f}s", flush=True)
            worst = max(worst, float((got - expected).abs().max()))
            if worst > 1e-3:
                raise SystemExit(f"push {version} did not take effect: logprob gap {worst:.3g}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return times, worst, nbytes
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=11)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="same-host updates through shared memory (weights.shared_memory); "
        "--no-shared-memory sends them over the network",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs/weight_sync")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig
    from verl_async.weight_sync import param_specs

    heads = args.hidden // 64
    model_path = build_tiny_model(
        args.out.resolve() / "model",
        TinyModelConfig(
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            num_kv_heads=heads,
            intermediate_size=args.intermediate,
        ),
    )
    bucket_bytes = args.bucket_mb << 20
    ours_times, gap, nbytes = asyncio.run(ours(model_path, args, bucket_bytes))

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    del model
    raw_times = raw_broadcast(
        tensors, param_specs(tensors.items()), bucket_bytes, args.repeats, args.backend,
        args.shared_memory,
    )  # fmt: skip

    params = nbytes // 4
    ours_s, raw_s = statistics.median(ours_times), statistics.median(raw_times)
    result = {
        "params": params,
        "bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        "backend": args.backend,
        "route": "memory" if args.shared_memory and args.backend == "gloo" else "network",
        "ours_s": ours_times,
        "raw_s": raw_times,
        "logprob_gap_after_push": gap,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_sync.json").write_text(json.dumps(result, indent=1))
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    print(f"machine: {machine()}")
    print(
        f"model: {params / 1e6:.0f}M float32 parameters ({nbytes / 2**20:.0f} MiB), "
        f"{args.bucket_mb} MiB buckets, {args.backend}"
    )
    print("| | median s | GB/s | runs (s) |")
    print("|---|---|---|---|")
    print(
        f"| push into vLLM until it samples with the new weights | {ours_s:.3f} | {gbps(ours_s):.2f} "
        f"| {', '.join(f'{t:.3f}' for t in ours_times)} |"
    )
    print(
        f"| raw broadcast, same bytes and buckets | {raw_s:.3f} | {gbps(raw_s):.2f} "
        f"| {', '.join(f'{t:.3f}' for t in raw_times)} |"
    )
    print(
        f"summary: weight push at {raw_s / ours_s:.2f}x the raw {args.backend} bandwidth "
        f"({gbps(ours_s):.2f} vs {gbps(raw_s):.2f} GB/s); logprobs after push within {gap:.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
