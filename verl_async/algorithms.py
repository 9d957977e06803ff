"""GRPO advantages and the PPO policy loss with its three off-policy corrections.

Three policies meet in a loss (DESIGN.md):
  pi_behav  the generator's sampling logprobs (vLLM ``processed_logprobs``),
  pi_prox   the learner's recomputation with the weights before this batch's updates,
  pi_theta  the weights being optimised.

Per response token, with A the sample's advantage and clip(x) = clip(x, 1 - eps, 1 + eps_high):

  none       r = pi_theta / pi_behav;           loss = -min(r A, clip(r) A)
  tis        u = pi_theta / pi_prox, w = min(pi_prox / pi_behav, cap)
                                                loss = -w * min(u A, clip(u) A)
  decoupled  u = pi_theta / pi_prox, w = pi_prox / pi_behav, tokens with w > cap masked
                                                loss = -w * min(u A, clip(u) A)   (AReaL)

``tis`` truncates large behaviour weights to ``cap``; ``decoupled`` drops those tokens, as
AReaL's decoupled PPO does. Losses are averaged over all response tokens of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages.

    rewards:     [N] float, one per sample
    group_index: [N] long, samples with equal index form a group
    returns      [N] (r - mean_group) / (std_group + eps), or without the division
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, inverse, rewards)
    mean = total / count
    centered = rewards - mean[inverse]
    if not normalize_std:
        return centered
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, inverse, centered**2)
    # Unbiased std like torch.std; a group of one has std 0 and advantage 0 anyway.
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std[inverse] + eps)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    clip_fraction: torch.Tensor  # scalar, share of tokens where the PPO clip was active
    is_weight_mean: torch.Tensor  # scalar, mean behaviour importance weight
    is_weight_max: torch.Tensor
    is_clipped_fraction: torch.Tensor  # share of tokens truncated (tis) or masked (decoupled)


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    correction: str,
    clip_eps: float,
    is_cap: float,
    clip_eps_high: float | None = None,
) -> LossOutput:
    """PPO-clip loss; every tensor is [N, T] (advantages broadcast per token), mask is 0/1.

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high defaults to
    clip_eps; a larger one is DAPO's clip-higher).
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1)
    if correction == "none":
        ratio = torch.exp(logp - logp_behav)
        weight = torch.ones_like(logp)
        limited = torch.zeros_like(logp)
    elif correction in ("tis", "decoupled"):
        ratio = torch.exp(logp - logp_prox)
        raw = torch.exp(logp_prox - logp_behav).detach()
        limited = (raw > is_cap).to(logp.dtype)
        weight = raw.clamp(max=is_cap) if correction == "tis" else raw * (1 - limited)
    else:
        raise ValueError(f"unknown correction '{correction}' (none, tis, decoupled)")
    unclipped = ratio * advantages
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = ratio.clamp(1 - clip_eps, 1 + high) * advantages
    per_token = -weight * torch.minimum(unclipped, clipped)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        clip_active = (clipped < unclipped).to(logp.dtype)
        w_masked = torch.where(mask > 0, torch.exp(logp_prox - logp_behav), torch.zeros_like(logp))
        return LossOutput(
            loss=loss,
            clip_fraction=(clip_active * mask).sum() / n_tokens,
            is_weight_mean=w_masked.sum() / n_tokens,
            is_weight_max=w_masked.max(),
            is_clipped_fraction=(limited * mask).sum() / n_tokens,
        )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [N, T, V], targets [N, T] -> logprob of each target [N, T] (float32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, T, V] -> entropy of each position [N, T]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(ref || theta) from samples of ref: e^x - 1 - x, x = logp - logp_ref."""
    x = logp - logp_ref
    return torch.exp(x) - 1 - x
