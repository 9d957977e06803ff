"""Who may talk to the servers: roles, and the credentials that prove them.

Roles. Every client of the buffer and of the reward-model processes plays one role,
``learner`` or ``generator``, and proves it when it connects. The server's ZAP handler
(verl_async/transport/guard.py) admits a connection only with a valid credential and
stamps every message from it with its role (ZeroMQ's ``User-Id``), so a server knows who
sent each message and refuses a request its list gives to the other role
(``RouterSocket``'s ``roles``; the buffer's list is in buffer/server.py). A third role,
``guest``, needs no secret and exists only without keys (on loopback): it may ask for the
run's description and counters (``GetRun``, ``GetStats``), which is how a role started on
its own (``verl-async generator --buffer ADDR``) finds the run directory holding its token.

Two ways to prove a role:

- **Key set** (``buffer.keys_dir``, required off loopback): CurveZMQ, so every frame is
  also encrypted. ``verl-async keys DIR`` (``make_keys``) writes one server key pair,
  shared by the buffer and every reward-model process, and one key pair per client name
  and role::

      DIR/server/server.key_secret                  the servers' key pair (mode 0600)
      DIR/server/authorized_clients/ROLE/NAME.key   public key of client NAME as ROLE
      DIR/clients/NAME/ROLE.key_secret              client NAME's key pair as ROLE (0600)
      DIR/clients/NAME/server.key                   the servers' public key

  ``buffer.client_key`` names the NAME a machine's clients use; each process takes the
  key of its own role. A machine that only runs generators needs only
  ``generator.key_secret`` and ``server.key`` (delete ``learner.key_secret`` from its
  copy, or ``authorized_clients/learner/NAME.key`` on the servers' machine).
- **Role tokens** (loopback without keys): ZeroMQ's PLAIN mechanism carries
  (role, token); a token is 32 random bytes in ``RUN_DIR/tokens/ROLE`` (mode 0600 in a
  0700 directory), written with ``endpoints.json`` (``write_role_tokens``). Another user
  on the machine cannot read them, so cannot act as a role; a process of the same user
  can (it could read any role's memory as well). Loopback TCP cannot be sniffed without
  root, so PLAIN's clear text stays on the machine.

A client that is refused sees no error from ZeroMQ, only a request that gets no reply, so
it fails with its own timeout (``BufferUnavailable``, ``RewardModelUnavailable``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from verl_async.config_base import ConfigError

if TYPE_CHECKING:
    import zmq

    from verl_async.schema import BufferConfig, RunConfig

LEARNER, GENERATOR, GUEST = "learner", "generator", "guest"
ROLES = (LEARNER, GENERATOR)  # the roles a key or a token can prove
SERVER_DIR = "server"
AUTHORIZED_DIR = "authorized_clients"
CLIENTS_DIR = "clients"
SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
TOKENS_DIR = "tokens"
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


# ----------------------------------------------------------------------------- key set


def make_keys(out_dir: str | Path, clients: list[str], force: bool = False) -> list[Path]:
    """Write a key set (layout in the module docstring) into ``out_dir``; return the
    secret files written. An existing key set is replaced only with ``force``."""
    from zmq.auth import create_certificates

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
    server_public, server_secret = map(Path, create_certificates(server, "server"))
    secrets_ = [server_secret]
    for role in ROLES:
        (server / AUTHORIZED_DIR / role).mkdir(parents=True)
    for name in clients:
        home = _private_dir(out / CLIENTS_DIR / name)
        shutil.copyfile(server_public, home / SERVER_PUBLIC)
        for role in ROLES:
            public, secret = map(Path, create_certificates(home, role))
            public.replace(server / AUTHORIZED_DIR / role / f"{name}.key")
            secrets_.append(secret)
    server_public.unlink()  # the servers need only their secret file; clients have copies
    for secret in secrets_:
        secret.chmod(0o600)
    return secrets_


def _private_dir(path: Path) -> Path:
    """``path`` made with mode 0700, so a secret written into it is never readable by
    others, not even before its own mode is set."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700)
    path.chmod(0o700)  # mkdir's mode is masked by the umask
    return path


# ----------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class CurveKeys:
    """A client's CurveZMQ credential: its key pair as ``role`` and the servers' public
    key (Z85)."""

    public: bytes
    secret: bytes
    server: bytes
    role: str

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client; call before it connects."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


@dataclass(frozen=True)
class RoleToken:
    """A client's loopback credential: its role and the run's token for it (PLAIN)."""

    role: str
    token: str

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a PLAIN client; call before it connects."""
        sock.plain_username = self.role.encode()
        sock.plain_password = self.token.encode()


def guest() -> RoleToken:
    """The credential of a client with no role (loopback only: ``GetRun``, ``GetStats``)."""
    return RoleToken(GUEST, GUEST)  # PLAIN wants a non-empty password; this one proves nothing


Credentials = CurveKeys | RoleToken


@dataclass(frozen=True)
class ServerKeys:
    """What a CURVE server needs: its key pair and the role of each client key it admits."""

    public: bytes
    secret: bytes
    roles: dict[bytes, str]  # client public key (Z85) -> role
    authorized_dir: Path


@dataclass(frozen=True)
class RoleTokens:
    """What a PLAIN server (loopback without keys) needs: the run's token of each role."""

    tokens: dict[str, str]  # role -> token
    path: Path  # where they were read (named in refusals)


