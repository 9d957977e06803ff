"""Parked long polls: bounded per connection and in all, expired in O(log n) each.

A long poll (``PollVersion`` from a generator, ``GetBatch`` from a learner rank) that
cannot be answered yet is parked until it can be, or until its deadline. A real run parks
one per generator and one or two per learner rank; each parked poll holds a little buffer
memory and, without a bound, a client could park as many as it likes. So:

- one connection parks at most ``max_per_client`` polls, and the buffer at most
  ``max_total`` of each kind; past either bound the request is rejected (a
  ``ProtocolError`` naming the bound), and generators' polls can never crowd out the
  learner's (each kind has its own bound);
- deadlines sit in a heap, so the 50 ms tick pops exactly the polls whose deadline has
  come (O(log n) each) instead of scanning every parked poll. A poll answered early stays
  in the heap as a stale entry until its deadline pops it (or the heap is compacted when
  stale entries outnumber live ones);
- version polls are only looked at when what answers them changes (``version_polls``,
  called after an announcement or a shutdown); batch polls, at most ``max_total`` learner
  requests, after every drain.

Pure state: no sockets, no clock of its own (callers pass ``now``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from verl_async import protocol as P

MAX_PARKED_PER_CLIENT = 16  # long polls one connection may have waiting (real ones: 1-2)
MAX_PARKED = 4096  # long polls of one kind the buffer holds in all (real ones: a few dozen)


@dataclass
class Parked:
    identity: bytes
    request_id: int
    body: P.PollVersion | P.GetBatch
    deadline: float


class ParkedPolls:
    """The parked long polls, by kind, with their deadlines in a heap."""

    def __init__(
        self, max_per_client: int = MAX_PARKED_PER_CLIENT, max_total: int = MAX_PARKED
    ) -> None:
        self.max_per_client = max_per_client
        self.max_total = max_total
        self.versions: dict[int, Parked] = {}  # PollVersion, by park number
        self.batches: dict[int, Parked] = {}  # GetBatch, by park number
        self.deadlines: list[tuple[float, int]] = []  # (deadline, park number), a heap
        self.per_client: Counter[bytes] = Counter()
        self.numbers = itertools.count()

    def __len__(self) -> int:
        return len(self.versions) + len(self.batches)

    def __iter__(self) -> Iterator[Parked]:
        yield from self.versions.values()
        yield from self.batches.values()

    def _kind(self, body: P.PollVersion | P.GetBatch) -> dict[int, Parked]:
        return self.versions if isinstance(body, P.PollVersion) else self.batches

    def check(self, identity: bytes, body: P.PollVersion | P.GetBatch) -> None:
        """Raise ProtocolError unless ``identity`` may park one more poll like ``body``."""
        waiting = self.per_client[identity]
        if waiting >= self.max_per_client:
            raise P.ProtocolError(
                f"{waiting} long polls of this connection are waiting already "
                f"(at most {self.max_per_client})"
            )
        if len(self._kind(body)) >= self.max_total:
            raise P.ProtocolError(
                f"{self.max_total} {type(body).__name__} long polls are waiting already "
                "(the buffer's bound); ask again later"
            )

    def add(self, parked: Parked) -> None:
        """Park ``parked`` (``check`` has accepted it)."""
        number = next(self.numbers)
        self._kind(parked.body)[number] = parked
        self.per_client[parked.identity] += 1
        heapq.heappush(self.deadlines, (parked.deadline, number))

    def _remove(self, kind: dict[int, Parked], number: int) -> Parked:
        parked = kind.pop(number)
        self.per_client[parked.identity] -= 1
        if not self.per_client[parked.identity]:
            del self.per_client[parked.identity]
        if len(self.deadlines) > 2 * len(self) + 64:  # mostly stale: compact
            self.deadlines = [(p.deadline, n) for n, p in self._numbered()]
            heapq.heapify(self.deadlines)
        return parked

    def _numbered(self) -> Iterator[tuple[int, Parked]]:
        yield from self.versions.items()
        yield from self.batches.items()

    def expired(self, now: float) -> list[Parked]:
        """Remove and return the polls whose deadline is ``now`` or earlier."""
        out = []
        while self.deadlines and self.deadlines[0][0] <= now:
            _, number = heapq.heappop(self.deadlines)
            for kind in (self.versions, self.batches):
                if number in kind:
                    out.append(self._remove(kind, number))
        return out

    def take_all(self) -> list[Parked]:
        """Remove and return every parked poll (the buffer is stopping)."""
        out = [*self.versions.values(), *self.batches.values()]
        self.versions.clear()
        self.batches.clear()
        self.per_client.clear()
        self.deadlines.clear()
        return out

    def version_polls(self) -> Iterator[tuple[int, Parked]]:
        """(number, poll) of each parked ``PollVersion``; ``take`` the ones answered."""
        return iter(list(self.versions.items()))

    def batch_polls(self) -> Iterator[tuple[int, Parked]]:
        """(number, poll) of each parked ``GetBatch``; ``take`` the ones answered."""
        return iter(list(self.batches.items()))

    def take(self, number: int) -> Parked:
        """Remove the poll ``number`` (it was answered)."""
        kind = self.versions if number in self.versions else self.batches
        return self._remove(kind, number)
