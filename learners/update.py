"""The learner's policy update: pi_prox, then PPO-clip minibatch steps (pure torch).

Shared by the learner process and ``benchmarks/gpu.py`` (FSDP2), so both run this code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learners.batching import TrainBatch
from verl_async.algorithms import kl_k3, policy_loss, token_entropy, token_logprobs


@dataclass
class StepStats:
    loss: float
    kl: float
    entropy: float
    clip_fraction: float
    is_weight_mean: float
    is_weight_max: float
    is_clipped_fraction: float
    grad_norm: float


def logits_of(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logits divided by the sampling temperature: log-probs of the distribution the
    generators sampled from (vLLM's processed logprobs are taken after the same division)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [N, T, V]
    return logits if temperature == 1.0 else logits / temperature


def policy_update(
    model,
    optimizer,
    batch: TrainBatch,
    advantages: torch.Tensor,
    algo,
    backward,
    clip_grad,
    temperature: float = 1.0,
) -> StepStats:
    """pi_prox recomputation, then ``algo.minibatches`` optimizer steps over the batch.

    ``backward(loss)`` and ``clip_grad() -> norm`` come from the caller (Accelerate in the
    learner; plain torch under FSDP2 in benchmarks/gpu.py), so both run this exact code.

    With one minibatch the gradient pass runs at the weights pi_prox is defined by, so
    pi_prox is that pass's log-probs, detached: no separate forward (a quarter of the
    step's compute on a real model).
    """
    one_pass = algo.minibatches == 1
    logp_prox = entropy = None
    if not one_pass:
        logp_prox, entropy = prox_pass(model, batch, temperature)
    mask = batch.loss_mask
    n_tok = mask.sum().clamp(min=1)
    totals = dict(loss=0.0, clip=0.0, w_mean=0.0, w_max=0.0, w_clip=0.0, grad=0.0)
    chunks = torch.arange(len(advantages), device=mask.device).chunk(algo.minibatches)
    for idx in chunks:
        logits = logits_of(model, batch.input_ids[idx], batch.attention_mask[idx], temperature)
        logp = token_logprobs(logits, batch.input_ids[idx, 1:])
        if one_pass:
            logp_prox = logp.detach()  # [N, T-1]
            with torch.no_grad():
                entropy = token_entropy(logits.detach())
        del logits
        out = policy_loss(
            logp,
            logp_prox[idx],
            batch.behav_logprobs[idx],
            advantages[idx, None],
            mask[idx],
            algo.correction,
            algo.clip_eps,
            algo.is_cap,
            algo.clip_eps_high,
        )
        backward(out.loss)
        grad = clip_grad()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        k = 1.0 / len(chunks)
        totals["loss"] += out.loss.item() * k
        totals["clip"] += out.clip_fraction.item() * k
        totals["w_mean"] += out.is_weight_mean.item() * k
        totals["w_max"] = max(totals["w_max"], out.is_weight_max.item())
        totals["w_clip"] += out.is_clipped_fraction.item() * k
        totals["grad"] += float(grad) * k
    return StepStats(
        loss=totals["loss"],
        kl=float((kl_k3(logp_prox, batch.behav_logprobs) * mask).sum() / n_tok),
        entropy=float((entropy[:, :-1] * mask).sum() / n_tok),
        clip_fraction=totals["clip"],
        is_weight_mean=totals["w_mean"],
        is_weight_max=totals["w_max"],
        is_clipped_fraction=totals["w_clip"],
        grad_norm=totals["grad"],
    )


def prox_pass(model, batch: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_prox log-probs [N, T-1] and token entropies [N, T] before any update (no grad)."""
    with torch.no_grad():
        logits = logits_of(model, batch.input_ids, batch.attention_mask, temperature)
        return token_logprobs(logits, batch.input_ids[:, 1:]), token_entropy(logits)
