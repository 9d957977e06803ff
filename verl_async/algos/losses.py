"""Loss aggregation, the PPO policy loss (with off-policy corrections and dual-clip), the
clipped value loss and the entropy bonus; verl's semantics unless stated.

agg_loss(L, m, mode) over a per-token loss L [N, T] and mask m:
  token-mean               sum(m L) / sum(m)                      (all kept tokens weigh alike)
  seq-mean-token-sum       mean over non-empty rows of sum_t(m L)
  seq-mean-token-mean      mean over non-empty rows of sum_t(m L) / (sum_t m + 1e-8)
  seq-mean-token-sum-norm  sum(m L) / S, S = T (the mask's width) unless loss_scale_factor
                           is given (Dr.GRPO's constant normaliser)
Rows with no kept token are left out of the seq-mean denominators. A batch with no kept
token at all gives 0 (verl divides 0 by 0 there).

Three policies meet in the policy loss:
  pi_behav  the generator's sampling logprobs (vLLM ``processed_logprobs``),
  pi_prox   the learner's recomputation with the weights before this batch's updates,
  pi_theta  the weights being optimised.
Per token, with A the advantage, clip(x) = clip(x, 1 - eps, 1 + eps_high) and every
log-ratio clamped to [-20, 20] before exp:

  none       r = pi_theta / pi_behav, w = 1
  tis        r = pi_theta / pi_prox,  w = min(pi_prox / pi_behav, cap)
  decoupled  r = pi_theta / pi_prox,  w = pi_prox / pi_behav, or 0 where that exceeds cap
             (AReaL's decoupled PPO drops those tokens; they stay in the denominator)

  L1 = max(-A r, -A clip(r))                                 (PPO-clip)
  L  = min(L1, -A c) where A < 0, else L1                    (dual-clip, if c is given)
  loss = agg_loss(w * L, mask, mode)

Metrics (masked token means): pg_clipfrac = share where -A clip(r) > -A r; pg_clipfrac_lower
= share where A < 0 and L1 > -A c (the dual clip binds); ppo_kl = mean of -log r.

value_loss: Vc = clip(V, V_old - c, V_old + c);
  loss = 0.5 * agg_loss(max((V - R)^2, (Vc - R)^2)); vf_clipfrac = share where
  (Vc - R)^2 > (V - R)^2.
explained_variance: 1 - var(R - V) / (var(R) + 1e-5) over kept tokens, unbiased variances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verl_async.algos.masked import masked_mean, masked_sum
from verl_async.algos.tokens import entropy_from_logits

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # |log r| is clamped to this before exp, as verl does
SEQ_MEAN_EPS = 1e-8  # added to each row's token count by seq-mean-token-mean
EXPLAINED_VAR_EPS = 1e-5


def _divide(num: torch.Tensor, den: torch.Tensor | float) -> torch.Tensor:
    """num / den, with a zero denominator read as 1 (num is 0 there: nothing was kept)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [N, T] (masked positions ignored, whatever they hold) into
    a scalar by ``mode`` (see the module docstring).

    The optional denominators replace the ones taken from this batch, as in verl:
    ``batch_num_tokens`` (token-mean), ``global_batch_size`` (the two seq-mean modes),
    ``loss_scale_factor`` (seq-mean-token-sum-norm, default T = mask.shape[-1]).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{mode}' (one of {', '.join(AGG_MODES)})")
    kept = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat)) * mask
    if mode == "token-mean":
        return _divide(kept.sum(), mask.sum() if batch_num_tokens is None else batch_num_tokens)
    seq_sum = kept.sum(dim=-1)
    if mode == "seq-mean-token-sum-norm":
        scale = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return seq_sum.sum() / scale
    count = mask.sum(dim=-1)
    per_seq = seq_sum if mode == "seq-mean-token-sum" else seq_sum / (count + SEQ_MEAN_EPS)
    seq_mask = (count > 0).to(per_seq.dtype)
    den = seq_mask.sum() if global_batch_size is None else global_batch_size
    return _divide((per_seq * seq_mask).sum(), den)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    clip_fraction: torch.Tensor  # scalar, share of tokens where the PPO clip was active
    is_weight_mean: torch.Tensor  # scalar, mean behaviour importance weight
    is_weight_max: torch.Tensor
    is_clipped_fraction: torch.Tensor  # share of tokens truncated (tis) or masked (decoupled)
    # verl's metric names: pg_clipfrac equals clip_fraction; pg_clipfrac_lower is the share
    # of tokens where the dual clip binds; ppo_kl the mean of log(pi_old / pi_theta).
    pg_clipfrac: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))
    pg_clipfrac_lower: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))
    ppo_kl: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))


