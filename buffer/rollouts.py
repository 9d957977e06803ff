"""Checks of a returned rollout group, and the group as the buffer stores it.

Pure, and every rejection raises ``ProtocolError`` naming the group and the field: nothing
is recorded from a group that fails here (the buffer refuses it alone and issues it again,
buffer/intake.py), and the learner never sees a batch it cannot train on. Whether the
sender may return the group at all is the ledger's question (``check_issued``, leases),
asked before any of this.

Multi-turn samples (verl_async/protocol.py, ``RolloutGroup``) add a loss mask, per-turn
rewards and episode stats; their observation tokens carry placeholder versions and
log-probs, so the version checks read sampled tokens only.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from buffer.ledger import StoredGroup
from verl_async.data import PromptRecord
from verl_async.numerics import finite32_mask
from verl_async.protocol import EPISODE_BUDGETS, EpisodeStats, ProtocolError, RolloutGroup, vector
from verl_async.schema import RunConfig


@dataclass(frozen=True)
class RolloutLimits:
    """What every returned group must look like. ``None``: not known to the buffer, so not
    checked (a buffer started without the generators' settings still runs)."""

    num_sources: int = 1  # reward sources: the width of every group's scores
    group_size: int | None = None  # samples per group (generators.group_size)
    vocab_size: int | None = None  # token ids are in [0, vocab_size)
    max_response_tokens: int | None = None  # see ``max_response_tokens``
    max_samples_per_episode: int | None = None  # see ``max_samples_per_episode``
    teacher_logprobs: bool = False  # teacher processes score every group (distillation)


def max_response_tokens(cfg: RunConfig) -> int:
    """The longest response a sample of run ``cfg`` may return.

    One response is at most ``generators.max_new_tokens``. With environments, a response
    is a whole episode: its turns and observations fit in ``multiturn.max_episode_tokens``
    together with the prompt, so that bounds the response too. Prompts no environment
    claims still get one response, hence the larger of the two.
    """
    single = cfg.generators.max_new_tokens
    if not cfg.multiturn.has_episodes:
        return single
    return max(single, cfg.multiturn.max_episode_tokens)


def max_samples_per_episode(cfg: RunConfig) -> int:
    """The most samples one episode of run ``cfg`` may give.

    Only an agent's episode gives several (a chat-completions call that rewrote the
    conversation starts a new sample), and each call gives at most one: the largest
    ``multiturn.agents[i].max_calls`` bounds them. Without agents every episode is one
    sample.
    """
    return max((agent.max_calls for agent in cfg.multiturn.agents), default=1)


def unpack_rollout(
    g: RolloutGroup,
    frames: list,
    limits: RolloutLimits,
    versions: tuple[int, int],
    issued: tuple[int, PromptRecord] | None = None,
) -> StoredGroup:
    """The group as the buffer stores it, after checking every field against ``limits``.

    ``versions`` = (oldest, newest) weights version its tokens may carry: the version the
    generator had loaded when the group was issued (versions only grow) and the newest one
    announced. ``issued`` = (prompt index, record) of the prompt the group was issued
    for: the rollout must name the same prompt, data source and prompt tokens, and the
    buffer stores its own copies of them, never the sender's (they end in trained.jsonl,
    in the metrics' per-source keys and in the learner's batches). None: not checked
    (tests of other parts). Pure, and raises only ProtocolError: nothing is recorded from
    a group that fails here, and the learner never sees a batch it cannot train on.

    Arrays are copied out of the received frames unless they span a frame of their own
    (``protocol.tensor``'s ``keep``), so a stored group pins no bytes it does not use.
    """
    where = f"group {g.group_id}"
    prompt = vector(g.prompt_ids, frames, "int32", f"{where}: prompt_ids")
    resp = vector(g.response_ids, frames, "int32", f"{where}: response_ids", keep=True)
    lp = vector(g.behav_logprobs, frames, "float32", f"{where}: behav_logprobs", keep=True)
    ver = vector(g.token_versions, frames, "int32", f"{where}: token_versions", keep=True)
    _check_lengths(where, g.lengths, limits, (len(resp), len(lp), len(ver)), g.episodes)
    _check_token_ids(where, "prompt_ids", prompt, limits.vocab_size)
    prompt_id, data_source = g.prompt_id, g.data_source
    if issued is not None:
        prompt_id, record = issued
        prompt = _check_prompt(where, g, prompt, prompt_id, record, limits.max_response_tokens)
        data_source = record.data_source
    _check_token_ids(where, "response_ids", resp, limits.vocab_size)
    if not _logprobs(lp):
        raise ProtocolError(f"{where}: behav_logprobs must be finite and <= 0")
    bounds = [0, *itertools.accumulate(g.lengths)]
    mask = _loss_mask(where, g, frames, bounds)
    rewards = _turn_rewards(where, g, frames, mask)
    teacher = _teacher_logprobs(where, g, frames, mask, limits.teacher_logprobs)
    _check_episodes(where, g.episodes, len(g.lengths))
    lo, hi = versions
    sampled = ver if mask is None else ver[mask.view(bool)]
    if sampled.size and (sampled.min() < lo or sampled.max() > hi):
        raise ProtocolError(
            f"{where}: token versions {sampled.min()}..{sampled.max()} are outside {lo}..{hi} "
            "(loaded when issued .. newest announced)"
        )
    _check_scores(where, g.scores, g.failed, len(g.lengths), limits.num_sources)
    # Views on the group's own arrays, one per sample.
    split = lambda a: [a[bounds[i] : bounds[i + 1]] for i in range(len(g.lengths))]  # noqa: E731
    return StoredGroup(
        g.group_id,
        prompt_id,
        g.generator_id,
        prompt,
        split(resp),
        split(lp),
        split(ver),
        [list(sample) for sample in zip(*g.scores, strict=True)],  # [S][N] -> [N][S]
        list(g.failed),
        data_source,
        loss_masks=None if mask is None else split(mask),
        turn_rewards=None if rewards is None else split(rewards),
        episodes=list(g.episodes),
        teacher_logprobs=None if teacher is None else split(teacher),
    )


def _check_prompt(
    where: str,
    g: RolloutGroup,
    prompt: np.ndarray,
    prompt_id: int,
    record: PromptRecord,
    cap: int | None = None,
) -> np.ndarray:
    """The issued prompt's token ids, once the rollout is seen to name that prompt (a
    multi-turn group's own, which its environment may have given)."""
    if g.prompt_id != prompt_id:
        raise ProtocolError(f"{where}: prompt_id {g.prompt_id}, it was issued for {prompt_id}")
    if g.data_source != record.data_source:
        raise ProtocolError(
            f"{where}: data_source {g.data_source[:64]!r}, its prompt's is "
            f"{record.data_source[:64]!r}"
        )
    issued = np.asarray(record.prompt_ids, dtype=np.int32)
    if g.episodes and not np.array_equal(prompt, issued):
        # An environment may start its episodes from a prompt of its own (``reset``, or
        # the row's with the tools' schemas): the ids the episodes really continued, which
        # the learner must train on. Their ids were checked against the vocabulary; the
        # prompt's index and data source, what trained.jsonl and the metrics name, are
        # still the buffer's. It fits in an episode (multiturn.max_episode_tokens).
        if cap is not None and len(prompt) > cap:
            raise ProtocolError(
                f"{where}: an episode's prompt of {len(prompt)} tokens, the run allows {cap}"
            )
        return prompt
    if not np.array_equal(prompt, issued):
        raise ProtocolError(
            f"{where}: prompt_ids ({len(prompt)} tokens) are not the {len(issued)} tokens "
            "it was issued with"
        )
    return issued


def _check_lengths(
    where: str,
    lengths: list[int],
    limits: RolloutLimits,
    sizes: tuple[int, int, int],
    episodes: list[EpisodeStats] = (),
) -> None:
    """Sample lengths against the run's group size (in episodes, when an episode gave
    several samples), token budget and the three tensors."""
    if not lengths:
        raise ProtocolError(f"{where}: no samples")
    count = _episode_count(where, episodes, len(lengths), limits.max_samples_per_episode)
    if count is not None:
        if limits.group_size is not None and count != limits.group_size:
            raise ProtocolError(
                f"{where}: {count} episodes, the run samples {limits.group_size} per group"
            )
    elif limits.group_size is not None and len(lengths) != limits.group_size:
        raise ProtocolError(
            f"{where}: {len(lengths)} samples, the run samples {limits.group_size} per group"
        )
    if min(lengths) < 0:
        raise ProtocolError(f"{where}: negative sample length")
    cap = limits.max_response_tokens
    if cap is not None and max(lengths) > cap:
        raise ProtocolError(f"{where}: a sample of {max(lengths)} tokens, the run allows {cap}")
    if sizes != (sum(lengths),) * 3:
        raise ProtocolError(
            f"{where}: lengths add up to {sum(lengths)} tokens; response_ids, "
            f"behav_logprobs and token_versions hold {sizes[0]}, {sizes[1]} and {sizes[2]}"
        )


def _loss_mask(where: str, g: RolloutGroup, frames: list, bounds: list[int]) -> np.ndarray | None:
    """The group's loss mask (None: every token sampled), checked: 0 or 1 per response
    token, and every non-empty sample ends on a sampled token (an observation no turn
    answers is nothing to train on). A sample may begin with tokens that are not sampled:
    the rest of its own prompt, when the samples of a group do not all start from the same
    one (an agent's calls; generators/trajectory.py: ``pack``)."""
    if g.loss_mask is None:
        return None
    mask = vector(g.loss_mask, frames, "uint8", f"{where}: loss_mask")
    if len(mask) != bounds[-1]:
        raise ProtocolError(
            f"{where}: loss_mask holds {len(mask)} values, lengths add up to {bounds[-1]} tokens"
        )
    if mask.size and mask.max() > 1:
        raise ProtocolError(
            f"{where}: loss_mask holds {mask.max()}; each value is 1 (sampled) or 0 (observation)"
        )
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if start != end and not mask[end - 1]:
            raise ProtocolError(
                f"{where}: sample {i} ends on an observation token (loss_mask 0); a "
                "response ends with a sampled token"
            )
    return mask


def _turn_rewards(
    where: str, g: RolloutGroup, frames: list, mask: np.ndarray | None
) -> np.ndarray | None:
    """The group's per-turn rewards (None: none), checked: finite, one per response token,
    and zero on observation tokens (a reward belongs to its turn's last sampled token)."""
    if g.turn_rewards is None:
        return None
    rewards = _per_token(where, "turn_rewards", g.turn_rewards, frames, g.lengths)
    if not np.isfinite(rewards).all():
        raise ProtocolError(f"{where}: turn_rewards must be finite")
    if mask is not None and rewards[~mask.view(bool)].any():
        raise ProtocolError(
            f"{where}: turn_rewards holds a nonzero reward at an observation token (loss_mask 0)"
        )
    return rewards


def _per_token(where: str, name: str, ref, frames: list, lengths: list[int]) -> np.ndarray:
    """A group's float32 field ``name`` of one value per response token, checked for size."""
    values = vector(ref, frames, "float32", f"{where}: {name}")
    total = sum(lengths)
    if len(values) != total:
        raise ProtocolError(
            f"{where}: {name} holds {len(values)} values, lengths add up to {total} tokens"
        )
    return values


def _logprobs(values: np.ndarray) -> bool:
    """Every value a log-prob: finite and <= 0 (NaN fails both comparisons)."""
    return not values.size or bool(values.max() <= 0 and values.min() > -np.inf)


def _teacher_logprobs(
    where: str, g: RolloutGroup, frames: list, mask: np.ndarray | None, required: bool
) -> np.ndarray | None:
    """The teacher's log-probs of the group's tokens, checked: present exactly when the run's
    teachers score in processes, one per response token, finite and <= 0 on sampled tokens
    and 0 on observation tokens."""
    if g.teacher_logprobs is None:
        if required:
            raise ProtocolError(f"{where}: teacher_logprobs missing (a teacher scores every group)")
        return None
    if not required:
        raise ProtocolError(f"{where}: teacher_logprobs sent, but no teacher process scores")
    logp = _per_token(where, "teacher_logprobs", g.teacher_logprobs, frames, g.lengths)
    if not _logprobs(logp if mask is None else logp[mask.view(bool)]):
        raise ProtocolError(f"{where}: teacher_logprobs must be finite and <= 0")
    if mask is not None and logp[~mask.view(bool)].any():
        raise ProtocolError(f"{where}: teacher_logprobs is nonzero at an observation token")
    if not 0 <= g.teacher_busy_s <= g.teacher_s < math.inf:  # NaN fails too
        raise ProtocolError(f"{where}: teacher_s and teacher_busy_s must be 0 <= busy <= wait")
    return logp


def _episode_count(where: str, episodes: list[EpisodeStats], n: int, cap: int | None) -> int | None:
    """The episodes of a group whose samples name theirs (``EpisodeStats.episode``): each
    index 0, 1, ... in order, an episode's samples consecutive, at most ``cap`` each (None:
    not checked); None when no sample names one (one per episode)."""
    if len(episodes) != n or all(e.episode == -1 for e in episodes):
        return None
    indices = [e.episode for e in episodes]
    if indices[0] != 0 or any(b - a not in (0, 1) for a, b in itertools.pairwise(indices)):
        raise ProtocolError(
            f"{where}: the samples' episodes {indices[:32]} are not 0, 1, ... in order, each "
            "episode's samples together"
        )
    longest = max(Counter(indices).values())
    if cap is not None and longest > cap:
        raise ProtocolError(
            f"{where}: an episode of {longest} samples, the run allows {cap} "
            "(the largest multiturn.agents[i].max_calls)"
        )
    return indices[-1] + 1


def _check_episodes(where: str, episodes: list[EpisodeStats], n: int) -> None:
    """No episode stats, or one sane ``EpisodeStats`` per sample."""
    if len(episodes) not in (0, n):
        raise ProtocolError(
            f"{where}: {len(episodes)} episode stats for {n} samples (one per sample, or none)"
        )
    counts = (
        "turns",
        "tool_calls",
        "tool_errors",
        "tool_timeouts",
        "tool_parse_errors",
        "prefix_breaks",
        "observation_tokens",
        "versions_spanned",
    )
    for i, ep in enumerate(episodes):
        for name in counts:
            if getattr(ep, name) < 0:
                raise ProtocolError(
                    f"{where}: episode {i}: {name} = {getattr(ep, name)} is negative"
                )
        if not (math.isfinite(ep.env_seconds) and ep.env_seconds >= 0):
            raise ProtocolError(
                f"{where}: episode {i}: env_seconds = {ep.env_seconds} is not a finite, "
                "non-negative number of seconds"
            )
        if not math.isfinite(ep.env_reward):
            raise ProtocolError(f"{where}: episode {i}: env_reward = {ep.env_reward} is not finite")
        if ep.budget and ep.budget not in EPISODE_BUDGETS:
            raise ProtocolError(
                f"{where}: episode {i}: budget {ep.budget[:32]!r} is not one of "
                + ", ".join(repr(b) for b in ("", *EPISODE_BUDGETS))
            )


def _check_token_ids(where: str, name: str, ids: np.ndarray, vocab_size: int | None) -> None:
    if not ids.size:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bound = "" if vocab_size is None else f", the vocabulary has {vocab_size}"
        raise ProtocolError(f"{where}: {name} holds token ids {low}..{high}{bound}")


def _check_scores(
    where: str, scores: list[list[float]], failed: list[int], n: int, num_sources: int
) -> None:
    """[S][n] scores: each source's row is all finite in float32 (scored) or all NaN (not
    routed)."""
    if len(scores) != num_sources or len(failed) != num_sources:
        raise ProtocolError(
            f"{where}: scores of {len(scores)} sources and failed counts of {len(failed)}, "
            f"the run has {num_sources} reward sources"
        )
    for s, (row, fails) in enumerate(zip(scores, failed, strict=True)):
        if len(row) != n:
            raise ProtocolError(f"{where}: source {s} scored {len(row)} samples of {n}")
        routed = [v == v for v in row]  # NaN != NaN: not routed to this group's data
        if any(routed) and not all(routed):
            raise ProtocolError(f"{where}: source {s} left some samples unscored (NaN)")
        if any(routed) and not finite32_mask(row).all():  # the learner trains them in float32
            raise ProtocolError(f"{where}: source {s} has a score that is not a finite float32")
        if not 0 <= fails <= n:
            raise ProtocolError(f"{where}: source {s} failed {fails} samples of {n}")
