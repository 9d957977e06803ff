"""Rollout correction as verl 1dda039 computes it (``verl/trainer/ppo/rollout_corr_helper.py``):
importance weights, rejection sampling and their metrics, from two log-probs per token.

  log_ratio rho = logp_train - logp_rollout                                  [B, T]

``logp_rollout`` is pi_behav (the generator's sampling log-probs, verl's rollout_log_probs).
``logp_train`` is pi_prox in decoupled use (verl's old_log_prob: the ratio of the loss is
then pi_theta / pi_prox and the weights correct pi_prox against pi_behav), or pi_theta,
detached, in bypass use (the ratio is pi_theta / pi_behav). Settings and their grammar:
``settings.py`` beside this module. Every exp takes its argument clamped to [-20, 20].

Importance weights (``rollout_is``):
  token     raw = exp(clamp(rho))
  sequence  raw_i = exp(clamp(S_i)), S_i = sum_t rho (unclamped sum), on every kept token
  U         w = min(raw, U)                                  (truncated IS)
  "L_U"     w = raw inside [L, U], else 0                    (IcePop; the mask is unchanged,
                                                              zeroed tokens still count)
  batch normalisation  w / mu, mu = the kept tokens' mean of w (token level) or the mean
            over non-empty rows of each row's mean (sequence level), when mu > 1e-8.
            verl averages over its world process group when torch.distributed is up; here
            ``reduce`` (a sum over the data-parallel group, e.g. an all_reduce of that
            group) makes mu global, and without it mu is this batch's.

Rejection sampling (``rollout_rs``), with u = clamp(rho): k1 = -u, k2 = u^2 / 2,
k3 = e^u - 1 - u per token; token_* tests each token, seq_sum_* the row's sum, seq_mean_*
its mean over kept tokens, seq_max_* its largest value (0 for an empty row), and a row
failing a seq_* option loses every token. k1 keeps log L <= stat <= log U (note: k1 is
log pi_rollout / pi_train, the inverse of the IS weight); k2/k3 keep stat <= U. Every
option must pass; the returned mask is mask * keep, in the mask's dtype. IS and RS both
read the original mask.

Metrics, under verl's names with the prefix ``rollout_corr/`` (definitions in the
functions below). Token-level IS metrics are taken over the truncated weights w, as
verl has done since 1dda039 (earlier verl, b178a3c, took them over the raw weights);
only the ``*_fraction_high/low`` ones read the raw weights. The one departure: with every
weight zeroed (IcePop, nothing in band) verl's effective sample size divides by zero and
raises; here it is 0.

Positions outside the mask may hold anything (inf, nan): they are read as rho = 0 and
never reach a kept output. Pure torch; the learner passes pi_prox or pi_theta in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from verl_async.algos.correction.settings import (
    PRESETS,
    RolloutCorrection,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)
from verl_async.algos.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
PREFIX = "rollout_corr/"
Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over the data-parallel group

__all__ = [
    "PRESETS",
    "Reduce",
    "RolloutCorrection",
    "importance_weights",
    "offpolicy_metrics",
    "rejection_mask",
    "rollout_correction",
]


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of each row [B] (0 for an empty row)."""
    return masked_mean(x, mask, dim=-1)


def _share(flags: torch.Tensor) -> torch.Tensor:
    """Mean of a boolean tensor in float32, as verl takes its shares of rows."""
    return flags.float().mean()


