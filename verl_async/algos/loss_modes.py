"""The built-in policy-loss modes (``algo.loss_mode``), each as verl 1dda039 defines it.

Per token, with lp = log pi_theta, olp = the ratio's denominator (``LossInputs.logp_old``),
A the advantage, M the mask, w the correction's weights (1 when None), sg = stop-gradient,
mmean the masked mean, eps_lo = clip_eps, eps_hi = clip_eps_high (default clip_eps) and
d = lp - olp; "clamped" means d clamped to [-20, 20] before exp:

  vanilla  r = exp(d) clamped; L = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)); where A < 0
           and clip_ratio_c = c is set, min(L, -A c) (dual clip)
  ...

Metrics (masked token means unless stated): see each function. Each mode multiplies its
per-token loss by w and aggregates with ``batch.agg`` and ``algo.loss_agg_mode`` unless its
docstring says it forces another aggregation.
"""

from __future__ import annotations

import torch

from verl_async.algos.losses import LOG_RATIO_CLAMP, GlobalBatch
from verl_async.algos.masked import masked_mean
from verl_async.algos.policy_losses import LossInputs, register_policy_loss

Metrics = dict[str, torch.Tensor]


def _weighted(loss_mat: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """The per-token loss times the correction's weights, if any."""
    return loss_mat if inputs.is_weights is None else loss_mat * inputs.is_weights


def _clamped_log_ratio(inputs: LossInputs) -> torch.Tensor:
    return (inputs.logp - inputs.logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _eps(algo) -> tuple[float, float]:
    """(eps_lo, eps_hi): clip_eps and clip_eps_high (clip_eps when empty)."""
    return algo.clip_eps, algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high


@register_policy_loss("vanilla")
def vanilla(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip with clip-higher and, with ``algo.clip_ratio_c`` set, dual clip.
    pg_clipfrac: share where the clip binds (-A clip(r) > -A r); pg_clipfrac_lower: share
    where A < 0 and the dual clip binds; ppo_kl: mmean(-d), d clamped."""
    c = algo.clip_ratio_c
    if c is not None and c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {c}")
    adv, mask = inputs.advantages, inputs.mask
    eps_lo, eps_hi = _eps(algo)
    log_ratio = _clamped_log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_lo, 1 + eps_hi)
    pg = torch.maximum(unclipped, clipped)
    negative = (adv < 0).expand_as(pg)
    lower = torch.zeros_like(negative)
    if c is not None:
        dual = -adv * c
        lower = negative & (pg > dual)
        pg = torch.where(negative, torch.minimum(pg, dual), pg)
    loss = batch.agg(_weighted(pg, inputs), mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "pg_clipfrac_lower": masked_mean(lower.to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
