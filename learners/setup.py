"""Build the learner: Accelerator, actor and optimizer, critic and reference when the
algorithm needs them, the distillation teachers, the weight-sync group; then run the loop
(learners/trainer.py).

One learner device: a plain Accelerate process. Several (``placement.learners``): the
launcher starts them as one torchrun job; Accelerate sets up the process group (NCCL on
GPU, gloo on CPU) and the actor and critic are sharded with FSDP2 (``fully_shard`` on
every decoder layer, then on the root), the same code on CPU and GPU. The frozen
reference is replicated on every rank."""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch

from learners.critic import load_critic, load_reference
from learners.logprobs import PassOptions
from learners.teacher import FromBatch, LocalTeachers
from learners.trainer import Learner
from verl_async import lora
from verl_async.algos import get_policy_loss
from verl_async.config_base import ConfigError
from verl_async.lifetime import interrupt_once
from verl_async.placement import sync_world_size
from verl_async.runtime import RunContext, mark, mark_cpu
from verl_async.weight_sync import join_group, resolve_backend

log = logging.getLogger("verl_async.learner")


def run_learner(ctx: RunContext) -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = ctx.cfg
    get_policy_loss(cfg.algo.loss_mode)  # a name no loss has ends the run here, naming the key
    on_cpu = not torch.cuda.is_available()
    if on_cpu and cfg.learner.keep_freed_memory and keep_freed_memory():
        log.info("freed memory is kept for reuse (learner.keep_freed_memory)")
    # Parameters and optimizer state stay float32; a bf16/fp16 model.dtype is the compute
    # dtype (autocast), as the generators' weights are (published tensors are cast on load).
    mixed = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[cfg.model.dtype]
    accelerator = Accelerator(
        cpu=on_cpu, mixed_precision=mixed, kwargs_handlers=process_group_kwargs(cfg.learner)
    )
    main = accelerator.is_main_process
    if main:
        mark(ctx.path, "learner", "imported")
    torch.manual_seed(cfg.learner.seed)
    ep = ctx.endpoints
    model = AutoModelForCausalLM.from_pretrained(ep.model_path, dtype=torch.float32)
    model = actor_model(cfg, model, main)
    offload = cfg.learner.cpu_offload
    if offload and accelerator.num_processes == 1:
        own_process_group()  # FSDP2 shards over a process group, here a group of one
    pad_id = AutoTokenizer.from_pretrained(ep.model_path).pad_token_id or 0
    model, optimizer = prepare(accelerator, model, lambda m: adamw(
        m, lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay
    ), cfg.model.dtype, offload)  # fmt: skip
    allocate_state(optimizer)  # now, not inside the first step (a checkpoint replaces it)
    warmup = cfg.learner.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    critic = critic_optimizer = reference = None
    if cfg.algo.adv_estimator == "gae":
        critic = load_critic(cfg.critic.path or ep.model_path)
        if cfg.learner.gradient_checkpointing:
            critic.gradient_checkpointing_enable()
        if cfg.learner.compile:
            compile_layers(critic)
        critic, critic_optimizer = prepare(accelerator, critic, lambda m: adamw(
            m, lr=cfg.critic.lr, weight_decay=cfg.critic.weight_decay
        ), cfg.model.dtype, offload)  # fmt: skip
        allocate_state(critic_optimizer)
    # Frozen models (reference, teachers): the compute dtype on CUDA, float32 on CPU.
    frozen = getattr(torch, cfg.model.dtype) if torch.cuda.is_available() else torch.float32
    if cfg.algo.uses_reference:
        reference = load_reference(
            cfg.algo.kl.ref_path or ep.model_path, accelerator.device, frozen
        )
    teachers = None
    if cfg.distillation.processes:
        teachers = FromBatch(cfg.distillation)
    elif cfg.distillation.enabled:  # each checked against the student's tokenizer first
        teachers = LocalTeachers.load(
            cfg.distillation, ep.model_path, accelerator.device, frozen,
            cfg.generators.temperature, PassOptions.of(cfg.learner),
        )  # fmt: skip
    group = None
    if main:
        mark(ctx.path, "learner", "models ready")
        world = sync_world_size(cfg)
        log.info("waiting for %d generator worker(s) to join the weight-sync group", world - 1)
        group = join_group(
            ep.weights_host,
            ep.weights_port,
            0,
            world,
            resolve_backend(cfg.weights.backend, cfg.placement.colocate),
            cfg.weights.join_timeout_s,
            shared_memory=cfg.weights.shared_memory,
            device=accelerator.device,
        )
        offered = "offered" if group.memory is not None else "not offered"
        log.info("weight-sync group ready: same-host memory %s", offered)
        mark(ctx.path, "learner", "joined weight sync")
    stop_on_signals()
    learner = Learner(
        ctx, accelerator, model, optimizer, group, pad_id, scheduler,
        critic, critic_optimizer, reference, teachers,
    )  # fmt: skip
    try:
        learner.train()
        if accelerator.num_processes > 1:
            torch.distributed.barrier()  # no rank leaves while another is still finishing
    finally:
        learner.close()
        rank = accelerator.process_index
        mark_cpu(ctx.path, "learner" if rank == 0 else f"learner{rank}")
    if torch.distributed.is_initialized():  # several ranks, or one sharded (cpu_offload)
        leave_job()


