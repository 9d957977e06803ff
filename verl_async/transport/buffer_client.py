"""Clients of the buffer: a blocking one (learner) and an asyncio one (generators).

Pattern: one DEALER socket per client, connected to the buffer's ROUTER. Each request
carries a fresh request_id and gets exactly one reply with that id. The asyncio client
has a single reader task that resolves per-request futures, so many coroutines share one
socket safely. Every wait has a deadline: a buffer that stops answering raises
``BufferUnavailable`` naming the endpoint instead of hanging. Bounded queues
(transport/limits.py), linger 0 at close. The socket presents ``credentials``, its role's
key or token (verl_async/auth.py); a buffer that refuses them never answers, so the
first request fails with ``BufferUnavailable`` like a buffer that is down.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import zmq

from verl_async import protocol as P
from verl_async.transport.client import AsyncDealer, dealer_socket, try_send

if TYPE_CHECKING:
    from verl_async.auth import Credentials


class BufferUnavailable(RuntimeError):
    """The buffer did not answer in time (crashed, or overloaded)."""


class BufferRejected(RuntimeError):
    """The buffer answered with an ``Error`` reply."""


def _check(body: P.Body, endpoint: str) -> P.Body:
    if isinstance(body, P.Error):
        raise BufferRejected(
            f"buffer at {endpoint} rejected the request ({body.code}): {body.message}"
        )
    return body


class BufferClient:
    """Blocking client (learner); one per thread (ZMQ sockets are not thread-safe).

    Pattern: DEALER connected to the buffer's ROUTER (``dealer_socket``: bounded queues,
    presenting ``credentials``); one outstanding request at a time, its reply matched by
    request id. Handshake: none (ZMQ connects by itself). Shutdown: ``close``, linger 0.
    """

    def __init__(
        self, endpoint: str, timeout_s: float, credentials: Credentials | None = None
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.ctx = zmq.Context.instance()
        self.sock = dealer_socket(self.ctx, endpoint, credentials)
        self.ids = itertools.count(1)

    def request(self, body: P.Body, frames: P.Frames | None = None, extra_wait_s: float = 0.0):
        """Send ``body``; return (reply body, reply frames)."""
        return self.receive(self.send(body, frames), extra_wait_s)

    def send(self, body: P.Body, frames: P.Frames | None = None) -> int:
        """Send ``body`` without waiting for the reply; ``receive`` it with the returned id
        (the caller works meanwhile). One outstanding request at a time. With no live
        connection (``try_send``) it waits for one for at most ``timeout_s``."""
        rid = next(self.ids)
        parts = P.encode(body, rid, frames)
        deadline = time.monotonic() + self.timeout_s
        while not try_send(self.sock, parts):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise self.unavailable(self.timeout_s)
            self.sock.poll(remaining_ms, zmq.POLLOUT)  # until a connection is up
        return rid

    def unavailable(self, waited_s: float) -> BufferUnavailable:
        return BufferUnavailable(
            f"no reply from the buffer at {self.endpoint} within {waited_s:.0f}s; "
            "is the buffer process alive?"
        )

    def receive(self, rid: int, extra_wait_s: float = 0.0):
        """The reply to request ``rid``: (reply body, reply frames)."""
        deadline_ms = int((self.timeout_s + extra_wait_s) * 1000)
        while True:
            if not self.sock.poll(deadline_ms):
                raise self.unavailable(self.timeout_s + extra_wait_s)
            env, frames_in = P.decode(self.sock.recv_multipart(copy=False))
            if env.request_id == rid:  # stale replies to abandoned requests are skipped
                return _check(env.body, self.endpoint), frames_in

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncBufferClient(AsyncDealer):
    """asyncio client (generators): ``AsyncDealer`` (its docstring: socket pattern, HWM,
    handshake, shutdown) raising ``BufferUnavailable`` / ``BufferRejected``."""

    def unavailable(self, waited_s: float) -> BufferUnavailable:
        return BufferUnavailable(
            f"no reply from the buffer at {self.endpoint} within {waited_s:.0f}s"
        )

    async def request(
        self, body: P.Body, frames: P.Frames | None = None, extra_wait_s: float = 0.0
    ) -> tuple[P.Body, list]:
        """Send ``body``; return (reply body, reply frames)."""
        reply, frames_in = await super().request(body, frames, extra_wait_s)
        return _check(reply, self.endpoint), frames_in
