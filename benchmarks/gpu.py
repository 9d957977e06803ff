"""Learner step throughput on CUDA as the learner runs it, and the gather + broadcast of
its weights.

    python benchmarks/gpu.py                                 # one GPU
    python benchmarks/gpu.py --fsdp2                         # one GPU, sharded anyway
    torchrun --nproc-per-node N benchmarks/gpu.py            # N GPUs, one FSDP2 job
    python benchmarks/gpu.py --device cpu --layers 2 --hidden 128 --vocab 64 --seq-len 32
                                                             # code-path check on CPU (gloo)

The step is the learner's own code: a ``Batch`` message is collated into pinned host
memory, copied to the device, and trained with ``learners.update.policy_update`` (pi_prox
recomputation, then ``algo.minibatches`` decoupled-PPO steps) on a random Llama made and
placed as learners/setup.py makes and places the policy: Accelerate's ``prepare`` (bf16
autocast over float32 weights) on one rank, FSDP2 over several or with
``--cpu-offload``. ``--fsdp2`` shards one rank anyway, the comparison that says what
FSDP2 costs where there is nothing to shard.

Each of ``--steps`` timed steps (after two warm-up steps, with the garbage collector's
objects frozen first, as a learner's steps should run) reports its wall seconds, its
phases' device seconds from CUDA events (pi_prox, forwards, backwards, optimizer) and
the collector's seconds; the summary gives medians and the spread. MFU counts the
update's FLOPs as benchmarks/step_measure.py derives them (matrix weights and causal
attention; the input embedding is a lookup) and reports the former count beside it.

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
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402
from step_measure import (  # noqa: E402
    PHASES,
    GcTimer,
    ModelShape,
    PhaseTimer,
    old_step_flops,
    profile_step,
    step_flops,
)


def accelerator_for(args, learner):
    """The learner's Accelerator (learners/setup.py's ``run_learner``): under torchrun it
    sets up the job's process group; one rank has none unless FSDP2 asks for one."""
    from accelerate import Accelerator

    from learners.setup import process_group_kwargs

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return Accelerator(
        cpu=not cuda, mixed_precision="bf16" if cuda else "no",
        kwargs_handlers=process_group_kwargs(learner),
    )  # fmt: skip


def _heads(hidden: int) -> int:
    """Attention heads: 64 wide (one below hidden size 64)."""
    return hidden // 64 if hidden >= 64 else 1


