"""Masked reductions shared by the advantage estimators and the losses.

A mask is 0/1 (bool, int or float) with the shape of the values. Masked-out entries never
reach a result, whatever they hold (inf and nan included): they are replaced by 0 before any
arithmetic, so ``0 * inf = nan`` cannot happen.

  masked_sum(x, m)     sum of m * x over the kept entries
  masked_mean(x, m)    masked_sum(x, m) / (sum(m) + 1e-8)      (0 when nothing is kept)
  masked_var(x, m)     masked_mean((x - mu)^2, m) * n / (n - 1), mu = masked_mean(x, m),
                       n = sum(m): the UNBIASED (Bessel-corrected) variance; fewer than two
                       kept entries raise ValueError
  masked_whiten(x, m)  (x - mu) / sqrt(var + 1e-8) with mu, var as above (mu is added back
                       when shift_mean is False); masked entries come out as 0 (mu)
  masked_center(x, m)  x - mu on kept entries, 0 on masked ones (whitening without the
                       division)

The 1e-8 terms are the ones verl uses, so statistics agree with verl's to the last bit of
float32 on the same inputs.
"""

from __future__ import annotations

import torch

MEAN_EPS = 1e-8  # added to the kept count by masked_mean
WHITEN_EPS = 1e-8  # added to the variance by masked_whiten


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``mask * values`` over ``dim`` (all entries when None); masked entries read as 0."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    total = kept * mask
    return total.sum() if dim is None else total.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum / (kept count + 1e-8)``: 0, not nan, where nothing is kept."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the kept entries (a scalar), Bessel-corrected unless ``unbiased`` is False.

    Raises ValueError when the correction would divide by zero (fewer than two kept entries).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return var
    n = mask.sum()
    if n == 0:
        raise ValueError("masked_var: the mask keeps no entry")
    if n == 1:
        raise ValueError("masked_var: the mask keeps a single entry; the unbiased variance is 0/0")
    return var * (n / (n - 1))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with the kept entries' mean and unbiased variance.

    Masked entries come out as 0 (``mean`` when shift_mean is False) whatever they held;
    verl transforms them like kept ones, but nothing downstream reads them.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    safe = torch.where(mask.bool(), values, mean.expand_as(values))
    whitened = (safe - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def masked_center(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values - mean`` of the kept entries; masked entries come out as 0."""
    mean = masked_mean(values, mask)
    return torch.where(mask.bool(), values - mean, torch.zeros_like(values))
