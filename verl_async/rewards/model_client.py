"""asyncio client of one reward-model process (``python -m reward_model``).

Pattern: one DEALER socket connected to the process's ROUTER, one reader task that
resolves a future per request id, so many coroutines share the socket. No handshake: ZMQ
connects by itself and reconnects after the process restarts; requests sent while it is
down wait in the socket's queue. Every call has a deadline of ``timeout_s``: on expiry it
raises ``RewardModelUnavailable`` naming the endpoint, and the late reply (if any) is
dropped by request id, so the client keeps working once the process answers again. HWM 0
(callers bound what they have outstanding), linger 0 at close. With ``curve`` keys the
socket is a CurveZMQ client (verl_async/auth.py); a server that refuses it never answers,
so calls fail with ``RewardModelUnavailable``.
"""

from __future__ import annotations

import asyncio
import itertools

import zmq
import zmq.asyncio

from verl_async import protocol as P
from verl_async.auth import CurveKeys


class RewardModelError(RuntimeError):
    """A reward-model request gave no scores."""


class RewardModelUnavailable(RewardModelError):
    """The reward-model process did not answer in time (down, restarting, or overloaded)."""


class RewardModelRejected(RewardModelError):
    """The reward-model process answered with an ``Error`` reply."""


class RewardModelClient:
    """``await score(conversations)`` -> one float per conversation (see the module doc)."""

    def __init__(self, endpoint: str, timeout_s: float, curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(endpoint)
        # Sends and drains go through a plain shadow: no event-loop round trip per message.
        self.raw = zmq.Socket.shadow(self.sock.underlying)
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    async def score(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        reply = await self._request(P.ScoreConversations(conversations=conversations))
        if isinstance(reply, P.Error):
            raise RewardModelRejected(
                f"reward model at {self.endpoint} rejected the request ({reply.code}): "
                f"{reply.message}"
            )
        if not isinstance(reply, P.Scores) or len(reply.scores) != len(conversations):
            raise RewardModelRejected(
                f"reward model at {self.endpoint} sent {type(reply).__name__} with "
                f"{len(getattr(reply, 'scores', []))} scores for {len(conversations)} conversations"
            )
        return [float(s) for s in reply.scores]

    async def _request(self, body: P.Body) -> P.Body:
        if self.reader is None or self.reader.done():
            self.reader = asyncio.create_task(self._read())
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            self.raw.send_multipart(P.encode(body, rid))
            # ZMQ's fd is edge-triggered and a send can consume the edge of a reply that
            # arrived meanwhile; the waiting reader would miss it, so look now.
            if self.raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._drain()
            async with asyncio.timeout(self.timeout_s):  # not wait_for: see transport.py
                return await fut
        except TimeoutError:
            raise RewardModelUnavailable(
                f"no reply from the reward model at {self.endpoint} within {self.timeout_s:g}s; "
                "is its process alive?"
            ) from None
        finally:
            self.pending.pop(rid, None)  # also on cancellation: a late reply is dropped

    async def _read(self) -> None:
        # Wakes at least every second, so a missed wake-up costs latency, never a hang.
        while True:
            await self.sock.poll(1000)
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                parts = self.raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(parts)

    def _deliver(self, parts: list) -> None:
        try:
            env, _ = P.decode(parts)
        except P.ProtocolError as exc:  # the server never sends these: fail every waiter
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(RewardModelRejected(f"{self.endpoint}: {exc}"))
            return
        fut = self.pending.get(env.request_id)
        if fut is not None and not fut.done():
            fut.set_result(env.body)

    def close(self) -> None:
        """Stop the reader and close the socket (idempotent; callable outside the loop)."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        if not self.sock.closed:
            self.sock.close(linger=0)
