"""From one combined reward per sample to per-token advantages, for every estimator.

    reward r_i  ->  token-level scores (r_i at the sample's last sampled token, 0 elsewhere)
                ->  plus the environment's turn rewards            (multi-turn samples)
                ->  minus coef * KL(pi_old || pi_ref) per token   (algo.kl.in_reward)
                ->  advantages [N, T-1] by algo.adv_estimator:
                      grpo, rloo             the sum of a sample's token rewards, compared
                                             within its group; broadcast over its tokens
                      gdpo                   not from r_i: each source's raw score compared
                                             within its group, weighted, summed, whitened
                      reinforce_plus_plus    discounted returns, whitened over the batch
                      gae                    TD(lambda) against the critic's values

Everything is in the targets' layout of ``TrainBatch`` ([N, T-1], ``loss_mask`` marks the
sampled response tokens); advantages are zero elsewhere. pi_old is pi_prox, the learner's
weights before this batch's updates, so the in-reward KL is measured against the same
policy the PPO ratio starts from, whatever the staleness of the samples.

Multi-turn samples have observation tokens (mask 0) between their sampled turns. Nothing
at those positions is read: the KL is charged on sampled tokens only, grpo and rloo sum
sampled tokens, and for reinforce_plus_plus and gae the observations are transparent: the
recursion goes from one sampled token to the next, discounting once per sampled token.
verl's REINFORCE++ restarts its running return at every masked position, so each row's
sampled positions are moved to its front, the estimator runs on those compacted rows and
the results go back to where the tokens came from (``over_sampled_tokens``; verl's GAE
passes masked positions through and would not need it, but gets the same path).

gdpo reads ``SourceScores``: the raw score of each of ``rewards.sources`` (NaN where a
source is not routed to the sample) and its ``weight``, which plays the part of verl's
``algorithm.gdpo_reward_weights``. With turn rewards, the environment's return (a sample's
turn rewards summed) is one more column, weighted by ``|multiturn.env_reward_weight|``:
the turn rewards already carry that weight, and the group normalisation keeps only its
sign, so the column contributes env_reward_weight times the normalised raw return.

Episodes (grpo, rloo, gdpo): a group's baseline counts episodes, not samples. An agent's
episode through the chat endpoint may give several samples (``EpisodeStats.episode``; each
carries the whole episode's reward): its return enters its group's statistics once and
every one of its samples gets its episode's advantage (``episodes_of``, ``episode_totals``;
docs/algorithms.md has the formulas). Steps where every episode is one sample compute
exactly what they always have.

A step whose samples hold no sampled token at all (agent episodes that never reached the
model, raised or timed out) gets zero advantages from every estimator, and its in-reward
KL leaves the adaptive coefficient as it was; with fewer than two sampled tokens the
whitening of gae, reinforce_plus_plus and gdpo is undefined (an unbiased variance of
0/0), so their advantages are 0 too (nothing to compare with). The update then skips the
optimizer steps of minibatches without a token (learners/update.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verl_async.algos.advantages import (
    gae_advantages,
    gdpo_advantages,
    grpo_outcome_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from verl_async.algos.episodes import Episodes
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


@dataclass
class SourceScores:
    """What ``gdpo`` reads instead of the combined reward."""

    scores: torch.Tensor  # [N, S] raw score of each reward source (NaN: not routed)
    weights: Sequence[float]  # [S] each source's weight (rewards.sources[s].weight)
    env_weight: float = 1.0  # multiturn.env_reward_weight, for the turn rewards' column

    @classmethod
    def of(cls, cfg, scores: np.ndarray) -> SourceScores:
        """A step's raw scores [N, S] (``TrainBatch.scores``) with the weights of the run's
        ``cfg`` (a ``RunConfig``)."""
        weights = [src.weight for src in cfg.rewards.sources]
        raw = torch.from_numpy(np.asarray(scores, np.float32))
        return cls(raw, weights, cfg.multiturn.env_reward_weight)


def gdpo_columns(
    sources: SourceScores,
    turn_rewards: torch.Tensor | None,
    mask: torch.Tensor,
    episodes: Episodes | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The [N, K] columns gdpo normalises and their K weights: the sources' scores, then
    with turn rewards the environment's return (see the module docstring): with
    ``episodes``, each sample's episode's, its samples' turn rewards summed."""
    scores = sources.scores.to(mask.device, torch.float32)
    weights = [float(w) for w in sources.weights]
    if turn_rewards is None:
        return scores, weights
    kept = torch.where(mask > 0, turn_rewards, torch.zeros_like(turn_rewards))
    env = kept.sum(dim=1).to(scores.dtype)
    if episodes is not None:
        env = episodes.spread(episodes.sum(env))
    return torch.cat([scores, env[:, None]], dim=1), [*weights, abs(sources.env_weight)]


