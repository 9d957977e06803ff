"""Evaluation rounds: validation prompts handed to generators beside training work.

The learner starts round r at a step barrier (``StartEval``) and goes on training; generators
take its prompts with their next ``GetPrompts`` (at most half of the room they ask for, at
least one, so training keeps flowing), sample them with the eval settings and return
scores (``PushEval``). A round is scored by the weights it was started at: its prompts go
only to generators that have loaded that version, and a generator holding it keeps it
loaded until its part of the round is sampled (``Generator.finish_eval_first``; bounded,
and a round that outlasts the bound reports the versions it mixed). Evaluation never
trains and is outside the exactly-once ledger: a round that a crash interrupts is simply
not reported.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from buffer.ledger import LedgerError, prompt_group
from verl_async import protocol as P
from verl_async.data import PromptRecord


@dataclass
class Round:
    step: int
    version: int
    started: float
    pending: deque[int]  # validation prompt indices not handed out yet
    results: dict[int, P.EvalResult] = field(default_factory=dict)
    holders: dict[int, bytes] = field(default_factory=dict)  # prompt -> connection it went to
    finished: float = 0.0


class EvalRounds:
    def __init__(self, prompts: list[PromptRecord]) -> None:
        self.prompts = prompts
        self.rounds: dict[int, Round] = {}

    def start(self, body: P.StartEval) -> None:
        if not self.prompts:
            raise LedgerError("evaluation asked for, but the buffer holds no validation prompts")
        if body.round in self.rounds:
            raise LedgerError(f"evaluation round {body.round} was already started")
        order = deque(range(len(self.prompts)))
        self.rounds[body.round] = Round(body.step, body.version, time.monotonic(), order)

    def _oldest_pending(self) -> tuple[int, Round | None]:
        for r, rnd in sorted(self.rounds.items()):
            if rnd.pending:
                return r, rnd
        return -1, None

    def pending_version(self) -> int:
        """The version of the oldest round with prompts to hand out; -1 if none."""
        _, rnd = self._oldest_pending()
        return -1 if rnd is None else rnd.version

    def wanted(self, room: int, loaded_version: int) -> int:
        """How many of ``room`` slots evaluation takes from a generator at
        ``loaded_version``: half, at least one, if the oldest round with work left was
        started at a version it has loaded."""
        _, rnd = self._oldest_pending()
        if rnd is None or room <= 0 or loaded_version < rnd.version:
            return 0
        return min(max(1, room // 2), len(rnd.pending))

    def take(
        self, room: int, loaded_version: int, client: bytes = b""
    ) -> tuple[int, list[P.PromptGroup]]:
        """Prompts of the oldest round with work left, handed to connection ``client``:
        (round, groups); (-1, []) if none."""
        n = self.wanted(room, loaded_version)
        r, rnd = self._oldest_pending()
        if n == 0:
            return -1, []
        picked = [rnd.pending.popleft() for _ in range(n)]
        rnd.holders.update((i, client) for i in picked)
        return r, [prompt_group(i, i, -1, self.prompts[i]) for i in picked]

    def record(self, body: P.PushEval, client: bytes = b"") -> None:
        """Take the results of ``body``: each for a prompt handed to ``client``, once."""
        rnd = self.rounds.get(body.round)
        if rnd is None:
            raise LedgerError(f"evaluation round {body.round} is not running")
        for res in body.results:
            if not 0 <= res.group_id < len(self.prompts) or res.group_id in rnd.results:
                raise LedgerError(f"evaluation prompt {res.group_id} is unknown or repeated")
            if rnd.holders.get(res.group_id) != client:
                raise LedgerError(
                    f"evaluation prompt {res.group_id} of round {body.round} was not handed "
                    "to this connection"
                )
        for res in body.results:
            rnd.results[res.group_id] = res
        if len(rnd.results) == len(self.prompts):
            rnd.finished = time.monotonic()

    def report(self, round_: int) -> P.EvalReport | P.NotReady:
        """The finished round (removed from the state), or how many prompts it still lacks."""
        rnd = self.rounds.get(round_)
        if rnd is None:
            raise LedgerError(f"evaluation round {round_} is not running")
        if not rnd.finished:
            return P.NotReady(step=round_, missing_groups=len(self.prompts) - len(rnd.results))
        del self.rounds[round_]
        return P.EvalReport(
            round=round_,
            step=rnd.step,
            version=rnd.version,
            results=[rnd.results[i] for i in sorted(rnd.results)],
            seconds=rnd.finished - rnd.started,
        )
