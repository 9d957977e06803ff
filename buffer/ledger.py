"""The buffer's prompt-accounting state, free of sockets: prompt ledger and rollout store
(a step's batch is assembled from it by buffer/batches.py).

It reads no clock of its own: lease deadlines are kept by buffer/leases.py (whose clock
is injected), and what the buffer measures about the generators (rates, admission time)
is buffer/telemetry.py's.

Every prompt group k moves  issued -> returned -> consumed, each exactly once. Step s
consumes groups sB .. sB + B - 1 (issue order; see verl_async/staleness.py for why).
With dynamic sampling (buffer/filtering.py) a returned group may be dropped instead of
stored: it is done (consumed, never issued again), and step s consumes the next B groups
*kept*, in issue order, from the first group after step s - 1's last. A group's
*position* is its index among the kept groups (in flight ones counted as kept): without
drops it is its id, and admission is decided on it.
Each issue of a group is a lease of its connection's (buffer/leases.py); when the lease
runs out the group goes back to the front of the issue queue, and a rollout under the old
lease never counts, whoever the group went to next. A rollout refused for what it holds
takes its group back the same way (``refuse``); refused ``MAX_REFUSALS`` times, the group
is dropped as dynamic sampling drops one, so a group no generator can sample acceptably
ends instead of going round forever, and every step still gets B groups.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from buffer.leases import Leases
from verl_async.data import PromptRecord, epoch_order
from verl_async.protocol import EpisodeStats, PromptGroup, RolloutGroup
from verl_async.staleness import Admission


class LedgerError(ValueError):
    """A message that contradicts the ledger (unknown or duplicate group)."""


MAX_REFUSALS = 3
"""Refusals of a group's rollouts (by any generators, counted from the buffer process's
start) after which the group is done without training: a refusal is a bug of the sampling
side or a bound of the run its episodes pass, which a fourth try rarely mends."""


@dataclass
class StoredGroup:
    """A returned group's samples, arrays owned by the buffer.

    Multi-turn samples add three per-sample fields (verl_async/protocol.py's
    ``RolloutGroup`` says what they mean); a single-turn group leaves them at their
    defaults, and every selection of samples goes through ``select`` to keep them aligned.
    """

    group_id: int
    prompt_id: int
    generator_id: int
    prompt_ids: np.ndarray  # [P] int32
    responses: list[np.ndarray]  # N x [T_i] int32
    behav_logprobs: list[np.ndarray]  # N x [T_i] float32
    token_versions: list[np.ndarray]  # N x [T_i] int32
    scores: list[list[float]]  # [N][S] raw score per reward source (NaN: not routed)
    failed: list[int]  # [S] samples whose source failed and gave its default score
    data_source: str
    loss_masks: list[np.ndarray] | None = None  # N x [T_i] uint8, 1 = sampled; None: all sampled
    turn_rewards: list[np.ndarray] | None = None  # N x [T_i] float32; None: all zero
    episodes: list[EpisodeStats] = field(default_factory=list)  # [N], or [] (single-turn)
    teacher_logprobs: list[np.ndarray] | None = None  # N x [T_i] float32; None: not scored

    @property
    def num_tokens(self) -> int:
        return sum(len(r) + len(self.prompt_ids) for r in self.responses)

    def sampled_versions(self, i: int) -> np.ndarray:
        """Weights versions of sample ``i``'s sampled tokens (observation tokens carry
        placeholders, which no check should read)."""
        if self.loss_masks is None:
            return self.token_versions[i]
        return self.token_versions[i][self.loss_masks[i].astype(bool)]

    def select(self, keep: list[int]) -> StoredGroup:
        """The same group with only samples ``keep``, in that order (arrays are shared)."""
        pick = lambda per_sample: [per_sample[i] for i in keep]  # noqa: E731
        return StoredGroup(
            self.group_id,
            self.prompt_id,
            self.generator_id,
            self.prompt_ids,
            pick(self.responses),
            pick(self.behav_logprobs),
            pick(self.token_versions),
            pick(self.scores),
            self.failed,
            self.data_source,
            loss_masks=None if self.loss_masks is None else pick(self.loss_masks),
            turn_rewards=None if self.turn_rewards is None else pick(self.turn_rewards),
            episodes=pick(self.episodes) if self.episodes else [],
            teacher_logprobs=None if self.teacher_logprobs is None else pick(self.teacher_logprobs),
        )


@dataclass
class StepBatch:
    """All samples of one step that passed the staleness check, and their split over ranks.

    Every rank is sent the whole step (its advantages, reward normalisation and metrics
    are computed over the global batch) and trains on its own shard of it.
    """

    step: int
    groups: list[StoredGroup]  # kept samples only
    shards: list[list[tuple[int, int]]]  # [world_size] (position in groups, sample index)
    dropped_stale: int
    consumed: list[StoredGroup]  # the step's groups as returned (before the staleness check)
    filtered: list[tuple[int, int]] = field(default_factory=list)  # (group, prompt) dropped
    past_bound: int = 0  # of the step's groups, those kept past max_in_a_row
    filtered_total: int = 0  # groups dropped up to this step's last group
    past_bound_total: int = 0  # groups kept past max_in_a_row up to this step's last group
    served: set[int] = field(default_factory=set)
    encoded: tuple | None = None  # the Batch message, built once: every rank gets the same


@dataclass(frozen=True)
class FilterMarks:
    """Where dynamic sampling stands at the start of a step (for a snapshot as of it)."""

    start: int  # the step's first group id: every group before it was trained or dropped
    dropped: list[int]  # groups dropped, ids >= start
    past_bound: list[int]  # groups kept past max_in_a_row, ids >= start
    past_bound_before: int  # groups kept past max_in_a_row, ids < start


@dataclass
class Issued:
    generator_id: int
    loaded_version: int
    client: bytes = b""  # the connection (ROUTER identity) the group went out on
    lease: int = 0  # the lease it went out under (its rollout must name it)


@dataclass(frozen=True)
class Expired:
    """Groups of one holder whose leases ran out in one sweep."""

    client: bytes
    generator_id: int  # the generator id its first group was asked for under
    group_ids: list[int]
    at_cap: int  # how many of them ran out at buffer.lease_max_s (renewed to the end)

    def line(self, timeout_s: float, max_s: float) -> str:
        """The buffer's log line about them."""
        capped = (
            f" ({self.at_cap} of them held buffer.lease_max_s = {max_s:g}s, past which no "
            "renewal goes)"
            if self.at_cap
            else ""
        )
        return (
            f"lease of {len(self.group_ids)} groups on connection {self.client.hex()} "
            f"(generator {self.generator_id}) expired: not returned within {timeout_s:g}s of "
            f"their issue or last renewal{capped}; groups {self.group_ids} go to the next "
            "generator that asks"
        )