def _correction(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    correction: str,
    is_cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clamped log-ratio, per-token weight w, 0/1 share limited by the cap), each [N, T]."""
    if correction == "none":
        log_ratio = logp - logp_behav
        weight = torch.ones_like(logp)
        limited = torch.zeros_like(logp)
    elif correction in ("tis", "decoupled"):
        log_ratio = logp - logp_prox
        raw = torch.exp(logp_prox - logp_behav).detach()
        limited = (raw > is_cap).to(logp.dtype)
        if correction == "tis":
            weight = raw.clamp(max=is_cap)
        else:
            weight = torch.where(limited > 0, torch.zeros_like(raw), raw)
    else:
        raise ValueError(f"unknown correction '{correction}' (none, tis, decoupled)")
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), weight, limited


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
    *,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
) -> LossOutput:
    """PPO-clip loss; every tensor is [N, T] (advantages may be [N, 1]), mask is 0/1.

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high defaults to
    clip_eps; a larger one is DAPO's clip-higher). ``clip_ratio_c`` (> 1) turns on verl's
    dual-clip for negative advantages; None leaves it off. The weighted per-token loss is
    aggregated by ``agg_loss`` with ``loss_agg_mode`` and the optional denominators
    (``loss_scale_factor``, ``batch_num_tokens``, ``global_batch_size``: see agg_loss).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    mask = mask.to(logp.dtype)
    log_ratio, weight, limited = _correction(logp, logp_prox, logp_behav, correction, is_cap)
    ratio = torch.exp(log_ratio)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    negative = (advantages < 0).expand_as(pg)
    lower_active = torch.zeros_like(negative)
    if clip_ratio_c is not None:
        pg_dual = -advantages * clip_ratio_c
        lower_active = negative & (pg > pg_dual)
        pg = torch.where(negative, torch.minimum(pg, pg_dual), pg)
    loss = agg_loss(
        weight * pg, mask, loss_agg_mode,
        batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )  # fmt: skip
    with torch.no_grad():
        n_tokens = mask.sum().clamp(min=1)
        clipfrac = masked_mean((pg_clipped > pg_unclipped).to(logp.dtype), mask)
        w_all = torch.exp(logp_prox - logp_behav)
        w_masked = torch.where(mask > 0, w_all, torch.zeros_like(w_all))
        return LossOutput(
            loss=loss,
            clip_fraction=clipfrac,
            is_weight_mean=w_masked.sum() / n_tokens,
            is_weight_max=w_masked.max(),
            is_clipped_fraction=masked_sum(limited, mask) / n_tokens,
            pg_clipfrac=clipfrac,
            pg_clipfrac_lower=masked_mean(lower_active.to(logp.dtype), mask),
            ppo_kl=masked_mean(-log_ratio, mask),
        )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's clipped value loss: values (being optimised), old_values (from rollout time),
    returns, mask [N, T] -> (vf_loss scalar, vf_clipfrac scalar). The denominators are
    agg_loss's."""
    clipped = torch.maximum(
        torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value
    )
    err = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    worst = torch.maximum(err, err_clipped)
    vf_loss = 0.5 * agg_loss(
        worst, mask, loss_agg_mode,
        batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )  # fmt: skip
    with torch.no_grad():
        vf_clipfrac = masked_mean((err_clipped > err).to(values.dtype), mask)
    return vf_loss, vf_clipfrac


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """1 - var(returns - values) / (var(returns) + 1e-5) over the kept tokens of [N, T]
    tensors, with unbiased variances (verl's ``critic/vf_explained_var``). nan with fewer
    than two kept tokens, where the unbiased variance is undefined."""
    keep = mask.bool()
    r, v = returns[keep], values[keep]
    n = r.numel()
    if n < 2:
        return torch.tensor(float("nan"), dtype=returns.dtype, device=returns.device)

    def var(x: torch.Tensor) -> torch.Tensor:
        return ((x - x.mean()) ** 2).sum() / (n - 1)

    return 1.0 - var(r - v) / (var(r) + EXPLAINED_VAR_EPS)


def entropy_loss(
    logits: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Mean entropy of the policy: logits [N, T, V], mask [N, T] -> scalar, aggregated by
    ``agg_loss``. Subtract ``coef * entropy_loss`` from the loss for an entropy bonus."""
    return agg_loss(entropy_from_logits(logits), mask, loss_agg_mode)
