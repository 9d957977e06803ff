"""The transport kit without the servers: ``AsyncDealer`` against a bare ROUTER stand-in,
and ``RouterSocket``'s decode-or-``Error`` and lost-reply paths."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
import zmq
import zmq.asyncio

from verl_async import protocol as P
from verl_async.rewards.model_client import RewardModelClient, RewardModelRejected
from verl_async.transport import AsyncBufferClient, BufferClient, BufferUnavailable
from verl_async.transport.server import RouterSocket, ServerOptions

ENDPOINTS = iter(range(10**6))


def _router() -> tuple[zmq.Socket, str]:
    endpoint = f"inproc://transport-{next(ENDPOINTS)}"
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)  # the clients' context (inproc)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock, endpoint


async def _recv(server: zmq.Socket) -> tuple[bytes, P.Envelope]:
    identity, *parts = await asyncio.wait_for(server.recv_multipart(), 5)
    return identity, P.decode(parts)[0]


async def _answer(server: zmq.Socket, body: P.Body) -> None:
    """Receive the next request and answer it with ``body``."""
    identity, env = await _recv(server)
    await server.send_multipart([identity, *P.encode(body, env.request_id)])


def _run(client_cls, timeout_s: float, scenario) -> None:
    """``await scenario(server, endpoint, client)`` with a ROUTER stand-in and a client."""

    async def go() -> None:
        server, endpoint = _router()
        client = client_cls(endpoint, timeout_s=timeout_s)
        try:
            await scenario(server, endpoint, client)
        finally:
            client.close()
            server.close()

    asyncio.run(go())


def test_a_cancelled_request_is_forgotten_and_its_late_reply_dropped():
    async def scenario(server, endpoint, client) -> None:
        first = asyncio.create_task(client.request(P.GetStats()))
        identity, env = await _recv(server)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert client.pending == {}
        late = [identity, *P.encode(P.Ack(), env.request_id)]
        await server.send_multipart(late)  # dropped: nobody waits for it
        second = asyncio.create_task(client.request(P.GetStats()))
        await _answer(server, P.Shutdown())
        assert isinstance((await second)[0], P.Shutdown)

    _run(AsyncBufferClient, 5, scenario)


def test_a_timeout_names_the_endpoint_and_a_dead_reader_is_started_again():
    async def scenario(server, endpoint, client) -> None:
        with pytest.raises(BufferUnavailable, match=f"buffer at {endpoint} within 0s"):
            await client.request(P.GetStats())
        await _recv(server)  # the request that timed out: never answered
        client.reader.cancel()  # a reader that died
        await asyncio.sleep(0)
        task = asyncio.create_task(client.request(P.GetStats(), extra_wait_s=5))
        await _answer(server, P.Ack())
        assert isinstance((await task)[0], P.Ack)

    _run(AsyncBufferClient, 0.2, scenario)


def test_a_reply_that_does_not_decode_fails_every_waiter_with_the_users_error():
    async def scenario(server, endpoint, client) -> None:
        tasks = [asyncio.create_task(client.score([[]])) for _ in range(2)]
        identity, _ = await _recv(server)
        await _recv(server)
        await server.send_multipart([identity, b"not msgpack"])
        for task in tasks:
            with pytest.raises(RewardModelRejected, match=f"^{endpoint}: "):
                await task
        assert client.pending == {}

    _run(RewardModelClient, 5, scenario)


def _curve_server() -> tuple[zmq.Socket, str]:
    """A CurveZMQ ROUTER on loopback: a client without keys fails its handshake."""
    public, secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_server, sock.curve_publickey, sock.curve_secretkey = True, public, secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def test_a_client_refused_by_the_handshake_times_out_instead_of_blocking_in_send():
    """Once the handshake has failed the DEALER has no peer to queue for, and a blocking
    send would wait forever: each client's request must still end at its deadline."""
    server, endpoint = _curve_server()
    try:
        client = BufferClient(endpoint, timeout_s=0.3)
        try:
            for _ in range(4):  # the first sends queue; the later ones find no peer
                t0 = time.monotonic()
                with pytest.raises(BufferUnavailable, match=endpoint):
                    client.request(P.GetStats())
                assert time.monotonic() - t0 < 5
        finally:
            client.close()

        async def go() -> None:
            client = AsyncBufferClient(endpoint, timeout_s=0.3)
            try:
                for _ in range(4):
                    with pytest.raises(BufferUnavailable, match=endpoint):
                        await asyncio.wait_for(client.request(P.GetStats()), 5)
            finally:
                client.close()

        asyncio.run(go())
    finally:
        server.close()


