"""CurveZMQ authentication of the buffer and the reward-model sockets.

Key set. ``verl-async keys DIR`` (``make_keys``) writes one server key pair, shared by the
buffer and every reward-model process, and one key pair per client name::

    DIR/server/server.key_secret             the servers' key pair (mode 0600)
    DIR/server/authorized_clients/NAME.key   public key of each client the servers accept
    DIR/clients/NAME/NAME.key_secret         client NAME's key pair (mode 0600)
    DIR/clients/NAME/server.key              the servers' public key

The machine that runs the buffer or a reward model needs ``DIR/server``; a machine whose
processes are clients (learner, generators) needs ``DIR/clients/NAME``. ``buffer.keys_dir``
names DIR on every machine and ``buffer.client_key`` the NAME its clients use. A client is
let in when its public key is in ``authorized_clients``: delete a file there (and restart
the servers) to shut a client out.

Server side (``serve_curve``). The ROUTER becomes a CURVE server under a ZAP domain with
enforcement on, so a connection is admitted only when the ZAP handler says so: with no
handler running, nobody is. The handler is pyzmq's ``ThreadAuthenticator`` (its own
thread, so a handshake never waits on the server's own loop), asked about each CURVE
client's public key. A socket monitor, read by a second thread, sees the handshakes that
fail before ZAP is asked: a client without CURVE, or one holding another key set's server
key. Each refusal is one warning in the role's log, rate-limited (``RateLimitedLog``: a
peer retrying is named once, for good); the socket goes on
serving the clients it admitted. ``CurveGuard.close`` stops both threads; it must run
before the socket's context is terminated (the threads hold sockets of that context).

Client side: ``CurveKeys.apply`` sets a socket's keys before it connects. A client that is
refused sees no error from ZeroMQ, only a request that gets no reply, so it fails with its
own timeout (``BufferUnavailable``, ``RewardModelUnavailable``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
from zmq.auth import Authenticator, create_certificates, load_certificate
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from verl_async.config_base import ConfigError
from verl_async.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from verl_async.schema import BufferConfig, RunConfig

SERVER_DIR = "server"
AUTHORIZED_DIR = "authorized_clients"
CLIENTS_DIR = "clients"
SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
ZAP_DOMAIN = b"verl_async"
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
JOIN_S = 5.0  # longest wait for a guard thread to stop
REFUSALS_WINDOW_S = 60.0  # a handshake retried forever costs a line a minute at most


# ----------------------------------------------------------------------------- key set


def make_keys(out_dir: str | Path, clients: list[str], force: bool = False) -> list[Path]:
    """Write a key set (layout in the module docstring) into ``out_dir``; return the
    secret files written. An existing key set is replaced only with ``force``."""
    out = Path(out_dir)
    bad = [n for n in clients if not CLIENT_NAME.fullmatch(n)]
    if not clients or bad or len(set(clients)) != len(clients):
        raise ValueError(
            f"client names must be distinct, non-empty and made of letters, digits, '_', '.' "
            f"and '-' (got {clients})"
        )
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"'{out}' exists and is not a directory")
    existing = [out / d for d in (SERVER_DIR, CLIENTS_DIR) if (out / d).exists()]
    if existing and not force:
        raise FileExistsError(f"'{out}' already holds a key set; pass --force to replace it")
    for path in existing:
        shutil.rmtree(path)
    server = _private_dir(out / SERVER_DIR)
    authorized = out / SERVER_DIR / AUTHORIZED_DIR
    authorized.mkdir()
    server_public, server_secret = map(Path, create_certificates(server, "server"))
    secrets = [server_secret]
    for name in clients:
        home = _private_dir(out / CLIENTS_DIR / name)
        public, secret = map(Path, create_certificates(home, name))
        public.replace(authorized / public.name)
        shutil.copyfile(server_public, home / SERVER_PUBLIC)
        secrets.append(secret)
    server_public.unlink()  # the servers need only their secret file; clients have copies
    for secret in secrets:
        secret.chmod(0o600)
    return secrets


def _private_dir(path: Path) -> Path:
    """``path`` made with mode 0700, so a secret written into it is never readable by
    others, not even before its own mode is set."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700)
    path.chmod(0o700)  # mkdir's mode is masked by the umask
    return path


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class CurveKeys:
    """What a client socket needs: its own key pair and the servers' public key (Z85)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client; call before it connects."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


@dataclass(frozen=True)
class ServerKeys:
    """What a server socket needs: its key pair and the clients it lets in (Z85 keys)."""

    public: bytes
    secret: bytes
    authorized: frozenset[bytes]
    authorized_dir: Path


def _bad(key: str, what: str) -> ConfigError:
    return ConfigError(f"bad value for 'buffer.{key}': {what}")


def _read_key(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of one key file; a missing, unreadable, malformed or (secret)
    group- or world-readable file is a ConfigError naming buffer.keys_dir."""
    if not path.is_file():
        raise _bad("keys_dir", f"'{path}' is missing; make a key set with `verl-async keys DIR`")
    if secret and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise _bad("keys_dir", f"'{path}' is readable by other users; run chmod 600 on it")
    try:
        public, secret_key = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise _bad("keys_dir", f"'{path}' is not a CurveZMQ key file ({exc})") from None
    if len(public) != 40 or (secret and (secret_key is None or len(secret_key) != 40)):
        raise _bad("keys_dir", f"'{path}' does not hold a 40-character Z85 key pair")
    return public, secret_key


