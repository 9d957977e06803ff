"""The server side of authentication: who gets in, and under which role.

``serve_guarded`` makes a ROUTER (before it binds) a CURVE server (a key set) or a PLAIN
server (the run's role tokens) under a ZAP domain with enforcement on, so a connection is
admitted only when the ZAP handler says so: with no handler running, nobody is. The
handler is pyzmq's ``ThreadAuthenticator`` (its own thread, so a handshake never waits on
the server's own loop); it answers with the client's role (verl_async/auth.py), which
libzmq then stamps on every message of that connection as ``User-Id``: a role that
cannot be forged by what the client sends. A socket monitor, read by a second thread, sees
the handshakes that fail before ZAP is asked: a client without CURVE, or one holding
another key set's server key. Each refusal is one warning in the role's log,
rate-limited (``RateLimitedLog``: a peer retrying is named once, for good); the socket
goes on serving the clients it admitted. ``Guard.close`` stops both threads; it must run
before the socket's context is terminated (the threads hold sockets of that context).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading

import zmq
from zmq.auth import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from verl_async.auth import GUEST, RoleTokens, ServerAuth, ServerKeys
from verl_async.ratelimit import RateLimitedLog

ZAP_DOMAIN = b"verl_async"
JOIN_S = 5.0  # longest wait for a guard thread to stop
REFUSALS_WINDOW_S = 60.0  # a handshake retried forever costs a line a minute at most


class _ZapHandler(ThreadAuthenticator):
    """ZAP handler: admits a CURVE client whose key is listed, or a PLAIN client with its
    role's token (or as ``guest``), and names its role."""

    def __init__(self, context: zmq.Context, auth: ServerAuth, refusals: RateLimitedLog) -> None:
        super().__init__(context)
        self.server_auth = auth
        self.refusals = refusals
        self.address = "?"  # peer of the ZAP request being answered

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The refusal line names the peer; ZAP carries its address in frame 3 only.
        self.address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def stop(self) -> None:
        """pyzmq's ``stop`` with a bounded wait for the thread."""
        if self.pipe is not None:
            self.pipe.send(b"TERMINATE")
            if self.thread is not None:
                self.thread.join(JOIN_S)
            self.pipe.close(linger=0)
            self.pipe = None
        Authenticator.stop(self)  # closes the ZAP socket

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's CURVE credentials-provider hook: ``key`` is the client's Z85 public key."""
        auth = self.server_auth
        if isinstance(auth, ServerKeys) and key in auth.roles:
            return True
        where = auth.authorized_dir if isinstance(auth, ServerKeys) else "the run's keys"
        self.refusals.log(
            "unauthorised-key",
            "refused a client at %s: its CURVE public key %s is not in %s",
            self.address,
            key.decode(errors="replace"),
            str(where),
            once=(self.address, key),  # libzmq names this peer: once, however often it retries
        )
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The role of an admitted CURVE client (its key's directory); ZAP hands the key
        over raw (32 bytes), the key set lists it in Z85."""
        return self.server_auth.roles[z85.encode(client_public_key)]

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        """A role's token (compared in constant time), or ``guest`` with anything."""
        auth = self.server_auth
        if isinstance(auth, RoleTokens):
            if username == GUEST:
                return True, b"OK"
            token = auth.tokens.get(username)
            if token is not None and hmac.compare_digest(token.encode(), password.encode()):
                return True, b"OK"
        self.refusals.log(
            "bad-token",
            "refused a client at %s: %r with a token that is not the run's (%s)",
            self.address,
            username[:32],
            str(getattr(auth, "path", "keys only")),
            once=(self.address, username),
        )
        return False, b"not a role of this run"


def _why(event: int, value: int, plain: bool) -> tuple[str, str]:
    """(kind, explanation) of a handshake that failed before ZAP was asked."""
    wanted = "a role token (PLAIN)" if plain else "CURVE"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "mechanism", f"it does not use {wanted} (a client without the run's credentials)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                "crypto",
                "its handshake does not decrypt (it holds another key set's server key)",
            )
        return f"protocol-{value:x}", f"protocol error 0x{value:x} in its handshake"
    return "mechanism", (  # the same client as above: which side hangs up first varies
        f"it hung up during the handshake ({os.strerror(value)}), as a client without {wanted} does"
    )


class _HandshakeWatch(threading.Thread):
    """Reads the server socket's monitor: logs handshakes that fail before ZAP."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, sock: zmq.Socket, refusals: RateLimitedLog, plain: bool) -> None:
        super().__init__(name="handshake-monitor", daemon=True)
        self.refusals = refusals
        self.plain = plain
        self.address = f"inproc://verl_async.monitor.{id(self)}"
        sock.monitor(self.address, self.EVENTS)
        # A plain socket on the same libzmq context (inproc needs it), even when the
        # server's own socket is an asyncio one.
        self.pipe = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self.pipe.linger = 0
        self.pipe.connect(self.address)
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.pipe.poll(500):
                    event = parse_monitor_message(self.pipe.recv_multipart())
                    kind, why = _why(event["event"], event["value"], self.plain)
                    endpoint = event["endpoint"].decode(errors="replace")
                    # libzmq does not name the peer of a handshake failing before ZAP:
                    # one line per kind of failure a window.
                    self.refusals.log(
                        kind, "refused a client on %s: %s", endpoint, why, once_a_window=True
                    )
                self.refusals.flush()
        finally:
            self.pipe.close(linger=0)


class Guard:
    """The authentication threads of one server socket (module docstring)."""

    def __init__(self, sock: zmq.Socket, auth: ServerAuth, logger: logging.Logger) -> None:
        self.sock = sock
        refusals = RateLimitedLog(logger, window_s=REFUSALS_WINDOW_S, what="refused handshakes")
        self.handler = _ZapHandler(sock.context, auth, refusals)
        self.handler.start()
        plain = isinstance(auth, RoleTokens)
        if plain:
            sock.plain_server = True
        else:
            self.handler.configure_curve_callback(
                ZAP_DOMAIN.decode(), credentials_provider=self.handler
            )
            sock.curve_secretkey = auth.secret
            sock.curve_publickey = auth.public
            sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: nobody is admitted
        self.watch = _HandshakeWatch(sock, refusals, plain)
        self.watch.start()

    def close(self) -> None:
        """Stop both threads: before the socket closes and its context is terminated."""
        self.watch.stopping.set()
        self.watch.join(JOIN_S)
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.handler.stop()


def serve_guarded(sock: zmq.Socket, auth: ServerAuth | None, logger: logging.Logger):
    """Make ``sock`` (a ROUTER, before it binds) admit only the clients ``auth`` lets in,
    each under its role, and log each refused one to ``logger``; None without ``auth``
    (no authentication: a socket nobody else can reach, such as a private ipc path)."""
    return Guard(sock, auth, logger) if auth is not None else None
