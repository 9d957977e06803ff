"""Hostile input on the reward sockets: the real clients never notice.

A real reward-model process (``python -m reward_model``, the tiny model of
test_reward_model_server.py) and a real scoring process (``verl_async.rewards.worker``
under its ``RuleScorer``) each serve a real client that scores requests back to back in a
thread of its own, while a fuzzer on a DEALER of its own (holding the run's generator
token: every role check passes for it) fires hypothesis-generated messages at the same
socket: random bytes; envelopes cut short, with bytes after them or of another protocol
version; other messages' types (replies sent as requests, the buffer's requests); the
served type with fields of the wrong type (NaN, a negative number or null where a
string or a list belongs); absurd values in the right types (thousands of items, empty
conversations, messages without a role, source indices out of range, request ids
anywhere in 0..2**64-1); and frames over the server's limit (1 MiB here).

The verdict counts, it never times: the fuzzer fires ``QUOTA`` messages, and after every
``LEGIT_EVERY`` of them waits until the real client has had one more request answered
(the client never runs more than ``AHEAD`` requests in front). Every legitimate reply is
the right one; every hostile message gets an ``Error`` with its own request id (0 when it
does not decode; unknown
source indices: a ``Scores`` whose every such item carries its error) or, over the limit,
costs the fuzzer its connection and gets nothing; the server is the process that was
started (never restarted); its resident memory at the end is within ``MEMORY_SLACK`` of
what it was after the first fifth of the quota. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from benchmarks.tiny_reward_model import build_tiny_reward_model
from verl_async import protocol as P
from verl_async.auth import GENERATOR, load_role_token
from verl_async.reward_config import ExactReward, FormatReward
from verl_async.rewards.model_client import RewardModelClient
from verl_async.rewards.scorer import RuleScorer

from ..unit.test_buffer_validation import broken_envelopes, replies_as_requests, wrong_requests
from .test_reward_model_server import BATCH, CONVS, MAX_LEN, START_S, start, stop, write_run_dir

QUOTA = 300  # hostile messages per server
LEGIT_EVERY = 10  # hostile messages per legitimate request answered (at least)
AHEAD = 3  # legitimate requests the real client may run in front of that pace
BATCH_EXAMPLES = 50  # messages per hypothesis run
LIMIT_MB = 1
LIMIT = LIMIT_MB * 2**20  # the servers' frame limit here
WAIT_S = 60.0  # the longest any single wait may take, on a loaded machine
MEMORY_SLACK = 48 * 2**20  # resident growth allowed from a fifth of the quota to its end
REQUEST_ID = st.integers(0, 2**64 - 1)
SOURCES = [ExactReward(name="exact"), FormatReward(name="digit", pattern="[0-9]+")]


def _head(body: object, rid: int) -> bytes:
    """An envelope of the current protocol version around ``body`` (a Struct, or plain
    msgpack-able data standing for one)."""
    return msgspec.msgpack.encode([P.PROTOCOL_VERSION, rid, body])


# ----------------------------------------------------------------------------- messages
# Each strategy draws (kind, the request id its reply must carry, frames). A message
# that does not decode is answered with request id 0 (its own is never read).


def _garbage() -> st.SearchStrategy:
    frames = st.lists(st.binary(max_size=200), min_size=1, max_size=3)
    return st.builds(lambda parts: ("garbage", 0, parts), frames)


def _broken() -> st.SearchStrategy:
    return st.builds(lambda parts: ("broken", 0, parts), broken_envelopes())


def _other_types(served: type) -> st.SearchStrategy:
    bodies = st.one_of(
        replies_as_requests(),
        wrong_requests(),
        st.builds(P.ScoreRules, items=st.just([])),
        st.builds(P.ScoreConversations, conversations=st.just([])),
    ).filter(lambda body: not isinstance(body, served))
    return st.builds(lambda body, rid: ("type", rid, [_head(body, rid)]), bodies, REQUEST_ID)


BAD_VALUES = st.sampled_from([math.nan, -1, -(2**63), None, 1.5, True, {"x": 1}])


def _bad_fields(served: type) -> st.SearchStrategy:
    """The served type with a field of the wrong type: never decodes."""
    if served is P.ScoreConversations:
        bodies = st.one_of(
            st.builds(lambda v: {"type": "ScoreConversations", "conversations": v}, BAD_VALUES),
            st.builds(
                lambda v: {"type": "ScoreConversations", "conversations": [[{"role": v}]]},
                BAD_VALUES,
            ),
            st.just({"type": "ScoreConversations"}),
            st.just({"type": "ScoreConversations", "conversations": [], "extra": 1}),
        )
    else:
        item = {"source": 0, "prompt": "q", "response": "r", "ground_truth": "g"}
        bodies = st.one_of(
            st.builds(lambda v: {"type": "ScoreRules", "items": v}, BAD_VALUES),
            st.builds(
                lambda key, v: {"type": "ScoreRules", "items": [{**item, key: v}]},
                st.sampled_from(sorted(item)),
                BAD_VALUES.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)),
            ),
            st.just({"type": "ScoreRules", "items": [{"source": 0}]}),
        )
    # It does not decode, so its request id is not read: the reply carries 0.
    return st.builds(lambda body, rid: ("field", 0, [_head(body, rid)]), bodies, REQUEST_ID)


def _absurd(served: type) -> st.SearchStrategy:
    """The served type, well-typed, with values no real client sends."""
    count = st.integers(1, 20_000)
    if served is P.ScoreConversations:
        hole = st.sampled_from([[], [{"role": "user"}], [{"content": "9"}], [{}]])
        bodies = st.builds(
            lambda n, bad, at: P.ScoreConversations(
                conversations=[*CONVS[:at], *[bad] * n, *CONVS[at:]]
            ),
            count,
            hole,
            st.integers(0, len(CONVS)),
        )
    else:
        wrong = st.sampled_from([-1, -(2**63), len(SOURCES), 2**63 - 1])
        bodies = st.builds(
            lambda n, source: P.ScoreRules(
                items=[P.ScoreItem(source=source, prompt="q", response="1", ground_truth="1")] * n
            ),
            st.integers(1, 5_000),
            wrong,
        )
    return st.builds(lambda body, rid: ("absurd", rid, [_head(body, rid)]), bodies, REQUEST_ID)


def _oversize(served: type) -> st.SearchStrategy:
    """A frame one byte or more over the limit: a tensor frame after a valid request, or
    an envelope that is itself too large."""
    valid = (
        P.ScoreConversations(conversations=CONVS[:1])
        if served is P.ScoreConversations
        else P.ScoreRules(items=[P.ScoreItem(source=0, prompt="q", response="1", ground_truth="1")])
    )

    def build(extra: int, whole: bool, rid: int):
        if whole:
            big = P.ScoreConversations(conversations=[[{"role": "user", "content": "9" * LIMIT}]])
            return ("oversize", rid, [_head(big, rid)[: LIMIT + extra]])
        return ("oversize", rid, [_head(valid, rid), bytes(LIMIT + extra)])

    return st.builds(build, st.integers(1, 4096), st.booleans(), REQUEST_ID)


def hostile(served: type) -> st.SearchStrategy:
    return st.one_of(
        _garbage(),
        _broken(),
        _other_types(served),
        _bad_fields(served),
        _absurd(served),
        _oversize(served),
    )


KINDS = ("garbage", "broken", "type", "field", "absurd", "oversize")
CODES = {  # kind -> the Error codes it may get
    "garbage": {"protocol"},
    "broken": {"protocol"},
    "type": {"unexpected"},
    "field": {"protocol"},
    "absurd": {"rejected"},
}


# ----------------------------------------------------------------------------- the parties


class RealClient(threading.Thread):
    """The legitimate client: ``ask(client, k)`` for k = 0, 1, ... on an event loop of its
    own, each checked by ``ask`` itself; never more than ``AHEAD`` requests ahead of the
    fuzzer's pace."""

    def __init__(self, make: Callable[[], Awaitable], ask: Callable) -> None:
        super().__init__(name="real-client", daemon=True)
        self.make, self.ask = make, ask
        self.client = None
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.progress = threading.Condition()
        self.answered, self.allowed = 0, AHEAD
        self.failures: list[str] = []

    def run(self) -> None:
        asyncio.run(self.main())

    async def main(self) -> None:
        try:
            self.client = await self.make()
            self.ready.set()
            k = 0
            while not self.stopping.is_set():
                with self.progress:  # the pace: waiting here costs the loop nothing it needs
                    self.progress.wait_for(
                        lambda: self.answered < self.allowed or self.stopping.is_set(), 1.0
                    )
                    if self.answered >= self.allowed:
                        continue
                try:
                    await self.ask(self.client, k)
                except Exception as exc:  # the verdict reads these
                    self.failures.append(f"request {k}: {exc!r}")
                with self.progress:
                    self.answered += 1
                    self.progress.notify_all()
                k += 1
        finally:
            self.ready.set()
            if self.client is not None:
                self.client.close()

    def keep_pace(self, sent: int) -> None:
        """Let the client run ``AHEAD`` in front of ``sent // LEGIT_EVERY`` and wait
        until it has had that many answered."""
        want = sent // LEGIT_EVERY
        with self.progress:
            self.allowed = want + AHEAD
            self.progress.notify_all()
            assert self.progress.wait_for(lambda: self.answered >= want, WAIT_S), (
                f"the real client had {self.answered} requests answered, not {want}"
            )

    def finish(self) -> None:
        self.stopping.set()
        with self.progress:
            self.progress.notify_all()
        self.join(WAIT_S)
        assert not self.is_alive(), "the real client did not stop"


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Fuzzer:
    """One DEALER, one hostile message out, its one reply in (or, over the limit, the
    connection lost): each wait with a deadline. A fresh socket after each lost one."""

    def __init__(self, endpoint: str, served: type, pid: int, credentials=None) -> None:
        self.ctx = zmq.Context()
        self.endpoint, self.served, self.pid = endpoint, served, pid
        self.credentials = credentials
        self.sent = 0
        self.kinds: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.rss: list[int] = []
        self.connect()

    def connect(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.credentials is not None:
            self.credentials.apply(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.endpoint)

    def disconnect(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def exchange(self, kind: str, rid: int, parts: list[bytes], real: RealClient) -> None:
        self.sock.send_multipart(parts)
        self.sent += 1
        self.kinds[kind] += 1
        if kind == "oversize":
            assert self.monitor.poll(int(WAIT_S * 1000)), "a frame over the limit was taken"
            assert recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert not self.sock.poll(0), "a frame over the limit got a reply"
            self.disconnect()
            self.connect()
        else:
            assert self.sock.poll(int(WAIT_S * 1000)), f"no reply to {kind} {parts[0][:40]!r}"
            env, _ = P.decode(self.sock.recv_multipart())
            self.check(kind, rid, env.request_id, env.body)
        if self.sent == QUOTA // 5:
            self.rss.append(resident_bytes(self.pid))
        real.keep_pace(self.sent)

    def check(self, kind: str, rid: int, got_rid: int, body: P.Body) -> None:
        assert got_rid == rid, (kind, rid, got_rid)
        if kind == "absurd" and self.served is P.ScoreRules:  # each item names its error
            assert isinstance(body, P.Scores) and len(body.scores) == len(body.errors), body
            assert all("out of range" in e for e in body.errors), body.errors[:3]
            self.codes["item errors"] += 1
            return
        assert isinstance(body, P.Error), f"{kind}: {body!r:.200} accepted"
        assert body.code in CODES[kind], (kind, body)
        assert len(body.message) < 2500
        self.codes[body.code] += 1

    def fire(self, real: RealClient) -> None:
        @settings(
            max_examples=BATCH_EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(message=hostile(self.served))
        def one(message):
            if self.sent < QUOTA:
                self.exchange(*message, real)

        while self.sent < QUOTA:
            one()
        self.rss.append(resident_bytes(self.pid))

    def close(self) -> None:
        self.disconnect()
        self.ctx.term()


def _verdict(fuzzer: Fuzzer, real: RealClient) -> None:
    print(
        f"sent {fuzzer.sent}: {dict(fuzzer.kinds)}; replies {dict(fuzzer.codes)}; "
        f"real requests answered {real.answered}; resident {[r >> 20 for r in fuzzer.rss]} MiB"
    )
    assert not real.failures, real.failures[:5]
    assert real.answered >= QUOTA // LEGIT_EVERY
    assert set(fuzzer.kinds) == set(KINDS), fuzzer.kinds
    assert fuzzer.rss[1] - fuzzer.rss[0] < MEMORY_SLACK, fuzzer.rss


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def test_reward_model_process_under_hostile_input_serves_its_real_client(
    tmp_path, free_port, rm_path
):
    from reward_model.scoring import load_reward_model, score_conversations

    model, tokenizer = load_reward_model(str(rm_path), "cpu")
    asks = [CONVS[0:3], CONVS[3:4], CONVS[4:7]]
    expected = [score_conversations(model, tokenizer, a, BATCH, MAX_LEN) for a in asks]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    write_run_dir(tmp_path, rm_path, endpoint, f"buffer.max_message_mb={LIMIT_MB}")
    credentials = load_role_token(tmp_path, GENERATOR)
    proc = start(tmp_path)

    async def make() -> RewardModelClient:
        client = RewardModelClient(endpoint, START_S, credentials)
        await client.score(CONVS[:1])  # the process is up: imports and model loaded
        client.timeout_s = WAIT_S
        return client

    async def ask(client: RewardModelClient, k: int) -> None:
        got = await client.score(asks[k % len(asks)])
        assert got == pytest.approx(expected[k % len(asks)], abs=1e-4), (k, got)

    real = RealClient(make, ask)
    fuzzer = None
    try:
        real.start()
        assert real.ready.wait(START_S + 10) and real.client is not None, real.failures
        fuzzer = Fuzzer(endpoint, P.ScoreConversations, proc.pid, credentials)
        fuzzer.fire(real)
        real.finish()
        assert proc.poll() is None, "the reward-model process died"
        _verdict(fuzzer, real)
    finally:
        real.stopping.set()
        real.join(WAIT_S)
        if fuzzer is not None:
            fuzzer.close()
        rc = stop(proc)
    assert rc == 0
    log = (tmp_path / "reward_model.log").read_text()
    assert "Traceback" not in log, log[-2000:]


def test_scoring_process_under_hostile_input_serves_its_real_client(tmp_path):
    holder: dict[str, RuleScorer] = {}
    items = [
        P.ScoreItem(source=s, prompt="q", response=r, ground_truth="1")
        for s in range(len(SOURCES))
        for r in ("1", "x", "12")
    ]
    want = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]

    async def make() -> RuleScorer:
        scorer = RuleScorer(tmp_path, SOURCES, WAIT_S, max_message_bytes=LIMIT)
        holder["scorer"] = scorer
        assert (await scorer.score(items[:1])).errors == [""]  # the process is up
        return scorer

    async def ask(scorer: RuleScorer, k: int) -> None:
        got = await scorer.score(items[k % 3 :])
        assert got.scores == want[k % 3 :] and not any(got.errors), (k, got)

    real = RealClient(make, ask)
    fuzzer = None
    try:
        real.start()
        assert real.ready.wait(WAIT_S) and real.client is not None, real.failures
        scorer = holder["scorer"]
        fuzzer = Fuzzer(scorer.client.endpoint, P.ScoreRules, scorer.proc.pid)
        fuzzer.fire(real)
        pid, starts = scorer.proc.pid, scorer.starts
        real.finish()
        _verdict(fuzzer, real)
    finally:
        real.stopping.set()
        real.join(WAIT_S)  # its loop's end closes the scorer: the process is killed
        if fuzzer is not None:
            fuzzer.close()
    assert starts == 1 and pid == fuzzer.pid, "the scoring process was restarted"
