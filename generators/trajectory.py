"""A rollout's one shape, from the engine's tokens to the wire: the ``Trajectory``.

Every kind of rollout (single-turn, an environment's episode, an agent's) is recorded by
generators/recorder.py through the methods below, and no other module writes a
trajectory's fields. A single-turn sample is the one-turn case: one sampled turn, no
observation. ``pack`` turns a group's trajectories into the arrays of a
``RolloutGroup``, so the wire form is built in one place::

    Trajectory(prompt_ids)
      .add_turn(sample, text)          sampled ids, log-probs, versions; loss mask 1
      .add_between(ids)                ids rendered between turns; loss mask 0
      .observe(messages)               the messages those ids render (the conversation)
      ...
      .finish(stats, messages)         an episode's stats and conversation (multi-turn)
    pack(prompt_ids, trajectories) -> Packed -> RolloutGroup arrays (generators/leases.py)

Never re-tokenised: a turn's ids are the engine's, as they came, and the ids between
turns are the chat template's (generators/render.py). A token between turns has log-prob
0.0 and repeats the version of the sampled token before it (placeholders nothing reads:
its loss mask is 0). A per-turn reward sits at the turn's last sampled token.

Whether a group is multi-turn is said by its trajectories' ``stats`` (every episode has
them), never by a type check: a multi-turn group carries its loss mask, turn rewards and
episode stats on the wire; a single-turn group does not (every token sampled).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace

import numpy as np

from generators.interface import Sample
from verl_async import protocol as P
from verl_async.teachers import TeacherScore

Message = dict[str, str]


@dataclass
class Trajectory:
    """One sample: a prompt and every token after it, with what the learner needs per token."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled; 0: rendered between turns
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

    def sampled(self) -> int:
        """How many of its tokens were sampled."""
        return self.loss_mask.count(1)

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

    def add_between(self, ids: list[int], next_version: int = 0) -> None:
        """Ids rendered after a turn and before the next one (not sampled); they repeat the
        last sampled token's version, or ``next_version`` when none was sampled yet."""
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else next_version] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.rewards += [0.0] * len(ids)

    def observe(self, messages: list[Message]) -> None:
        """The messages that follow the last turn (what the ids between render)."""
        self.observations.append(messages)

    def add_reward(self, reward: float) -> None:
        """A reward for the last turn, at its last sampled token (none: nowhere to put it)."""
        if self.turn_ends and self.turn_ends[-1] > 0:
            self.rewards[self.turn_ends[-1] - 1] += reward

    def sampled_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]

    def finish(
        self, stats: P.EpisodeStats, messages: list[Message], final_text: str | None = None
    ) -> Trajectory:
        """An episode's end: its stats and its conversation (for reward models);
        ``final_text`` replaces the last turn's text as what the reward sources score."""
        self.stats = stats
        self.messages = messages
        if final_text is not None and self.turns:
            self.turns[-1] = final_text
        return self


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
    teacher: TeacherScore | None = None  # distillation by teacher processes only


def pack(prompt_ids: list[int], trajectories: list[Trajectory]) -> Packed:
    """One group's trajectories, packed. A multi-turn group (its trajectories have episode
    stats) starts from its episodes' prompt, which an environment may have given, and
    carries loss mask, turn rewards and stats; a single-turn group from ``prompt_ids``.
    Episodes whose prompts differ (an agent's calls each render their own) share the
    longest prefix of them as the group's prompt, and each begins its response with the
    rest of its own, not sampled: the same tokens in the same order. A sample with no
    sampled token (an episode that never reached the engine) is an empty response."""
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
    """The trajectories over the longest prompt they all begin with (copies where moved).
    A trajectory without a sampled token has nothing to train on: it becomes an empty
    response to that prompt, whatever prompt it had (its own rest would be a response of
    unsampled tokens, which no step may hold)."""
    empty = [t.sampled() == 0 for t in trajectories]
    prompts = [t.prompt_ids for t, e in zip(trajectories, empty, strict=True) if not e]
    if not prompts:  # nothing sampled at all: the first prompt, every response empty
        prompts = [trajectories[0].prompt_ids]
    common = len(os.path.commonprefix(prompts))
    out = []
    for t, is_empty in zip(trajectories, empty, strict=True):
        rest = t.prompt_ids[common:]
        if is_empty:
            out.append(_emptied(t, prompts[0][:common]))
        elif not rest:
            out.append(t)
        else:
            out.append(_moved(t, common))
    return out


def _emptied(t: Trajectory, prompt_ids: list[int]) -> Trajectory:
    return replace(
        t, prompt_ids=list(prompt_ids), token_ids=[], logprobs=[], versions=[], loss_mask=[],
        rewards=[], turn_ends=[],
    )  # fmt: skip


def _moved(t: Trajectory, common: int) -> Trajectory:
    """``t`` with the rest of its prompt past ``common`` moved into its response."""
    rest = t.prompt_ids[common:]
    # The version of the first sampled token (a placeholder nothing reads).
    first = next((v for v, m in zip(t.versions, t.loss_mask, strict=True) if m), 0)
    return replace(
        t,
        prompt_ids=t.prompt_ids[:common],
        token_ids=rest + t.token_ids,
        logprobs=[0.0] * len(rest) + t.logprobs,
        versions=[first] * len(rest) + t.versions,
        loss_mask=[0] * len(rest) + t.loss_mask,
        rewards=[0.0] * len(rest) + t.rewards,
        turn_ends=[e + len(rest) for e in t.turn_ends],
    )
