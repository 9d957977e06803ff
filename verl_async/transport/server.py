"""The server side of the kit: one ROUTER socket, the parts every server loop shares.

The buffer (asyncio), a model process (a reward model's or a distillation teacher's: a
blocking loop that handles what it drained together, ``serve_drained``) and a
generator's scoring process (one request at a time) run different loops over the same
socket chores; ``RouterSocket`` does the chores (limits, admission, roles, decoding,
refusing what the server does not serve, replies) and leaves the handling of requests to
each server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from verl_async import protocol as P
from verl_async.auth import ServerAuth, server_auth
from verl_async.ratelimit import RateLimitedLog, short
from verl_async.transport.guard import serve_guarded
from verl_async.transport.limits import MAX_MESSAGE_BYTES, bounded

if TYPE_CHECKING:
    from verl_async.schema import RunConfig

Roles = Mapping[type, Collection[str]]
"""Request type -> the roles (verl_async/auth.py) that may send it; unlisted: any."""


@dataclass(frozen=True)
class ServerOptions:
    """Who a server admits and how large a frame it takes (verl_async/transport/limits.py).
    ``auth`` None: no authentication and no role checks (a socket only its own process
    family can reach: a private ipc path, a test)."""

    auth: ServerAuth | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES

    @classmethod
    def for_run(cls, cfg: RunConfig, run_dir: str | Path) -> ServerOptions:
        """What the run's servers (buffer, reward models) admit: its key set's clients or
        its role tokens' holders, frames up to ``buffer.max_message_mb``."""
        return cls(server_auth(cfg, run_dir), cfg.buffer.max_message_mb * 2**20)


@dataclass(frozen=True)
class Request:
    """One decoded message: who sent it (connection, role) and what it says."""

    identity: bytes
    role: str | None  # None: the socket does not authenticate
    envelope: P.Envelope
    frames: list