def _client_names(keys_dir: str | Path) -> list[str]:
    clients = Path(keys_dir) / CLIENTS_DIR
    return sorted(p.name for p in clients.iterdir() if p.is_dir()) if clients.is_dir() else []


def client_name(keys_dir: str | Path, client_key: str = "") -> str:
    """The client identity to use: ``client_key``, or the only one ``keys_dir`` holds."""
    clients, names = Path(keys_dir) / CLIENTS_DIR, _client_names(keys_dir)
    if client_key:
        if client_key not in names:
            raise _bad("client_key", f"'{clients / client_key}' does not exist (clients: {names})")
        return client_key
    if len(names) != 1:
        found = f"holds several ({', '.join(names)})" if names else "holds none"
        raise _bad("client_key", f"'{clients}' {found}; set buffer.client_key to this machine's")
    return names[0]


def load_client_keys(keys_dir: str | Path, client_key: str = "") -> CurveKeys:
    """A client's keys from a key set (``client_name`` picks which client)."""
    home = Path(keys_dir) / CLIENTS_DIR / client_name(keys_dir, client_key)
    name = home.name
    public, secret = _read_key(home / f"{name}.key_secret", secret=True)
    server, _ = _read_key(home / SERVER_PUBLIC, secret=False)
    return CurveKeys(public=public, secret=secret, server=server)


def load_server_keys(keys_dir: str | Path) -> ServerKeys:
    """The servers' key pair and the public keys of the clients they accept."""
    server = Path(keys_dir) / SERVER_DIR
    public, secret = _read_key(server / SERVER_SECRET, secret=True)
    authorized_dir = server / AUTHORIZED_DIR
    files = sorted(authorized_dir.glob("*.key")) if authorized_dir.is_dir() else []
    if not files:
        raise _bad("keys_dir", f"'{authorized_dir}' holds no client public key (*.key)")
    authorized = frozenset(_read_key(f, secret=False)[0] for f in files)
    return ServerKeys(public, secret, authorized, authorized_dir)


def check_keys_dir(buffer: BufferConfig) -> None:
    """Config validation: ``buffer.keys_dir`` holds the server's side of a key set, a
    client's side, or both, and whichever it holds loads. With several clients and no
    ``buffer.client_key`` (the machine of the servers may keep them all), the choice is
    checked when a client starts."""
    keys_dir = Path(buffer.keys_dir)
    make = f"make a key set with `verl-async keys {keys_dir}`"
    if not keys_dir.is_dir():
        raise _bad("keys_dir", f"'{keys_dir}' is not a directory; {make}")
    has_server, names = (keys_dir / SERVER_DIR).is_dir(), _client_names(keys_dir)
    if not (has_server or names or buffer.client_key):
        raise _bad(
            "keys_dir",
            f"'{keys_dir}' holds neither '{SERVER_DIR}/' nor '{CLIENTS_DIR}/NAME/'; {make}",
        )
    if has_server:
        load_server_keys(keys_dir)
    if buffer.client_key or len(names) == 1:
        load_client_keys(keys_dir, buffer.client_key)


