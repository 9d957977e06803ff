"""Learner step throughput under FSDP2 on CUDA, and the gather + broadcast of its weights.

    python benchmarks/gpu.py                                 # one GPU
    torchrun --nproc-per-node N benchmarks/gpu.py            # N GPUs, one FSDP2 job
    python benchmarks/gpu.py --device cpu --layers 2 --hidden 128 --vocab 64 --seq-len 32
                                                             # code-path check on CPU (gloo)

The step is the learner's own code: a ``Batch`` message is collated into pinned host
memory, copied to the device, and trained with ``learners.update.policy_update`` (pi_prox
recomputation, then ``algo.minibatches`` decoupled-PPO steps) on a Llama whose decoder
layers and root are wrapped with FSDP2 ``fully_shard`` (the wrapping Accelerate's FSDP2
plugin applies). Weights are bf16 on CUDA, float32 on CPU.

Publication is timed as the learner does it: bucket by bucket, ``full_tensor()`` of the
bucket's parameters on every rank, then rank 0 packs it and broadcasts it over a
weight-sync group. So is the check that nothing non-finite leaves the learner
(learners/finite.py): of the weights before each publish, of weights and optimizer state
before each checkpoint.
No vLLM runs here, so that group has the learner alone (world size 1): the figure is the
gather + packing + collective launch cost, not a transfer to generators.

Only CUDA runs are benchmark figures; ``--device cpu`` exists so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        from verl_async.runtime import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", rank=rank, world_size=world, device_id=None
    )
    return rank, world, dev


def _heads(hidden: int) -> int:
    """Attention heads: 64 wide (one below hidden size 64)."""
    return hidden // 64 if hidden >= 64 else 1


def _kv_heads(hidden: int) -> int:
    """Key-value heads when ``--kv-heads`` is not given: a quarter of the heads, rounded
    down to a divisor of their number (1 below hidden size 256)."""
    heads = _heads(hidden)
    want = max(heads // 4, 1) if hidden >= 256 else 1
    return max(d for d in range(1, want + 1) if heads % d == 0)


def build_model(args, cfg, dev: torch.device, dtype: torch.dtype):
    """A random Llama of the arguments' shape, made what the learner trains (``cfg``'s
    Liger kernels, checkpointing, LoRA, compiled layers: learners/setup.py's
    ``actor_model``), then sharded as the learner shards it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from learners.setup import actor_model, fsdp2

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=_heads(args.hidden),
        num_key_value_heads=args.kv_heads or _kv_heads(args.hidden),
        max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(config)  # float32 parameters, as the learner keeps them
    model = actor_model(cfg, model, main=False)
    return fsdp2(model, dtype)  # the learner's sharding; dtype is the compute dtype


