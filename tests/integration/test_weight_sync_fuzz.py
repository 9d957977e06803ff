"""The weight-sync rendezvous under fire: a third party on the host writes into the store.

The weight-sync store is a TCPStore on learner rank 0 with no authentication: any local
process can connect, write any key (the gloo rendezvous's own addresses among them),
count on keys, or send bytes that are no request at all. While a real learner (rank 0)
and a member (rank 1) sync weight-sync epoch after epoch, as they do when the group is
rebuilt, this test fires hypothesis-generated hostile traffic at the store: garbage
values under the keys each epoch's members write, bogus keys, ``add`` on them, and raw
TCP connections that send junk or nothing and stay open. Each epoch must end, on both
sides, within a bound set by ``weights.timeout_s`` (never a hang), either with the
member holding exactly the learner's weights or with one error (``GroupFailed`` when the
group did not form; a gloo error when a collective broke); the next epoch is tried
regardless (the learner's regroup). Once the traffic stops, the next epoch must sync
through the learner's memory file, as on any quiet host. No wrong weights, ever.

The member is given the learner's memory offer as the buffer would relay it; the store
is the untrusted channel under test, so what it says about memory files is never read.
"""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Iterable

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch._C._distributed_c10d import TCPStore

from tests.weight_sync_helpers import send_weights
from verl_async.weight_sync import SyncGroup, join_group, param_specs, receive_weights

TIMEOUT_S = 1.5  # the group's rendezvous and collectives (weights.timeout_s)
# Gloo retries a connection a few times over its timeout: an epoch that fails ends
# within a few timeouts, never more.
EPOCH_BOUND_S = 8 * TIMEOUT_S
HOSTILE_EPOCHS = 5  # epochs synced while the traffic runs (then one quiet epoch)
BUCKET = 1 << 12
BATCH = 25  # hostile operations per hypothesis run


def _keys(epochs: int) -> st.SearchStrategy[str]:
    """Keys a member reads (gloo's rendezvous: ``<epoch prefix>/0/<rank>``), keys near
    them, and anything else."""
    epoch = st.integers(0, epochs + 1)
    rendezvous = st.builds(lambda e, r: f"verl_async/weights/{e}/0/{r}", epoch, st.integers(0, 2))
    return st.one_of(
        rendezvous,
        rendezvous,  # twice as likely as each of the others
        st.builds(lambda e, k: f"verl_async/weights/{e}/{k}", epoch, st.text(max_size=12)),
        st.text(max_size=40),
    )


def _operations(epochs: int) -> st.SearchStrategy[tuple]:
    return st.one_of(
        st.tuples(st.just("set"), _keys(epochs), st.binary(max_size=160)),
        st.tuples(st.just("add"), _keys(epochs), st.integers(-(2**63), 2**63 - 1)),
        st.tuples(st.just("junk"), st.binary(min_size=1, max_size=600)),
        st.tuples(st.just("idle"), st.none()),
    )