def client_keys(cfg: RunConfig) -> CurveKeys | None:
    """This machine's client keys for the run (None: the run has no keys)."""
    if not cfg.buffer.keys_dir:
        return None
    return load_client_keys(cfg.buffer.keys_dir, cfg.buffer.client_key)


def server_keys(cfg: RunConfig) -> ServerKeys | None:
    """The servers' keys for the run (None: the run has no keys)."""
    return load_server_keys(cfg.buffer.keys_dir) if cfg.buffer.keys_dir else None


# ----------------------------------------------------------------------------- server side


class _KeyCheck(ThreadAuthenticator):
    """ZAP handler: admits a CURVE client whose public key is authorised."""

    def __init__(self, context: zmq.Context, keys: ServerKeys, refusals: RateLimitedLog) -> None:
        super().__init__(context)
        self.keys = keys
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
        """pyzmq's credentials-provider hook: ``key`` is the client's Z85 public key."""
        if key in self.keys.authorized:
            return True
        self.refusals.log(
            "unauthorised-key",
            "refused a client at %s: its CURVE public key %s is not in %s",
            self.address,
            key.decode(errors="replace"),
            str(self.keys.authorized_dir),
            once=(self.address, key),  # libzmq names this peer: once, however often it retries
        )
        return False


def _why(event: int, value: int) -> tuple[str, str]:
    """(kind, explanation) of a handshake that failed before ZAP was asked."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "no-curve", "it does not use CURVE (a client with no keys configured)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                "crypto",
                "its handshake does not decrypt (it holds another key set's server key)",
            )
        return f"protocol-{value:x}", f"protocol error 0x{value:x} in its handshake"
    return "no-curve", (  # the same client as above: which side hangs up first varies
        f"it hung up during the handshake ({os.strerror(value)}), as a client with no keys "
        "configured does"
    )


class _HandshakeWatch(threading.Thread):
    """Reads the server socket's monitor: logs handshakes that fail before ZAP."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, sock: zmq.Socket, refusals: RateLimitedLog) -> None:
        super().__init__(name="handshake-monitor", daemon=True)
        self.refusals = refusals
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
                    kind, why = _why(event["event"], event["value"])
                    endpoint = event["endpoint"].decode(errors="replace")
                    # libzmq does not name the peer of a handshake failing before ZAP:
                    # one line per kind of failure a window.
                    self.refusals.log(
                        kind, "refused a client on %s: %s", endpoint, why, once_a_window=True
                    )
                self.refusals.flush()
        finally:
            self.pipe.close(linger=0)


class CurveGuard:
    """The authentication threads of one CURVE server socket (module docstring)."""

    def __init__(self, sock: zmq.Socket, keys: ServerKeys, logger: logging.Logger) -> None:
        self.sock = sock
        refusals = RateLimitedLog(logger, window_s=REFUSALS_WINDOW_S, what="refused handshakes")
        self.auth = _KeyCheck(sock.context, keys, refusals)
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self.auth)
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: nobody is admitted
        self.watch = _HandshakeWatch(sock, refusals)
        self.watch.start()

    def close(self) -> None:
        """Stop both threads: before the socket closes and its context is terminated."""
        self.watch.stopping.set()
        self.watch.join(JOIN_S)
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.auth.stop()


def serve_curve(
    sock: zmq.Socket, keys: ServerKeys | None, logger: logging.Logger
) -> CurveGuard | None:
    """Make ``sock`` (a ROUTER, before it binds) a CURVE server that admits only the
    authorised clients and logs each refused one to ``logger``; None without keys."""
    return CurveGuard(sock, keys, logger) if keys is not None else None