def _tensor_floats(metrics: dict[str, float | torch.Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------- importance weights


def importance_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float | str,
    batch_normalize: bool = False,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights [B, T], 0 off the mask, detached; IS metrics without prefix)."""
    upper, lower = parse_is_threshold(threshold)
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
    m = mask.to(log_ratio.dtype)
    if level == "token":
        log_w = log_ratio  # [B, T]
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    else:
        log_w = masked_sum(log_ratio, m, dim=-1)[:, None]  # [B, 1]
        raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(m) * m
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = is_metrics(w, raw, log_w, m, level, upper, lower)
    if lower is not None:
        out = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = float(masked_mean(out.to(m.dtype), m))
    w = w.detach()
    if batch_normalize:
        w, metrics["rollout_is_batch_norm_factor"] = _batch_normalize(w, m, level, reduce)
    return w, metrics


def _batch_normalize(
    w: torch.Tensor, m: torch.Tensor, level: str, reduce: Reduce | None
) -> tuple[torch.Tensor, float]:
    """w / mu and mu (1.0 and w unchanged when mu <= 1e-8); mu over ``reduce``'s group."""
    if level == "token":
        num, den = masked_sum(w, m), m.sum()
    else:
        seq_mask = (m.sum(dim=-1) > 0).to(w.dtype)
        num, den = (_row_mean(w, m) * seq_mask).sum(), seq_mask.sum()
    if reduce is not None:
        num, den = reduce(num), reduce(den)
    # verl's local forms: masked_mean adds 1e-8 to the token count; the row mean clamps.
    mu = num / (den + 1e-8) if level == "token" else num / den.clamp(min=1e-8)
    if mu > 1e-8:
        return w / mu, float(mu)
    return w, 1.0


def is_metrics(
    w: torch.Tensor,
    raw: torch.Tensor,
    log_w: torch.Tensor,
    m: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """verl's IS metrics: ``w`` applied weights, ``raw`` before truncation/band (both
    [B, T], 0 off the mask), ``log_w`` the unclamped log-weights ([B, T] token, [B, 1]
    sequence); the low side is ``lower`` or 1/upper."""
    low = 1.0 / upper if lower is None else lower
    keep = m.bool()
    if level == "sequence":
        out = {
            "rollout_is_max": torch.exp(log_w.max().clamp(max=SAFETY_BOUND)),
            "rollout_is_min": torch.exp(log_w.min()),
            "rollout_is_mean": masked_mean(w, m),
            "rollout_is_ratio_fraction_high": _share(log_w > math.log(upper)),
            "rollout_is_ratio_fraction_low": _share(log_w < math.log(low)),
        }
    else:
        out = {
            "rollout_is_mean": masked_mean(w, m),
            "rollout_is_ratio_fraction_high": masked_mean((raw > upper).to(m.dtype), m),
            "rollout_is_ratio_fraction_low": masked_mean((raw < low).to(m.dtype), m),
            "rollout_is_max": w.masked_fill(~keep, float("-inf")).max(),
            "rollout_is_min": w.masked_fill(~keep, float("inf")).min(),
        }
    out.update(_spread_metrics(w, m, upper))
    out.update(_seq_is_metrics(w, raw, m, upper, low))
    return _tensor_floats(out)


def _spread_metrics(w: torch.Tensor, m: torch.Tensor, upper: float) -> dict[str, torch.Tensor]:
    """Std and effective sample size of w clamped to [0, upper], over kept tokens."""
    wc = w.clamp(min=0.0, max=upper)
    mean = masked_mean(wc, m)
    std = torch.zeros((), dtype=w.dtype)
    if m.sum() > 1:
        std = (masked_mean(wc.square(), m) - mean.square()).clamp(min=0.0).sqrt()
    second = masked_mean((wc / (mean + 1e-8)).square(), m)
    # verl divides by zero here (every weight 0); report no effective sample instead.
    ess = 1.0 / second if second > 0 else torch.zeros((), dtype=w.dtype)
    return {"rollout_is_std": std, "rollout_is_eff_sample_size": ess}


def _seq_is_metrics(
    w: torch.Tensor, raw: torch.Tensor, m: torch.Tensor, upper: float, low: float
) -> dict[str, torch.Tensor]:
    """Statistics of each row's mean weight, over every row (an empty row's is 0)."""
    seq = _row_mean(w, m)  # [B]
    raw_seq = _row_mean(raw, m)
    zero = torch.zeros((), dtype=w.dtype)
    return {
        "rollout_is_seq_mean": seq.mean(),
        "rollout_is_seq_std": seq.std() if seq.numel() > 1 else zero,
        "rollout_is_seq_max": seq.max(),
        "rollout_is_seq_min": seq.min(),
        "rollout_is_seq_max_deviation": (seq - 1.0).abs().max(),
        "rollout_is_seq_fraction_high": _share(raw_seq > upper),
        "rollout_is_seq_fraction_low": _share(raw_seq < low),
    }


# ---------------------------------------------------------------- rejection sampling


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    u = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -u, "k2": 0.5 * u.square(), "k3": torch.exp(u) - 1.0 - u}


def _option_stat(option: str, k: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """The per-row statistic [B] of a seq_* option (None for token_* options)."""
    if option.startswith("seq_sum"):
        return masked_sum(k, m, dim=-1)
    if option.startswith("seq_mean"):
        return _row_mean(k, m)
    if option.startswith("seq_max"):
        top = k.masked_fill(~m.bool(), float("-inf")).max(dim=-1).values
        return torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    return None


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold: float | str | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """(mask * keep in the mask's dtype, RS metrics without prefix): every option of
    ``rollout_rs`` must pass."""
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    if log_ratio.shape[0] == 0:
        return mask, {}
    m = mask.to(log_ratio.dtype)
    keep_m = m.bool()
    ks = _divergences(log_ratio)
    combined = torch.ones_like(keep_m)
    metrics: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        hi, lo = (math.log(upper), math.log(lower)) if k1 else (upper, 0.0)
        per_row = _option_stat(option, ks[option[-2:]], m)
        stat = ks[option[-2:]] if per_row is None else per_row[:, None].expand_as(m)
        keep = (stat <= hi) & (stat >= lo) if k1 else stat <= hi
        combined = combined & keep
        metrics.update(rs_option_metrics(option, stat, per_row, m, hi, lo if k1 else None))
        metrics.update(_masked_fractions(f"rollout_rs_{option}", keep, keep_m, valid_rows=True))
    metrics.update(_masked_fractions("rollout_rs", combined, keep_m, valid_rows=False))
    return (mask * combined.to(mask.dtype)).to(mask.dtype), metrics


def _masked_fractions(
    prefix: str, keep: torch.Tensor, keep_m: torch.Tensor, valid_rows: bool
) -> dict[str, float]:
    """Share of kept tokens rejected, and of rows with a kept token rejected: over
    non-empty rows (``valid_rows``, verl's per-option form) or all rows (its overall one)."""
    m = keep_m.to(torch.float64)
    hit = (~keep & keep_m).any(dim=-1).to(torch.float64)  # [B]
    if valid_rows:
        valid = keep_m.any(dim=-1).to(torch.float64)
        seq = float((hit * valid).sum() / valid.sum()) if valid.sum() > 0 else 0.0
    else:
        seq = float(_share(hit > 0))
    return {
        f"{prefix}_masked_fraction": float(masked_mean((~keep).to(m.dtype), m)),
        f"{prefix}_seq_masked_fraction": seq,
    }


def rs_option_metrics(
    option: str,
    stat: torch.Tensor,
    per_row: torch.Tensor | None,
    m: torch.Tensor,
    hi: float,
    lo: float | None,
) -> dict[str, float]:
    """verl's per-option RS metrics: ``stat`` [B, T] (a seq option's row value on every
    token), ``per_row`` [B] or None (token options: each row's mean of stat), thresholds in
    the statistic's space; ``lo`` None for k2/k3 (no low side, clamp floor 0)."""
    p = f"rollout_rs_{option}"
    keep = m.bool()
    valid = keep.any(dim=-1)
    rows = (_row_mean(stat, m) if per_row is None else per_row)[valid]  # valid rows only
    tok_max = stat.masked_fill(~keep, float("-inf")).max()
    tok_min = stat.masked_fill(~keep, float("inf")).min()
    by_rows = per_row is not None and rows.numel() > 0
    frac = lambda x: _share(x) if by_rows else masked_mean(x.to(m.dtype), m)  # noqa: E731
    src = rows if by_rows else stat
    out = {
        f"{p}_mean": masked_mean(stat, m),
        f"{p}_max": rows.max() if by_rows else tok_max,
        f"{p}_min": rows.min() if by_rows else tok_min,
        f"{p}_fraction_high": frac(src > hi),
        f"{p}_fraction_low": frac(src < lo) if lo is not None else 0.0,
        f"{p}_std": 0.0,
    }
    if m.sum() > 1:
        c = stat.clamp(min=0.0 if lo is None else lo, max=hi)
        var = masked_mean(c.square(), m) - masked_mean(c, m).square()
        out[f"{p}_std"] = var.clamp(min=0.0).sqrt()
    out.update(_rs_row_metrics(p, rows, hi, lo))
    return _tensor_floats(out)


def _rs_row_metrics(p: str, rows: torch.Tensor, hi: float, lo: float | None) -> dict:
    """Statistics over the valid rows' values (all 0 when there is none)."""
    if rows.numel() == 0:
        names = ("mean", "std", "max", "min", "max_deviation", "fraction_high", "fraction_low")
        return {f"{p}_seq_{n}": 0.0 for n in names}
    out = {
        f"{p}_seq_mean": rows.mean(),
        f"{p}_seq_std": rows.std() if rows.numel() > 1 else 0.0,
        f"{p}_seq_max": rows.max(),
        f"{p}_seq_min": rows.min(),
        f"{p}_seq_max_deviation": rows.abs().max(),
        f"{p}_seq_fraction_high": _share(rows > hi),
    }
    if lo is not None:
        out[f"{p}_seq_fraction_low"] = _share(rows < lo)
    return out


# ---------------------------------------------------------------- off-policy metrics


def offpolicy_metrics(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's mismatch diagnostics; per-row means over kept tokens, "mean over rows"
    counting empty rows (value 0) as verl does."""
    m = mask.to(logp_train.dtype)
    rho = logp_train - logp_rollout
    train_row, roll_row = _row_mean(logp_train, m), _row_mean(logp_rollout, m)  # [B]
    diff = roll_row - train_row
    rho_sum = masked_sum(rho, m, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho_tok = rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {
        "training_ppl": torch.exp(-train_row).mean(),
        "training_log_ppl": (-train_row).mean(),
        "kl": masked_mean(-rho, m),
        "k3_kl": masked_mean(torch.exp(rho) - rho - 1.0, m),  # unclamped, as verl
        "rollout_ppl": torch.exp(-roll_row).mean(),
        "rollout_log_ppl": (-roll_row).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": masked_mean(torch.exp(2.0 * rho_tok), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * rho_sum).mean() - 1.0,
    }
    return _tensor_floats(out)


# ---------------------------------------------------------------- orchestration


def rollout_correction(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    cfg: RolloutCorrection,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights [B, T] or None when ``cfg.rollout_is`` is null, the mask after
    rejection sampling, metrics named ``rollout_corr/...``) for [B, T] inputs; no
    gradient flows. ``reduce``: see batch normalisation in the module docstring."""
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise ValueError(
            f"shapes differ: logp_train {tuple(logp_train.shape)}, logp_rollout "
            f"{tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}"
        )
    if not mask.bool().any():
        raise ValueError("rollout correction needs at least one token in the mask")
    keep = mask.bool()
    with torch.no_grad():
        train = torch.where(keep, logp_train.detach(), torch.zeros_like(logp_train))
        roll = torch.where(keep, logp_rollout.detach(), torch.zeros_like(logp_rollout))
        rho = train - roll
        weights, metrics = None, {}
        if cfg.rollout_is is not None:
            weights, metrics = importance_weights(
                rho,
                mask,
                cfg.rollout_is,
                cfg.rollout_is_threshold,
                batch_normalize=cfg.rollout_is_batch_normalize,
                reduce=reduce,
            )
        new_mask = mask.clone()
        if cfg.rollout_rs is not None:
            new_mask, rs = rejection_mask(rho, mask, cfg.rollout_rs, cfg.rollout_rs_threshold)
            metrics.update(rs)
        metrics.update(offpolicy_metrics(train, roll, mask))
    return weights, new_mask, {PREFIX + k: v for k, v in metrics.items()}
