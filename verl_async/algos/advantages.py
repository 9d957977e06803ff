"""Advantage estimators of the PPO family, on the semantics of verl's.

Shapes: N samples (responses), T response positions; a mask is 1 on response tokens and 0
on padding. Token-level estimators return zeros at masked positions (verl leaves
intermediate values there that nothing reads); masked inputs never change a kept output.

Outcome estimators (one scalar score per sample, samples grouped by prompt ``index``):

  grpo_outcome_advantages  A_i = (s_i - mean_g) / (std_g + eps), std_g unbiased (n - 1);
                           without the division when norm_by_std is False (Dr.GRPO). A group
                           of one has mean 0 and std 1, so A_i = s_i / (1 + eps) (or s_i).
                           A tied group has std 0: A_i = 0 / eps = 0.
  grpo_advantages          the learner's GRPO: same formula, but a group of one gets 0.
  rloo_advantages          A_i = n / (n - 1) * (s_i - mean_g) = s_i - mean of the others;
                           a group of one keeps its score.
  reinforce_plus_plus_baseline_advantages
                           (s_i - mean_g) on every token of i (mean 0 for a group of one),
                           whitened over all kept tokens of the batch.
  gdpo_advantages          several scores per sample: each column's verl GRPO advantage
                           (always divided by the std), weighted and summed, put on every
                           token of i and whitened over all kept tokens of the batch.

Token-level estimators (rewards per token):

  gae_advantages           delta_t = r_t + gamma * V_next - V_t,
                           A_t = delta_t + gamma * lam * A_next, where "next" is the next
                           kept position of the same row (V_next = A_next = 0 after the last:
                           no bootstrap past the end of the response). returns = A + V;
                           advantages = A whitened over the kept tokens of the batch (or
                           only centred there, with norm_by_std False).
  reinforce_plus_plus_advantages
                           G_t = r_t + gamma * G_{t+1}, restarted at 0 after every masked
                           position; advantages = G whitened over the kept tokens (or
                           only centred, with norm_by_std False).
  remax_advantages         G_t = sum of kept rewards from t on; A_t = G_t - b_i.

Whitening is ``masked_whiten`` (mean-shifted, unbiased variance): it raises ValueError when
the batch holds fewer than two kept tokens.

Episodes: every estimator that compares a group (grpo_advantages, grpo_outcome_advantages,
rloo_advantages, reinforce_plus_plus_baseline_advantages, gdpo_advantages) takes an optional
``episodes`` (``Episodes``, episodes.py) for an agent episode that gave several samples.
Its samples then count once: the statistics above run over episodes, an episode's score
being its first sample's (every sample of an episode carries the episode's return; the
caller puts it there), group sizes n count episodes, and each sample gets its episode's
advantage. Without it, or when every episode is one sample, each sample is an episode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl_async.algos.episodes import Episodes
from verl_async.algos.masked import masked_center, masked_whiten

GroupIndex = torch.Tensor | Sequence


def group_ids(index: GroupIndex) -> tuple[torch.Tensor, int]:
    """Dense group ids: ``index`` [N] (a tensor, or any sequence of hashables such as uid
    strings) -> (inverse [N] long with values in [0, n_groups), n_groups)."""
    if isinstance(index, torch.Tensor):
        _, inverse = torch.unique(index, return_inverse=True)
        return inverse, int(inverse.max()) + 1 if inverse.numel() else 0
    dense: dict = {}
    ids = [dense.setdefault(key, len(dense)) for key in index]
    return torch.tensor(ids, dtype=torch.long), len(dense)


def _group_sums(
    x: torch.Tensor, inverse: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per group [G], sum of x per group [G]) in x's dtype and device."""
    zeros = torch.zeros(n_groups, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, inverse, torch.ones_like(x))
    return count, zeros.index_add(0, inverse, x)


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
    episodes: Episodes | None = None,
) -> torch.Tensor:
    """Group-relative advantages as the learner uses them.

    rewards:     [N] float, one per sample
    group_index: [N] long, samples with equal index form a group
    returns      [N] (r - mean_group) / (std_group + eps), or without the division

    Unlike ``grpo_outcome_advantages`` (verl), a group of one gets advantage 0.
    ``episodes``: each episode counts once (module docstring).
    """
    if episodes is not None:
        once = episodes.once(rewards), episodes.once(group_index)
        return episodes.spread(grpo_advantages(*once, normalize_std, eps))
    inverse, n_groups = group_ids(group_index.to(rewards.device))
    count, total = _group_sums(rewards, inverse, n_groups)
    centered = rewards - (total / count)[inverse]
    if not normalize_std:
        return centered
    sq = torch.zeros_like(total).index_add_(0, inverse, centered**2)
    # Unbiased std like torch.std; a group of one has std 0 and advantage 0 anyway.
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std[inverse] + eps)


