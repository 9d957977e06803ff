"""The learner's policy update: pi_prox, then PPO-clip minibatch steps (pure torch).

Shared by the learner process and ``benchmarks/gpu.py`` (FSDP2), so both run this code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learners.batching import TrainBatch
from verl_async.algos import (
    LossOutput,
    kl_k3,
    policy_loss,
    token_entropy,
    token_logprobs,
)
from verl_async.algos.kl import kl_penalty
from verl_async.algos.losses import agg_loss


@dataclass
class StepStats:
    loss: float
    kl: float  # k3 estimate of KL(pi_behav || pi_prox): how far the samples' policy lags
    entropy: float
    clip_fraction: float  # verl's actor/pg_clipfrac
    clip_fraction_lower: float  # dual-clip active (verl's actor/pg_clipfrac_lower)
    ppo_kl: float  # mean of logp_prox - logp over the update (verl's actor/ppo_kl)
    is_weight_mean: float
    is_weight_max: float
    is_clipped_fraction: float
    grad_norm: float
    kl_loss: float | None = None  # the KL-to-reference loss term (algo.kl.loss_coef > 0)


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
    logp_prox: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    step: bool = True,
) -> StepStats:
    """pi_prox, then ``algo.minibatches`` optimizer steps over the batch.

    ``advantages`` is [N] (one per sample) or [N, T-1] (per token). ``backward(loss)`` and
    ``clip_grad() -> norm`` come from the caller (Accelerate in the learner; plain torch
    under FSDP2 in benchmarks/gpu.py), so both run this exact code. ``logp_ref`` adds the
    KL loss term (``algo.kl.loss_coef``); ``step=False`` computes the losses and metrics
    without changing the weights (the critic's warm-up steps).

    pi_prox: ``logp_prox`` when the caller computed it already, else with one minibatch
    the gradient pass runs at the weights pi_prox is defined by, so pi_prox is that pass's
    log-probs, detached: no separate forward (a quarter of the step's compute on a real
    model); else a no-grad pass first.
    """
    one_pass = logp_prox is None and algo.minibatches == 1
    entropy = None
    if logp_prox is None and not one_pass:
        logp_prox, entropy = prox_pass(model, batch, temperature)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    mask = batch.loss_mask
    n_tok = mask.sum().clamp(min=1)
    chunks = torch.arange(len(adv), device=mask.device).chunk(algo.minibatches)
    parts, entropies = [], []
    bonus = algo.entropy_coeff > 0
    for idx in chunks:
        with torch.enable_grad() if step else torch.no_grad():
            logits = logits_of(model, batch.input_ids[idx], batch.attention_mask[idx], temperature)
            logp = token_logprobs(logits, batch.input_ids[idx, 1:])
            if one_pass:
                logp_prox = logp.detach()  # [N, T-1]
            chunk_entropy = None
            if entropy is None or bonus:  # [n, T]; with a gradient only for the bonus
                chunk_entropy = token_entropy(logits if bonus else logits.detach())
                entropies.append(chunk_entropy.detach())
            del logits
            out, kl_loss = actor_loss(
                logp, logp_prox[idx], batch.behav_logprobs[idx], adv[idx], mask[idx], algo,
                chunk_entropy[:, :-1] if bonus else None,
                None if logp_ref is None else logp_ref[idx],
            )  # fmt: skip
        grad = 0.0
        if step:
            backward(out.loss)
            grad = clip_grad()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out.loss = out.loss.detach()
        parts.append((out, None if kl_loss is None else kl_loss.detach(), float(grad)))
    if entropy is None:  # no pass before the update: the entropies seen during it
        entropy = torch.cat(entropies)
    return _step_stats(parts, logp_prox, entropy, batch, n_tok)


def actor_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    algo,
    entropy: torch.Tensor | None,
    logp_ref: torch.Tensor | None,
) -> tuple[LossOutput, torch.Tensor | None]:
    """PPO-clip loss (``out.loss`` includes the entropy bonus and the KL loss term)."""
    out = policy_loss(
        logp, logp_prox, logp_behav, adv, mask,
        algo.correction, algo.clip_eps, algo.is_cap, algo.clip_eps_high,
        clip_ratio_c=algo.clip_ratio_c, loss_agg_mode=algo.loss_agg_mode,
        loss_scale_factor=algo.loss_scale_factor,
    )  # fmt: skip
    agg = lambda x: agg_loss(x, mask, algo.loss_agg_mode, loss_scale_factor=algo.loss_scale_factor)  # noqa: E731
    if entropy is not None:
        out.loss = out.loss - algo.entropy_coeff * agg(entropy)
    kl_loss = None
    if logp_ref is not None and algo.kl.loss_coef > 0:
        kl_loss = agg(kl_penalty(logp, logp_ref, algo.kl.loss_type))
        out.loss = out.loss + algo.kl.loss_coef * kl_loss
    return out, kl_loss


def _step_stats(parts: list, logp_prox, entropy, batch: TrainBatch, n_tok) -> StepStats:
    """Metrics of one update: means over its minibatches (the largest behaviour weight)."""
    mask = batch.loss_mask
    k = 1.0 / len(parts)
    mean = lambda get: sum(float(get(p)) for p in parts) * k  # noqa: E731
    kl_losses = [p[1] for p in parts if p[1] is not None]
    return StepStats(
        loss=mean(lambda p: p[0].loss),
        kl=float((kl_k3(logp_prox, batch.behav_logprobs) * mask).sum() / n_tok),
        entropy=float((entropy[:, :-1] * mask).sum() / n_tok),
        clip_fraction=mean(lambda p: p[0].clip_fraction),
        clip_fraction_lower=mean(lambda p: p[0].pg_clipfrac_lower),
        ppo_kl=mean(lambda p: p[0].ppo_kl),
        is_weight_mean=mean(lambda p: p[0].is_weight_mean),
        is_weight_max=max(float(p[0].is_weight_max) for p in parts),
        is_clipped_fraction=mean(lambda p: p[0].is_clipped_fraction),
        grad_norm=mean(lambda p: p[2]),
        kl_loss=sum(float(x) for x in kl_losses) / len(kl_losses) if kl_losses else None,
    )


def prox_pass(model, batch: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_prox log-probs [N, T-1] and token entropies [N, T] before any update (no grad)."""
    with torch.no_grad():
        logits = logits_of(model, batch.input_ids, batch.attention_mask, temperature)
        return token_logprobs(logits, batch.input_ids[:, 1:]), token_entropy(logits)
