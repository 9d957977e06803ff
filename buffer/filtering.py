"""DAPO's dynamic sampling at the buffer: a group whose samples all score alike is dropped
as it arrives, before it can take a place in a step.

Under GRPO such a group has advantage 0 everywhere: it costs a step's room and teaches
nothing. verl filters a batch once it is generated and generates more until the batch is
full; here the steps are filled from the stream instead: the ledger (buffer/ledger.py)
gives a step the next ``learner.groups_per_step`` groups *kept*, in issue order, and a
dropped group is done (it counts as consumed, is never issued again, and its prompt is
listed in the trail of the step whose groups it came between).

The rule (verl's): a group of two or more members (samples, or an agent's episodes) is
dropped when every member has the same metric value. ``reward`` compares every reward
source's raw score and the sum of the environment's turn rewards, so a group is dropped
only when its combined reward, under any normalisation, is equal across members; a source
name compares that source's raw score alone, and a group it does not score (not routed)
is never dropped. Singleton groups are never dropped, nor evaluation groups (which never
come here).

Never stalling: after ``max_in_a_row`` drops in a row (in arrival order), the next group
that would be dropped is kept (``PAST_BOUND``) and the count starts again; verl's recipe
raises after ``max_num_gen_batches`` instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from enum import Enum

from buffer.ledger import StoredGroup
from verl_async.ratelimit import RateLimitedLog
from verl_async.schema import RunConfig

log = logging.getLogger("verl_async.buffer")


class Verdict(Enum):
    KEEP = "keep"
    DROP = "drop"  # every member scored alike: not stored, counted as consumed
    PAST_BOUND = "past_bound"  # would be dropped, kept because max_in_a_row were


@dataclass(frozen=True)
class FilterRule:
    """``algo.filter_groups`` resolved against the reward sources."""

    source: int | None  # index of the metric's reward source; None: ``reward``
    max_in_a_row: int

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FilterRule | None:
        """The run's rule; None when filtering is off."""
        fg = cfg.algo.filter_groups
        if not fg.enable:
            return None
        names = [src.name for src in cfg.rewards.sources]
        source = None if fg.metric == "reward" else names.index(fg.metric)
        return cls(source, fg.max_in_a_row)


def member_values(group: StoredGroup, source: int | None) -> list[tuple] | None:
    """The metric of each sample of ``group`` (a tuple, compared exactly); None when the
    metric does not apply to it (its source is not routed to the group's data)."""
    if source is not None:
        column = [sample[source] for sample in group.scores]
        if all(math.isnan(v) for v in column):
            return None
        return [(v,) for v in column]
    env = (
        [0.0] * len(group.responses)
        if group.turn_rewards is None
        else [float(r.sum(dtype="float64")) for r in group.turn_rewards]
    )
    # NaN (a source not routed) compares unequal to itself: None stands for it.
    return [
        (*(None if math.isnan(v) else v for v in sample), e)
        for sample, e in zip(group.scores, env, strict=True)
    ]


def members(group: StoredGroup) -> int:
    """Samples of the group, or episodes when its samples name theirs (an agent's episode
    may give several samples)."""
    named = [e.episode for e in group.episodes if e.episode >= 0]
    return len(set(named)) if named else len(group.responses)


def uniform(group: StoredGroup, source: int | None) -> bool:
    """Whether ``group`` has two or more members and every one has the same metric."""
    if members(group) < 2:
        return False
    values = member_values(group, source)
    return values is not None and all(v == values[0] for v in values[1:])


class GroupFilter:
    """The filtering decision for each arriving group, and the count of drops in a row."""

    def __init__(self, rule: FilterRule) -> None:
        self.rule = rule
        self.in_a_row = 0  # groups dropped since the last one kept (arrival order)
        # A converged policy keeps a group past the bound every step: one line a window.
        self.past_bound_log = RateLimitedLog(
            log, what="groups kept past filter_groups.max_in_a_row"
        )

    def verdict(self, group: StoredGroup) -> Verdict:
        """``decide``, and a warning (rate-limited) when the group is kept only because too
        many were dropped in a row."""
        verdict = self.decide(group)
        if verdict is Verdict.PAST_BOUND:
            self.past_bound_log.log(
                "past_bound",
                "group %d scored alike, but %d groups in a row were dropped "
                "(algo.filter_groups.max_in_a_row): it is kept and trains with zero advantage",
                group.group_id,
                self.rule.max_in_a_row,
                once_a_window=True,
            )
        return verdict

    def decide(self, group: StoredGroup) -> Verdict:
        if not uniform(group, self.rule.source):
            self.in_a_row = 0
            return Verdict.KEEP
        if self.in_a_row >= self.rule.max_in_a_row:
            self.in_a_row = 0
            return Verdict.PAST_BOUND
        self.in_a_row += 1
        return Verdict.DROP
