"""What a push of rollouts does to the buffer: each group is taken, dropped or refused on
its own.

A generator pushes the groups it finished, several per ``PushRollouts`` when it is busy
(generators/leases.py). Each group of the message has one of three outcomes:

- **taken**: recorded in the ledger (stored, or dropped by dynamic sampling,
  buffer/filtering.py);
- **dropped**: its rollout names a lease of this connection's that ended (it ran out, or
  its generator was restarted). The group was issued again and this copy never counts
  (``Dropped.group_ids``): its generator was slow, not wrong;
- **refused**: what it holds fails a check of buffer/rollouts.py (a field outside the
  run's bounds, say an agent's episode of more samples than ``max_calls`` allows). The
  group is taken back and issued again, first in line, like a group whose lease ran out
  (``Dropped.refused``); refused ``MAX_REFUSALS`` times it ends, done without training
  (buffer/ledger.py's ``refuse``: the way dynamic sampling drops a group, so every step
  still gets its B groups), logged at ERROR and counted.

The other groups of the message are recorded all the same: a group the buffer cannot
take costs that group alone, never its generator. (One refused group used to make the
whole message an ``Error``; the generator stopped, was restarted, and a group refused
every time went round the restarts until the run died.)

What stays a whole-message ``Error``, nothing of it recorded, are the checks about the
*sender*: a group that is not in flight (never issued, already returned, waiting to be
issued again), went out on another connection, under another generator id or another
live lease, or is named twice in one message. Such a message is a stranger's, or comes
from a generator whose own bookkeeping is broken: nothing it says about any of its
groups can be trusted, and refusing its groups one by one would let a stranger take back
(and, three times over, end) groups it was never given. Those checks come first, before
any tensor is looked at; then the content of every group is judged before any group is
recorded or refused, so a message changes state only once it has been read whole.
"""

from __future__ import annotations

import logging

from buffer.filtering import GroupFilter, Verdict
from buffer.ledger import MAX_REFUSALS, PromptLedger, StoredGroup, check_issued
from buffer.rollouts import RolloutLimits, unpack_rollout
from buffer.telemetry import TeacherWaits, TokenRate
from verl_async import protocol as P
from verl_async.ratelimit import RateLimitedLog, short


class Intake:
    """Takes the rollouts of pushes into the ledger, and counts what it did not take."""

    def __init__(
        self,
        ledger: PromptLedger,
        limits: RolloutLimits,
        group_filter: GroupFilter | None,
        rate: TokenRate,
        rejections: RateLimitedLog,
    ) -> None:
        self.ledger = ledger
        self.limits = limits  # what a returned group must look like
        self.filter = group_filter  # dynamic sampling; None: every group is kept
        self.rate = rate  # generated tokens, for the generation rate
        self.rejections = rejections  # the server's rate-limited log of peers' mistakes
        self.teacher_waits = TeacherWaits()  # what scoring by teacher processes cost
        self.dropped = 0  # rollouts under a lease that had ended
        self.refused = 0  # rollouts refused for what they held
        self.ended = 0  # groups refused MAX_REFUSALS times: done without training

    def push(
        self, identity: bytes, groups: list[P.RolloutGroup], frames: list, newest_version: int
    ) -> P.Ack | P.Dropped:
        """Take ``groups``, pushed on connection ``identity``: ``Ack`` when every one was
        taken, else ``Dropped`` naming those under a lease that ended and those refused.
        Raises LedgerError (nothing recorded) when the message is wrong as a whole.
        ``newest_version``: the newest weights announced, which no token may be past."""
        lg = self.ledger
        late = [lg.late(g, identity) is not None for g in groups]
        live = [g for g, out in zip(groups, late, strict=True) if not out]
        lg.check_returnable([g.group_id for g in live])
        for g in live:
            check_issued(g, lg.in_flight.get(g.group_id), identity)
        judged = [self._unpack(g, frames, newest_version) for g in live]
        refused = []
        for g, stored in zip(live, judged, strict=True):
            if isinstance(stored, str):
                refused.append(self._refuse(g.group_id, stored, identity))
                continue
            verdict = Verdict.KEEP if self.filter is None else self.filter.verdict(stored)
            lg.record_return(stored, verdict.value)
            self.rate.add(sum(len(r) for r in stored.responses))
            if stored.teacher_logprobs is not None:
                self.teacher_waits.add(g.teacher_s, g.teacher_busy_s)
        lapsed = [g.group_id for g, out in zip(groups, late, strict=True) if out]
        self.dropped += len(lapsed)
        if not lapsed and not refused:
            return P.Ack()
        reason = "lease expired" if lapsed else ""
        return P.Dropped(group_ids=lapsed, reason=reason, refused=refused)

    def _unpack(self, g: P.RolloutGroup, frames: list, newest: int) -> StoredGroup | str:
        """Group ``g`` as the buffer stores it, or why what it holds is refused. Its tokens
        carry versions from the one its generator had loaded when it was issued."""
        lg = self.ledger
        versions = (lg.in_flight[g.group_id].loaded_version, newest)
        try:
            return unpack_rollout(g, frames, self.limits, versions, lg.issued_prompt(g.group_id))
        except P.ProtocolError as exc:
            return str(exc)

    def _refuse(self, group_id: int, reason: str, identity: bytes) -> P.Refusal:
        """Take back a group whose rollout was refused: it is issued again, or it ends."""
        ended = self.ledger.refuse(group_id)
        self.refused += 1
        self.ended += ended
        if ended:
            self.rejections.log(
                "ended",
                "group %d ends without training: its rollouts were refused %d times, the "
                "last from %s: %s",
                group_id, MAX_REFUSALS, identity.hex(), reason,
                level=logging.ERROR,
            )  # fmt: skip
        else:
            self.rejections.log(
                "refused",
                "refused the rollout of group %d from %s: %s; the group is issued again",
                group_id, identity.hex(), reason,
            )  # fmt: skip
        return P.Refusal(group_id=group_id, reason=short(reason), ended=ended)
