"""Off-policy corrections: what a policy loss's ratio is taken against, and the per-token
weights and mask it is multiplied by (``algo.correction``).

Three policies meet in the actor loss:
  pi_behav  the generator's sampling logprobs (vLLM ``processed_logprobs``),
  pi_prox   the learner's recomputation with the weights before this batch's updates,
  pi_theta  the weights being optimised.

  none       ratio against pi_behav, no weights (verl's bypass mode: old = rollout)
  tis        ratio against pi_prox,  w = min(pi_prox / pi_behav, is_cap)
  decoupled  ratio against pi_prox,  w = pi_prox / pi_behav, or 0 where that exceeds
             is_cap (AReaL's decoupled PPO drops those tokens; they stay in the denominator)
  rollout    verl's rollout correction (``algo.rollout_correction``,
             ``correction/rollout.py``): importance weights and rejection
             sampling from log pi_train - log pi_behav. Decoupled: ratio against pi_prox,
             pi_train = pi_prox; the learner may pass the weights and mask it computed over
             the whole step (``given``: batch normalisation and rejection need every row).
             Bypass: ratio against pi_behav, pi_train = pi_theta detached, computed here per
             micro-batch; its weights reach the loss with loss_type reinforce only.

Every weight is detached: it scales a token's loss, it is not optimised. The weights fill
verl's ``rollout_is_weights`` slot of every loss mode (``LossInputs.is_weights``), and the
returned mask is the one the loss aggregates over. ``off_policy_correction`` is the one
place that turns (pi_prox, pi_behav, mask) into (ratio denominator, weights, mask): another
correction (importance sampling or rejection by other rules) plugs in there.

Metrics, over the kept tokens, whatever the correction: the mean and largest
pi_prox / pi_behav, and the share of tokens whose weight exceeded the cap (rollout: the
share rejection sampling removed); rollout adds verl's ``rollout_corr/*`` metrics when it
computed them here (bypass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verl_async.algos.correction.rollout import rollout_correction

CORRECTIONS = ("none", "tis", "decoupled", "rollout")


@dataclass
class Correction:
    logp_old: torch.Tensor  # [N, T] the ratio's denominator: pi_prox, or pi_behav (none)
    weights: torch.Tensor | None  # [N, T] detached per-token weights, None: all 1
    mask: torch.Tensor  # [N, T] 0/1, the tokens the loss aggregates over
    is_weight_mean: torch.Tensor  # scalar, mean pi_prox / pi_behav over kept tokens
    is_weight_max: torch.Tensor  # scalar, its largest value
    is_clipped_fraction: torch.Tensor  # scalar, share of tokens above is_cap
    metrics: dict[str, float] = field(default_factory=dict)  # rollout_corr/* (bypass)


def off_policy_correction(
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    algo,
    logp: torch.Tensor | None = None,
    given: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> Correction:
    """``algo.correction`` applied to [N, T] log-probs of pi_prox and pi_behav and the
    loss mask (0/1, any dtype): see the module docstring. ``logp`` (pi_theta) is read by
    rollout's bypass mode, ``given`` (weights, mask) by its decoupled mode."""
    mask = mask.to(logp_prox.dtype)
    keep = mask > 0
    with torch.no_grad():
        raw = torch.exp(torch.where(keep, logp_prox - logp_behav, torch.zeros_like(mask)))
        limited = (raw > algo.is_cap) & keep
        n_tokens = mask.sum().clamp(min=1)
        kept_raw = torch.where(keep, raw, torch.zeros_like(raw))
        metrics: dict[str, float] = {}
        if algo.correction == "none":
            logp_old, weights = logp_behav, None
        elif algo.correction == "tis":
            logp_old, weights = logp_prox, raw.clamp(max=algo.is_cap)
        elif algo.correction == "decoupled":
            logp_old, weights = logp_prox, torch.where(limited, torch.zeros_like(raw), raw)
        elif algo.correction == "rollout":
            logp_old, weights, new_mask, metrics = _rollout(
                logp_prox, logp_behav, mask, algo, logp, given
            )
            limited, mask = (mask > 0) & (new_mask == 0), new_mask.to(mask.dtype)
        else:
            raise ValueError(f"unknown correction '{algo.correction}' ({', '.join(CORRECTIONS)})")
        return Correction(
            logp_old=logp_old.detach(),
            weights=weights,
            mask=mask,
            is_weight_mean=kept_raw.sum() / n_tokens,
            is_weight_max=kept_raw.max(),
            is_clipped_fraction=limited.to(mask.dtype).sum() / n_tokens,
            metrics=metrics,
        )


def _rollout(logp_prox, logp_behav, mask, algo, logp, given):
    """(ratio denominator, weights or None, mask, metrics) of ``algo.correction: rollout``."""
    settings = algo.rollout_correction.settings()
    if not settings.bypass_mode:
        if given is not None:
            return logp_prox, given[0], given[1], {}
        if not (mask > 0).any():
            return logp_prox, None, mask, {}
        weights, new_mask, _ = rollout_correction(logp_prox, logp_behav, mask, settings)
        return logp_prox, weights, new_mask, {}  # the step's metrics are taken over all rows
    if logp is None:
        raise ValueError("rollout correction in bypass mode needs pi_theta's log-probs")
    if not (mask > 0).any():  # a placeholder pass
        return logp_behav, None, mask, {}
    weights, new_mask, metrics = rollout_correction(logp.detach(), logp_behav, mask, settings)
    applied = weights if settings.loss_type == "reinforce" else None
    return logp_behav, applied, new_mask, metrics