class PromptLedger:
    """Issue order, admission, leases, returns and consumption of prompt groups."""

    def __init__(
        self,
        prompts: list[PromptRecord],
        admission: Admission,
        total_steps: int,
        seed: int,
        leases: Leases | None = None,
    ) -> None:
        self.prompts = prompts
        self.admission = admission
        self.total_groups = total_steps * admission.groups_per_step
        self.seed = seed
        self.next_group = 0
        # Issued, never returned, to be issued again first (in id order): groups in flight
        # at a restore, and groups whose lease expired.
        self.reissue: deque[int] = deque()
        self.min_version = 0  # after a restore: the restored version (no older weights)
        self.in_flight: dict[int, Issued] = {}
        self.refusals: dict[int, int] = {}  # group id -> its rollouts refused so far
        self.leases = Leases() if leases is None else leases  # default: never expire
        self.returned: dict[int, StoredGroup] = {}
        self.consumed_steps = 0
        self._orders: dict[int, list[int]] = {}
        # Dynamic sampling (buffer/filtering.py): groups dropped and kept past the bound,
        # ids from the start of the oldest step in ``marks`` on; each recent step's marks.
        self.start = 0  # first group of step consumed_steps
        self.dropped: set[int] = set()
        self.past_bound: set[int] = set()
        self.marks: dict[int, tuple[int, int]] = {0: (0, 0)}  # step -> (start, past_bound_before)

    def prompt_of(self, group_id: int) -> tuple[int, int]:
        """group k -> (epoch, prompt index)."""
        n = len(self.prompts)
        epoch = group_id // n
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(n, epoch, self.seed)}
        return epoch, self._orders[epoch][group_id % n]

    def issued_prompt(self, group_id: int) -> tuple[int, PromptRecord]:
        """(prompt index, record) of the prompt group ``group_id`` samples."""
        _, idx = self.prompt_of(group_id)
        return idx, self.prompts[idx]

    def issue(
        self, generator_id: int, loaded_version: int, max_groups: int, client: bytes = b""
    ) -> tuple[list[PromptGroup], bool]:
        """Up to ``max_groups`` admissible groups; the flag says admission held some back.

        Groups to re-issue (after a restore, or an expired lease) go first, under the same
        admission rule as fresh ones. A generator still running weights older than the
        restored version gets nothing until it has loaded them. ``client`` is the
        connection asking: only it may return the groups (``check_issued``), each under
        the lease granted to it now.
        """
        out: list[PromptGroup] = []
        while len(out) < max_groups and not self.exhausted:
            k = self.reissue[0] if self.reissue else self.next_group
            admitted = self.admission.admits(self.position(k), loaded_version)
            if loaded_version < self.min_version or not admitted:
                return out, True
            epoch, idx = self.prompt_of(k)
            lease = self.leases.grant(k, client)
            out.append(prompt_group(k, idx, epoch, self.prompts[idx], lease))
            self.in_flight[k] = Issued(generator_id, loaded_version, client, lease)
            if self.reissue:
                self.reissue.popleft()
            else:
                self.next_group += 1
        return out, False

    @property
    def exhausted(self) -> bool:
        """No group to issue now: all the run's steps are spoken for (a group in flight
        that is dropped on its return makes room for one more)."""
        return not self.reissue and self.position(self.next_group) >= self.total_groups

    def position(self, k: int) -> int:
        """Group ``k``'s place among the kept groups, counting those in flight as kept: an
        upper bound of its final place (drops only lower it), and ``k`` without drops."""
        dropped_before_start = self.start - self.consumed_steps * self.admission.groups_per_step
        return k - dropped_before_start - sum(1 for d in self.dropped if self.start <= d < k)

    def late(self, group: RolloutGroup, client: bytes) -> str | None:
        """Why ``group``, from ``client``, comes too late to be taken (None: it does not):
        the lease it names was this client's and ended without its rollout. Such a rollout
        is dropped, not refused: its generator did nothing wrong, it was only slow."""
        return self.leases.lapsed_reason(group.group_id, group.lease, client)

    def check_returnable(self, group_ids: list[int]) -> None:
        """Raise LedgerError unless every id is in flight, once."""
        if len(set(group_ids)) != len(group_ids):
            twice = sorted(k for k, n in Counter(group_ids).items() if n > 1)
            raise LedgerError(f"a message returns the same group twice: {_ids(twice)}")
        for k in group_ids:
            if k not in self.in_flight:
                raise LedgerError(f"group {k} {self._not_in_flight(k)}")

    def _not_in_flight(self, k: int) -> str:
        """Why group ``k`` cannot be returned now (it is not in flight)."""
        if k in self.reissue:
            return "waits to be issued again (in flight at a restore, or its lease expired)"
        if k in self.returned or 0 <= k < self.next_group:
            return "was already returned"
        return "was never issued"

    def record_return(self, group: StoredGroup, verdict: str = "keep") -> None:
        """Take ``group`` back; ``verdict`` (buffer/filtering.py's ``Verdict`` value) says
        whether it is stored (``keep``, ``past_bound``) or done without training (``drop``)."""
        self.check_returnable([group.group_id])
        del self.in_flight[group.group_id]
        self.refusals.pop(group.group_id, None)
        self.leases.end(group.group_id)
        if verdict == "drop":
            self.dropped.add(group.group_id)
            return
        if verdict == "past_bound":
            self.past_bound.add(group.group_id)
        self.returned[group.group_id] = group

    def refuse(self, group_id: int) -> bool:
        """Take back ``group_id``, in flight, whose rollout was refused for what it held:
        first in line to be issued again, under a new lease; at its ``MAX_REFUSALS``-th
        refusal done without training instead (dropped: consumed, never issued again).
        Returns whether it ended."""
        self.check_returnable([group_id])
        del self.in_flight[group_id]
        self.leases.revoke([group_id], why="refused")
        count = self.refusals[group_id] = self.refusals.get(group_id, 0) + 1
        if count >= MAX_REFUSALS:
            del self.refusals[group_id]
            self.dropped.add(group_id)
            return True
        self.reissue = deque(sorted([*self.reissue, group_id]))
        return False

    def expire_leases(self) -> list[Expired]:
        """Take back the groups whose lease ran out; each is first in line to be issued
        again. Returns what ran out, per holder."""
        expired = []
        for client, leases in self.leases.expire().items():
            ids = [lease.group_id for lease in leases]
            issued = [self.in_flight.pop(k) for k in ids]
            at_cap = sum(lease.capped for lease in leases)
            expired.append(Expired(client, issued[0].generator_id, ids, at_cap))
            self.reissue.extend(ids)
        if expired:  # lowest id first: the head is the group the next step waits for
            self.reissue = deque(sorted(self.reissue))
        return expired

    def take_back(self, generator_id: int) -> list[int]:
        """Every group in flight at generator ``generator_id``, taken back at once (its
        process was restarted: nothing it held will come back); each is first in line
        to be issued again. Returns their ids."""
        ids = sorted(
            k for k, issued in self.in_flight.items() if issued.generator_id == generator_id
        )
        self.leases.revoke(ids)
        for k in ids:
            del self.in_flight[k]
        self.reissue = deque(sorted([*self.reissue, *ids]))
        return ids

    def in_flight_of(self, generator_id: int) -> int:
        return sum(1 for i in self.in_flight.values() if i.generator_id == generator_id)

    def _window(self) -> tuple[list[int], int]:
        """The next step's groups: (the kept ones returned, how many are not returned yet),
        walking from ``start`` over dropped groups until B are kept or awaited."""
        b = self.admission.groups_per_step
        kept, pending, k = [], 0, self.start
        while len(kept) + pending < b:
            if k in self.returned:
                kept.append(k)
            elif k not in self.dropped:
                pending += 1
            k += 1
        return kept, pending

    def missing_for(self, step: int) -> int:
        """Groups step ``step`` still waits for (all of them for a step after the next)."""
        if step < self.consumed_steps:
            return 0
        if step > self.consumed_steps:
            return self.admission.groups_per_step
        return self._window()[1]

    def consume(self, step: int) -> list[StoredGroup]:
        """Remove and return the groups of ``step``; every one must have been returned."""
        return self.consume_step(step)[0]

    def consume_step(self, step: int) -> tuple[list[StoredGroup], list[int], int]:
        """Remove the groups of ``step`` (every one must have been returned): (them, the
        ids of the groups dropped among them, how many were kept past the bound)."""
        if step != self.consumed_steps:
            raise LedgerError(
                f"step {step} requested, next unconsumed step is {self.consumed_steps}"
            )
        kept, pending = self._window()
        if pending:
            raise LedgerError(f"step {step} still waits for {pending} groups")
        end = kept[-1] + 1
        filtered = sorted(d for d in self.dropped if self.start <= d < end)
        past_bound = sum(1 for k in kept if k in self.past_bound)
        groups = [self.returned.pop(k) for k in kept]
        self.consumed_steps += 1
        self.start = end
        self.marks[self.consumed_steps] = (end, self.marks[step][1] + past_bound)
        self._forget_marks()
        return groups, filtered, past_bound

    # Steps whose marks are kept behind the next one (buffer/batches.py keeps as many).
    MARKS_KEPT = 4

    def _forget_marks(self) -> None:
        for t in [t for t in self.marks if t < self.consumed_steps - self.MARKS_KEPT]:
            del self.marks[t]
        oldest = self.marks[min(self.marks)][0]
        self.dropped = {d for d in self.dropped if d >= oldest}
        self.past_bound = {k for k in self.past_bound if k >= oldest}

    @property
    def past_bound_total(self) -> int:
        """Groups kept past the bound among the steps consumed."""
        return self.marks[self.consumed_steps][1]

    def filter_marks(self, step: int) -> FilterMarks:
        """Dynamic sampling's state as of the start of ``step`` (consumed, or the next)."""
        if step not in self.marks:
            raise LedgerError(f"snapshot at step {step}: its filtering marks are gone")
        start, before = self.marks[step]
        return FilterMarks(
            start,
            sorted(d for d in self.dropped if d >= start),
            sorted(k for k in self.past_bound if k >= start),
            before,
        )

    def snapshot(
        self, step: int, handed_out: dict[int, list[StoredGroup]]
    ) -> tuple[list[StoredGroup], list[int]]:
        """State as of step ``step``: (stored groups, groups to re-issue).

        ``handed_out[t]`` holds the groups already consumed for step t; those of steps
        >= ``step`` are stored again (a learner restored at ``step`` never trained on them).
        """
        if not step <= self.consumed_steps:
            raise LedgerError(
                f"snapshot at step {step}, but only {self.consumed_steps} steps were consumed"
            )
        stored = list(self.returned.values())
        for t in range(step, self.consumed_steps):
            if t not in handed_out:
                raise LedgerError(f"snapshot at step {step}: the groups of step {t} are gone")
            stored.extend(handed_out[t])
        stored.sort(key=lambda g: g.group_id)
        return stored, sorted([*self.reissue, *self.in_flight])

    def restore(
        self,
        step: int,
        version: int,
        next_group: int,
        stored: list[StoredGroup],
        reissue: list[int],
        marks: FilterMarks | None = None,
    ) -> None:
        """Continue from a snapshot; every group of steps >= ``step`` is stored, re-issued
        or (``marks``, with dynamic sampling) dropped."""
        b = self.admission.groups_per_step
        marks = marks or FilterMarks(step * b, [], [], 0)
        expected = set(range(marks.start, next_group))
        held = [g.group_id for g in stored] + list(reissue) + list(marks.dropped)
        if len(set(held)) != len(held) or set(held) != expected or marks.start < step * b:
            raise LedgerError(
                f"snapshot is inconsistent: groups {marks.start}..{next_group - 1} should "
                "each be stored, re-issued or dropped exactly once"
            )
        self.start = marks.start
        self.dropped = set(marks.dropped)
        self.past_bound = set(marks.past_bound)
        self.marks = {step: (marks.start, marks.past_bound_before)}
        self.consumed_steps = step
        self.next_group = next_group
        self.returned = {g.group_id: g for g in stored}
        self.reissue = deque(sorted(reissue))
        self.in_flight = {}
        self.refusals = {}
        self.leases.clear()
        self.min_version = version