ServerAuth = ServerKeys | RoleTokens


# ----------------------------------------------------------------------------- loading keys


def _bad(key: str, what: str) -> ConfigError:
    return ConfigError(f"bad value for 'buffer.{key}': {what}")


def _old_layout(keys_dir: Path) -> ConfigError:
    return _bad(
        "keys_dir",
        f"'{keys_dir}' holds a key set without per-role keys (made by an earlier version); "
        f"make a new one with `verl-async keys {keys_dir} --force`",
    )


def _read_key(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of one key file; a missing, unreadable, malformed or (secret)
    group- or world-readable file is a ConfigError naming buffer.keys_dir."""
    from zmq.auth import load_certificate

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


def load_client_keys(keys_dir: str | Path, client_key: str, role: str) -> CurveKeys:
    """Client ``client_name(keys_dir, client_key)``'s keys as ``role``."""
    home = Path(keys_dir) / CLIENTS_DIR / client_name(keys_dir, client_key)
    if (home / f"{home.name}.key_secret").is_file() and not any(
        (home / f"{r}.key_secret").is_file() for r in ROLES
    ):
        raise _old_layout(Path(keys_dir))
    public, secret = _read_key(home / f"{role}.key_secret", secret=True)
    server, _ = _read_key(home / SERVER_PUBLIC, secret=False)
    return CurveKeys(public=public, secret=secret, server=server, role=role)


def load_server_keys(keys_dir: str | Path) -> ServerKeys:
    """The servers' key pair and the public key of each client they admit, by role."""
    server = Path(keys_dir) / SERVER_DIR
    public, secret = _read_key(server / SERVER_SECRET, secret=True)
    authorized_dir = server / AUTHORIZED_DIR
    if authorized_dir.is_dir() and any(authorized_dir.glob("*.key")):
        raise _old_layout(Path(keys_dir))
    roles = {
        _read_key(f, secret=False)[0]: role
        for role in ROLES
        for f in sorted((authorized_dir / role).glob("*.key"))
    }
    if not roles:
        raise _bad("keys_dir", f"'{authorized_dir}' holds no client public key (ROLE/*.key)")
    return ServerKeys(public, secret, roles, authorized_dir)


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
        home = keys_dir / CLIENTS_DIR / client_name(keys_dir, buffer.client_key)
        held = [r for r in ROLES if (home / f"{r}.key_secret").is_file()]
        for role in held or [LEARNER]:  # none held: the first load says what is wrong
            load_client_keys(keys_dir, buffer.client_key, role)


# ----------------------------------------------------------------------------- role tokens


def write_role_tokens(run_dir: str | Path) -> None:
    """Give ``run_dir`` a token per role (kept if there already: a resumed run and its
    restarted roles go on with the same ones)."""
    tokens = Path(run_dir) / TOKENS_DIR
    tokens.mkdir(mode=0o700, exist_ok=True)  # processes of one job may race here
    tokens.chmod(0o700)  # mkdir's mode is masked by the umask
    for role in ROLES:
        try:  # written whole before anyone can open it: the name appears with its text
            tmp = tokens / f".{role}.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            os.link(tmp, tokens / role)  # fails if the role has one: it is kept
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)


def _read_token(run_dir: str | Path, role: str) -> str:
    path = Path(run_dir) / TOKENS_DIR / role
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the run's {role} token '{path}' ({exc.strerror}); roles on "
            "loopback without keys prove their role with it: start the run with "
            "`verl-async train` (or `verl-async buffer`), which writes it"
        ) from None
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"'{path}' is readable by other users; run chmod 600 on it")
    return token


def load_role_token(run_dir: str | Path, role: str) -> RoleToken:
    return RoleToken(role, _read_token(run_dir, role))


def load_role_tokens(run_dir: str | Path) -> RoleTokens:
    tokens = {role: _read_token(run_dir, role) for role in ROLES}
    return RoleTokens(tokens, Path(run_dir) / TOKENS_DIR)


# ----------------------------------------------------------------------------- per run


def client_credentials(cfg: RunConfig, run_dir: str | Path, role: str) -> Credentials:
    """This machine's credential as ``role`` in the run: its keys, or the run's token."""
    if cfg.buffer.keys_dir:
        return load_client_keys(cfg.buffer.keys_dir, cfg.buffer.client_key, role)
    return load_role_token(run_dir, role)


def server_auth(cfg: RunConfig, run_dir: str | Path) -> ServerAuth:
    """What the run's servers admit: the key set's clients, or the run's role tokens."""
    if cfg.buffer.keys_dir:
        return load_server_keys(cfg.buffer.keys_dir)
    return load_role_tokens(run_dir)
