"""The client side of the kit: DEALER socket set-up and the asyncio request client.

Every client of a verl-async server (the buffer, a reward-model process) is a DEALER
that sends ``Envelope(request_id, body)`` and gets exactly one reply with that id.
``AsyncDealer`` is that client for asyncio code; its users (``AsyncBufferClient``,
``RewardModelClient``, the scoring process's ``RuleScorer``) only name their errors and
check their replies.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from verl_async import protocol as P
from verl_async.transport.limits import bounded

if TYPE_CHECKING:
    from verl_async.auth import Credentials


SEND_RETRY_S = 0.01  # how often a request with no live connection to go out on looks again


def try_send(sock: zmq.Socket, parts: list) -> bool:
    """Send ``parts`` without blocking; False when the DEALER has no live connection
    (``dealer_socket`` sets ZMQ_IMMEDIATE): the server is down or restarting, or it
    refused the handshake (or, never in practice, its queue is full:
    verl_async/transport/limits.py). The caller looks again until its request's deadline,
    so a request never waits for a server longer than its timeout, and is never queued to
    be delivered after it (a restarted server would otherwise first work through every
    request its clients gave up on while it was down, and time out the new ones)."""
    try:
        sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True


def dealer_socket(ctx: zmq.Context, endpoint: str, credentials: Credentials | None) -> zmq.Socket:
    """A DEALER of ``ctx`` set up as every client's (``bounded`` queues; presenting
    ``credentials``, a role's key or token, verl_async/auth.py; messages go only over a
    connection that is up, ZMQ_IMMEDIATE) and connected to ``endpoint``."""
    sock = ctx.socket(zmq.DEALER)
    bounded(sock)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    if credentials is not None:
        credentials.apply(sock)
    sock.connect(endpoint)
    return sock


class AsyncDealer:
    """asyncio request client: one DEALER socket, one reader task, one future per request.

    Pattern: DEALER connected to a server's ROUTER; each request carries a fresh
    request_id and the reader resolves the future waiting on that id, so many coroutines
    share the socket. HWM: ``QUEUE_MESSAGES`` (transport/limits.py). Handshake: none (ZMQ
    connects, and reconnects after the server restarts, by itself; a request made
    meanwhile waits for the connection within its own deadline, ``try_send``); it presents
    ``credentials`` (a role's key or token), and a server that refuses them never answers,
    so its requests time out. Shutdown: ``close`` cancels the reader and closes the socket
    with linger 0.

    asyncio is used only to sleep until a reply is readable; sends (never blocking: with no
    live connection, ``try_send`` looks again until the request's deadline) and the
    draining of every ready reply go through a plain shadow of the socket, zero-copy, which
    saves an event-loop round trip per message. The reader also wakes every second, so
    even a missed wake-up costs latency, never a hang; a reader that died is started
    again by the next request. A request that times out or is cancelled is
    forgotten, so its late reply is dropped and the client goes on working.

    Users name their errors: ``unavailable(waited_s)`` is raised when no reply came in
    time, ``bad_reply(exc)`` is set on every waiter when a reply does not decode (the
    servers never send such a thing).
    """

    def __init__(
        self, endpoint: str, timeout_s: float, credentials: Credentials | None = None
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = dealer_socket(self.ctx, endpoint, credentials)
        self.raw = zmq.Socket.shadow(self.sock.underlying)
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    def unavailable(self, waited_s: float) -> Exception:
        """The error of a request that got no reply within ``waited_s``."""
        return TimeoutError(f"no reply from {self.endpoint} within {waited_s:g}s")

    def bad_reply(self, exc: P.ProtocolError) -> Exception:
        """The error every waiter gets when a reply does not decode."""
        return exc

    async def request(
        self, body: P.Body, frames: P.Frames | None = None, extra_wait_s: float = 0.0
    ) -> tuple[P.Body, list]:
        """Send ``body``; return (reply body, reply frames), waiting at most ``timeout_s +
        extra_wait_s`` (then ``unavailable``)."""
        if self.reader is None or self.reader.done():
            self.reader = asyncio.create_task(self._read())
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        parts = P.encode(body, rid, frames)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
            # that lands as the reply arrives, and a SIGTERMed generator then carries on.
            async with asyncio.timeout(self.timeout_s + extra_wait_s):
                while not try_send(self.raw, parts):
                    await asyncio.sleep(SEND_RETRY_S)
                # ZMQ's file descriptor is edge-triggered and a send can consume the edge
                # of a reply that arrived meanwhile; the waiting reader would miss it.
                if self.raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._drain()
                return await fut
        except TimeoutError:
            raise self.unavailable(self.timeout_s + extra_wait_s) from None
        finally:
            self.pending.pop(rid, None)  # also on cancellation: a late reply is dropped

    async def _read(self) -> None:
        while True:
            await self.sock.poll(1000)
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                parts = self.raw.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._deliver(parts)

    def _deliver(self, parts: list) -> None:
        try:
            env, frames = P.decode(parts)
        except P.ProtocolError as exc:  # the servers never send these: fail every waiter
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(self.bad_reply(exc))
            self.pending.clear()
            return
        fut = self.pending.pop(env.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result((env.body, frames))

    def close(self) -> None:
        """Stop the reader and close the socket (idempotent; callable outside the loop)."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        if not self.sock.closed:
            self.sock.close(linger=0)