def grpo_outcome_advantages(
    scores: torch.Tensor,
    index: GroupIndex,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    episodes: Episodes | None = None,
) -> torch.Tensor:
    """verl's GRPO outcome advantage, one scalar per sample.

    scores [N] float, index [N] group keys -> [N]: (s - mean_g) / (std_g + eps) with the
    unbiased std (torch.std), or s - mean_g when ``norm_by_std`` is False (Dr.GRPO).
    A group of one is taken to have mean 0 and std 1. Broadcast over tokens with
    ``adv[:, None] * mask``. ``episodes``: each episode counts once (module docstring).
    """
    if episodes is not None:
        once = episodes.once(scores), episodes.once(index)
        return episodes.spread(grpo_outcome_advantages(*once, norm_by_std, eps))
    inverse, n_groups = group_ids(index)
    inverse = inverse.to(scores.device)
    with torch.no_grad():
        count, total = _group_sums(scores, inverse, n_groups)
        single = count == 1
        mean = torch.where(single, torch.zeros_like(total), total / count)
        centered = scores - mean[inverse]
        if not norm_by_std:
            return centered
        sq = torch.zeros_like(total).index_add(0, inverse, centered**2)
        std = torch.where(single, torch.ones_like(sq), torch.sqrt(sq / (count - 1).clamp(min=1)))
        return centered / (std[inverse] + eps)


