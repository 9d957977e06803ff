"""Clients of the buffer: a blocking one (learner) and an asyncio one (generators).

Pattern: one DEALER socket per client, connected to the buffer's ROUTER. Each request
carries a fresh request_id and gets exactly one reply with that id. The asyncio client
has a single reader task that resolves per-request futures, so many coroutines share one
socket safely. Every wait has a deadline: a buffer that stops answering raises
``BufferUnavailable`` naming the endpoint instead of hanging. HWM 0 (unbounded; callers
bound what they have outstanding), linger 0 at close. With ``curve`` keys the socket is a
CurveZMQ client (verl_async/auth.py); a buffer that refuses it never answers, so the
first request fails with ``BufferUnavailable`` like a buffer that is down.
"""

from __future__ import annotations

import asyncio
import itertools

import zmq
import zmq.asyncio

from verl_async import protocol as P
from verl_async.auth import CurveKeys


class BufferUnavailable(RuntimeError):
    """The buffer did not answer in time (crashed, or overloaded)."""


class BufferRejected(RuntimeError):
    """The buffer answered with an ``Error`` reply."""


def _configure(sock: zmq.Socket, curve: CurveKeys | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        curve.apply(sock)


def _check(body: P.Body, endpoint: str) -> P.Body:
    if isinstance(body, P.Error):
        raise BufferRejected(
            f"buffer at {endpoint} rejected the request ({body.code}): {body.message}"
        )
    return body


class BufferClient:
    """Blocking client; one per thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str, timeout_s: float, curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        _configure(self.sock, curve)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)

    def request(self, body: P.Body, frames: P.Frames | None = None, extra_wait_s: float = 0.0):
        """Send ``body``; return (reply body, reply frames)."""
        return self.receive(self.send(body, frames), extra_wait_s)

    def send(self, body: P.Body, frames: P.Frames | None = None) -> int:
        """Send ``body`` without waiting; ``receive`` the reply with the returned id (the
        caller works meanwhile). One outstanding request at a time."""
        rid = next(self.ids)
        self.sock.send_multipart(P.encode(body, rid, frames), copy=False)
        return rid

    def receive(self, rid: int, extra_wait_s: float = 0.0):
        """The reply to request ``rid``: (reply body, reply frames)."""
        deadline_ms = int((self.timeout_s + extra_wait_s) * 1000)
        while True:
            if not self.sock.poll(deadline_ms):
                raise BufferUnavailable(
                    f"no reply from the buffer at {self.endpoint} within {self.timeout_s + extra_wait_s:.0f}s; "
                    "is the buffer process alive?"
                )
            env, frames_in = P.decode(self.sock.recv_multipart(copy=False))
            if env.request_id == rid:  # stale replies to abandoned requests are skipped
                return _check(env.body, self.endpoint), frames_in

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncBufferClient:
    """asyncio client: one socket, one reader task, one future per request.

    asyncio is used only to sleep until a reply is readable; sends (HWM 0: they never
    block) and the draining of every ready reply go through a plain shadow of the socket,
    which saves an event-loop round trip per message. The reader also wakes every second,
    so even a missed wake-up costs latency, never a hang.
    """

    def __init__(self, endpoint: str, timeout_s: float, curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        _configure(self.sock, curve)
        self.sock.connect(endpoint)
        self.raw = zmq.Socket.shadow(self.sock.underlying)
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

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
        except P.ProtocolError as exc:  # the buffer never sends these; fail every waiter
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(exc)
            self.pending.clear()
            return
        fut = self.pending.pop(env.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result((env.body, frames))

    async def request(
        self, body: P.Body, frames: P.Frames | None = None, extra_wait_s: float = 0.0
    ):
        if self.reader is None:
            self.reader = asyncio.create_task(self._read())
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.raw.send_multipart(P.encode(body, rid, frames), copy=False)
        # ZMQ's file descriptor is edge-triggered and a send can consume the edge of a reply
        # that arrived meanwhile; the waiting reader would miss it, so look now.
        if self.raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._drain()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
            # that lands as the reply arrives, and a SIGTERMed generator then carries on.
            async with asyncio.timeout(self.timeout_s + extra_wait_s):
                reply, frames_in = await fut
        except TimeoutError:
            self.pending.pop(rid, None)
            raise BufferUnavailable(
                f"no reply from the buffer at {self.endpoint} within {self.timeout_s + extra_wait_s:.0f}s"
            ) from None
        return _check(reply, self.endpoint), frames_in

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.sock.close(linger=0)
