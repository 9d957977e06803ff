"""Loss aggregation, the clipped value loss and the entropy bonus; verl's semantics (at
verl commit 1dda039) unless stated. The policy losses are in ``policy_losses.py`` (their
registry) and ``loss_modes.py`` (the built-in modes).

agg_loss(L, m, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) over a
per-token loss L [N, T] and mask m, with S = sum(m L), s_i = sum_t(m L) of row i, n_i its
kept tokens and dp = dp_size:
  token-mean               S / batch_num_tokens * dp                  (all kept tokens weigh alike)
  token-sum                S * dp                                     (no normalisation)
  seq-mean-token-sum       sum_i s_i / G * dp
  seq-mean-token-mean      sum_i s_i / (n_i + 1e-8) / G * dp
  seq-mean-token-sum-norm  seq-mean-token-sum's value / F, F = loss_scale_factor, else T
                           (the mask's width)
G = global_batch_size: the minibatch's sequences, rows without a kept token included. The
denominators are those of the whole minibatch on every rank (``GlobalBatch``); the factor
dp undoes the averaging of the ranks' gradients. Without them (one process, dp = 1) the
batch's own are used: its kept tokens, its non-empty rows. Rows with no kept token add
nothing to a numerator. A batch with no kept token at all gives 0 (verl divides 0 by 0).

value_loss: Vc = clip(V, V_old - c, V_old + c);
  loss = 0.5 * agg_loss(max((V - R)^2, (Vc - R)^2)); vf_clipfrac = share where
  (Vc - R)^2 > (V - R)^2.
explained_variance: 1 - var(R - V) / (var(R) + 1e-5) over kept tokens, unbiased variances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_async.algos.masked import masked_mean
from verl_async.algos.tokens import entropy_from_logits

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
LOG_RATIO_CLAMP = 20.0  # |log r| is clamped to this before exp, as verl does
SEQ_MEAN_EPS = 1e-8  # added to each row's token count by seq-mean-token-mean
EXPLAINED_VAR_EPS = 1e-5


def _divide(num: torch.Tensor, den: torch.Tensor | float) -> torch.Tensor:
    """num / den, with a zero denominator read as 1 (num is 0 there: nothing was kept).
    A number stays a number (a tensor made of it would be copied to num's device)."""
    if not isinstance(den, torch.Tensor):
        return num / (den if den != 0 else 1.0)
    den = den.to(num.dtype)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def _global(name: str, given, local: torch.Tensor, dp_size: int):
    """A global denominator, or this batch's own when it is not given (one rank only: with
    several, the local count would weigh each rank's tokens differently)."""
    if given is not None:
        return given
    if dp_size > 1:
        raise ValueError(f"agg_loss: {name} is required when dp_size > 1")
    return local


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [N, T] (masked positions ignored, whatever they hold) into
    a scalar by ``mode`` (see the module docstring). The keyword arguments are verl's
    ``global_batch_info``: the minibatch's kept tokens (token-mean) and sequences (the
    seq-mean modes) over all ranks, the number of ranks, and -norm's divisor."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{mode}' (one of {', '.join(AGG_MODES)})")
    kept = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat)) * mask
    if mode == "token-sum":
        return kept.sum() * dp_size
    if mode == "token-mean":
        den = _global("batch_num_tokens", batch_num_tokens, mask.sum(), dp_size)
        return _divide(kept.sum(), den) * dp_size
    count = mask.sum(dim=-1)
    seq_sum = kept.sum(dim=-1)
    per_seq = seq_sum / (count + SEQ_MEAN_EPS) if mode == "seq-mean-token-mean" else seq_sum
    nonempty = (count > 0).to(per_seq.dtype)
    den = _global("global_batch_size", global_batch_size, nonempty.sum(), dp_size)
    loss = _divide((per_seq * nonempty).sum(), den) * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


@dataclass(frozen=True)
class GlobalBatch:
    """The denominators of the minibatch a micro-batch's loss belongs to (verl's
    ``global_batch_info``; ``learners/plan.py`` makes them): summed over its micro-batches
    and averaged over ranks, the losses are the minibatch's loss on one rank. The defaults
    are one batch on one rank, aggregated by its own counts."""

    dp_size: int = 1  # data-parallel ranks
    batch_num_tokens: float | None = None  # kept tokens of the minibatch, all ranks
    global_batch_size: float | None = None  # its sequences, all ranks, empty ones included
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor (None: T)

    def agg(self, loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
        """``agg_loss`` of ``loss_mat`` [N, T] with these denominators."""
        return agg_loss(
            loss_mat,
            mask,
            mode,
            dp_size=self.dp_size,
            batch_num_tokens=self.batch_num_tokens,
            global_batch_size=self.global_batch_size,
            loss_scale_factor=self.loss_scale_factor,
        )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    batch: GlobalBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's clipped value loss: values (being optimised), old_values (from rollout time),
    returns, mask [N, T] -> (vf_loss scalar, vf_clipfrac scalar), aggregated with the
    denominators of ``batch`` (default: this batch's own)."""
    clipped = torch.maximum(
        torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value
    )
    err = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    worst = torch.maximum(err, err_clipped)
    vf_loss = 0.5 * (batch or GlobalBatch()).agg(worst, mask, loss_agg_mode)
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
