"""Parked long polls (buffer/polls.py): bounded in all, expired without a scan, and left
alone by messages that cannot answer them."""

from __future__ import annotations

import asyncio
import time

import pytest

from buffer.evaluation import EvalRounds
from buffer.ledger import PromptLedger
from buffer.polls import MAX_PARKED_PER_CLIENT, Parked, ParkedPolls
from buffer.server import BufferServer
from verl_async import protocol as P
from verl_async.data import PromptRecord
from verl_async.staleness import Admission
from verl_async.transport.server import Request


def _server(max_parked: int, name: str) -> BufferServer:
    prompts = [PromptRecord(f"p{i}", str(i), prompt_ids=(1, 2)) for i in range(16)]
    ledger = PromptLedger(prompts, Admission(2, 1), 4, seed=0)
    server = BufferServer(
        ledger, 1, f"inproc://polls-{name}", evals=EvalRounds([]), max_parked=max_parked
    )
    server.replies = []
    server.router.reply = lambda identity, rid, body, frames=None: server.replies.append(
        (identity, rid, body)
    )
    return server


def _send(server: BufferServer, identity: bytes, rid: int, body: P.Body) -> None:
    server._dispatch(Request(identity, None, P.Envelope(P.PROTOCOL_VERSION, rid, body), []))
    server._serve_parked()


def _poll(wait_s: float = 300.0) -> P.PollVersion:
    return P.PollVersion(generator_id=0, loaded_version=0, wait_s=wait_s)


def _connection(i: int) -> bytes:
    return i.to_bytes(4, "big")


@pytest.fixture
def bounded():
    server = _server(max_parked=64, name="bounded")
    yield server
    server.router.close()


def test_many_connections_cannot_park_more_than_the_global_bound(bounded):
    """The per-connection bound alone let any number of connections park 16 each."""
    server = bounded
    for i in range(64):
        _send(server, _connection(i // MAX_PARKED_PER_CLIENT), i, _poll())
    assert len(server.parked) == 64 and server.replies == []
    _send(server, b"one more", 99, _poll())
    [(identity, rid, body)] = server.replies
    assert (identity, rid) == (b"one more", 99) and isinstance(body, P.Error)
    assert body.message == (
        "64 PollVersion long polls are waiting already (the buffer's bound); ask again later"
    )
    # The learner's batch polls have a bound of their own: generators cannot crowd them out.
    batch = P.GetBatch(step=0, rank=0, world_size=1, learner_version=0, wait_s=300.0)
    _send(server, b"learner", 100, batch)
    assert len(server.replies) == 1 and len(server.parked) == 65


def test_messages_that_cannot_answer_version_polls_do_not_look_at_them(bounded, monkeypatch):
    server = bounded
    for i in range(48):
        _send(server, _connection(i // MAX_PARKED_PER_CLIENT), i, _poll())
    looked = []
    real = server._try_answer
    monkeypatch.setattr(server, "_try_answer", lambda body: looked.append(body) or real(body))
    for i in range(10):
        _send(server, b"stats", i, P.GetStats())
    assert looked == [] and len(server.replies) == 10
    update = P.WeightUpdate(version=1, params=[], bucket_bytes=1)
    _send(server, b"learner", 1, P.AnnounceWeights(update=update))
    assert len(looked) == 48 and len(server.parked) == 0  # all answered at the announcement
    assert {type(body) for _, _, body in server.replies[11:]} == {P.VersionStatus}


def test_thousands_of_polls_expire_without_a_scan_per_poll():
    """8000 polls whose deadline passes together: the old expiry compared every expired
    poll with every parked one (about 7-10 s here for 8000); one heap pop each is a
    fraction of a second."""
    server = _server(max_parked=8000, name="expiry")
    try:
        for i in range(8000):
            _send(server, _connection(i // MAX_PARKED_PER_CLIENT), i, _poll(wait_s=0.2))
        assert len(server.parked) == 8000

        async def expire() -> float:
            await asyncio.sleep(0.25)
            t0 = time.perf_counter()
            ticker = asyncio.create_task(server._tick())
            while len(server.parked):
                await asyncio.sleep(0.001)
            ticker.cancel()
            return time.perf_counter() - t0

        elapsed = asyncio.run(expire())
        assert elapsed < 2.0, elapsed
        assert len(server.replies) == 8000
        assert {type(body) for _, _, body in server.replies} == {P.VersionStatus}
    finally:
        server.router.close()


def test_the_heap_returns_exactly_the_due_polls_and_forgets_answered_ones():
    polls = ParkedPolls(max_per_client=4, max_total=100)
    for i, deadline in enumerate([5.0, 1.0, 3.0, 2.0]):
        polls.add(Parked(_connection(i), i, _poll(), deadline))
    answered = [n for n, p in polls.version_polls() if p.request_id == 2]
    polls.take(answered[0])  # the poll due at 3.0 was answered early
    assert [p.request_id for p in polls.expired(3.5)] == [1, 3]
    assert len(polls) == 1 and dict(polls.per_client) == {_connection(0): 1}
    assert polls.expired(4.9) == [] and [p.request_id for p in polls.expired(5.0)] == [0]
    assert len(polls) == 0 and not polls.per_client
