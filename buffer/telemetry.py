"""What the buffer measures about the generators, kept off the data path.

Gauges and running totals read by ``GetStats`` (``Stats``): the generation rate
(``TokenRate``), the seconds admission held generators back (``AdmissionClock``) and the
seconds groups waited for their distillation teachers (``TeacherWaits``).
They read the clock (the ledger does not) and live only as long as the buffer process:
checkpoints do not carry them, so after a resume they count from zero again and the
learner, which turns the totals into per-step values, treats a smaller total as a
restart (learners/step_metrics.py).
"""

from __future__ import annotations

import time
from collections import deque


class AdmissionClock:
    """Seconds generators spent held back by admission, summed over generators.

    A generator is *blocked* from a GetPrompts that admission refused outright until its
    next GetPrompts that gets work; it is *idle* for the part of that time during which it
    had no group in flight either (its engine had nothing to do). Running intervals count
    up to ``now``, so totals read mid-interval are exact.
    """

    def __init__(self) -> None:
        self.blocked_since: dict[int, float] = {}
        self.idle_since: dict[int, float] = {}
        self.blocked_total = 0.0
        self.idle_total = 0.0

    def observe(self, generator_id: int, refused: bool, in_flight: int, now: float) -> None:
        """After a GetPrompts: ``refused`` = admission gave nothing; ``in_flight`` = groups it holds."""
        if refused:
            self.blocked_since.setdefault(generator_id, now)
            if in_flight == 0:
                self.idle_since.setdefault(generator_id, now)
            else:
                self.idle_total += _close(self.idle_since, generator_id, now)
            return
        self.blocked_total += _close(self.blocked_since, generator_id, now)
        self.idle_total += _close(self.idle_since, generator_id, now)

    def totals(self, now: float) -> tuple[float, float]:
        """(blocked seconds, idle seconds) so far."""
        blocked = self.blocked_total + sum(now - t for t in self.blocked_since.values())
        idle = self.idle_total + sum(now - t for t in self.idle_since.values())
        return blocked, idle


def _close(open_since: dict[int, float], generator_id: int, now: float) -> float:
    """End the generator's open interval, if it has one; returns its length (0 if none)."""
    start = open_since.pop(generator_id, None)
    return 0.0 if start is None else now - start


class TokenRate:
    """Generated tokens per second over a sliding window (O(1) per event, amortised).

    The tokens that arrived in the last ``window_s`` seconds, divided by the window, or,
    early in a run, by the time since the rate started counting (``start``: when it was
    made, or when ``begin`` said generation began). A group's tokens arrive at once but
    were generated over the time before; dividing by the span of the events instead (or
    by the time since the first event) turns a burst after a quiet spell, such as the
    first groups arriving together after the engines started, into an absurd rate.
    Counted from when the rate was made, the first readings include the engines' start-up
    and are low until a window of generation has passed; ``begin`` at the first prompts
    handed out leaves the start-up out.
    """

    def __init__(self, window_s: float = 20.0, start: float | None = None) -> None:
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0  # tokens of the events in the window
        self.start = time.monotonic() if start is None else start
        self.first: float | None = None  # time of the first event ever
        self.begun = False

    def begin(self, now: float | None = None) -> None:
        """Generation began at ``now``: count from there. Only the first call counts."""
        if not self.begun and self.first is None:
            self.start = time.monotonic() if now is None else now
        self.begun = True

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.first = now if self.first is None else self.first
        self.events.append((now, tokens))
        self.total += tokens

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self.events and now - self.events[0][0] > self.window_s:
            self.total -= self.events.popleft()[1]
        if self.first is None:
            return 0.0
        # Counting began at ``start``; or at the first event, when the caller's clock
        # (``now``) is not the monotonic one ``start`` was read from and puts it earlier.
        elapsed = now - min(self.start, self.first)
        return self.total / min(self.window_s, elapsed) if elapsed > 0 else 0.0


class TeacherWaits:
    """Running totals of the groups a teacher process scored, as their rollouts say: how
    long their generators waited for the scores (``RolloutGroup.teacher_s``: queue,
    transport, retries after a teacher died) and the part the teacher computed
    (``teacher_busy_s``). The learner turns them into per-group means per step."""

    def __init__(self) -> None:
        self.groups = 0
        self.seconds = 0.0
        self.busy_s = 0.0

    def add(self, seconds: float, busy_s: float) -> None:
        self.groups += 1
        self.seconds += seconds
        self.busy_s += busy_s
