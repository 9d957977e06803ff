"""The groups a generator holds, each under the lease it was issued with, and their pushes.

A group is held from the ``Prompts`` reply that issued it until the buffer has answered
its rollout; meanwhile one task works on it (sampling it, then scoring and pushing it).
``HeldGroups`` is that bookkeeping, and what follows from it:

- **Renewal.** Every third of ``buffer.lease_timeout_s`` the generator sends the leases of
  every group it holds (``RenewLeases``), so a group whose episodes take many minutes is
  not issued to anyone else while this generator still works on it. The buffer answers
  with the leases it no longer counts as this connection's (``Renewed.lost``: the lease
  ran out before a renewal came, e.g. at ``buffer.lease_max_s``, or the generator was
  declared restarted); their copies are cancelled, because their rollouts would be dropped.
- **One copy per group.** When the buffer issues a group this generator still holds (its
  lease ran out and it came back first in line, to the same connection), the older copy
  is cancelled before the new one starts: a group never runs twice at once here, and the
  older copy's rollout, if it was already on its way, is dropped by the buffer under its
  old lease.
- **Late or refused rollouts are not fatal.** The buffer takes each group of a push on
  its own (buffer/intake.py). ``RolloutPusher`` logs and counts the groups a ``Dropped``
  reply names (late: their lease was over; refused: the buffer found what they hold
  wrong, and issues them again or, refused too often, ends them) and goes on: the
  groups are released and their ``push`` returns. Only an ``Error``, which says the
  message was wrong as a whole, stops the process (see ``RolloutPusher``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from generators.trajectory import Packed
from verl_async import protocol as P
from verl_async.ratelimit import RateLimitedLog
from verl_async.rewards.scorer import GroupScores
from verl_async.transport import AsyncBufferClient

log = logging.getLogger("verl_async.generator")


@dataclass
class Held:
    """A group held here: the lease it was issued under and the task working on it now."""

    group_id: int
    lease: int
    task: asyncio.Task


class HeldGroups:
    """The training groups this generator holds, by group id (one copy each)."""

    def __init__(self) -> None:
        self.groups: dict[int, Held] = {}
        self.replaced = 0  # copies cancelled because their group was issued here again
        self.lost = 0  # copies cancelled because the buffer said their lease was over

    def cancel_older(self, group: P.PromptGroup) -> Held | None:
        """Cancel and forget a copy of ``group`` held under an older lease (the group was
        issued here again); returns it, or None. Called before the new copy starts, so the
        older one's requests are cancelled ahead of the new one's."""
        old = self.groups.get(group.group_id)
        if old is None or old.lease == group.lease:
            return None
        del self.groups[group.group_id]
        old.task.cancel()
        self.replaced += 1
        return old

    def hold(self, group: P.PromptGroup, task: asyncio.Task) -> None:
        """``task`` works on ``group`` now (a new copy, or the same one moving on from
        sampling to scoring and pushing)."""
        self.groups[group.group_id] = Held(group.group_id, group.lease, task)

    def release(self, task: asyncio.Task) -> None:
        """``task`` ended: its group is no longer held, unless another task carries it on."""
        for k, held in list(self.groups.items()):
            if held.task is task:
                del self.groups[k]

    def leases(self) -> list[int]:
        """The lease of every group held, to renew."""
        return [held.lease for held in self.groups.values()]

    def lose(self, leases: list[int]) -> list[int]:
        """Cancel the copies working under ``leases`` (the buffer no longer counts them as
        this connection's); returns their group ids."""
        gone = set(leases)
        lost = [k for k, held in self.groups.items() if held.lease in gone]
        for k in lost:
            self.groups.pop(k).task.cancel()
        self.lost += len(lost)
        return lost


@dataclass
class Finished:
    """A sampled and scored group waiting to be pushed."""

    group: P.PromptGroup
    packed: Packed
    scored: GroupScores
    seconds: float
    acknowledged: asyncio.Event

    def message(self, generator_id: int, frames: P.Frames) -> P.RolloutGroup:
        p = self.packed
        multiturn = p.loss_mask is not None
        return P.RolloutGroup(
            group_id=self.group.group_id,
            prompt_id=self.group.prompt_id,
            generator_id=generator_id,
            lease=self.group.lease,
            prompt_ids=frames.add(np.asarray(p.prompt_ids, np.int32)),
            response_ids=frames.add(p.tokens),
            behav_logprobs=frames.add(p.logprobs),
            token_versions=frames.add(p.versions),
            lengths=p.lengths,
            scores=self.scored.scores,
            failed=self.scored.failed,
            data_source=self.group.data_source,
            gen_seconds=self.seconds,
            loss_mask=frames.add(p.loss_mask) if multiturn else None,
            turn_rewards=frames.add(p.turn_rewards) if multiturn else None,
            episodes=p.episodes,
            teacher_logprobs=None if p.teacher is None else frames.add(p.teacher.logprobs),
            teacher_s=0.0 if p.teacher is None else p.teacher.wait_s,
            teacher_busy_s=0.0 if p.teacher is None else p.teacher.busy_s,
        )


class RolloutPusher:
    """Coalescing pushes: one PushRollouts in flight; groups finished meanwhile ride along.

    No added latency when idle (a lone group goes at once), fewer and larger messages when
    busy. ``push`` returns when the buffer has answered for the group: taken, dropped
    because its lease was over (counted in ``dropped``), or refused for what it holds
    (counted in ``refused``, logged with the buffer's reason, rate-limited). Neither of
    the last two is an error: the buffer took the group back, and this generator may well
    sample it again. An ``Error`` reply raises in the flusher task, which ``on_error``
    reports, and the generator stops: the buffer answers ``Error`` only to a message wrong
    as a whole (a group not in flight here, under another lease or generator id, or named
    twice), so this process's own bookkeeping is broken and nothing more it pushes can be
    trusted; a restart starts it clean, and the buffer takes back every group it held.
    """

    def __init__(self, client: AsyncBufferClient, generator_id: int, on_error=None) -> None:
        self.client = client
        self.generator_id = generator_id
        self.on_error = on_error
        self.outbox: list[Finished] = []
        self.flusher: asyncio.Task | None = None
        self.dropped = 0  # groups the buffer did not take: their lease was over
        self.refused = 0  # groups the buffer refused for what their rollout held
        self.ended = 0  # of those, groups it ended (refused too often: never trained)
        self.refusals_log = RateLimitedLog(log, what="refused rollouts")

    async def push(self, group, packed, scored, seconds) -> None:
        done = asyncio.Event()
        self.outbox.append(Finished(group, packed, scored, seconds, done))
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.create_task(self._flush())
            if self.on_error is not None:
                self.flusher.add_done_callback(self.on_error)
        await done.wait()

    async def _flush(self) -> None:
        while self.outbox:
            batch, self.outbox = self.outbox, []
            frames = P.Frames()
            groups = [f.message(self.generator_id, frames) for f in batch]
            reply, _ = await self.client.request(P.PushRollouts(groups=groups), frames)
            if isinstance(reply, P.Dropped):
                self._not_taken(reply)
            for f in batch:
                f.acknowledged.set()

    def _not_taken(self, reply: P.Dropped) -> None:
        """Log and count the groups of a push the buffer did not take."""
        if reply.group_ids:  # too late: the groups were issued again
            self.dropped += len(reply.group_ids)
            log.warning(
                "the buffer dropped the rollouts of groups %s (%s; %d dropped so far): "
                "their leases were over, so the groups went out again. A live generator "
                "loses a lease only when it could not renew it for "
                "buffer.lease_timeout_s or held it buffer.lease_max_s",
                reply.group_ids,
                reply.reason,
                self.dropped,
            )
        self.refusals_log.flush()
        for r in reply.refused:
            self.refused += 1
            self.ended += r.ended
            fate = "ended without training" if r.ended else "issued again"
            self.refusals_log.log(
                "refused",
                "the buffer refused the rollout of group %d (%d refused so far), %s: %s",
                r.group_id, self.refused, fate, r.reason,
            )  # fmt: skip
