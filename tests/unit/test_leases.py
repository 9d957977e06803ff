"""Leases on issued groups: a holder that never returns its work cannot lose or keep it.

Every test runs on an injected clock: the lease class alone, the ledger with leases
(re-issue order, admission, exactly-once, snapshot), and the server driven in-process
(late rollouts refused and changing nothing, the per-connection bound, the log, Stats).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.leases import MAX_LAPSED, Leases
from buffer.ledger import Expired, LedgerError, PromptLedger, StoredGroup, check_issued
from buffer.snapshot import rollouts_from_arrow, rollouts_to_arrow
from verl_async import protocol as P
from verl_async.data import PromptRecord
from verl_async.staleness import Admission, check_sample

from .test_buffer_validation import Harness, make_group


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _ledger(clock: Clock, b=2, eta=1, steps=4, n=16, timeout_s=10.0, cap=None) -> PromptLedger:
    prompts = [PromptRecord(f"p{i}", str(i)) for i in range(n)]
    leases = Leases(timeout_s, cap, clock)
    return PromptLedger(prompts, Admission(b, eta), steps, seed=0, leases=leases)


def _stored(k: int, version: int = 0) -> StoredGroup:
    z = np.zeros(2, np.int32)
    return StoredGroup(
        k, 0, 0, z, [z], [z.astype(np.float32)], [np.full(2, version, np.int32)], [[0.0]], [0], ""
    )


def _ids(groups) -> list[int]:
    return [g.group_id for g in groups]


# ----------------------------------------------------------------------------- the leases


def _due(leases: Leases) -> dict[bytes, list[int]]:
    return {c: [lease.group_id for lease in due] for c, due in leases.expire().items()}


def test_leases_expire_in_grant_order_per_holder_and_only_when_due():
    clock = Clock()
    leases = Leases(10.0, None, clock)
    for k, client in ((0, b"A"), (1, b"B"), (2, b"A")):
        leases.grant(k, client)
    clock.now += 5
    leases.grant(3, b"A")
    leases.end(1)  # returned in time: never expires
    clock.now += 5  # 0 and 2 are due (granted at t, deadline t + 10); 3 is not
    assert _due(leases) == {b"A": [0, 2]}
    assert _due(leases) == {}
    assert dict(leases.held) == {b"A": 1} and leases.expired_total == 2
    clock.now += 4.999
    assert _due(leases) == {}
    clock.now += 0.001
    assert _due(leases) == {b"A": [3]}
    assert not leases.held and not leases.deadline


def test_a_lease_that_ran_out_stays_lapsed_when_its_group_goes_back_to_the_same_connection():
    """The defect this pins: a group re-issued to the connection whose lease on it ran out
    made that old lease live again, so the holder's first copy was taken for the new lease
    and its second copy was refused as "already returned" (an Error, fatal to the
    generator). Each issue is a lease of its own: the old copy stays late, by name."""
    clock = Clock()
    leases = Leases(10.0, None, clock)
    first = leases.grant(7, b"A")
    assert leases.lapsed_reason(7, first, b"A") is None
    clock.now += 10
    assert _due(leases) == {b"A": [7]}
    clock.now += 3
    late = (
        f"group 7: lease {first} of this connection ran out 3s ago; the group was issued "
        "again and this rollout is not taken"
    )
    assert leases.lapsed_reason(7, first, b"A") == late
    assert leases.lapsed_reason(7, first, b"B") is None  # B never held it: not its lease
    assert leases.lapsed_reason(8, first, b"A") is None  # not that group's lease
    second = leases.grant(7, b"A")  # A asked again and got the group back
    assert second != first and leases.live[7].number == second
    assert leases.lapsed_reason(7, first, b"A") == late  # its first copy is still late
    assert leases.lapsed_reason(7, second, b"A") is None  # its second is live


def test_lapsed_leases_remembered_are_bounded():
    clock = Clock()
    leases = Leases(1.0, None, clock)
    numbers = [leases.grant(k, b"A") for k in range(MAX_LAPSED + 5)]
    clock.now += 1
    assert len(leases.expire()[b"A"]) == MAX_LAPSED + 5
    assert len(leases.lapsed) == MAX_LAPSED
    assert leases.lapsed_reason(0, numbers[0], b"A") is None  # the oldest are forgotten first
    assert leases.lapsed_reason(MAX_LAPSED + 4, numbers[-1], b"A") is not None


def test_a_renewal_extends_only_what_the_connection_holds_and_never_past_max_s():
    clock = Clock()
    leases = Leases(10.0, None, clock, max_s=25.0)
    a, b = leases.grant(0, b"A"), leases.grant(1, b"B")
    clock.now += 8
    # A renews its own lease, B's, one never granted and one that does not exist yet.
    assert leases.renew(b"A", [a, b, 0, 99]) == [b, 0, 99]
    assert leases.deadline == {0: 1018.0, 1: 1010.0}  # only A's moved
    assert (leases.renewed_total, leases.refused_total) == (1, 3)
    clock.now += 2  # B's runs out; A's was renewed
    assert _due(leases) == {b"B": [1]}
    assert leases.renew(b"B", [b]) == [b]  # too late: it is lapsed, and stays so
    assert leases.lapsed_reason(1, b, b"B") is not None
    clock.now += 7.5
    assert leases.renew(b"A", [a]) == [] and leases.deadline == {0: 1025.0}  # the cap
    clock.now += 5  # renewed in time, but max_s after its grant it runs out anyway
    assert leases.renew(b"A", [a]) == [] and leases.deadline == {0: 1025.0}
    clock.now += 2.5
    assert leases.renew(b"A", [a]) == [a]  # due: not renewed, whether or not expired yet
    [lapsed] = leases.expire()[b"A"]
    assert lapsed.capped
    assert "ran out at buffer.lease_max_s" in leases.lapsed_reason(0, a, b"A")
    assert leases.renew(b"A", [a]) == [a] and not leases.live


def test_a_cap_below_the_timeout_leaves_every_lease_its_timeout_and_no_renewal():
    """A run that raised lease_timeout_s above lease_max_s (the advice before leases were
    renewed) keeps leases of lease_timeout_s: the cap only bounds renewals."""
    clock = Clock()
    leases = Leases(3600.0, None, clock, max_s=1800.0)
    n = leases.grant(0, b"A")
    assert leases.deadline == {0: 4600.0}
    clock.now += 2000
    assert leases.renew(b"A", [n]) == [] and leases.deadline == {0: 4600.0}
    clock.now += 1599.999
    assert _due(leases) == {}
    clock.now += 0.001
    assert _due(leases) == {b"A": [0]}


def test_a_renewed_lease_keeps_one_place_in_line_and_runs_out_only_when_due():
    """A renewal moves the deadline only; the lease's entry goes back in line when its old
    deadline comes up, so however many renewals come, each lease has one entry."""
    clock = Clock()
    leases = Leases(3.0, None, clock)
    n = leases.grant(0, b"A")
    for _ in range(10):
        clock.now += 2
        for _ in range(100):  # a flood of renewals costs no memory
            assert leases.renew(b"A", [n]) == []
        assert _due(leases) == {} and len(leases.due) == 1
    clock.now += 2.999
    assert _due(leases) == {}
    clock.now += 0.001
    assert _due(leases) == {b"A": [0]} and not leases.due


def test_a_renewal_may_name_at_most_what_a_connection_may_hold():
    leases = Leases(10.0, 4, Clock())
    leases.check_renewal([1, 2, 3, 4])
    for bad, message in (
        ([1, 2, 3, 4, 5], "a renewal of 5 leases; a connection holds at most 4"),
        ([1, 0], "lease 0 was never granted: leases are numbered from 1"),
        ([-7], "lease -7 was never granted: leases are numbered from 1"),
    ):
        with pytest.raises(P.ProtocolError) as err:
            leases.check_renewal(bad)
        assert str(err.value) == message


def test_a_connection_is_refused_more_than_its_bound():
    leases = Leases(10.0, 4, Clock())
    leases.check_request(b"A", 4)
    for k in range(3):
        leases.grant(k, b"A")
    leases.check_request(b"A", 1)
    leases.check_request(b"B", 4)  # the bound is per connection
    with pytest.raises(P.ProtocolError) as err:
        leases.check_request(b"A", 2)
    assert str(err.value) == (
        "this connection holds 3 prompt groups and asks for 2 more; a connection may hold "
        "at most 4 at once (twice generators.max_inflight_groups): return rollouts before "
        "asking for more"
    )
    Leases().check_request(b"A", 10**9)  # no bound configured


# ----------------------------------------------------------------------------- the ledger


def test_expiry_reissues_exactly_the_expired_groups_first_in_id_order():
    clock = Clock()
    ledger = _ledger(clock, b=2, eta=1)
    assert _ids(ledger.issue(0, 0, 2, client=b"A")[0]) == [0, 1]
    clock.now += 4
    assert _ids(ledger.issue(1, 0, 2, client=b"B")[0]) == [2, 3]
    ledger.record_return(_stored(1))
    clock.now += 6  # A's lease on 0 is due (1 was returned); B's run 4 s more
    assert ledger.expire_leases() == [Expired(b"A", 0, [0], at_cap=0)]
    assert list(ledger.reissue) == [0] and sorted(ledger.in_flight) == [2, 3]
    clock.now += 4
    assert ledger.expire_leases() == [Expired(b"B", 1, [2, 3], at_cap=0)]
    assert list(ledger.reissue) == [0, 2, 3] and not ledger.in_flight
    # Issued again before any fresh group, to whoever asks next (here: A again, then C).
    assert _ids(ledger.issue(2, 1, 2, client=b"C")[0]) == [0, 2]
    assert _ids(ledger.issue(2, 1, 2, client=b"C")[0]) == [3, 4]
    assert ledger.in_flight[0].client == b"C" and ledger.leases.holder[0] == b"C"
    assert ledger.leases.expired_total == 3


def _late(ledger: PromptLedger, k: int, lease: int, client: bytes) -> str | None:
    return ledger.late(make_group(k=k, lease=lease)[0], client)


def test_a_late_rollout_is_named_and_the_new_holders_is_taken_once():
    clock = Clock()
    ledger = _ledger(clock)
    a_leases = [g.lease for g in ledger.issue(0, 0, 2, client=b"A")[0]]
    clock.now += 10
    ledger.expire_leases()
    assert "group 1: lease 2 of this connection ran out 0s ago" in _late(ledger, 1, 2, b"A")
    b_leases = [g.lease for g in ledger.issue(1, 0, 2, client=b"B")[0]]
    assert b_leases == [3, 4] and ledger.in_flight[1].lease == 4
    for k, lease in zip((0, 1), a_leases, strict=True):
        assert _late(ledger, k, lease, b"A") is not None  # A's copies, under A's old leases
        assert _late(ledger, k, lease, b"B") is None  # not B's: a wrong message, not late
    ledger.record_return(_stored(0))
    ledger.record_return(_stored(1))
    with pytest.raises(LedgerError, match="group 1 was already returned"):
        ledger.check_returnable([1])
    assert _late(ledger, 1, a_leases[1], b"A") is not None  # returned by B: A's is still late
    assert _ids(ledger.consume(0)) == [0, 1]


def test_a_group_issued_again_to_its_holder_is_returned_once_under_its_new_lease():
    """The holder is the only generator: its lease ran out while it still sampled, and the
    group came back to it first in line. Its two copies are told apart by lease."""
    clock = Clock()
    ledger = _ledger(clock)
    [first] = ledger.issue(0, 0, 1, client=b"A")[0]
    clock.now += 10
    assert ledger.expire_leases() == [Expired(b"A", 0, [0], at_cap=0)]
    [second] = ledger.issue(0, 0, 1, client=b"A")[0]
    assert first.group_id == second.group_id == 0 and first.lease != second.lease
    assert _late(ledger, 0, first.lease, b"A") is not None
    assert _late(ledger, 0, second.lease, b"A") is None
    check_issued(make_group(k=0, lease=second.lease)[0], ledger.in_flight[0], b"A")
    ledger.record_return(_stored(0))
    assert _late(ledger, 0, first.lease, b"A") is not None  # still late after the return


def test_a_restarted_generators_groups_are_taken_back_at_once_and_first_in_line():
    clock = Clock()
    ledger = _ledger(clock, b=2, eta=1, timeout_s=300.0)
    old = ledger.issue(1, 0, 2, client=b"A")[0]  # generator 1's old process
    ledger.issue(0, 0, 2, client=b"B")  # generator 0
    assert ledger.take_back(1) == [0, 1]  # no clock movement: not an expiry
    assert list(ledger.reissue) == [0, 1] and sorted(ledger.in_flight) == [2, 3]
    assert ledger.leases.held == {b"B": 2} and ledger.leases.expired_total == 0
    assert "lease 1 of this connection was revoked (its generator restarted)" in _late(
        ledger, 0, old[0].lease, b"A"
    )
    assert _ids(ledger.issue(1, 0, 2, client=b"C")[0]) == [0, 1]  # the new process
    assert ledger.take_back(7) == []  # an id holding nothing
    ledger.record_return(_stored(0))
    ledger.record_return(_stored(1))
    assert _ids(ledger.consume(0)) == [0, 1]


def test_a_reissued_group_is_admitted_like_a_fresh_one():
    """eta = 0: group 2 belongs to step 1 and may only go to a generator running version 1;
    after its lease expires a generator still at version 0 cannot take it either, and the
    groups behind it wait (issue order is kept)."""
    clock = Clock()
    ledger = _ledger(clock, b=2, eta=0)
    ledger.issue(0, 0, 2, client=b"A")
    for k in (0, 1):
        ledger.record_return(_stored(k))
    assert _ids(ledger.issue(0, 1, 2, client=b"A")[0]) == [2, 3]
    clock.now += 10
    ledger.expire_leases()
    assert ledger.issue(1, 0, 2, client=b"B") == ([], True)
    groups, blocked = ledger.issue(1, 1, 4, client=b"B")
    assert (_ids(groups), blocked) == ([2, 3], True)  # 4 belongs to step 2
    assert ledger.in_flight[2].loaded_version == 1  # the rollout's oldest allowed version


def test_snapshot_after_expiry_reissues_every_unreturned_group_once():
    clock = Clock()
    before = _ledger(clock, b=2, eta=1, steps=4, n=8)
    before.issue(0, 0, 4, client=b"A")  # 0..3
    before.record_return(_stored(0))
    clock.now += 10
    before.expire_leases()  # 1, 2, 3 back in the queue
    before.issue(0, 0, 2, client=b"B")  # 1 and 2 again
    stored, reissue = before.snapshot(0, {})
    assert [g.group_id for g in stored] == [0] and reissue == [1, 2, 3]

    after = _ledger(clock, b=2, eta=1, steps=4, n=8)
    after.restore(0, 0, before.next_group, rollouts_from_arrow(rollouts_to_arrow(stored)), reissue)
    assert not after.leases.deadline and not after.leases.held
    trained = []
    for step in range(4):  # the learner version at step s is s
        for g in after.issue(0, step, 100, client=b"C")[0]:
            after.record_return(_stored(g.group_id, step))
        trained += _ids(after.consume(step))
    assert trained == list(range(8))
    assert after.exhausted and not after.in_flight and not after.leases.deadline


@settings(max_examples=300, deadline=None)
@given(
    b=st.integers(1, 3),
    eta=st.integers(0, 2),
    steps=st.integers(1, 5),
    choices=st.lists(st.integers(0, 1_000_000), min_size=50, max_size=400),
)
def test_random_interleavings_with_expiry_train_each_group_once_within_eta(b, eta, steps, choices):
    """Two connections take, renew, return (also too late, and copies of one group issued
    to the same connection twice), lose work to expiry; steps consume. Every copy a
    connection returns is either live (taken) or late (dropped), never both, never
    neither; each group is trained once."""
    clock = Clock()
    ledger = _ledger(clock, b=b, eta=eta, steps=steps, n=5, timeout_s=3.0)
    clients, loaded, learner_version = (b"A", b"B"), [0, 0], 0
    held: dict[bytes, list[tuple[int, int, int]]] = {b"A": [], b"B": []}  # (group, version, lease)
    trained: list[int] = []
    for c in choices:
        op, who = c % 6, clients[(c // 6) % 2]
        g = clients.index(who)
        if op == 0:
            groups, _ = ledger.issue(g, loaded[g], 1 + c % 3, client=who)
            held[who] += [(x.group_id, loaded[g], x.lease) for x in groups]
        elif op == 1 and held[who]:
            k, v, lease = held[who].pop((c // 12) % len(held[who]))
            issued = ledger.in_flight.get(k)
            live = issued is not None and (issued.client, issued.lease) == (who, lease)
            rollout = make_group(k=k, generator_id=g, lease=lease)[0]
            assert (ledger.late(rollout, who) is not None) == (not live)
            if live:
                check_issued(rollout, issued, who)
                ledger.record_return(_stored(k, v))
        elif op == 2:
            clock.now += c % 4
            ledger.expire_leases()
        elif op == 3 and learner_version < steps and ledger.missing_for(learner_version) == 0:
            for grp in ledger.consume(learner_version):
                trained.append(grp.group_id)
                assert check_sample(learner_version, int(grp.token_versions[0].min()), eta)
            learner_version += 1
        elif op == 4:
            loaded[g] = min(learner_version, loaded[g] + 1)
        elif op == 5:
            ledger.expire_leases()  # as the server does before every request
            mine = [lease for _, _, lease in held[who]]
            live = {i.lease for i in ledger.in_flight.values() if i.client == who}
            assert set(ledger.leases.renew(who, mine)) == set(mine) - live
    assert trained == list(range(learner_version * b))
    live = set(ledger.in_flight)
    assert not live & set(ledger.reissue) and not live & set(ledger.returned)
    assert set(ledger.leases.deadline) == live
    assert sum(ledger.leases.held.values()) == len(live)


# ----------------------------------------------------------------------------- the server


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def harness(clock):
    h = Harness(leases=Leases(10.0, 6, clock))
    yield h
    h.close()


def _error(body: P.Body) -> str:
    assert isinstance(body, P.Error) and body.code == "rejected", body
    return body.message


def _issue(
    h: Harness, client: bytes, n: int, generator_id: int = 0, version: int = 0
) -> list[P.PromptGroup]:
    req = P.GetPrompts(generator_id=generator_id, loaded_version=version, max_groups=n)
    reply = h.request(client, req)
    assert isinstance(reply, P.Prompts), reply
    return reply.groups


def _take(h: Harness, client: bytes, n: int, generator_id: int = 0, version: int = 0) -> list[int]:
    return _ids(_issue(h, client, n, generator_id, version))


def _rollouts(*issued: P.PromptGroup, generator_id: int = 0) -> tuple[list, P.Frames]:
    """Valid rollouts of ``issued``, each under the lease it came with (as a generator's)."""
    frames = P.Frames()
    groups = [
        make_group(
            k=g.group_id,
            generator_id=generator_id,
            lease=g.lease,
            frames=frames,
            ver=np.zeros(6, np.int32),
        )[0]
        for g in issued
    ]
    return groups, frames


def _push(h: Harness, client: bytes, *issued: P.PromptGroup, generator_id: int = 0) -> P.Body:
    groups, frames = _rollouts(*issued, generator_id=generator_id)
    return h.push(client, *groups, frames=frames)


def test_in_a_push_only_the_lapsed_groups_are_dropped(harness, clock):
    h = harness
    lapsing = _issue(h, b"R", 2)
    clock.now += 10
    assert _take(h, b"G", 2, generator_id=1) == [0, 1]  # the expired ones, re-issued
    fresh = _issue(h, b"R", 1)  # the slow generator asks again: a fresh group
    assert _ids(fresh) == [2]
    reply = _push(h, b"R", lapsing[0], fresh[0])
    assert reply == P.Dropped(group_ids=[0], reason="lease expired")
    assert sorted(h.server.ledger.returned) == [2]  # its valid group was taken
    assert sorted(h.server.ledger.in_flight) == [0, 1]  # with G now


def test_a_late_push_is_dropped_by_name_and_changes_nothing(harness, clock):
    h = harness
    rogue = _issue(h, b"R", 2)  # the rogue takes two groups and never returns them in time
    clock.now += 10
    mine = _issue(h, b"G", 3, generator_id=1)
    assert _ids(mine) == [0, 1, 2]  # expired first, then fresh
    before = h.state()
    assert _push(h, b"R", *rogue) == P.Dropped(group_ids=[0, 1], reason="lease expired")
    assert h.state() == before
    # Under G's leases, from R, they are not late but someone else's: refused.
    assert _error(_push(h, b"R", *mine[:2], generator_id=1)) == (
        "group 0 was issued to generator 1 on another connection"
    )
    assert isinstance(_push(h, b"G", *mine[:2], generator_id=1), P.Ack)
    assert _error(_push(h, b"G", *mine[:2], generator_id=1)) == "group 0 was already returned"
    assert _push(h, b"R", *rogue) == P.Dropped(group_ids=[0, 1], reason="lease expired")
    assert sorted(h.server.ledger.returned) == [0, 1]
    stats = h.request(b"L", P.GetStats())
    assert (stats.leases_expired, stats.returned, stats.rollouts_dropped) == (2, 2, 4)


@pytest.mark.parametrize("late_first", [True, False])
def test_a_group_issued_again_to_its_holder_takes_one_copy_and_drops_the_other(
    harness, clock, late_first
):
    """The defect this pins, through the server: one generator's lease ran out while it
    still sampled, the group came back to the same connection, and both copies were
    pushed. Before leases were numbered the first copy was taken under the new lease and
    the second was refused with an Error (group already returned), which stopped the
    generator. Whichever copy comes first, one is taken and the other is dropped."""
    h = harness
    [first] = _issue(h, b"G", 1)
    clock.now += 10
    [second] = _issue(h, b"G", 1)
    assert first.group_id == second.group_id == 0 and first.lease != second.lease
    copies = (first, second) if late_first else (second, first)
    replies = [_push(h, b"G", c) for c in copies]
    dropped = P.Dropped(group_ids=[0], reason="lease expired")
    assert replies == ([dropped, P.Ack()] if late_first else [P.Ack(), dropped])
    assert sorted(h.server.ledger.returned) == [0] and not h.server.ledger.in_flight
    stats = h.request(b"L", P.GetStats())
    assert (stats.leases_expired, stats.returned, stats.rollouts_dropped) == (1, 1, 1)


def test_renewals_keep_a_slow_holders_groups_and_only_its_own(harness, clock):
    h = harness
    slow = _issue(h, b"G", 2)
    stranger = _issue(h, b"R", 1)
    leases = [g.lease for g in slow]
    for _ in range(5):  # 40 s of work on a 10 s lease, renewed every 8 s
        clock.now += 8
        assert h.request(b"G", P.RenewLeases(leases=leases)) == P.Renewed(lost=[])
    assert sorted(h.server.ledger.in_flight) == [0, 1]  # 40 s after their issue
    assert list(h.server.ledger.reissue) == [2]  # the stranger's ran out meanwhile
    # A renewal of someone else's lease, or of one that ran out, changes nothing.
    before = h.state()
    reply = h.request(b"R", P.RenewLeases(leases=[*leases, stranger[0].lease]))
    assert reply == P.Renewed(lost=[*leases, stranger[0].lease])
    assert h.state() == before
    assert isinstance(_push(h, b"G", *slow), P.Ack)
    assert h.request(b"G", P.RenewLeases(leases=leases)) == P.Renewed(lost=leases)  # returned
    stats = h.request(b"L", P.GetStats())
    assert (stats.leases_renewed, stats.renewals_refused, stats.leases_expired) == (10, 5, 1)


def test_leases_expire_on_the_ticker_without_any_request(harness, clock, caplog):
    h = harness
    _take(h, b"R", 3)
    clock.now += 10
    with caplog.at_level(logging.WARNING, logger="verl_async.buffer"):
        h.server._expire_leases()  # what the server's 50 ms ticker does
    assert list(h.server.ledger.reissue) == [0, 1, 2] and not h.server.ledger.in_flight
    assert [r.getMessage() for r in caplog.records] == [
        f"lease of 3 groups on connection {b'R'.hex()} (generator 0) expired: not returned "
        "within 10s of their issue or last renewal; groups [0, 1, 2] go to the next "
        "generator that asks"
    ]


def test_a_lease_renewed_to_its_cap_runs_out_and_says_so(clock, caplog):
    h = Harness(leases=Leases(10.0, 6, clock, max_s=15.0))
    try:
        [group] = _issue(h, b"G", 1)
        clock.now += 8
        assert h.request(b"G", P.RenewLeases(leases=[group.lease])) == P.Renewed(lost=[])
        assert h.server.ledger.leases.deadline == {0: 1015.0}  # not 1018: the cap
        clock.now += 7
        with caplog.at_level(logging.WARNING, logger="verl_async.buffer"):
            reply = h.request(b"G", P.RenewLeases(leases=[group.lease]))
        assert reply == P.Renewed(lost=[group.lease])  # ran out just before this renewal
        assert (
            " renewal (1 of them held buffer.lease_max_s = 15s, past which no renewal goes); "
            in caplog.text
        )
        assert _push(h, b"G", group) == P.Dropped(group_ids=[0], reason="lease expired")
    finally:
        h.close()


def test_expired_lease_lines_are_rate_limited(harness, clock, caplog):
    h = harness
    log = h.server.lease_log
    log.clock, log.window_start, log.window_s = clock, clock.now, 1000.0
    with caplog.at_level(logging.WARNING, logger="verl_async.buffer"):
        for i in range(30):  # 30 connections each lose a group, one sweep apart
            assert _take(h, b"R%d" % i, 1) != []
            clock.now += 10
            h.server._expire_leases()
        clock.now += 1000
        log.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 21 and all(" expired: not returned " in line for line in lines[:20])
    assert lines[20] == "10 more expired leases in the last 1300s were not logged (10 lease)"


def test_one_connection_holds_at_most_its_bound(harness, clock):
    h = harness  # bound 6; admission (B = 2, eta = 1) allows groups 0..3 at version 0
    assert _take(h, b"R", 4) == [0, 1, 2, 3]
    before = h.state()
    req = P.GetPrompts(generator_id=0, loaded_version=0, max_groups=3)
    assert _error(h.request(b"R", req)).startswith(
        "this connection holds 4 prompt groups and asks for 3 more; a connection may hold at most 6"
    )
    assert h.state() == before
    update = P.WeightUpdate(version=1, params=[], bucket_bytes=1)
    assert isinstance(h.request(b"L", P.AnnounceWeights(update=update)), P.Ack)  # k < 6 now
    assert _take(h, b"G", 3, 1, version=1) == [4, 5]  # another connection is not bound by R
    clock.now += 10  # every lease runs out: R may ask again, and is first in line for them
    assert _take(h, b"R", 6, version=1) == [0, 1, 2, 3, 4, 5]


def test_a_cut_after_expiry_restores_with_every_unreturned_group_to_issue(harness, clock, tmp_path):
    h = harness
    assert _take(h, b"R", 3) == [0, 1, 2]
    clock.now += 10
    assert _take(h, b"G", 1, generator_id=1) == [0]  # 0 is G's now; 1 and 2 wait in line
    assert isinstance(h.request(b"L", P.SnapshotBuffer(step=0, version=0)), P.Ack)
    files, frames = h.server.cuts.files(0)
    wire = [bytes(b) for b in frames.buffers]
    for name, ref in files.files.items():
        (tmp_path / name).write_bytes(P.tensor(ref, wire).tobytes())

    fresh = Harness(leases=Leases(10.0, 6, clock))
    try:
        fresh.server.restore(tmp_path)
        lg = fresh.server.ledger
        assert list(lg.reissue) == [0, 1, 2] and lg.next_group == 3 and not lg.leases.deadline
        assert fresh.request(b"L", P.GetStats()).leases_expired == 3
        assert _take(fresh, b"G", 4, generator_id=1) == [0, 1, 2, 3]
    finally:
        fresh.close()