def batch_message(args, rank: int):
    """A ``Batch`` like the buffer sends: ``--response-len`` response tokens after a prompt
    that fills the rest of ``--seq-len``, groups of 8."""
    from verl_async import protocol as P

    rng = np.random.default_rng(rank)
    n, resp = args.samples, args.response_len or args.seq_len // 2
    prompt = args.seq_len - resp
    lengths = [resp] * n
    if args.ragged:  # responses of 1/4 to all of --response-len tokens, as sampling gives
        lengths = rng.integers(max(1, resp // 4), resp + 1, n).tolist()
    frames = P.Frames()
    body = P.Batch(
        step=0,
        group_ids=list(range(n // 8)),
        sample_group=[i // 8 for i in range(n)],
        prompt_lengths=[prompt] * n,
        response_lengths=lengths,
        scores=rng.integers(0, 2, (n, 1)).astype(float).tolist(),
        failed=[0],
        data_sources=["default"] * (n // 8),
        prompt_ids=frames.add(rng.integers(0, args.vocab, n * prompt, dtype=np.int32)),
        response_ids=frames.add(rng.integers(0, args.vocab, sum(lengths), dtype=np.int32)),
        behav_logprobs=frames.add(np.full(sum(lengths), -np.log(args.vocab), np.float32)),
        token_versions=frames.add(np.zeros(sum(lengths), np.int32)),
        dropped_stale=0,
        buffer_size=0,
    )
    return body, [bytes(b) for b in frames.buffers]


PARTS = ("prox_s", "forward_s", "backward_s", "optimizer_s")

# Dense bf16 peak of the accelerators we know (vendor data sheets); --peak-tflops otherwise.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def _gpu_kind(dev: torch.device) -> str:
    if dev.type != "cuda":
        return ""
    name = torch.cuda.get_device_name(dev)
    return next((kind for kind in PEAK_BF16_TFLOPS if kind in name), "")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def profile_step(step, dev: torch.device) -> None:
    """One more step under torch.profiler: the operators by device time, then by host time
    (host time near the step's wall time and device time well under it: launch-bound)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(dev)
    table = prof.key_averages().table
    if dev.type == "cuda":
        print(table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))
    print(table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=50))


def time_finite_checks(model, optimizer, any_rank, dev: torch.device, n: int) -> dict:
    """Seconds of ``require_finite`` over what the learner checks before a publish and
    before a checkpoint (every rank its own shards, one collective), ``n`` times each."""
    from learners.checkpoints.state import LearnerState
    from learners.finite import require_finite

    checks = {
        "weights (each publish)": lambda: model.state_dict().items(),
        "weights + optimizer state (each checkpoint)": lambda: LearnerState(
            model, optimizer
        ).named_tensors(),
    }
    times: dict[str, list[float]] = {}
    for what, named in checks.items():
        for i in range(1 + n):  # the first one warms up
            sync(dev)
            t0 = time.perf_counter()
            require_finite(what, named(), any_rank)
            sync(dev)
            if i:
                times.setdefault(what, []).append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--kv-heads", type=int, default=0, help="key-value heads (0: see _kv_heads)")
    ap.add_argument("--samples", type=int, default=64, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument(
        "--response-len", type=int, default=0, help="of --seq-len (default: half of it)"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on q/k/v/o (model.lora) and publish only them",
    )
    ap.add_argument(
        "--chunk-tokens", type=int, default=1024,
        help="learner.logprob_chunk_tokens (0: the head over every kept position at once)",
    )  # fmt: skip
    ap.add_argument("--padding-free", action="store_true", help="learner.padding_free")
    ap.add_argument(
        "--ragged", action="store_true", help="response lengths drawn from 1/4 to all of it"
    )
    ap.add_argument("--compile", action="store_true", help="learner.compile")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    ap.add_argument("--liger", action="store_true", help="Liger's RoPE, RMSNorm, SwiGLU (CUDA)")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU (default: known GPUs)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/gpu")
    ap.add_argument("--profile", action="store_true", help="print one step's operator profile")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("summary: skipped, no CUDA device (use --device cpu for a code-path check)")
        return 0

    from learners.batching import collate, copy_to_device, wait_for_copy
    from learners.publish import gathered_buckets
    from learners.setup import adamw
    from learners.update import UpdateHooks, policy_update
    from verl_async import lora
    from verl_async.algos import grpo_advantages
    from verl_async.runtime import free_port
    from verl_async.schema import AlgoConfig, LearnerConfig, LoraConfig, ModelConfig, RunConfig
    from verl_async.weight_sync import (
        join_group,
        pack_bucket,
        param_specs,
        plan_buckets,
        send_update,
    )

    rank, world, dev = init_distributed(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    learner = LearnerConfig(
        logprob_chunk_tokens=args.chunk_tokens, padding_free=args.padding_free,
        gradient_checkpointing=args.checkpointing, compile=args.compile, liger=args.liger,
    )  # fmt: skip
    lora_cfg = ModelConfig(lora=LoraConfig(rank=args.lora_rank))
    model = build_model(args, RunConfig(model=lora_cfg, learner=learner), dev, dtype)
    optimizer = adamw(model, lr=1e-6, weight_decay=0.0)  # the learner's
    algo = AlgoConfig(correction="decoupled", minibatches=2)
    body, frames = batch_message(args, rank)

    def clip_grad() -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    hooks = UpdateHooks(backward=torch.Tensor.backward, clip_grad=clip_grad)
    parts: list[dict] = []  # each timed step's split (StepStats' timing fields)

    def train_step(batch) -> None:
        rewards = torch.from_numpy(batch.scores[:, 0])  # one source, weight 1
        adv = grpo_advantages(rewards, batch.group_index.cpu()).to(dev)
        model.train()
        s = policy_update(model, optimizer, batch, adv, algo, hooks, learner=learner)
        parts.append({k: getattr(s, k, None) for k in PARTS})

    def timed_steps(overlap: bool) -> list[float]:
        """Steps fed from pinned host memory: the copy inline before each step, or (the
        learner's prefetch) issued on a side stream while the previous step computes."""
        side = torch.cuda.Stream(dev) if overlap else None
        pending = copy_to_device(collate(body, frames, pad_id=0, pin=pin), dev, side)
        times = []
        for i in range(2 + args.steps):  # two warm-up steps (with --compile: compiling)
            sync(dev)
            t0 = time.perf_counter()
            if overlap:
                batch = wait_for_copy(*pending)
                pending = copy_to_device(collate(body, frames, pad_id=0, pin=pin), dev, side)
            else:
                batch = collate(body, frames, pad_id=0, pin=pin).to(dev)
            train_step(batch)
            sync(dev)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            else:
                parts.pop()
                warmup.append(time.perf_counter() - t0)
        return times

    pin = dev.type == "cuda"
    warmup: list[float] = []  # the warm-up steps' seconds: first shapes, compilation
    step_times = timed_steps(overlap=False)
    overlap_times = timed_steps(overlap=True) if dev.type == "cuda" else []
    tokens = sum(p + r for p, r in zip(body.prompt_lengths, body.response_lengths, strict=True))
    tokens *= world
    if args.profile and rank == 0:
        profile_step(lambda: train_step(collate(body, frames, pad_id=0, pin=pin).to(dev)), dev)
        parts.pop()

    group = None
    if rank == 0:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        group = join_group(
            "127.0.0.1", free_port("127.0.0.1"), 0, 1, backend, 60, shared_memory=False
        )
    publish_times, nbytes = [], 0
    for _ in range(1 + args.steps):
        sync(dev)
        t0 = time.perf_counter()
        state = model.state_dict()
        if args.lora_rank:  # the generators hold the base: the adapter alone goes
            state = lora.adapter_state(state)
        buckets = plan_buckets(param_specs(state.items()), args.bucket_mb << 20)
        packed = (pack_bucket(b, tensors) for b, tensors in gathered_buckets(state, buckets))
        if group is not None:
            send_update(group, packed)
        for _ in packed:  # the other ranks take part in every gather
            pass
        nbytes = sum(b.nbytes for b in buckets)
        sync(dev)
        publish_times.append(time.perf_counter() - t0)
    publish_times = publish_times[1:]  # the first one allocates the buckets
    from learners.distributed import DataParallel

    check_times = time_finite_checks(
        model, optimizer, DataParallel(rank, world).any_rank, dev, args.steps
    )

    if rank == 0:
        step_s = statistics.median(step_times)
        pub_s = statistics.median(publish_times)
        params = sum(p.numel() for p in model.parameters())  # global sizes (DTensor)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        # The work the update needs: ~6 FLOPs per parameter and token (forward and
        # backward), ~2 more for the pi_prox pass over the later minibatches' rows; the
        # output head's parameters count on response tokens only (nothing reads the
        # logits of other positions). With LoRA the frozen weights get no gradient of their
        # own: 4 FLOPs instead of 6 (the adapters' share is left out).
        k = algo.minibatches
        head = model.get_output_embeddings().weight.numel()
        resp_tokens = sum(body.response_lengths) * world
        per_token = (4 if args.lora_rank else 6) + 2 * (k - 1) / k
        flops = per_token * ((params - head) * tokens + head * resp_tokens)
        per_device = flops / step_s / world / 1e12
        peak_tflops = args.peak_tflops or PEAK_BF16_TFLOPS.get(_gpu_kind(dev), 0.0)
        result = {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "lora_rank": args.lora_rank,
            "options": {
                "chunk_tokens": args.chunk_tokens,
                "padding_free": args.padding_free,
                "compile": args.compile,
                "checkpointing": args.checkpointing,
                "liger": args.liger,
            },  # fmt: skip
            "world_size": world,
            "params": params,
            "dtype": str(dtype),
            "tokens_per_step": tokens,
            "response_tokens_per_step": resp_tokens,
            "step_s": step_times,
            "warmup_s": warmup,
            "publish_s": publish_times,
            "publish_bytes": nbytes,
            "finite_check_s": check_times,
            "peak_gib": peak,
            "overlapped_step_s": overlap_times,
            "parts_s": parts,
            "tflops_per_device": per_device,
            "mfu": per_device / peak_tflops if peak_tflops else None,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
        print(f"machine: {machine()}; ranks: {world}; device: {result['device']}")
        adapter = f", LoRA rank {args.lora_rank} on q/k/v/o" if args.lora_rank else ""
        print(
            f"model: {params / 1e6:.0f}M parameters{adapter}, {dtype}; {tokens} tokens per step "
            f"({args.samples} x {args.seq_len} per rank, {resp_tokens} of them response tokens)"
        )
        print("| | median s | rate |")
        print("|---|---|---|")
        print(f"| learner step (FSDP2) | {step_s:.3f} | {tokens / step_s:,.0f} tokens/s |")
        if parts and parts[0]["prox_s"] is not None:  # a learner that reports its parts
            split = ", ".join(
                f"{k[:-2]} {statistics.median(p[k] for p in parts):.3f}" for k in PARTS
            )
            print(f"| of which (median s) | {split} | |")
        if overlap_times:
            over_s = statistics.median(overlap_times)
            print(
                f"| same, batch copied on a side stream during the previous step | {over_s:.3f} "
                f"| {tokens / over_s:,.0f} tokens/s ({over_s / step_s:.2f}x the step) |"
            )
        print(
            f"| gather shards + broadcast ({nbytes / 2**20:.0f} MiB) | {pub_s:.3f} "
            f"| {nbytes / pub_s / 1e9:.2f} GB/s |"
        )
        for what, times in check_times.items():
            check_s = statistics.median(times)
            print(
                f"| finite check of the {what} | {check_s:.4f} | {check_s / step_s:.2%} of a step |"
            )
        mfu = f", MFU {result['mfu']:.1%}" if result["mfu"] else ""
        print(
            f"summary: {tokens / step_s:,.0f} tokens/s per step on {world} x {result['device']} "
            f"({per_device:.3g} TFLOP/s per device{mfu}); "
            f"publish {pub_s * 1000:.0f} ms ({pub_s / step_s:.1%} of a step); peak {peak:.1f} GiB"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
