"""The server side of the kit: one ROUTER socket, the parts every server loop shares.

The buffer (asyncio) and a reward-model process (a blocking loop that scores what it
drained together) run different loops over the same socket chores; ``RouterSocket`` does
the chores and leaves the loop, and the handling of requests, to each server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import zmq

from verl_async import protocol as P
from verl_async.auth import ServerKeys, serve_curve
from verl_async.ratelimit import RateLimitedLog, short
from verl_async.transport.client import unbounded


class RouterSocket:
    """A server's ROUTER socket: set up, drained, replied through, closed.

    Pattern: ROUTER bound on ``endpoint``; clients are DEALERs that send
    ``Envelope(request_id, body)`` and get exactly one reply with the same request_id.
    HWM 0 both ways (every request is answered once and each client bounds what it has
    outstanding); ROUTER_MANDATORY makes a reply to a vanished peer raise, which ``reply``
    logs instead of losing it silently. Handshake: none (ZMQ connects and reconnects by
    itself); with ``curve`` keys the ROUTER is a CurveZMQ server that admits only
    authorised clients (verl_async/auth.py ``serve_curve``). Shutdown: ``close`` stops the
    CurveZMQ guard, closes the socket with linger 0 and terminates ``ctx``, which this
    object owns (a ``zmq.Context`` or a ``zmq.asyncio.Context``: ``sock`` is of that kind,
    for the server loop to sleep on; receives and sends go through ``raw``, a plain shadow
    of the same socket, so a burst costs no event-loop round trip per message).

    Peer-provoked log lines (undecodable messages, lost replies) go through
    ``rejections``, rate-limited; pass the server's own log to share its window.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        curve: ServerKeys | None,
        logger: logging.Logger,
        rejections: RateLimitedLog | None = None,
    ) -> None:
        self.ctx = ctx
        self.rejections = rejections or RateLimitedLog(logger)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        unbounded(self.sock)
        self.guard = serve_curve(self.sock, curve, logger)  # None: no keys, no authentication
        self.sock.bind(endpoint)
        self.raw = zmq.Socket.shadow(self.sock.underlying)

    def readable(self) -> bool:
        """A message is waiting (after sends: they can consume the edge of ZMQ's
        edge-triggered fd, so a loop sleeping on it would miss what arrived)."""
        return bool(self.raw.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def drain(self, max_messages: int = 1024) -> Iterator[tuple[bytes, P.Envelope, list]]:
        """``(identity, envelope, frames)`` of each message ready now, at most
        ``max_messages`` (one flood cannot starve the replies); bad ones are answered here."""
        for _ in range(max_messages):
            try:
                parts = self.raw.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.decode(parts)
            if message is not None:
                yield message

    def decode(self, parts: list) -> tuple[bytes, P.Envelope, list] | None:
        """``(identity, envelope, frames)`` of one received message; None when it does not
        decode: it got ``Error(code="protocol")`` and a (rate-limited) log line."""
        identity = parts[0].bytes
        try:
            env, frames = P.decode(parts[1:])
        except P.ProtocolError as exc:
            self.rejections.log("undecodable", "bad message from %s: %s", identity.hex(), str(exc))
            self.reply(identity, 0, P.Error(code="protocol", message=short(str(exc))))
            return None
        return identity, env, frames

    def reply(
        self, identity: bytes, request_id: int, body: P.Body, frames: P.Frames | None = None
    ) -> None:
        """Send ``body`` to ``identity``; a peer gone meanwhile costs a (rate-limited) log
        line, never an exception."""
        try:
            self.raw.send_multipart([identity, *P.encode(body, request_id, frames)], copy=False)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): nothing to deliver to
            self.rejections.log("lost", "reply to %s lost: %s", identity.hex(), str(exc))

    def close(self) -> None:
        """Stop the CurveZMQ guard (before the context ends), close, terminate the context."""
        if self.guard is not None:
            self.guard.close()
        self.sock.close(linger=0)
        self.ctx.term()
