"""The built-in policy-loss modes (``algo.loss_mode``), each as verl 1dda039 defines it.

Per token, with lp = log pi_theta, olp = the ratio's denominator (``LossInputs.logp_old``),
A the advantage, M the mask, sg = stop-gradient, mmean = masked mean, d = lp - olp,
dc = d clamped to [-20, 20], r = exp(dc), eps_lo = clip_eps, eps_hi = clip_eps_high
(clip_eps when empty), clip(x) = clip(x, 1 - eps_lo, 1 + eps_hi):

  vanilla   max(-A r, -A clip(r)); where A < 0, at most -A c (c = clip_ratio_c, if set)
  dppo_tv   -A sg(min(r, C)) lp v,  v = sg(p - p_old <= eps_hi if A > 0 else >= -eps_lo)
  dppo_kl   the same with v from the binary KL of p_old and p (p = exp(lp)); C = clip_ratio_c
  gspo      s = exp(min(lp - sg(lp) + sg(mean_t d), 10)); max(-A s, -A clip(s))
  sapo      -A (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg
  gpg       -A lp
  clip_cov  max(-A e^d, -A clip(e^d)), 0 on a random few tokens of high cov(A, lp)
  kl_cov    -A e^d, plus kl_cov_coef |d| on the tokens of highest cov(A, lp)
  geo_mean  per sequence -mean_t(A) exp(mean_t clip-limited d); a plain mean over rows
  dro       -(A lp - dro_beta d^2 / 2)
  cispo     -sg(clip(r)) A lp
  reinforce -A lp  (verl's bypass-mode REINFORCE; ppo_kl against pi_behav)

Each multiplies its per-token loss by the correction's weights (geo_mean: their geometric
mean per sequence) and aggregates with ``batch.agg`` and ``algo.loss_agg_mode``, except
gspo and sapo (always seq-mean-token-mean) and geo_mean (mean over the micro-batch's rows).
The metrics of each are in its docstring.
"""

from __future__ import annotations

import torch

from verl_async.algos.losses import LOG_RATIO_CLAMP, SEQ_MEAN_EPS, GlobalBatch
from verl_async.algos.masked import masked_mean
from verl_async.algos.policy_losses import LossInputs, register_policy_loss

Metrics = dict[str, torch.Tensor]
DPPO_CAP = 20.0  # dppo's ratio cap when clip_ratio_c is empty (verl's fallback)
BINARY_KL_EPS = 1e-8
GSPO_LOG_RATIO_MAX = 10.0
GEO_WEIGHT_EPS = 1e-10


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