class Hostile:
    """A third party on the host: a store client of its own and raw connections."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.store: TCPStore | None = None
        self.idle: list[socket.socket] = []  # connections that never speak
        self.counts = {"set": 0, "add": 0, "junk": 0, "idle": 0, "refused": 0}

    def client(self) -> TCPStore:
        if self.store is None:
            timeout = dt.timedelta(seconds=2)
            self.store = TCPStore(
                "127.0.0.1", self.port, is_master=False, wait_for_workers=False, timeout=timeout
            )
        return self.store

    def run(self, op: tuple) -> None:
        kind, *args = op
        try:
            if kind == "set":
                self.client().set(args[0], args[1])
            elif kind == "add":
                self.client().add(args[0], args[1])
            elif kind == "junk":
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.sendall(args[0])
            elif len(self.idle) < 16:
                self.idle.append(socket.create_connection(("127.0.0.1", self.port), timeout=2))
            self.counts[kind] += 1
        except (RuntimeError, OSError, ValueError):  # the store hung up on it: reconnect
            self.counts["refused"] += 1
            self.store = None

    def close(self) -> None:
        for s in self.idle:
            s.close()


def _fire(hostile: Hostile, stop: threading.Event) -> None:
    """Hostile operations, ``BATCH`` per hypothesis run, until ``stop``."""

    @settings(
        max_examples=BATCH,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(_operations(HOSTILE_EPOCHS))
    def one(op):
        if not stop.is_set():
            hostile.run(op)

    while not stop.is_set():
        one()


class Side:
    """One rank's epochs: build the group of each (over the same store), send or receive
    one update, record the outcome and how long it took."""

    def __init__(self, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        self.rank = rank
        self.tensors = tensors
        self.specs = param_specs(tensors.items())
        self.group: SyncGroup | None = None  # holds the store across failed epochs
        self.outcomes: list[tuple[str, float]] = []

    def epoch(self, epoch: int, offers: dict) -> None:
        t0 = time.monotonic()
        memory = None
        try:
            if self.rank == 0:
                memory = self.group.new_memory()
                offers[epoch] = memory.offer  # announced before the group is built
            built = self.group.rebuild(epoch, memory)
            memory = None
            self.group = built
            outcome = self._sync(offers.get(epoch))
        except RuntimeError as exc:  # GroupFailed, or gloo's error for a broken collective
            outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            if memory is not None:
                memory.close()
        self.outcomes.append((outcome, time.monotonic() - t0))

    def _sync(self, offer) -> str:
        if self.rank == 0:
            send_weights(self.group, self.tensors, self.specs, BUCKET)
            return "sent"
        got = {}
        for bucket in receive_weights(self.group, self.specs, BUCKET, torch.device("cpu"), offer):
            got.update({n: t.clone() for n, t in bucket})
        same = set(got) == set(self.tensors)
        same = same and all(torch.equal(got[n], t) for n, t in self.tensors.items())
        return "received" if same else "WRONG WEIGHTS"


def _run_epochs(
    side: Side, epochs: Iterable[int], offers: dict, barrier: threading.Barrier
) -> None:
    for epoch in epochs:
        side.epoch(epoch, offers)
        barrier.wait()  # the buffer's role: both move to the next epoch together
        time.sleep(0.5)  # room for the traffic between rendezvous


def test_hostile_store_traffic_never_hangs_a_sync_nor_loads_wrong_weights(free_port):
    port = free_port()
    torch.manual_seed(0)
    tensors = {"w": torch.randn(64, 48), "b": torch.randn(48), "h": torch.randn(9).half()}
    sides = [Side(0, tensors), Side(1, tensors)]
    offers: dict = {}

    # Epoch 0, before anyone else is there: the run as it starts.
    joined = threading.Thread(
        target=lambda: setattr(
            sides[1], "group", join_group("127.0.0.1", port, 1, 2, "gloo", TIMEOUT_S)
        )
    )
    joined.start()
    sides[0].group = join_group("127.0.0.1", port, 0, 2, "gloo", TIMEOUT_S)
    joined.join(30)
    assert sides[1].group is not None

    hostile, stop = Hostile(port), threading.Event()
    firing = threading.Thread(target=_fire, args=(hostile, stop), daemon=True)
    barrier = threading.Barrier(2, timeout=EPOCH_BOUND_S * 2)
    under_fire = range(1, 1 + HOSTILE_EPOCHS)
    firing.start()
    try:
        threads = [
            threading.Thread(target=_run_epochs, args=(s, under_fire, offers, barrier))
            for s in sides
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HOSTILE_EPOCHS * (EPOCH_BOUND_S + 1) * 2)
        assert not any(t.is_alive() for t in threads), "an epoch never ended"
    finally:
        stop.set()
        firing.join(30)
        hostile.close()
    assert sum(hostile.counts[k] for k in ("set", "add", "junk")) > 20, hostile.counts

    # The traffic has stopped: regrouping goes on until an epoch syncs, which the first
    # one past the epochs the traffic wrote keys for does (garbage left under an epoch's
    # keys fails that epoch: the regroup moves past it).
    for epoch in range(1 + HOSTILE_EPOCHS, 3 + HOSTILE_EPOCHS + 1):
        barrier = threading.Barrier(2, timeout=EPOCH_BOUND_S * 2)
        member = threading.Thread(target=_run_epochs, args=(sides[1], [epoch], offers, barrier))
        member.start()
        _run_epochs(sides[0], [epoch], offers, barrier)
        member.join(EPOCH_BOUND_S * 2)
        if sides[1].outcomes[-1][0] == "received":
            break

    outcomes = [[o for o, _ in s.outcomes] for s in sides]
    report = f"{outcomes} {hostile.counts}"
    assert len(outcomes[0]) == len(outcomes[1]) > HOSTILE_EPOCHS, report
    for outcome, seconds in sides[0].outcomes + sides[1].outcomes:
        assert seconds < EPOCH_BOUND_S, f"{outcome} took {seconds:.1f}s: {report}"
        assert outcome in ("sent", "received") or outcome.startswith("failed: "), report
        assert "\n" not in outcome
    assert "WRONG WEIGHTS" not in outcomes[1], report
    assert outcomes[0][-1] == "sent" and outcomes[1][-1] == "received", report
    assert sides[1].group.memory is not None, "the quiet epoch did not use the memory file"
    for s in sides:
        s.group.close()
