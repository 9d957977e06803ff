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
from buffer.ledger import LedgerError, PromptLedger, StoredGroup
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


def test_leases_expire_in_grant_order_per_holder_and_only_when_due():
    clock = Clock()
    leases = Leases(10.0, None, clock)
    for k, client in ((0, b"A"), (1, b"B"), (2, b"A")):
        leases.grant(k, client)
    clock.now += 5
    leases.grant(3, b"A")
    leases.end(1)  # returned in time: never expires
    clock.now += 5  # 0 and 2 are due (granted at t, deadline t + 10); 3 is not
    assert leases.expire() == {b"A": [0, 2]}
    assert leases.expire() == {}
    assert dict(leases.held) == {b"A": 1} and leases.expired_total == 2
    clock.now += 4.999
    assert leases.expire() == {}
    clock.now += 0.001
    assert leases.expire() == {b"A": [3]}
    assert not leases.held and not leases.deadline


def test_a_lapsed_lease_is_named_until_the_group_is_leased_to_that_connection_again():
    clock = Clock()
    leases = Leases(10.0, None, clock)
    leases.grant(7, b"A")
    assert leases.lapsed_reason(7, b"A") is None
    clock.now += 10
    leases.expire()
    clock.now += 3
    assert leases.lapsed_reason(7, b"A") == (
        "group 7: the lease of this connection on it expired 3s ago, 10s after it was issued; "
        "the group was issued again and this rollout is not taken"
    )
    assert leases.lapsed_reason(7, b"B") is None  # B never held it: not its lease
    leases.grant(7, b"A")  # A asked again and got it back: its new lease is live
    assert leases.lapsed_reason(7, b"A") is None


def test_lapsed_leases_remembered_are_bounded():
    clock = Clock()
    leases = Leases(1.0, None, clock)
    for k in range(MAX_LAPSED + 5):
        leases.grant(k, b"A")
    clock.now += 1
    assert len(leases.expire()[b"A"]) == MAX_LAPSED + 5
    assert len(leases.lapsed) == MAX_LAPSED
    assert leases.lapsed_reason(0, b"A") is None  # the oldest are forgotten first
    assert leases.lapsed_reason(MAX_LAPSED + 4, b"A") is not None


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
    assert ledger.expire_leases() == [(b"A", 0, [0])]
    assert list(ledger.reissue) == [0] and sorted(ledger.in_flight) == [2, 3]
    clock.now += 4
    assert ledger.expire_leases() == [(b"B", 1, [2, 3])]
    assert list(ledger.reissue) == [0, 2, 3] and not ledger.in_flight
    # Issued again before any fresh group, to whoever asks next (here: A again, then C).
    assert _ids(ledger.issue(2, 1, 2, client=b"C")[0]) == [0, 2]
    assert _ids(ledger.issue(2, 1, 2, client=b"C")[0]) == [3, 4]
    assert ledger.in_flight[0].client == b"C" and ledger.leases.holder[0] == b"C"
    assert ledger.leases.expired_total == 3


def test_a_late_rollout_is_refused_and_the_new_holders_is_taken_once():
    clock = Clock()
    ledger = _ledger(clock)
    ledger.issue(0, 0, 2, client=b"A")
    clock.now += 10
    ledger.expire_leases()
    with pytest.raises(LedgerError, match="group 1: the lease of this connection on it expired"):
        ledger.check_returnable([1], b"A")  # waiting in the queue
    ledger.issue(1, 0, 2, client=b"B")
    for ids in ([1], [0, 1]):  # in flight to B now; a message with one of them fails whole
        with pytest.raises(LedgerError, match="lease of this connection on it expired 0s ago"):
            ledger.check_returnable(ids, b"A")
    ledger.check_returnable([0, 1], b"B")
    ledger.record_return(_stored(0))
    ledger.record_return(_stored(1))
    with pytest.raises(LedgerError, match="group 1 was already returned"):
        ledger.check_returnable([1], b"B")
    with pytest.raises(LedgerError, match="lease of this connection on it expired"):
        ledger.check_returnable([1], b"A")  # returned by B: still A's expired lease
    assert _ids(ledger.consume(0)) == [0, 1]