def test_a_request_that_timed_out_while_the_server_was_down_is_never_delivered():
    """A restarted server gets only the requests made since it came back: one its client
    gave up on while it was down would cost it work nobody waits for (a reward model
    that starts again would score a backlog of stale requests and time out the new)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    client = BufferClient(endpoint, timeout_s=0.3)
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    try:
        with pytest.raises(BufferUnavailable):
            client.request(P.GetStats())  # nobody listens yet
        server.bind(endpoint)
        client.timeout_s = 10.0
        rid = client.send(P.GetStats())  # waits for the connection, then goes out
        assert server.poll(10_000)
        identity, *parts = server.recv_multipart()
        assert P.decode(parts)[0].request_id == rid  # the new request, not the stale one
        server.send_multipart([identity, *P.encode(P.Ack(), rid)])
        assert isinstance(client.receive(rid)[0], P.Ack)
        assert not server.poll(300)  # and nothing else arrived
    finally:
        client.close()
        server.close()


def test_router_answers_what_does_not_decode_and_logs_a_lost_reply(caplog):
    endpoint = f"inproc://transport-{next(ENDPOINTS)}"
    router = RouterSocket(
        zmq.Context(), endpoint, ServerOptions(), logging.getLogger("test.transport")
    )
    client = router.ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="test.transport"):
            client.send_multipart([b"garbage"])
            client.send_multipart(P.encode(P.GetStats(), 9))
            assert router.sock.poll(5000)
            got = []
            while len(got) < 1:
                got += list(router.drain())
            assert [(r.envelope.request_id, type(r.envelope.body)) for r in got] == [
                (9, P.GetStats)
            ]
            assert client.poll(5000)
            env, _ = P.decode(client.recv_multipart())
            assert (env.request_id, env.body.code) == (0, "protocol")
            router.reply(b"nobody", 1, P.Ack())  # a peer gone: a log line, no exception
        messages = [r.getMessage() for r in caplog.records]
        assert messages[0].startswith("bad message from ")
        assert messages[1].startswith(f"reply to {b'nobody'.hex()} lost: ")
    finally:
        client.close()
        router.close()


def test_router_answers_types_its_server_does_not_serve(caplog):
    """``serves``: another request type is answered ``Error("unexpected")`` naming the
    server and what it serves, with the request's id; the served type reaches the loop."""
    endpoint = f"inproc://transport-{next(ENDPOINTS)}"
    router = RouterSocket(
        zmq.Context(),
        endpoint,
        ServerOptions(),
        logging.getLogger("test.transport"),
        serves=(P.ScoreRules, P.GetStats),
        name="the test server",
    )
    client = router.ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="test.transport"):
            client.send_multipart(P.encode(P.Ack(), 5))
            client.send_multipart(P.encode(P.GetStats(), 6))
            got = []
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                router.sock.poll(100)
                got += list(router.drain())
            assert [(r.envelope.request_id, type(r.envelope.body)) for r in got] == [
                (6, P.GetStats)
            ]
            assert client.poll(5000)
            env, _ = P.decode(client.recv_multipart())
        assert env.request_id == 5 and env.body == P.Error(
            code="unexpected", message="the test server serves ScoreRules or GetStats, not Ack"
        )
        assert [r.getMessage() for r in caplog.records] == [
            f"unexpected message from {got[0].identity.hex()}: {env.body.message}"
        ]
    finally:
        client.close()
        router.close()