def _ids(ids: list[int], at_most: int = 8) -> str:
    """A list of group ids for a message, cut short: a hostile one can hold millions."""
    more = f" and {len(ids) - at_most} more" if len(ids) > at_most else ""
    return f"{ids[:at_most]}{more}"


# ----------------------------------------------------------------------------- issuance


def check_issued(group: RolloutGroup, issued: Issued | None, client: bytes) -> None:
    """Raise LedgerError unless ``group`` is in flight to the generator returning it.

    ``issued`` is the ledger's record of the group (None: not in flight). A group goes
    back only on the connection it went out on, under the generator id it was asked for
    and the lease it was issued under: another process, however well-formed its message,
    cannot return (and so steal, or poison) a group it was not given. (A copy under an
    older lease of the same connection was dropped before this, ``PromptLedger.late``.)
    """
    k = group.group_id
    if issued is None:
        raise LedgerError(f"group {k} is not in flight (never issued, or already returned)")
    if group.generator_id != issued.generator_id:
        raise LedgerError(
            f"group {k} was issued to generator {issued.generator_id}, "
            f"not generator {group.generator_id}"
        )
    if client != issued.client:
        raise LedgerError(
            f"group {k} was issued to generator {issued.generator_id} on another connection"
        )
    if group.lease != issued.lease:
        raise LedgerError(
            f"group {k} was issued under lease {issued.lease}, not lease {group.lease}"
        )


def prompt_group(
    group_id: int, prompt_id: int, epoch: int, rec: PromptRecord, lease: int = 0
) -> PromptGroup:
    """The message that hands prompt ``rec`` to a generator (under ``lease``; 0: none)."""
    return PromptGroup(
        group_id=group_id,
        prompt_id=prompt_id,
        epoch=epoch,
        prompt_ids=list(rec.prompt_ids),
        prompt=rec.prompt,
        ground_truth=rec.ground_truth,
        data_source=rec.data_source,
        extra_info=rec.extra_info,
        lease=lease,
    )