def test_a_restarted_generators_groups_are_taken_back_at_once_and_first_in_line():
    clock = Clock()
    ledger = _ledger(clock, b=2, eta=1, timeout_s=300.0)
    ledger.issue(1, 0, 2, client=b"A")  # generator 1's old process
    ledger.issue(0, 0, 2, client=b"B")  # generator 0
    assert ledger.take_back(1) == [0, 1]  # no clock movement: not an expiry
    assert list(ledger.reissue) == [0, 1] and sorted(ledger.in_flight) == [2, 3]
    assert ledger.leases.held == {b"B": 2} and ledger.leases.expired_total == 0
    with pytest.raises(LedgerError, match="group 0: the lease of this connection"):
        ledger.check_returnable([0], b"A")
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
    """Two connections take, return (also too late), lose work to expiry; steps consume."""
    clock = Clock()
    ledger = _ledger(clock, b=b, eta=eta, steps=steps, n=5, timeout_s=3.0)
    clients, loaded, learner_version = (b"A", b"B"), [0, 0], 0
    held: dict[bytes, list[tuple[int, int]]] = {b"A": [], b"B": []}  # (group, version) per holder
    trained: list[int] = []
    for c in choices:
        op, who = c % 5, clients[(c // 5) % 2]
        g = clients.index(who)
        if op == 0:
            groups, _ = ledger.issue(g, loaded[g], 1 + c % 3, client=who)
            held[who] += [(x.group_id, loaded[g]) for x in groups]
        elif op == 1 and held[who]:
            k, v = held[who].pop((c // 10) % len(held[who]))
            live = k in ledger.in_flight and ledger.in_flight[k].client == who
            try:
                ledger.check_returnable([k], who)
            except LedgerError:
                assert not live
                continue
            assert live
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


def _take(h: Harness, client: bytes, n: int, generator_id: int = 0, version: int = 0) -> list[int]:
    req = P.GetPrompts(generator_id=generator_id, loaded_version=version, max_groups=n)
    reply = h.request(client, req)
    assert isinstance(reply, P.Prompts), reply
    return _ids(reply.groups)


def test_in_a_push_only_the_lapsed_groups_are_dropped(harness, clock):
    h = harness
    assert _take(h, b"R", 2) == [0, 1]
    clock.now += 10
    assert _take(h, b"G", 2, generator_id=1) == [0, 1]  # the expired ones, re-issued
    assert _take(h, b"R", 1) == [2]  # the slow generator asks again: a fresh group
    frames = P.Frames()
    both = [make_group(k=k, frames=frames, ver=np.zeros(6, np.int32))[0] for k in (0, 2)]
    assert h.push(b"R", *both, frames=frames) == P.Dropped(group_ids=[0], reason="lease expired")
    assert sorted(h.server.ledger.returned) == [2]  # its valid group was taken
    assert sorted(h.server.ledger.in_flight) == [0, 1]  # with G now


def test_a_late_push_is_dropped_by_name_and_changes_nothing(harness, clock):
    h = harness
    assert _take(h, b"R", 2) == [0, 1]  # the rogue takes two groups and never returns them
    clock.now += 10
    assert _take(h, b"G", 3, generator_id=1) == [0, 1, 2]  # expired first, then fresh
    before = h.state()
    frames = P.Frames()
    late = [make_group(k=k, frames=frames, ver=np.zeros(6, np.int32))[0] for k in (0, 1)]
    assert h.push(b"R", *late, frames=frames) == P.Dropped(group_ids=[0, 1], reason="lease expired")
    assert h.state() == before
    frames = P.Frames()
    mine = [
        make_group(k=k, generator_id=1, frames=frames, ver=np.zeros(6, np.int32))[0] for k in (0, 1)
    ]
    assert isinstance(h.push(b"G", *mine, frames=frames), P.Ack)
    assert _error(h.push(b"G", *mine, frames=frames)) == "group 0 was already returned"
    assert sorted(h.server.ledger.returned) == [0, 1]
    stats = h.request(b"L", P.GetStats())
    assert (stats.leases_expired, stats.returned) == (2, 2)


def test_leases_expire_on_the_ticker_without_any_request(harness, clock, caplog):
    h = harness
    _take(h, b"R", 3)
    clock.now += 10
    with caplog.at_level(logging.WARNING, logger="verl_async.buffer"):
        h.server._expire_leases()  # what the server's 50 ms ticker does
    assert list(h.server.ledger.reissue) == [0, 1, 2] and not h.server.ledger.in_flight
    assert [r.getMessage() for r in caplog.records] == [
        f"lease of 3 groups on connection {b'R'.hex()} (generator 0) expired after 10s "
        "without their rollouts; groups [0, 1, 2] go to the next generator that asks"
    ]


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
    assert len(lines) == 21 and all(" expired after 10s " in line for line in lines[:20])
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