def actor_model(cfg, model, main: bool):
    """The policy as the learner trains it, before sharding: Liger's kernels, activation
    checkpointing, then LoRA (FSDP2 then shards base and adapter alike), then compiled layers (inside
    the checkpoint, around the adapters)."""
    if cfg.learner.liger:
        apply_liger(model)
    if cfg.learner.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        if lora.enabled(cfg):  # the frozen embeddings' output must carry a gradient
            model.enable_input_require_grads()
    if lora.enabled(cfg):
        model = lora.apply(model, cfg.model.lora)
        if main:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            log.info(
                "LoRA rank %d: %.2fM trainable parameters", cfg.model.lora.rank, trainable / 1e6
            )
    if cfg.learner.compile:
        compile_layers(model)
    return model


def apply_liger(model) -> None:
    """Liger's RoPE, RMSNorm and SwiGLU kernels in ``model`` (``learner.liger``), by its
    model type; no fused cross-entropy (the learner's head is its chunked log-prob pass)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise ConfigError(
            "bad value for 'learner.liger': the liger-kernel package is not installed "
            "(pip install liger-kernel, or the gpu extra)"
        ) from exc
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
        fused_linear_cross_entropy=False,
    )  # fmt: skip


def keep_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations instead of returning it
    to the system: glibc's malloc then takes large blocks from its heap instead of mapping
    each one (and unmapping it when freed), and never trims the heap. A learner's step
    allocates and frees its activations, GiBs on a CPU. Returned each time, they are
    page-faulted in again every step: 0.3-1 s of system time a pass for SmolLM2-135M, and
    about 10 us a page instead of 1.5 us on virtual machines that hand freed guest memory
    back to their host. Resident memory then stays at the largest step's, as with a
    caching allocator. False where the C library has no ``mallopt`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    # -1 reads as the largest size_t (the value is an int): never trim.
    return mallopt(m_mmap_max, 0) == 1 and mallopt(m_trim_threshold, -1) == 1


def leave_job() -> None:
    """End a rank of a multi-rank job whose ranks have all finished: flush and exit now.

    Tearing a gloo process group down, by ``destroy_process_group`` or at interpreter
    exit, now and then aborts a rank after all its work is done ("terminate called
    without an active exception", SIGABRT), which would turn a finished run into a
    failed one. Everything this process wrote is closed by now (metrics, checkpoints,
    the weight-sync group), so the teardown is skipped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (every one, or a LoRA run's adapter), fused:
    one kernel over all tensors instead of a loop, on CPU as on CUDA (4.8x faster a step
    on a 141M-parameter model on 2 CPU cores; BENCHMARKS.md section 5)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


@torch.no_grad()
def allocate_state(optimizer) -> None:
    """Allocate the optimizer's state (AdamW's two moments: twice the trainable weights)
    while the learner waits for its engine and first batch, instead of inside its first
    step (1.2-1.4 s for SmolLM2-135M on 2 CPU cores). One step over zero gradients at
    learning rate 0 makes the state the optimizer's own code would make; its step count is
    then set back to 0. The moments of zero gradients are zero and a step at learning
    rate 0 moves no weight (nor does AdamW's decoupled decay), so training continues
    exactly as from a fresh optimizer (tests/unit/test_learner_setup.py)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for p in params:
        p.grad = None
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def prepare(accelerator, model, make_optimizer, dtype: str, offload: bool = False):
    """(model, optimizer) ready to train: Accelerate's prepare on one rank; FSDP2 over
    several (Accelerate would wrap a CPU model in DDP, so the sharding is applied here),
    or over one with ``offload`` (learner.cpu_offload: FSDP2's offload is the way to it)."""
    if accelerator.num_processes == 1 and not offload:
        return accelerator.prepare(model, make_optimizer(model))
    if accelerator.is_main_process:
        n = accelerator.num_processes
        log.info(
            "%s: FSDP2 over %d rank%s (%s)%s", type(model).__name__, n, "s" if n > 1 else "",
            torch.distributed.get_backend(), ", CPU offload" if offload else "",
        )  # fmt: skip
    if not offload:  # offloaded: the shards go to host memory, no need to visit the device
        model = model.to(accelerator.device)
    model = fsdp2(model, getattr(torch, dtype), offload)
    return model, make_optimizer(model)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (its ``_no_split_modules`` classes): the units FSDP2
    shards and ``learner.compile`` compiles."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in layers]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder layer class")
    return blocks


def fsdp2(model, compute_dtype: torch.dtype, offload: bool = False):
    """``fully_shard`` each decoder layer, then the root. Parameters and optimizer state
    stay float32; a bf16/fp16 ``model.dtype`` is the compute dtype (FSDP2's mixed
    precision, gradients reduced in float32). ``offload``: shards, gradients and optimizer
    state live in host memory (pinned on CUDA), each layer's parameters are copied to the
    device for its forward and backward, and the optimizer steps on the CPU."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    policy = MixedPrecisionPolicy()
    if compute_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    placement = OffloadPolicy()
    if offload:
        placement = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in decoder_layers(model):
        fully_shard(block, mp_policy=policy, offload_policy=placement)
    fully_shard(model, mp_policy=policy, offload_policy=placement)
    return model


def compile_layers(model) -> None:
    """``torch.compile`` each decoder layer in place (``Module.compile``: parameter names
    and state_dict keys stay, so publishing and checkpoints see no difference). The layers
    hold the step's compute and most of its small kernels (norms, RoPE, SwiGLU, casts);
    the head stays eager because learners/logprobs.py replaces its forward at call time.
    Layers of one class share their compiled code once the forward keeps no KV cache
    (``use_cache`` off: a learner never decodes, and a cache's state differs from the
    first layer to the next, a recompile each). Shapes: automatic dynamic, so the first
    shape compiles static and the first different one recompiles with the batch and
    sequence sizes symbolic, which later shapes reuse (``dynamic=True`` would make the
    hidden size symbolic too: a tiny model's steady step was 17x slower on CPU). Call it
    after gradient checkpointing is enabled (the checkpoint then wraps the compiled
    layer) and before FSDP2 (whose hooks stay outside the compiled graphs)."""
    model.config.use_cache = False
    for block in decoder_layers(model):
        block.compile()


def process_group_kwargs(learner) -> list:
    """Accelerate's process-group settings: an offloading CUDA job of several ranks needs
    gloo beside NCCL (its shards and their collectives are in host memory); one rank
    makes its own group (``own_process_group``)."""
    from accelerate.utils import InitProcessGroupKwargs

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if learner.cpu_offload and torch.cuda.is_available() and ranks > 1:
        return [InitProcessGroupKwargs(backend=OFFLOAD_BACKEND)]
    return []


OFFLOAD_BACKEND = "cpu:gloo,cuda:nccl"


def own_process_group() -> None:
    """A default process group of this one process, for FSDP2 on a single learner rank
    (learner.cpu_offload); the weight-sync group is separate (verl_async/weight_sync.py)."""
    if torch.distributed.is_initialized():
        return
    backend = OFFLOAD_BACKEND if torch.cuda.is_available() else "gloo"
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)


def stop_on_signals() -> None:
    """SIGTERM (the launcher's stop, e.g. on Ctrl-C) and SIGINT (Ctrl-C where the learner
    runs in a terminal) unwind the loop like Ctrl-C, so an in-progress checkpoint write is
    finished (or abandoned uncommitted) before exit: the first of them only, so the stop
    logs one line and no later signal turns into a traceback."""
    interrupt_once(signal.SIGTERM, signal.SIGINT)
