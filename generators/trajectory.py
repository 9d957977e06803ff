"""A rollout's one shape, from the engine's tokens to the wire: the ``Trajectory``.

Every way of sampling builds trajectories here, and only here: one response to a prompt
(``single_turn``), an environment's episode (generators/episodes.py), and whatever else
produces turns. A single-turn sample is the one-turn case: one sampled turn, no
observation. ``pack`` turns a group's trajectories into the arrays of a
``RolloutGroup``, so the wire form is built in one place::

    Trajectory(prompt_ids)
      .add_turn(sample, text)          sampled ids, log-probs, versions; loss mask 1
      .add_observation(messages, ids)  ids the template adds between turns; loss mask 0
      ...
      .finish(stats, messages)         an episode's stats and conversation (multi-turn)
    pack(prompt_ids, trajectories) -> Packed -> RolloutGroup arrays (generators/leases.py)

Never re-tokenised: a turn's ids are the engine's, as they came, and an observation's are
the chat template's delta (generators/render.py). An observation token's log-prob is 0.0
and its version repeats the sampled token's before it (placeholders nothing reads: its
loss mask is 0). A per-turn reward sits at the turn's last sampled token.

Whether a group is multi-turn is said by its trajectories' ``stats`` (an environment's
episode has them), never by a type check: a multi-turn group carries its loss mask, turn
rewards and episode stats on the wire; a single-turn group does not (every token sampled).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace

import numpy as np

from generators.interface import Sample
from verl_async import protocol as P

Message = dict[str, str]


@dataclass
class Trajectory:
    """One sample: a prompt and every token after it, with what the learner needs per token."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled; 0: observation
    rewards: list[float] = field(default_factory=list)  # turn rewards at turns' last tokens
    turn_ends: list[int] = field(default_factory=list)  # end (exclusive) of each sampled turn
    turns: list[str] = field(default_factory=list)  # each sampled turn's text
    observations: list[list[Message]] = field(default_factory=list)  # after turn i
    # What the reward sources read: the last turn's text, and for a reward model the whole
    # conversation (None: the prompt and the text, as for any single-turn sample).
    messages: list[Message] | None = None
    stats: P.EpisodeStats | None = None  # an episode's (multi-turn); None: single-turn

    @property
    def text(self) -> str:
        """The last turn's text: what the reward sources score ("" without a turn)."""
        return self.turns[-1] if self.turns else ""

    def length(self) -> int:
        """Prompt and response tokens so far (what an episode's token budget counts)."""
        return len(self.prompt_ids) + len(self.token_ids)

    def ids(self) -> list[int]:
        """The whole sequence so far: what the engine continues from."""
        return self.prompt_ids + self.token_ids

    def add_turn(self, turn: Sample, text: str) -> Trajectory:
        """A sampled turn: its ids, log-probs and versions as the engine gave them."""
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.loss_mask += [1] * len(turn.token_ids)
        self.rewards += [0.0] * len(turn.token_ids)
        self.turn_ends.append(len(self.token_ids))
        self.turns.append(text)
        return self

    def add_reward(self, reward: float) -> None:
        """A reward for the last turn, at its last sampled token (none: nowhere to put it)."""
        if self.turn_ends and self.turn_ends[-1] > 0:
            self.rewards[self.turn_ends[-1] - 1] += reward

    def add_observation(self, messages: list[Message], ids: list[int]) -> None:
        """What follows a turn before the next one: ``ids`` (not sampled) for ``messages``."""
        self.observations.append(messages)
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.rewards += [0.0] * len(ids)

    def sampled_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]

    def finish(self, stats: P.EpisodeStats, messages: list[Message]) -> Trajectory:
        """An episode's end: its stats and its conversation (for reward models)."""
        self.stats = stats
        self.messages = messages
        return self


def single_turn(prompt_ids: list[int], sample: Sample, text: str) -> Trajectory:
    """One response to a prompt: the one-turn trajectory."""
    return Trajectory(list(prompt_ids)).add_turn(sample, text)


@dataclass
class Packed:
    """A group's trajectories as the arrays of a ``RolloutGroup`` (concatenated over tokens)."""

    prompt_ids: list[int]
    tokens: np.ndarray  # [sum T] int32
    logprobs: np.ndarray  # float32
    versions: np.ndarray  # int32
    lengths: list[int]
    loss_mask: np.ndarray | None = None  # uint8, multi-turn only
    turn_rewards: np.ndarray | None = None  # float32, multi-turn only
    episodes: list[P.EpisodeStats] = field(default_factory=list)


def pack(prompt_ids: list[int], trajectories: list[Trajectory]) -> Packed:
    """One group's trajectories, packed. A multi-turn group (its trajectories have episode
    stats) starts from its episodes' prompt, which an environment may have given, and
    carries loss mask, turn rewards and stats; a single-turn group from ``prompt_ids``.
    Episodes whose prompts differ (an agent's calls each render their own) share the
    longest prefix of them as the group's prompt, and each begins its response with the
    rest of its own, not sampled: the same tokens in the same order."""
    episodes = [t.stats for t in trajectories if t.stats is not None]
    if episodes and len(episodes) != len(trajectories):
        raise ValueError("a group mixes episodes with single-turn samples")
    if episodes:
        trajectories = _on_common_prompt(trajectories)

    def cat(name: str, dtype) -> np.ndarray:
        values = itertools.chain.from_iterable(getattr(t, name) for t in trajectories)
        return np.fromiter(values, dtype)

    lengths = [len(t.token_ids) for t in trajectories]
    packed = Packed(
        trajectories[0].prompt_ids if episodes else list(prompt_ids),
        cat("token_ids", np.int32),
        cat("logprobs", np.float32),
        cat("versions", np.int32),
        lengths,
    )
    if episodes:
        packed.loss_mask = cat("loss_mask", np.uint8)
        packed.turn_rewards = cat("rewards", np.float32)
        packed.episodes = episodes
    return packed


def _on_common_prompt(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The trajectories over the longest prompt they all begin with (copies where moved)."""
    prompts = [t.prompt_ids for t in trajectories]
    if all(p == prompts[0] for p in prompts):
        return trajectories
    common = len(os.path.commonprefix(prompts))
    out = []
    for t in trajectories:
        rest = t.prompt_ids[common:]
        if not rest:
            out.append(t)
            continue
        # The version of the first sampled token (a placeholder nothing reads).
        first = next((v for v, m in zip(t.versions, t.loss_mask, strict=True) if m), 0)
        moved = replace(
            t,
            prompt_ids=t.prompt_ids[:common],
            token_ids=rest + t.token_ids,
            logprobs=[0.0] * len(rest) + t.logprobs,
            versions=[first] * len(rest) + t.versions,
            loss_mask=[0] * len(rest) + t.loss_mask,
            rewards=[0.0] * len(rest) + t.rewards,
            turn_ends=[e + len(rest) for e in t.turn_ends],
        )
        out.append(moved)
    return out
