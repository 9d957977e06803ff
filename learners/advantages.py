"""From one combined reward per sample to per-token advantages, for every estimator.

    reward r_i  ->  token-level scores (r_i at the sample's last response token, 0 elsewhere)
                ->  minus coef * KL(pi_old || pi_ref) per token   (algo.kl.in_reward)
                ->  advantages [N, T-1] by algo.adv_estimator:
                      grpo, rloo             the sum of a sample's token rewards, compared
                                             within its group; broadcast over its tokens
                      reinforce_plus_plus    discounted returns, whitened over the batch
                      gae                    TD(lambda) against the critic's values

Everything is in the targets' layout of ``TrainBatch`` ([N, T-1], ``loss_mask`` marks the
response tokens); advantages are zero outside responses. pi_old is pi_prox, the learner's
weights before this batch's updates, so the in-reward KL is measured against the same
policy the PPO ratio starts from, whatever the staleness of the samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_async.algos.advantages import (
    gae_advantages,
    grpo_outcome_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from verl_async.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)


@dataclass
class Advantages:
    advantages: torch.Tensor  # [N, T-1], zero outside responses
    returns: torch.Tensor | None  # [N, T-1] (gae and reinforce_plus_plus)
    token_rewards: torch.Tensor  # [N, T-1] after the in-reward KL
    kl_in_reward: float | None = None  # mean per-sequence KL penalty (algo.kl.in_reward)


def kl_controller(kl_cfg) -> FixedKLController | AdaptiveKLController:
    """The in-reward KL coefficient's controller of an ``algo.kl`` config."""
    return make_kl_controller(kl_cfg.controller, kl_cfg.coef, kl_cfg.target_kl, kl_cfg.horizon)


def token_level_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rewards [N], mask [N, T-1] -> [N, T-1]: each reward at its sample's last response
    token (a sample with no response token gets nothing)."""
    scores = torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # [N], -1: empty
    rows = torch.nonzero(last >= 0).squeeze(1)
    scores[rows, last[rows]] = rewards[rows].to(scores.dtype)
    return scores


def estimate(
    algo,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor | None = None,
    logp_old: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_ctrl: FixedKLController | AdaptiveKLController | None = None,
) -> Advantages:
    """Advantages of one batch under ``algo`` (an ``AlgoConfig``); see the module docstring.

    ``values`` is needed by gae; ``logp_old``, ``logp_ref`` and ``kl_ctrl`` by
    ``algo.kl.in_reward`` (the controller is updated with this batch's KL).
    """
    mask = mask.float()
    tokens = token_level_scores(rewards, mask)
    kl_mean = None
    if algo.kl.in_reward:
        tokens, kl_mean = apply_kl_penalty(
            tokens, logp_old, logp_ref, mask, kl_ctrl.value, algo.kl.penalty
        )
        kl_mean = float(kl_mean)
        kl_ctrl.update(kl_mean, len(rewards))
    returns = None
    kind = algo.adv_estimator
    if kind == "gae":
        if values is None:
            raise ValueError("adv_estimator 'gae' needs the critic's values")
        adv, returns = gae_advantages(
            tokens, values, mask, algo.gamma, algo.lam, algo.normalize_adv_std
        )
    elif kind == "reinforce_plus_plus":
        adv, returns = reinforce_plus_plus_advantages(
            tokens, mask, algo.gamma, algo.normalize_adv_std
        )
    else:
        totals = (tokens * mask).sum(dim=1)  # the reward, less the sample's KL penalty
        if kind == "grpo":
            per_sample = grpo_outcome_advantages(totals, group_index, algo.normalize_adv_std)
        elif kind == "rloo":
            per_sample = rloo_advantages(totals, group_index)
        else:
            raise ValueError(f"unknown adv_estimator '{kind}'")
        adv = per_sample[:, None].to(mask.dtype)  # broadcast over the sample's tokens
    return Advantages(adv * mask, returns, tokens, kl_mean)
