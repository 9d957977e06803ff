"""Staleness control: the one place that decides how old a sample may be.

Invariant: no sample whose staleness exceeds eta (``staleness.max``) ever
enters a gradient step, where

    staleness(sample, step s) = learner version at s  -  oldest token version in the sample

and the learner version at step s is s (weights are published after every step).

Two rules make it hold without throwing generation away:

1. Admission. Prompt groups are numbered k = 0, 1, 2, ... in issue order, B per step.
   Group k may go to a generator that has *loaded* version v only if
   ``k + 1 <= (v + eta + 1) * B``.
2. Consumption in issue order. Step s trains on groups sB .. sB + B - 1, waiting for any
   of them still in flight.

Proof sketch: group k belongs to step s = k // B, so k + 1 > sB and rule 1 gives
(v + eta + 1) B >= k + 1 > sB, i.e. v > s - eta - 1, i.e. v >= s - eta. Every token of the
sample was produced by weights of version >= v (versions only grow), so staleness <= eta.
With eta = 0 a group of step s is issued only to a generator running version s: generation
and training alternate, which is synchronous on-policy RL.

With dynamic sampling (``algo.filter_groups``, buffer/filtering.py) a returned group may be
dropped, and step s takes the next B groups *kept*, in issue order. Both rules then read a
group's *position* p(k), its index among the kept groups with those still in flight
counted as kept (buffer/ledger.py, ``PromptLedger.position``), in place of k: admission
asks p(k) + 1 <= (v + eta + 1) B when k is issued. Drops only lower positions, so k's
final position is at most p(k), its step s = final // B <= p(k) // B, and the proof above
gives v >= s - eta again. Without drops p(k) = k.

``check_sample`` is the safety net applied at batch assembly; anything it rejects is
counted in ``dropped_stale``, which must stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """The admission rule for ``groups_per_step`` = B and ``max_staleness`` = eta."""

    groups_per_step: int
    max_staleness: int

    def limit(self, loaded_version: int) -> int:
        """Number of groups (k < limit) a generator at ``loaded_version`` may have been issued."""
        return (loaded_version + self.max_staleness + 1) * self.groups_per_step

    def admits(self, group_id: int, loaded_version: int) -> bool:
        """Whether a group may go to a generator at ``loaded_version``; ``group_id`` is its
        position among the kept groups (its id when no group is dropped)."""
        return group_id + 1 <= self.limit(loaded_version)

    def step_of(self, group_id: int) -> int:
        return group_id // self.groups_per_step

    def groups_of_step(self, step: int) -> range:
        b = self.groups_per_step
        return range(step * b, (step + 1) * b)


def staleness(learner_version: int, oldest_token_version: int) -> int:
    return learner_version - oldest_token_version


def check_sample(learner_version: int, oldest_token_version: int, max_staleness: int) -> bool:
    """True when the sample may enter the gradient step at ``learner_version``."""
    return staleness(learner_version, oldest_token_version) <= max_staleness