def _kv_heads(hidden: int) -> int:
    """Key-value heads when ``--kv-heads`` is not given: a quarter of the heads, rounded
    down to a divisor of their number (1 below hidden size 256)."""
    heads = _heads(hidden)
    want = max(heads // 4, 1) if hidden >= 256 else 1
    return max(d for d in range(1, want + 1) if heads % d == 0)


def build_model(args, cfg, dev: torch.device):
    """A random Llama of the arguments' shape, made what the learner trains (``cfg``'s
    Liger kernels, checkpointing, LoRA, compiled layers: learners/setup.py's
    ``actor_model``); placed and sharded by ``place``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from learners.setup import actor_model

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
    return actor_model(cfg, model, main=False), config


def place(args, accelerator, model, dtype: torch.dtype):
    """(model, optimizer, sharding) as the learner of this many ranks has them
    (learners/setup.py's ``prepare``), or FSDP2 at one rank with ``--fsdp2``."""
    from learners.setup import adamw, fsdp2, own_process_group, prepare

    def make_optimizer(m):
        return adamw(m, lr=1e-6, weight_decay=0.0)  # the learner's

    one = accelerator.num_processes == 1
    if one and (args.fsdp2 or args.cpu_offload):
        own_process_group()  # FSDP2 shards over a process group, here a group of one
    if args.fsdp2 and one and not args.cpu_offload:
        model = fsdp2(model, dtype)
        return model, make_optimizer(model), "FSDP2 at one rank"
    dtype_name = str(dtype).removeprefix("torch.")
    model, optimizer = prepare(accelerator, model, make_optimizer, dtype_name, args.cpu_offload)
    if not one or args.cpu_offload:
        offload = " with CPU offload" if args.cpu_offload else ""
        n = accelerator.num_processes
        return model, optimizer, f"FSDP2 over {n} rank{'s' if n > 1 else ''}{offload}"
    return model, optimizer, "one rank, Accelerate, not sharded"


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


def parse_args(argv):
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
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
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
    ap.add_argument("--fused-head", action="store_true", help="learner.fused_head")
    ap.add_argument("--padding-free", action="store_true", help="learner.padding_free")
    ap.add_argument(
        "--ragged", action="store_true", help="response lengths drawn from 1/4 to all of it"
    )
    ap.add_argument("--compile", action="store_true", help="learner.compile")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    ap.add_argument("--liger", action="store_true", help="Liger's RoPE, RMSNorm, SwiGLU (CUDA)")
    ap.add_argument("--cpu-offload", action="store_true", help="learner.cpu_offload")
    ap.add_argument("--fsdp2", action="store_true", help="FSDP2 even at one rank")
    ap.add_argument(
        "--overlap", action="store_true",
        help="also time steps whose batch is copied on a side stream during the previous one",
    )  # fmt: skip
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU (default: known GPUs)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/gpu")
    ap.add_argument("--profile", action="store_true", help="profile one more step")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("summary: skipped, no CUDA device (use --device cpu for a code-path check)")
        return 0

    from learners.batching import collate, copy_to_device, wait_for_copy
    from learners.update import UpdateHooks, policy_update
    from verl_async.algos import grpo_advantages
    from verl_async.schema import AlgoConfig, LearnerConfig, LoraConfig, ModelConfig, RunConfig

    learner = LearnerConfig(
        logprob_chunk_tokens=args.chunk_tokens, padding_free=args.padding_free,
        gradient_checkpointing=args.checkpointing, compile=args.compile, liger=args.liger,
        cpu_offload=args.cpu_offload, fused_head=args.fused_head,
    )  # fmt: skip
    accelerator = accelerator_for(args, learner)
    rank, world, dev = accelerator.process_index, accelerator.num_processes, accelerator.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lora_cfg = ModelConfig(lora=LoraConfig(rank=args.lora_rank))
    model, config = build_model(args, RunConfig(model=lora_cfg, learner=learner), dev)
    shape = ModelShape.of(model, config)
    model, optimizer, sharding = place(args, accelerator, model, dtype)
    algo = AlgoConfig(correction="decoupled", minibatches=2)
    body, frames = batch_message(args, rank)

    def clip_grad() -> float:  # learners/trainer.py's Learner.clip_grad
        if world == 1:
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    phases = PhaseTimer(cuda=dev.type == "cuda")
    phases.attach(model, optimizer)
    hooks = UpdateHooks(
        backward=phases.wrap("backward", accelerator.backward),
        clip_grad=phases.wrap("optimizer", clip_grad),
    )
    collector = GcTimer()
    collector.install()
    pin = dev.type == "cuda"

    def train_step(batch) -> None:
        rewards = torch.from_numpy(batch.scores[:, 0])  # one source, weight 1
        adv = grpo_advantages(rewards, batch.group_index.cpu()).to(dev)
        model.train()
        policy_update(model, optimizer, batch, adv, algo, hooks, learner=learner)

    def timed_steps(overlap: bool) -> tuple[list[float], list[dict]]:
        """Steps fed from pinned host memory: the copy inline before each step, or (the
        learner's prefetch) issued on a side stream while the previous step computes.
        Each timed step: its wall seconds, and its phases' and the collector's seconds."""
        side = torch.cuda.Stream(dev) if overlap else None
        pending = copy_to_device(collate(body, frames, pad_id=0, pin=pin), dev, side)
        times, splits = [], []
        for i in range(2 + args.steps):  # two warm-up steps (with --compile: compiling)
            if i == 2:  # what the warm-up left is the long-lived heap: out of the collector's way
                gc.collect()
                gc.freeze()
                collector.running = True
            sync(dev)
            t0 = time.perf_counter()
            if overlap:
                batch = wait_for_copy(*pending)
                pending = copy_to_device(collate(body, frames, pad_id=0, pin=pin), dev, side)
            else:
                batch = collate(body, frames, pad_id=0, pin=pin).to(dev)
            train_step(batch)
            sync(dev)
            wall = time.perf_counter() - t0
            split = phases.read()
            split["gc"], split["gc_full"] = collector.take()
            if i >= 2:
                times.append(wall)
                splits.append(split)
            else:
                warmup.append(wall)
        collector.running = False
        gc.unfreeze()
        return times, splits

    warmup: list[float] = []  # the warm-up steps' seconds: first shapes, compilation
    step_times, splits = timed_steps(overlap=False)
    overlap_times = timed_steps(overlap=True)[0] if args.overlap and pin else []
    profiled = None
    if args.profile and rank == 0:
        profiled = profile_step(
            lambda: train_step(collate(body, frames, pad_id=0, pin=pin).to(dev)), dev
        )
        phases.read()
    publish_times, nbytes = time_publish(args, model, dev, rank)
    from learners.distributed import DataParallel

    check_times = time_finite_checks(
        model, optimizer, DataParallel(rank, world).any_rank, dev, min(args.steps, 5)
    )
    if rank == 0:
        rows = [p + r for p, r in zip(body.prompt_lengths, body.response_lengths, strict=True)]
        resp_tokens = sum(body.response_lengths) * world
        lora = bool(args.lora_rank)
        k = algo.minibatches
        flops = step_flops(shape, rows * world, resp_tokens, k, lora)  # rank 0's rows x world
        old = old_step_flops(shape, sum(rows) * world, resp_tokens, k, lora)
        result = {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "sharding": sharding,
            "lora_rank": args.lora_rank,
            "options": {
                "chunk_tokens": args.chunk_tokens,
                "fused_head": args.fused_head,
                "padding_free": args.padding_free,
                "compile": args.compile,
                "checkpointing": args.checkpointing,
                "liger": args.liger,
                "cpu_offload": args.cpu_offload,
            },  # fmt: skip
            "world_size": world,
            "params": shape.all_params,
            "matrix_params": shape.matrix_params,
            "dtype": str(dtype),
            "tokens_per_step": sum(rows) * world,
            "response_tokens_per_step": resp_tokens,
            "flops_per_step": flops,
            "old_flops_per_step": old,
            "step_s": step_times,
            "phases_s": splits,
            "warmup_s": warmup,
            "publish_s": publish_times,
            "publish_bytes": nbytes,
            "finite_check_s": check_times,
            "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if pin else 0.0,
            "overlapped_step_s": overlap_times,
            "profile": profiled,
        }
        result.update(rates(args, result, dev, world))
        result["step_s_median"] = statistics.median(step_times)
        result["phases_median_s"] = {
            k: statistics.median(s[k] for s in splits) for k in (*PHASES, "gc")
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
        report(args, result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def time_publish(args, model, dev: torch.device, rank: int) -> tuple[list[float], int]:
    """Seconds of each publication after the first (which allocates the buckets), and
    the bytes one sends."""
    from learners.publish import gathered_buckets
    from verl_async import lora
    from verl_async.runtime import free_port
    from verl_async.weight_sync import (
        join_group,
        pack_bucket,
        param_specs,
        plan_buckets,
        send_update,
    )

    group = None
    if rank == 0:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        group = join_group(
            "127.0.0.1", free_port("127.0.0.1"), 0, 1, backend, 60, shared_memory=False
        )
    publish_times, nbytes = [], 0
    for _ in range(1 + min(args.steps, 5)):
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
    return publish_times[1:], nbytes


def spread(values: list[float]) -> str:
    """Median, then the range and the steps more than 1.5x the median."""
    med = statistics.median(values)
    slow = sum(v > 1.5 * med for v in values) if med > 0 else 0
    return f"{med:.3f} ({min(values):.3f}-{max(values):.3f}, {slow} over 1.5x)"


def rates(args, result: dict, dev: torch.device, world: int) -> dict:
    """Throughput and MFU from the median step, per device."""
    step_s = statistics.median(result["step_s"])
    peak_tflops = args.peak_tflops or PEAK_BF16_TFLOPS.get(_gpu_kind(dev), 0.0)
    per_device = result["flops_per_step"] / step_s / world / 1e12
    old = result["old_flops_per_step"] / step_s / world / 1e12
    return {
        "tflops_per_device": per_device,
        "mfu": per_device / peak_tflops if peak_tflops else None,
        "old_mfu": old / peak_tflops if peak_tflops else None,
    }


def report(args, result: dict) -> None:
    """The run's table on standard output, ending with the summary line."""
    tokens, world = result["tokens_per_step"], result["world_size"]
    step_s = statistics.median(result["step_s"])
    print(f"machine: {machine()}; ranks: {world}; device: {result['device']}")
    adapter = f", LoRA rank {args.lora_rank} on q/k/v/o" if args.lora_rank else ""
    print(
        f"model: {result['params'] / 1e6:.0f}M parameters ({result['matrix_params'] / 1e6:.0f}M "
        f"in matrices but the head){adapter}, {result['dtype']}; {tokens} tokens per step "
        f"({args.samples} x {args.seq_len} per rank, {result['response_tokens_per_step']} of "
        f"them response tokens); {result['sharding']}"
    )
    print("| | median s (min-max, slow steps) | rate |")
    print("|---|---|---|")
    n = len(result["step_s"])
    print(
        f"| learner step ({result['sharding']}), {n} steps | {spread(result['step_s'])} "
        f"| {tokens / step_s:,.0f} tokens/s |"
    )
    splits = result["phases_s"]
    clock = "CUDA events" if result["device"] != "cpu" else "host clock"
    for phase in PHASES:
        values = [s[phase] for s in splits]
        share = statistics.median(values) / step_s
        print(f"| of which {phase} ({clock}) | {spread(values)} | {share:.1%} of the step |")
    gc_s = [s["gc"] for s in splits]
    print(
        f"| garbage collector during the steps (host) | {spread(gc_s)} "
        f"| {sum(s['gc_full'] for s in splits)} full passes in {n} steps |"
    )
    if result["overlapped_step_s"]:
        over_s = statistics.median(result["overlapped_step_s"])
        print(
            f"| same, batch copied on a side stream during the previous step "
            f"| {spread(result['overlapped_step_s'])} "
            f"| {tokens / over_s:,.0f} tokens/s ({over_s / step_s:.2f}x the step) |"
        )
    if result["profile"]:
        prof = result["profile"]
        kernels = "" if prof["device_s"] is None else f"; {prof['device_s']:.3f} s in kernels"
        print(
            f"| one step under torch.profiler (wall) | {prof['host_s']:.3f} "
            f"| {prof['launches']} kernel launches{kernels} |"
        )
    pub_s, nbytes = statistics.median(result["publish_s"]), result["publish_bytes"]
    print(
        f"| gather shards + broadcast ({nbytes / 2**20:.0f} MiB) | {pub_s:.3f} "
        f"| {nbytes / pub_s / 1e9:.2f} GB/s |"
    )
    for what, times in result["finite_check_s"].items():
        check_s = statistics.median(times)
        print(f"| finite check of the {what} | {check_s:.4f} | {check_s / step_s:.2%} of a step |")
    mfu = ""
    if result["mfu"] is not None:
        mfu = f", MFU {result['mfu']:.1%} (former count {result['old_mfu']:.1%})"
    print(
        f"summary: {tokens / step_s:,.0f} tokens/s per step on {world} x {result['device']} "
        f"({result['sharding']}; {result['tflops_per_device']:.3g} TFLOP/s per device{mfu}); "
        f"publish {pub_s * 1000:.0f} ms ({pub_s / step_s:.1%} of a step); "
        f"peak {result['peak_gib']:.1f} GiB"
    )


if __name__ == "__main__":
    sys.exit(main())