class RouterSocket:
    """A server's ROUTER socket: set up, drained, replied through, closed.

    Pattern: ROUTER bound on ``endpoint``; clients are DEALERs that send
    ``Envelope(request_id, body)`` and get exactly one reply with the same request_id.
    Queues and frame size bounded (``bounded``: ``QUEUE_MESSAGES`` per connection, frames
    up to ``options.max_message_bytes``); ROUTER_MANDATORY makes a reply to a vanished
    peer (or one whose queue is full) fail, which ``reply`` logs instead of losing it
    silently or blocking. Handshake: with ``options.auth`` only clients holding a role's
    credential get in (verl_async/transport/guard.py), and a request that ``roles`` gives
    to other roles than its sender's is answered ``Error("forbidden")`` here, before the
    server sees it. Shutdown: ``close`` stops the guard, closes the socket with linger 0
    and terminates ``ctx``, which this object owns (a ``zmq.Context`` or a
    ``zmq.asyncio.Context``: ``sock`` is of that kind, for the server loop to sleep on;
    receives and sends go through ``raw``, a plain shadow of the same socket, so a burst
    costs no event-loop round trip per message).

    A server that takes only a few request types names them in ``serves`` (with its own
    name, for the reply): any other is answered ``Error("unexpected")`` here.

    Peer-provoked log lines (undecodable messages, refused roles and types, lost replies)
    go through ``rejections``, rate-limited; pass the server's own log to share its window.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        options: ServerOptions,
        logger: logging.Logger,
        roles: Roles | None = None,
        rejections: RateLimitedLog | None = None,
        serves: tuple[type, ...] = (),
        name: str = "this server",
    ) -> None:
        self.ctx = ctx
        self.serves = serves
        self.name = name
        self.rejections = rejections or RateLimitedLog(logger)
        self.roles = roles or {}
        self.checks_roles = options.auth is not None
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bounded(self.sock, options.max_message_bytes)
        self.guard = serve_guarded(self.sock, options.auth, logger)
        self.sock.bind(endpoint)
        self.raw = zmq.Socket.shadow(self.sock.underlying)

    def readable(self) -> bool:
        """A message is waiting (after sends: they can consume the edge of ZMQ's
        edge-triggered fd, so a loop sleeping on it would miss what arrived)."""
        return bool(self.raw.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def drain(self, max_messages: int = 1024) -> Iterator[Request]:
        """Each message ready now, at most ``max_messages`` (one flood cannot starve the
        replies); bad and forbidden ones are answered here."""
        for _ in range(max_messages):
            try:
                parts = self.raw.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            request = self.decode(parts)
            if request is not None:
                yield request

    def role_of(self, frame: zmq.Frame) -> str | None:
        """The role libzmq stamped on the connection ``frame`` came over (None: the
        socket does not authenticate)."""
        return frame.get("User-Id") if self.checks_roles else None

    def decode(self, parts: list) -> Request | None:
        """The ``Request`` of one received message; None when it does not decode (it got
        ``Error(code="protocol")``), its sender's role may not send it (``"forbidden"``)
        or it is not of a type the server ``serves`` (``"unexpected"``), each with a
        (rate-limited) log line."""
        identity = parts[0].bytes
        try:
            env, frames = P.decode(parts[1:])
        except P.ProtocolError as exc:
            self.rejections.log("undecodable", "bad message from %s: %s", identity.hex(), str(exc))
            self.reply(identity, 0, P.Error(code="protocol", message=short(str(exc))))
            return None
        role = self.role_of(parts[0])
        allowed = self.roles.get(type(env.body))
        if self.checks_roles and allowed is not None and role not in allowed:
            name = type(env.body).__name__
            message = f"{name} comes only from the {' or the '.join(sorted(allowed))}, not a {role}"
            self.rejections.log(
                "forbidden", "refused %s from %s: %s", name, identity.hex(), message
            )
            self.reply(identity, env.request_id, P.Error(code="forbidden", message=message))
            return None
        if self.serves and not isinstance(env.body, self.serves):
            served = " or ".join(t.__name__ for t in self.serves)
            message = f"{self.name} serves {served}, not {type(env.body).__name__}"
            self.rejections.log(
                "unexpected", "unexpected message from %s: %s", identity.hex(), message
            )
            self.reply(identity, env.request_id, P.Error(code="unexpected", message=message))
            return None
        return Request(identity, role, env, frames)

    def reply(
        self, identity: bytes, request_id: int, body: P.Body, frames: P.Frames | None = None
    ) -> None:
        """Send ``body`` to ``identity`` without blocking; a peer gone meanwhile, or one
        that let its queue fill up, costs a (rate-limited) log line, never an exception."""
        parts = [identity, *P.encode(body, request_id, frames)]
        try:
            self.raw.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # gone (ROUTER_MANDATORY) or its queue is full
            self.rejections.log("lost", "reply to %s lost: %s", identity.hex(), str(exc))

    def close(self) -> None:
        """Stop the guard (before the context ends), close, terminate the context."""
        if self.guard is not None:
            self.guard.close()
        self.sock.close(linger=0)
        self.ctx.term()


POLL_MS = 200  # longest sleep of ``serve_drained`` before it looks at ``stopped`` again
LOAD_LOG_S = 30.0  # a load line (busy share, items handled) this often while serving
MAX_DRAIN = 1024  # messages taken per wake-up, so one flood cannot starve the replies


def serve_drained(
    router: RouterSocket,
    handle: Callable[[list[Request]], int],
    stopped: Callable[[], bool],
    logger: logging.Logger,
    unit: str,
) -> None:
    """A model process's loop: sleep until the socket is readable (at most ``POLL_MS``),
    drain every message queued (at most ``MAX_DRAIN``), ``handle`` them together (it
    replies to each and returns how many ``unit`` it handled), repeat until ``stopped()``;
    a load line every ``LOAD_LOG_S`` while busy. Closes ``router`` on the way out."""
    since, busy, handled = time.monotonic(), 0.0, 0
    try:
        while not stopped():
            router.rejections.flush()  # the summary of a flood, when its window ends
            if router.sock.poll(POLL_MS):
                t0 = time.monotonic()
                handled += handle(list(router.drain(MAX_DRAIN)))
                busy += time.monotonic() - t0
            if (elapsed := time.monotonic() - since) >= LOAD_LOG_S:
                if handled:
                    logger.info(
                        "busy %.0f%% of the last %.0fs: %d %s (%.1f/s busy)",
                        100 * busy / elapsed, elapsed, handled, unit, handled / max(busy, 1e-9),
                    )  # fmt: skip
                since, busy, handled = time.monotonic(), 0.0, 0
    finally:
        router.close()