def rloo_advantages(
    scores: torch.Tensor, index: GroupIndex, episodes: Episodes | None = None
) -> torch.Tensor:
    """verl's RLOO: scores [N], index [N] -> [N] leave-one-out advantages.

    For a group of n > 1: s_i * n / (n - 1) - mean_g * n / (n - 1) (= s_i minus the mean of
    the other n - 1 scores). A group of one keeps its score unchanged. ``episodes``: n
    counts episodes, and the one left out is the sample's whole episode (module docstring).
    """
    if episodes is not None:
        return episodes.spread(rloo_advantages(episodes.once(scores), episodes.once(index)))
    inverse, n_groups = group_ids(index)
    inverse = inverse.to(scores.device)
    with torch.no_grad():
        count, total = _group_sums(scores, inverse, n_groups)
        n = count[inverse]
        scale = n / (n - 1).clamp(min=1)
        loo = scores * scale - (total / count)[inverse] * scale
        return torch.where(n > 1, loo, scores)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GAE: rewards, values, mask [N, T] -> (advantages [N, T], returns [N, T]).

    The recursion runs backwards over kept positions only: a masked position passes the
    next kept value and advantage through unchanged, so after the last kept token nothing
    is bootstrapped. returns = raw advantages + values; advantages are whitened over the
    kept tokens of the whole batch (verl), or with ``norm_by_std`` False only centred
    there: once the critic predicts the returns well, the raw advantages are small, and
    whitening scales what is left of them (mostly the critic's error) back up to unit
    variance. Both are 0 at masked positions.
    """
    keep = mask.bool()
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        raw = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            next_value = torch.where(keep[:, t], values[:, t], next_value)
            last_gae = torch.where(keep[:, t], gae, last_gae)
            raw[:, t] = last_gae
        returns = torch.where(keep, raw + values, torch.zeros_like(raw))
        normalize = masked_whiten if norm_by_std else masked_center
        return normalize(raw, mask), returns


def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, norm_by_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's REINFORCE++: token_rewards, mask [N, T] -> (advantages, returns), each [N, T].

    Going backwards, G_t = r_t + gamma * G_{t+1}; after a masked position the running sum
    restarts at 0 (so padding, and anything past a masked gap, never reaches an earlier
    token). advantages = G whitened over the kept tokens of the batch (centred only, with
    ``norm_by_std`` False). Both are 0 at masked positions.
    """
    keep = mask.bool()
    with torch.no_grad():
        running = torch.zeros_like(token_rewards[:, 0])
        returns = torch.zeros_like(token_rewards)
        for t in reversed(range(token_rewards.shape[1])):
            running = token_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = torch.where(keep[:, t], running, torch.zeros_like(running))
        returns = torch.where(keep, returns, torch.zeros_like(returns))
        normalize = masked_whiten if norm_by_std else masked_center
        return normalize(returns, mask), returns


def _minus_group_mean(scores: torch.Tensor, index: GroupIndex) -> torch.Tensor:
    """scores [N] -> s_i - mean_g [N], the mean 0 for a group of one."""
    inverse, n_groups = group_ids(index)
    inverse = inverse.to(scores.device)
    count, total = _group_sums(scores, inverse, n_groups)
    mean = torch.where(count == 1, torch.zeros_like(total), total / count)
    return scores - mean[inverse]


def reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor, index: GroupIndex, mask: torch.Tensor, episodes: Episodes | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's REINFORCE++-baseline: scores [N], index [N], mask [N, T] -> (adv, adv) [N, T].

    s_i - mean_g (mean 0 for a group of one) is put on every kept token of i, then
    whitened over all kept tokens of the batch (longer responses weigh more in the
    statistics). verl returns the advantages as the returns too. ``episodes``: mean_g is
    over episodes, each counted once (module docstring); the whitening still reads tokens.
    """
    with torch.no_grad():
        if episodes is None:
            centred = _minus_group_mean(scores, index)
        else:
            centred = episodes.spread(
                _minus_group_mean(episodes.once(scores), episodes.once(index))
            )
        tiled = centred[:, None].expand_as(mask).to(scores.dtype)
        tiled = torch.where(mask.bool(), tiled, torch.zeros_like(tiled))
        adv = masked_whiten(tiled, mask)
        return adv, adv


def _gdpo_sums(scores: torch.Tensor, index: GroupIndex, weights, eps: float) -> torch.Tensor:
    """scores [N, K] -> S [N]: each column's GRPO advantage over the samples it scores
    (0 for the others), weighted and summed."""
    inverse, _ = group_ids(index)
    inverse = inverse.to(scores.device)
    weights = torch.as_tensor(weights, dtype=scores.dtype, device=scores.device)
    total = scores.new_zeros(scores.shape[0])
    for k in range(scores.shape[1]):
        routed = ~torch.isnan(scores[:, k])
        if routed.any():
            adv_k = torch.zeros_like(total)
            adv_k[routed] = grpo_outcome_advantages(scores[routed, k], inverse[routed], eps=eps)
            total = total + weights[k] * adv_k
    return total


def gdpo_advantages(
    scores: torch.Tensor,
    index: GroupIndex,
    weights,
    mask: torch.Tensor,
    eps: float = 1e-6,
    episodes: Episodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242; verl's ``gdpo``): scores [N, K] (one column per reward
    component, NaN where the component does not score the sample), index [N], weights [K],
    mask [N, T] -> (adv, adv), both [N, T].

    For each column k, A_k is ``grpo_outcome_advantages`` (with the std) of the samples it
    scores, grouped as usual; the others get A_k = 0, so a group it scores no sample of
    adds nothing, and a group statistic is taken over the scored samples only. Then
    S_i = sum_k w_k * A_k[i] is put on every kept token of i and whitened over all kept
    tokens of the batch (fewer than two raise ValueError). Zero at masked positions.
    ``episodes``: the A_k are taken over episodes, each counted once (module docstring).
    """
    with torch.no_grad():
        if episodes is None:
            total = _gdpo_sums(scores, index, weights, eps)
        else:
            once = episodes.once(scores), episodes.once(index)
            total = episodes.spread(_gdpo_sums(*once, weights, eps))
        tiled = total[:, None].expand(mask.shape).to(scores.dtype)
        adv = masked_whiten(torch.where(mask.bool(), tiled, torch.zeros_like(tiled)), mask)
        return adv, adv


def remax_advantages(
    token_rewards: torch.Tensor, baselines: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ReMax: token_rewards [N, T], baselines [N] (the greedy response's reward),
    mask [N, T] -> (advantages, returns) [N, T].

    returns_t = sum of the kept rewards at positions >= t; advantages = returns - b_i. Both
    are 0 at masked positions. No whitening.
    """
    keep = mask.bool()
    with torch.no_grad():
        kept = torch.where(keep, token_rewards, torch.zeros_like(token_rewards))
        returns = kept.flip(-1).cumsum(-1).flip(-1)
        adv = returns - baselines[:, None]
        zero = torch.zeros_like(returns)
        return torch.where(keep, adv, zero), torch.where(keep, returns, zero)
