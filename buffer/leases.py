"""Leases: how long a connection may hold a prompt group before it goes to someone else.

Every group the ledger issues is leased to the connection that asked for it until
``issue time + timeout_s``. Only a returned rollout ends a lease; nothing else the holder
does (polling, asking for more work) renews it. When a lease runs out, the ledger takes
the group back and issues it again, first in line, to whichever generator asks next.
So a generator that died, hung or never meant to return its work holds each group for
at most ``timeout_s`` and loses none of them; its late rollout is refused with a message
naming the expired lease, because the group is someone else's now (exactly-once).

One connection holds at most ``max_per_client`` groups at once: a client that asks for
work and never returns it ties up a bounded number of groups for a bounded time.

Pure and clock-injectable: deadlines are read from ``clock`` (monotonic seconds), and
leases run out only when ``expire`` is called (the buffer calls it before every request
and every 50 ms). Every lease lasts the same ``timeout_s``, so grant order is deadline
order and ``expire`` looks only at the leases that are due.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from verl_async.protocol import ProtocolError

MAX_LAPSED = 10_000
"""Expired leases remembered to name them when their holder's rollout arrives (a late
rollout is refused either way; past this many the oldest are only refused, not named)."""


class Leases:
    """The live leases on issued groups, and the recently expired ones.

    ``timeout_s`` = inf never expires a lease and ``max_per_client`` = None bounds nothing
    (a ledger built without leases, as in tests of other parts).
    """

    def __init__(
        self,
        timeout_s: float = math.inf,
        max_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_per_client = max_per_client
        self.clock = clock
        self.deadline: OrderedDict[int, float] = OrderedDict()  # group id -> deadline (in order)
        self.holder: dict[int, bytes] = {}  # group id -> connection (ROUTER identity)
        self.held: Counter[bytes] = Counter()  # connection -> groups it holds
        self.lapsed: OrderedDict[tuple[int, bytes], float] = OrderedDict()  # -> when it expired
        self.expired_total = 0  # groups whose lease ran out, over the run

    def grant(self, group_id: int, client: bytes) -> None:
        """``client`` holds ``group_id`` from now until now + timeout_s."""
        self.deadline[group_id] = self.clock() + self.timeout_s
        self.holder[group_id] = client
        self.held[client] += 1
        self.lapsed.pop((group_id, client), None)  # issued to it again: this lease is live

    def end(self, group_id: int) -> None:
        """The group's rollout was taken: its lease is over."""
        del self.deadline[group_id]
        self._release(self.holder.pop(group_id))

    def expire(self) -> dict[bytes, list[int]]:
        """Remove the leases that are due: connection -> its groups, in grant order."""
        now = self.clock()
        due: dict[bytes, list[int]] = {}
        while self.deadline:
            k = next(iter(self.deadline))
            if self.deadline[k] > now:
                break
            due.setdefault(self._lapse(k, now), []).append(k)
            self.expired_total += 1
        return due

    def revoke(self, group_ids: list[int]) -> None:
        """End these leases now, as if they had run out: their holder is known to be gone
        (its generator was restarted). A rollout of them from that connection is refused."""
        now = self.clock()
        for k in group_ids:
            self._lapse(k, now)

    def _lapse(self, group_id: int, now: float) -> bytes:
        """End ``group_id``'s lease, remembering it as lapsed; returns its holder."""
        del self.deadline[group_id]
        client = self.holder.pop(group_id)
        self._release(client)
        self.lapsed[(group_id, client)] = now
        if len(self.lapsed) > MAX_LAPSED:
            self.lapsed.popitem(last=False)
        return client

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

    def lapsed_reason(self, group_id: int, client: bytes) -> str | None:
        """Why ``client``'s rollout of ``group_id`` is refused, if its lease on it expired."""
        expired_at = self.lapsed.get((group_id, client))
        if expired_at is None:
            return None
        return (
            f"group {group_id}: the lease of this connection on it expired "
            f"{self.clock() - expired_at:.0f}s ago, {self.timeout_s:g}s after it was issued; "
            "the group was issued again and this rollout is not taken"
        )

    def clear(self) -> None:
        """Forget every lease (a restore issues every group in flight again anyway)."""
        self.deadline.clear()
        self.holder.clear()
        self.held.clear()
        self.lapsed.clear()