def kl_controller(kl_cfg) -> FixedKLController | AdaptiveKLController:
    """The in-reward KL coefficient's controller of an ``algo.kl`` config."""
    return make_kl_controller(kl_cfg.controller, kl_cfg.coef, kl_cfg.target_kl, kl_cfg.horizon)


def token_level_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rewards [N], mask [N, T-1] -> [N, T-1]: each reward at its sample's last kept
    (sampled) token (a sample with no kept token gets nothing)."""
    scores = torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # [N], -1: empty
    rows = torch.nonzero(last >= 0).squeeze(1)
    scores[rows, last[rows]] = rewards[rows].to(scores.dtype)
    return scores


def episode_returns(outcome: torch.Tensor, turn_rewards: torch.Tensor | None) -> torch.Tensor:
    """Each sample's whole return [N]: its outcome reward plus the sum of its turn rewards
    (``turn_rewards`` [N, T-1] is 0 off the sampled tokens, as ``collate`` leaves it)."""
    if turn_rewards is None:
        return outcome
    return outcome + turn_rewards.sum(dim=1).to(outcome.device, outcome.dtype)


def episodes_of(group_index: torch.Tensor, stats: Sequence) -> Episodes | None:
    """The step's episodes from ``TrainBatch.episodes`` (each sample's ``EpisodeStats``,
    None for a single-turn sample; or [] when the step has no multi-turn sample), or None
    when every episode is one sample: the estimators then read samples as they always
    have."""
    index = [-1 if e is None else e.episode for e in stats]
    if not any(i >= 0 for i in index):
        return None
    episodes = Episodes.of(group_index.cpu(), index)
    return None if episodes.singles else episodes


def episode_totals(
    totals: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, episodes: Episodes
) -> torch.Tensor:
    """Each sample's episode's return [N], what grpo and rloo compare within a group.

    ``totals`` [N]: each sample's token rewards summed (its outcome reward at its last
    sampled token, its turn rewards, less its in-reward KL); ``rewards`` [N]: the outcome
    rewards (the episode's, on each of its samples). An episode is read as one trajectory:
    its outcome reward once, plus what every sample's tokens add. An episode of one sample
    keeps its own total, bit for bit; one without any sampled token has 0, like such a
    sample alone (its reward has no token to sit on)."""
    has = (mask > 0).any(dim=1)  # [N]
    rewards = rewards.to(totals.device, totals.dtype)
    placed = torch.where(has, rewards, torch.zeros_like(totals))  # what its tokens hold
    any_token = episodes.sum(has.to(totals.dtype)) > 0  # [E]
    outcome = torch.where(
        any_token, episodes.once(rewards), torch.zeros_like(any_token, dtype=totals.dtype)
    )
    combined = outcome + episodes.sum(totals - placed)
    own = episodes.count(totals.device) == 1
    return episodes.spread(torch.where(own, episodes.once(totals), combined))


def has_gaps(mask: torch.Tensor) -> bool:
    """Whether some row of ``mask`` [N, T] has a masked position between two kept ones."""
    keep = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    first = torch.where(keep, positions, mask.shape[1]).min(dim=1).values
    last = torch.where(keep, positions, -1).max(dim=1).values
    span = (last - first + 1).clamp(min=0)  # 0 for a row with nothing kept
    return bool((span != keep.sum(dim=1)).any())


def over_sampled_tokens(estimator, mask: torch.Tensor, *inputs: torch.Tensor):
    """Run a token-level ``estimator(mask, *inputs) -> (advantages, returns)`` as if each
    row held its kept positions only, one after the other; [N, T] in and out, zeros at
    masked positions.

    A batch without gaps (every single-turn batch) goes to the estimator unchanged, so
    its results are bit for bit those of the estimator alone."""
    if not has_gaps(mask):
        return estimator(mask, *inputs)
    keep = mask > 0
    # A stable sort of "is masked" puts each row's kept positions first, in their order.
    order = torch.sort((~keep).to(torch.int32), dim=1, stable=True).indices
    packed_mask = mask.gather(1, order)
    packed = estimator(packed_mask, *(x.gather(1, order) for x in inputs))
    # The estimators give zeros at masked positions, so the packed tails land as zeros.
    return tuple(torch.zeros_like(out).scatter(1, order, out) for out in packed)


def estimate(
    algo,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor | None = None,
    logp_old: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_ctrl: FixedKLController | AdaptiveKLController | None = None,
    turn_rewards: torch.Tensor | None = None,
    sources: SourceScores | None = None,
    episodes: Episodes | None = None,
) -> Advantages:
    """Advantages of one batch under ``algo`` (an ``AlgoConfig``); see the module docstring.

    ``rewards`` [N] are the outcome rewards (placed on each sample's last sampled token);
    ``turn_rewards`` [N, T-1], when given, are added where ``mask`` is 1. ``values`` is
    needed by gae; ``logp_old``, ``logp_ref`` and ``kl_ctrl`` by ``algo.kl.in_reward``
    (the controller is updated with this batch's KL); ``sources`` by gdpo; ``episodes``
    (``episodes_of``) says which samples are one episode, for grpo, rloo and gdpo.
    """
    mask = mask.float()
    kind = algo.adv_estimator
    if kind == "gdpo" and (sources is None or algo.kl.in_reward):
        raise ValueError(
            "adv_estimator 'gdpo' needs each reward source's scores, and takes no KL in the reward"
        )
    tokens = token_level_scores(rewards, mask)
    if turn_rewards is not None:
        tokens = tokens + torch.where(mask > 0, turn_rewards, torch.zeros_like(turn_rewards))
    sampled = int(mask.sum())  # the step's sampled tokens
    kl_mean = None
    if algo.kl.in_reward:
        tokens, kl_mean = apply_kl_penalty(
            tokens, logp_old, logp_ref, mask, kl_ctrl.value, algo.kl.penalty
        )
        kl_mean = float(kl_mean)
        if sampled:  # a step without a sampled token observed no KL
            kl_ctrl.update(kl_mean, len(rewards))
    returns = None
    if kind in ("gae", "reinforce_plus_plus"):
        adv, returns = _token_level(algo, tokens, mask, values, whiten=sampled >= 2)
    elif kind == "gdpo":
        columns, weights = gdpo_columns(sources, turn_rewards, mask, episodes)
        adv = torch.zeros_like(mask)  # whitening fewer than two tokens: nothing to compare
        if sampled >= 2:
            adv, _ = gdpo_advantages(columns, group_index, weights, mask, episodes=episodes)
    else:
        totals = (tokens * mask).sum(dim=1)  # the rewards, less the sample's KL penalty
        if episodes is not None:
            totals = episode_totals(totals, rewards, mask, episodes)
        if kind == "grpo":
            norm = algo.normalize_adv_std
            per_sample = grpo_outcome_advantages(totals, group_index, norm, episodes=episodes)
        elif kind == "rloo":
            per_sample = rloo_advantages(totals, group_index, episodes)
        else:
            raise ValueError(f"unknown adv_estimator '{kind}'")
        adv = per_sample[:, None].to(mask.dtype)  # broadcast over the sample's tokens
    return Advantages(adv * mask, returns, tokens, kl_mean)


def _token_level(
    algo, tokens: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None, whiten: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """gae or reinforce_plus_plus over the sampled tokens: (advantages, returns) [N, T-1].
    ``whiten`` False (fewer than two sampled tokens): a whitening run would be 0/0, so
    its advantages are 0; the returns stay."""
    norm = algo.normalize_adv_std and whiten
    if algo.adv_estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator 'gae' needs the critic's values")
        adv, returns = over_sampled_tokens(
            lambda m, r, v: gae_advantages(r, v, m, algo.gamma, algo.lam, norm),
            mask, tokens, values,
        )  # fmt: skip
    else:
        adv, returns = over_sampled_tokens(
            lambda m, r: reinforce_plus_plus_advantages(r, m, algo.gamma, norm), mask, tokens
        )
    if algo.normalize_adv_std and not whiten:
        adv = torch.zeros_like(adv)
    return adv, returns
