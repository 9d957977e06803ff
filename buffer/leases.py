"""Leases: how long a connection may hold a prompt group before it goes to someone else.

Every time the ledger issues a group it grants a new lease, numbered (1, 2, 3, ... over
the buffer process's life) and held by the connection that asked. The number travels
with the group (``PromptGroup.lease``) and comes back with its rollout
(``RolloutGroup.lease``): a rollout is taken only under the lease that is live for its
group, on the connection that holds it. So two copies of one group are always told
apart, even when both were issued to the same connection: the group's lease ran out, it
was issued again, and the holder's first copy arrives beside (or after) the second.

A lease lasts ``timeout_s`` from its grant, and again from each renewal: the holder
renews, every third of ``timeout_s``, the leases of the groups it is still working on
(``RenewLeases``), so an agent episode of many minutes keeps its group, while a
generator that died, hangs with its event loop blocked, or never meant to return its
work stops renewing and loses each group ``timeout_s`` later. No renewal takes a lease
past ``max_s`` after its grant (a grant alone always lasts ``timeout_s``): a holder whose loop still runs but whose work never
ends (an engine stuck with its event loop alive, a client renewing forever) holds a
group for a bounded time too.

When a lease runs out, the ledger takes the group back and issues it again, first in
line, to whichever generator asks next, under a new lease. The old lease is remembered
as lapsed, so its rollout, whenever it arrives, is answered ``Dropped`` by name
(exactly-once: the group belongs to the newer lease now) and never counts. One
connection holds at most ``max_per_client`` groups at once: a client that asks for work
and never returns it ties up a bounded number of groups for a bounded time.

Pure and clock-injectable: deadlines are read from ``clock`` (monotonic seconds), and
leases run out only when ``expire`` is called (the buffer calls it before every request
and every 50 ms). Each live lease has one place in a heap ordered by deadline, so
``expire`` looks only at the leases that are due; a renewal only moves the lease's
deadline, and its entry goes back in line at the new one when it comes up.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from verl_async.protocol import ProtocolError

MAX_LAPSED = 10_000
"""Leases that ended without their rollout, remembered to answer a late rollout with
``Dropped``; past this many the oldest are forgotten, and a rollout under one of those is
refused as a lease this buffer does not know (a generator cancels the copies it learns
are lost, so none of its own should be that old)."""


@dataclass
class Lease:
    """One issue of a group to a connection."""

    number: int
    group_id: int
    client: bytes  # the connection (ROUTER identity) that holds it
    granted_at: float
    deadline: float  # renewals move it, never past granted_at + max_s
    capped: bool = False  # a renewal was cut short by max_s: renewals take it no further


@dataclass(frozen=True)
class Lapsed:
    """A lease that ended without its rollout (ran out, or revoked)."""

    group_id: int
    client: bytes
    at: float  # when it ended
    why: str


class Leases:
    """The live leases on issued groups, and the recently lapsed ones.

    ``timeout_s`` = inf never expires a lease and ``max_per_client`` = None bounds nothing
    (a ledger built without leases, as in tests of other parts); ``max_s`` caps renewals.
    """

    def __init__(
        self,
        timeout_s: float = math.inf,
        max_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_s: float = math.inf,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_s = max_s
        self.max_per_client = max_per_client
        self.clock = clock
        self.live: dict[int, Lease] = {}  # group id -> its live lease
        self.numbers: dict[int, int] = {}  # live lease number -> its group id
        self.due: list[tuple[float, int]] = []  # heap of (deadline, lease number), lazily pruned
        self.held: Counter[bytes] = Counter()  # connection -> groups it holds
        self.lapsed: OrderedDict[int, Lapsed] = OrderedDict()  # lease number -> how it ended
        self.next_number = 1
        self.expired_total = 0  # groups whose lease ran out, over the run
        self.renewed_total = 0  # renewals that extended a live lease
        self.refused_total = 0  # renewals of a lease the connection did not hold

    @property
    def deadline(self) -> dict[int, float]:
        """Group id -> when its lease runs out, for every live lease."""
        return {k: lease.deadline for k, lease in self.live.items()}

    @property
    def holder(self) -> dict[int, bytes]:
        """Group id -> the connection holding its live lease."""
        return {k: lease.client for k, lease in self.live.items()}

    def grant(self, group_id: int, client: bytes) -> int:
        """``client`` holds ``group_id`` under a new lease from now; returns its number."""
        now = self.clock()
        number = self.next_number
        self.next_number += 1
        lease = Lease(number, group_id, client, now, now + self.timeout_s)
        self.live[group_id] = lease
        self.numbers[number] = group_id
        self.held[client] += 1
        if lease.deadline < math.inf:  # a lease that never runs out needs no place in line
            heapq.heappush(self.due, (lease.deadline, number))
        return number

    def end(self, group_id: int) -> None:
        """The group's rollout was taken: its lease is over."""
        lease = self.live.pop(group_id)
        del self.numbers[lease.number]
        self._release(lease.client)

    def renew(self, client: bytes, numbers: list[int]) -> list[int]:
        """Extend each lease of ``numbers`` that ``client`` holds to now + timeout_s, never
        past its grant + max_s (and never shorter than it was: with max_s below timeout_s a
        renewal changes nothing); returns the others (lost: not live, or not this client's)."""
        now = self.clock()
        lost = []
        for number in numbers:
            k = self.numbers.get(number)
            lease = None if k is None else self.live[k]
            if lease is None or lease.client != client or lease.deadline <= now:
                lost.append(number)  # a due lease is over, whether or not expire() ran yet
                self.refused_total += 1
                continue
            # Only the deadline moves: the lease's place in line is fixed when it comes up
            # (``expire``), so a flood of renewals costs no memory.
            cap = lease.granted_at + self.max_s
            lease.capped = cap < now + self.timeout_s
            lease.deadline = max(lease.deadline, min(now + self.timeout_s, cap))
            self.renewed_total += 1
        return lost

    def expire(self) -> dict[bytes, list[Lease]]:
        """Remove the leases that are due: connection -> its leases, in deadline order."""
        now = self.clock()
        due: dict[bytes, list[Lease]] = {}
        while self.due and self.due[0][0] <= now:
            _, number = heapq.heappop(self.due)
            k = self.numbers.get(number)
            if k is None:
                continue  # returned (or revoked) since it was put in line
            lease = self.live[k]
            if lease.deadline > now:  # renewed since: back in line at its new deadline
                heapq.heappush(self.due, (lease.deadline, number))
                continue
            self._lapse(k, now, "capped" if lease.capped else "expired")
            due.setdefault(lease.client, []).append(lease)
            self.expired_total += 1
        return due

    def revoke(self, group_ids: list[int], why: str = "revoked") -> None:
        """End these leases now, as if they had run out: their holder is known to be gone
        (its generator was restarted), or (``why`` = "refused") its rollout was refused and
        the group is taken back. A rollout under them is dropped."""
        now = self.clock()
        for k in group_ids:
            self._lapse(k, now, why)

    def _lapse(self, group_id: int, now: float, why: str) -> bytes:
        """End ``group_id``'s lease, remembering it as lapsed; returns its holder."""
        lease = self.live.pop(group_id)
        del self.numbers[lease.number]
        self._release(lease.client)
        self.lapsed[lease.number] = Lapsed(group_id, lease.client, now, why)
        if len(self.lapsed) > MAX_LAPSED:
            self.lapsed.popitem(last=False)
        return lease.client

    def _release(self, client: bytes) -> None:
        self.held[client] -= 1
        if not self.held[client]:
            del self.held[client]  # connections come and go: keep only those holding work

    def check_request(self, client: bytes, max_groups: int) -> None:
        """Raise ProtocolError unless ``client`` may be issued ``max_groups`` more groups."""
        cap = self.max_per_client
        held = self.held[client]
        if cap is not None and held + max_groups > cap:
            raise ProtocolError(
                f"this connection holds {held} prompt groups and asks for {max_groups} more; "
                f"a connection may hold at most {cap} at once (twice "
                "generators.max_inflight_groups): return rollouts before asking for more"
            )

    def check_renewal(self, numbers: list[int]) -> None:
        """Raise ProtocolError unless a renewal of ``numbers`` is one a holder could send."""
        cap = self.max_per_client
        if cap is not None and len(numbers) > cap:
            raise ProtocolError(
                f"a renewal of {len(numbers)} leases; a connection holds at most {cap}"
            )
        low = min(numbers, default=1)
        if low < 1:
            raise ProtocolError(f"lease {low} was never granted: leases are numbered from 1")

    def lapsed_reason(self, group_id: int, number: int, client: bytes) -> str | None:
        """Why ``client``'s rollout of ``group_id`` under lease ``number`` is not taken, if
        that lease was this client's and ended without its rollout; None otherwise."""
        lapsed = self.lapsed.get(number)
        if lapsed is None or (lapsed.group_id, lapsed.client) != (group_id, client):
            return None
        how = {
            "expired": "ran out",
            "capped": "ran out at buffer.lease_max_s",
            "revoked": "was revoked (its generator restarted)",
            "refused": "ended when its rollout was refused",
        }[lapsed.why]
        return (
            f"group {group_id}: lease {number} of this connection {how} "
            f"{self.clock() - lapsed.at:.0f}s ago; the group was issued again and this "
            "rollout is not taken"
        )

    def clear(self) -> None:
        """Forget every lease (a restore issues every group in flight again anyway)."""
        self.live.clear()
        self.numbers.clear()
        self.due.clear()
        self.held.clear()
        self.lapsed.clear()
