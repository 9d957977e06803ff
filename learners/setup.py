"""Build the learner: Accelerator, actor and optimizer, critic and reference when the
algorithm needs them, the weight-sync group; then run the loop (learners/trainer.py)."""

from __future__ import annotations

import logging
import signal

import torch

from learners.critic import load_critic, load_reference
from learners.trainer import Learner
from verl_async.runtime import RunContext
from verl_async.weight_sync import join_group, resolve_backend

log = logging.getLogger("verl_async.learner")


def run_learner(ctx: RunContext) -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = ctx.cfg
    # Parameters and optimizer state stay float32; a bf16/fp16 model.dtype is the compute
    # dtype (autocast), as the generators' weights are (published tensors are cast on load).
    mixed = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[cfg.model.dtype]
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed)
    torch.manual_seed(cfg.learner.seed)
    ep = ctx.endpoints
    model = AutoModelForCausalLM.from_pretrained(ep.model_path, dtype=torch.float32)
    if cfg.learner.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    pad_id = AutoTokenizer.from_pretrained(ep.model_path).pad_token_id or 0
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay
    )
    warmup = cfg.learner.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    critic = critic_optimizer = reference = None
    if cfg.algo.adv_estimator == "gae":
        critic = load_critic(cfg.critic.path or ep.model_path)
        if cfg.learner.gradient_checkpointing:
            critic.gradient_checkpointing_enable()
        critic_optimizer = torch.optim.AdamW(
            critic.parameters(), lr=cfg.critic.lr, weight_decay=cfg.critic.weight_decay
        )
        critic, critic_optimizer = accelerator.prepare(critic, critic_optimizer)
    if cfg.algo.uses_reference:  # frozen: the compute dtype on CUDA, float32 on CPU
        dtype = getattr(torch, cfg.model.dtype) if torch.cuda.is_available() else torch.float32
        reference = load_reference(cfg.algo.kl.ref_path or ep.model_path, accelerator.device, dtype)
    group = None
    if accelerator.is_main_process:
        log.info("waiting for %d generator(s) to join the weight-sync group", cfg.generators.count)
        group = join_group(
            ep.weights_host,
            ep.weights_port,
            0,
            1 + cfg.generators.count,
            resolve_backend(cfg.weights.backend),
            cfg.weights.join_timeout_s,
        )
        log.info("weight-sync group ready")
    # SIGTERM (the launcher's stop, e.g. on Ctrl-C) unwinds the loop like Ctrl-C would, so
    # an in-progress checkpoint write is finished (or abandoned uncommitted) before exit.
    signal.signal(signal.SIGTERM, _interrupt)
    learner = Learner(
        ctx, accelerator, model, optimizer, group, pad_id, scheduler,
        critic, critic_optimizer, reference,
    )  # fmt: skip
    try:
        learner.train()
    finally:
        learner.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