def _dppo(inputs: LossInputs, algo, batch: GlobalBatch, kl: bool) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary (arXiv 2602.04879): clip_eps / clip_eps_high are divergence thresholds, the
    ratio is truncated at clip_ratio_c (20 when empty) and stops the gradient; a token whose
    probability moved past the threshold in its advantage's direction drops out."""
    adv, mask, lp, olp = inputs.advantages, inputs.mask, inputs.logp, inputs.logp_old
    eps_lo, eps_hi = _eps(algo)
    cap = DPPO_CAP if algo.clip_ratio_c is None else algo.clip_ratio_c
    log_ratio = _clamped_log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        p, p_old = torch.exp(lp), torch.exp(olp)
        if kl:
            div = p_old * (olp - lp) + (1 - p_old) * torch.log(
                (1 - p_old + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS)
            )
            up, down = (div <= eps_hi) | (p <= p_old), (div <= eps_lo) | (p >= p_old)
        else:
            up, down = p - p_old <= eps_hi, p - p_old >= -eps_lo
        valid = torch.where(adv > 0, up, down).to(mask.dtype)
    pg = -adv * ratio.clamp(max=cap).detach() * lp * valid
    loss = batch.agg(_weighted(pg, inputs), mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {
            "pg_clipfrac": masked_mean(1.0 - valid, mask),
            "pg_clipfrac_lower": masked_mean((ratio > cap).to(mask.dtype) * valid, mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }


@register_policy_loss("dppo_tv")
def dppo_tv(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """DPPO with the total-variation test p - p_old. pg_clipfrac: share of tokens dropped;
    pg_clipfrac_lower: share kept whose ratio exceeds the cap; ppo_kl: mmean(-dc)."""
    return _dppo(inputs, algo, batch, kl=False)


@register_policy_loss("dppo_kl")
def dppo_kl(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """DPPO with the binary KL test (a token moving towards its advantage's direction past
    the threshold drops out). Metrics as dppo_tv."""
    return _dppo(inputs, algo, batch, kl=True)


@register_policy_loss("gspo")
def gspo(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """GSPO (arXiv 2507.18071): the sequence's mean log-ratio as every token's ratio, the
    gradient each token's; always seq-mean-token-mean. pg_clipfrac: share where the clip
    binds; pg_clipfrac_lower: 0; ppo_kl: mmean(-d), d unclamped."""
    adv, mask, lp = inputs.advantages, inputs.mask, inputs.logp
    eps_lo, eps_hi = _eps(algo)
    log_ratio = lp - inputs.logp_old
    seq = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # [N]
    log_s = (lp - lp.detach() + seq.detach()[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * s.clamp(1 - eps_lo, 1 + eps_hi)
    pg = torch.maximum(unclipped, clipped)
    loss = batch.agg(_weighted(pg, inputs), mask, "seq-mean-token-mean")
    with torch.no_grad():
        return loss, {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }


@register_policy_loss("sapo")
def sapo(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """SAPO (arXiv 2511.20347): a soft sigmoid gate of the ratio instead of a clip;
    always seq-mean-token-mean. pg_clipfrac and pg_clipfrac_lower: 0; ppo_kl: mmean(-dc)."""
    adv, mask = inputs.advantages, inputs.mask
    log_ratio = _clamped_log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    pos = torch.tensor(algo.tau_pos, dtype=adv.dtype, device=adv.device)
    neg = torch.tensor(algo.tau_neg, dtype=adv.dtype, device=adv.device)
    tau = torch.where(adv > 0, pos, neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = batch.agg(_weighted(-gate * adv, inputs), mask, "seq-mean-token-mean")
    with torch.no_grad():
        return loss, {"ppo_kl": masked_mean(-log_ratio, mask)}


@register_policy_loss("gpg")
def gpg(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """GPG: the plain policy gradient -A lp, no ratio. No metrics (all read 0)."""
    pg = -inputs.logp * inputs.advantages
    return batch.agg(_weighted(pg, inputs), inputs.mask, algo.loss_agg_mode), {}


@register_policy_loss("clip_cov")
def clip_cov(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO clip (no dual clip, unclamped ratio), and max(1, clip_cov_ratio x kept
    tokens) tokens, drawn at random (``inputs.seed``) among the unclipped ones whose
    cov = (A - mmean A)(lp - mmean lp) lies in (clip_cov_lb, clip_cov_ub), lose their loss
    and gradient. pg_clipfrac: share of tokens so dropped; ppo_kl: mmean(-d)."""
    adv, mask, lp = inputs.advantages, inputs.mask, inputs.logp
    eps_lo, eps_hi = _eps(algo)
    log_ratio = lp - inputs.logp_old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_lo, 1 + eps_hi)
    with torch.no_grad():
        keep = (mask > 0) & ~(clipped > unclipped)
        cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
        cand = torch.nonzero(keep & (cov > algo.clip_cov_lb) & (cov < algo.clip_cov_ub))
        count = max(int(algo.clip_cov_ratio * mask.sum().item()), 1)
        gen = torch.Generator().manual_seed(inputs.seed)
        pick = cand[torch.randperm(len(cand), generator=gen)[:count].to(cand.device)]
        corr = torch.ones_like(mask)
        corr[pick[:, 0], pick[:, 1]] = 0
    pg = torch.maximum(unclipped, clipped) * corr
    loss = batch.agg(_weighted(pg, inputs), mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {
            "pg_clipfrac": masked_mean((corr == 0).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }


@register_policy_loss("kl_cov")
def kl_cov(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: -A e^d, and on the max(1, kl_cov_ratio x kept tokens) kept tokens of largest
    cov = (A - mean A)(lp - mean lp) (means over the kept tokens) also kl_cov_coef |d|.
    ppo_kl: mmean(|d|) (verl's definition for this mode)."""
    adv, mask, lp = inputs.advantages, inputs.mask, inputs.logp
    log_ratio = lp - inputs.logp_old
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        kept = torch.nonzero((mask > 0).reshape(-1), as_tuple=True)[0]
        a, x = adv.reshape(-1)[kept], lp.detach().reshape(-1)[kept]
        chosen = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        if len(kept):
            cov = (a - a.mean()) * (x - x.mean())
            top = torch.topk(cov, max(1, int(len(kept) * algo.kl_cov_ratio))).indices
            chosen[kept[top]] = True
    penalty = algo.kl_cov_coef * log_ratio.abs() * chosen.view_as(mask)
    pg = -adv * ratio + penalty
    loss = batch.agg(_weighted(pg, inputs), mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {"ppo_kl": masked_mean(log_ratio.abs(), mask)}


@register_policy_loss("geo_mean")
def geo_mean(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """GMPO (arXiv 2507.20673): per sequence, -mean_t(A) times the geometric mean of the
    ratios, each log-ratio limited to [-eps_lo, eps_hi] in the direction its advantage
    pushes; the correction's weights by their geometric mean per sequence. A plain mean
    over the micro-batch's rows: ``algo.loss_agg_mode`` and ``batch`` do not apply.
    pg_clipfrac / pg_clipfrac_lower: share limited with A > 0 / A < 0; ppo_kl: mmean(-d)."""
    adv, mask = inputs.advantages, inputs.mask
    eps_lo, eps_hi = _eps(algo)
    log_ratio = inputs.logp - inputs.logp_old
    sign = torch.sign(adv)
    limited = log_ratio.clamp(-eps_lo, eps_hi)
    bounded = sign * torch.minimum(sign * log_ratio, sign * limited)
    count = mask.sum(dim=-1) + SEQ_MEAN_EPS
    ratio = torch.exp((bounded * mask).sum(dim=-1) / count)  # [N]
    seq_adv = (adv * mask).sum(dim=-1) / count
    per_seq = -seq_adv * ratio
    if inputs.is_weights is not None:
        log_w = torch.log(inputs.is_weights + GEO_WEIGHT_EPS)
        per_seq = per_seq * torch.exp((log_w * mask).sum(dim=-1) / count)
    loss = per_seq.mean()
    with torch.no_grad():
        moved = (log_ratio != limited).to(mask.dtype)
        return loss, {
            "pg_clipfrac": masked_mean(moved * (adv > 0), mask),
            "pg_clipfrac_lower": masked_mean(moved * (adv < 0), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }


@register_policy_loss("dro")
def dro(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """DRO: -(A lp - dro_beta d^2 / 2), d unclamped. ppo_kl: mmean(-d)."""
    beta = algo.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("bad value for 'algo.dro_beta': loss_mode dro needs a value > 0")
    log_ratio = inputs.logp - inputs.logp_old
    pg = -(inputs.logp * inputs.advantages - 0.5 * beta * log_ratio.square())
    loss = batch.agg(_weighted(pg, inputs), inputs.mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {"ppo_kl": masked_mean(-log_ratio, inputs.mask)}


@register_policy_loss("cispo")
def cispo(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """CISPO (arXiv 2506.13585): the clipped ratio, stopped, weighs -A lp; no token loses
    its gradient. pg_clipfrac: share where clip(r) != r; pg_clipfrac_lower: 0; ppo_kl:
    mmean(-dc)."""
    adv, mask = inputs.advantages, inputs.mask
    eps_lo, eps_hi = _eps(algo)
    log_ratio = _clamped_log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - eps_lo, 1 + eps_hi)
    pg = -weight.detach() * adv * inputs.logp
    loss = batch.agg(_weighted(pg, inputs), mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {
            "pg_clipfrac": masked_mean((ratio != weight).to(mask.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }


@register_policy_loss("reinforce")
def reinforce(inputs: LossInputs, algo, batch: GlobalBatch) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE, -A lp times the correction's weights (verl's loss of bypass mode with
    loss_type reinforce). ppo_kl: mmean(log pi_behav - lp)."""
    pg = -inputs.advantages * inputs.logp
    loss = batch.agg(_weighted(pg, inputs), inputs.mask, algo.loss_agg_mode)
    with torch.no_grad():
        return loss, {"ppo_kl": masked_mean(inputs.logp_behav - inputs.logp, inputs.mask)}
