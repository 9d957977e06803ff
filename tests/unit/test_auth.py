"""Key sets and role tokens: what ``verl-async keys`` writes, what each side loads, the
run's tokens, and the config errors a user meets (each names its key)."""

import logging
import re
import shutil
import stat

import pytest
import zmq

from verl_async.auth import (
    GENERATOR,
    LEARNER,
    client_credentials,
    load_client_keys,
    load_role_token,
    load_role_tokens,
    load_server_keys,
    make_keys,
    server_auth,
    write_role_tokens,
)
from verl_async.config import ConfigError, load_config
from verl_async.launch import cli
from verl_async.ratelimit import RateLimitedLog
from verl_async.transport.guard import REFUSALS_WINDOW_S


def client_keys(cfg, role=LEARNER):
    return client_credentials(cfg, "/nonexistent", role)


def server_keys(cfg):
    return server_auth(cfg, "/nonexistent")


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_command_writes_the_layout_with_private_secrets(tmp_path, capsys):
    out = tmp_path / "keys"
    assert cli.main(["keys", str(out), "--clients", "learner", "gen0"]) == 0
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "clients/gen0/generator.key_secret",
        "clients/gen0/learner.key_secret",
        "clients/gen0/server.key",
        "clients/learner/generator.key_secret",
        "clients/learner/learner.key_secret",
        "clients/learner/server.key",
        "server/authorized_clients/generator/gen0.key",
        "server/authorized_clients/generator/learner.key",
        "server/authorized_clients/learner/gen0.key",
        "server/authorized_clients/learner/learner.key",
        "server/server.key_secret",
    ]
    for secret in out.rglob("*.key_secret"):
        assert mode(secret) == 0o600
        assert mode(secret.parent) == 0o700
    assert "buffer.keys_dir=" in capsys.readouterr().out


def test_keys_command_defaults_to_one_client_named_default(tmp_path):
    assert cli.main(["keys", str(tmp_path / "k")]) == 0
    assert [p.name for p in (tmp_path / "k/clients").iterdir()] == ["default"]


def test_an_existing_key_set_is_replaced_only_with_force(tmp_path, capsys):
    out = tmp_path / "keys"
    make_keys(out, ["a"])
    before = (out / "server/server.key_secret").read_bytes()
    assert cli.main(["keys", str(out)]) == 1
    assert "already holds a key set; pass --force" in capsys.readouterr().err
    assert (out / "server/server.key_secret").read_bytes() == before
    assert cli.main(["keys", str(out), "--clients", "b", "--force"]) == 0
    assert (out / "server/server.key_secret").read_bytes() != before
    assert [p.name for p in (out / "clients").iterdir()] == ["b"]  # a's keys are gone
    for role in (LEARNER, GENERATOR):
        assert [p.name for p in (out / "server/authorized_clients" / role).iterdir()] == ["b.key"]


@pytest.mark.parametrize("names", [[], ["a", "a"], ["../x"], [".hidden"], ["a b"]])
def test_bad_client_names_are_refused(tmp_path, names):
    with pytest.raises(ValueError, match="client names"):
        make_keys(tmp_path / "k", names)
    assert not (tmp_path / "k").exists()


def test_each_side_loads_matching_keys_one_per_role(tmp_path):
    make_keys(tmp_path, ["a", "b"])
    server = load_server_keys(tmp_path)
    a, b = load_client_keys(tmp_path, "a", LEARNER), load_client_keys(tmp_path, "b", LEARNER)
    ga = load_client_keys(tmp_path, "a", GENERATOR)
    assert a.server == b.server == ga.server == server.public
    assert ga.public != a.public and ga.role == GENERATOR
    assert server.roles[a.public] == server.roles[b.public] == LEARNER
    assert server.roles[ga.public] == GENERATOR and len(server.roles) == 4
    assert zmq.curve_public(server.secret) == server.public
    assert zmq.curve_public(a.secret) == a.public


def test_a_key_set_without_roles_is_refused_with_the_fix(tmp_path):
    make_keys(tmp_path, ["a"])
    # The layout an earlier version wrote: one key per client, no roles.
    (tmp_path / "clients/a/generator.key_secret").unlink()
    (tmp_path / "clients/a/learner.key_secret").rename(tmp_path / "clients/a/a.key_secret")
    auth = tmp_path / "server/authorized_clients"
    (auth / "learner/a.key").rename(auth / "a.key")
    shutil.rmtree(auth / "learner")
    shutil.rmtree(auth / "generator")
    for load in (
        lambda: load_server_keys(tmp_path),
        lambda: load_client_keys(tmp_path, "a", LEARNER),
    ):
        with pytest.raises(ConfigError, match="without per-role keys.*--force"):
            load()


def test_role_tokens_are_private_kept_and_one_per_role(tmp_path):
    write_role_tokens(tmp_path)
    tokens = load_role_tokens(tmp_path)
    assert set(tokens.tokens) == {LEARNER, GENERATOR}
    assert tokens.tokens[LEARNER] != tokens.tokens[GENERATOR]
    assert mode(tmp_path / "tokens") == 0o700
    assert all(mode(tmp_path / "tokens" / r) == 0o600 for r in (LEARNER, GENERATOR))
    write_role_tokens(tmp_path)  # a resumed run keeps its tokens
    assert load_role_tokens(tmp_path) == tokens
    assert load_role_token(tmp_path, GENERATOR).token == tokens.tokens[GENERATOR]
    (tmp_path / "tokens" / LEARNER).chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        load_role_token(tmp_path, LEARNER)
    with pytest.raises(ConfigError, match="cannot read the run's learner token"):
        load_role_token(tmp_path / "nowhere", LEARNER)


def test_a_client_machine_needs_only_its_own_directory(tmp_path, repo_root):
    make_keys(tmp_path / "full", ["a", "b"])
    client_only = tmp_path / "copy"
    shutil.copytree(tmp_path / "full/clients/b", client_only / "clients/b")
    cfg = load_config(None, [f"buffer.keys_dir={client_only}", "buffer.host=10.0.0.7"])
    assert client_keys(cfg) == load_client_keys(tmp_path / "full", "b", LEARNER)
    with pytest.raises(ConfigError, match=r"^bad value for 'buffer\.keys_dir'.*server\.key_secret"):
        server_keys(cfg)  # what a buffer started on that machine would meet


def test_a_server_machine_needs_only_the_server_directory(tmp_path):
    make_keys(tmp_path / "full", ["a"])
    shutil.copytree(tmp_path / "full/server", tmp_path / "copy/server")
    cfg = load_config(None, [f"buffer.keys_dir={tmp_path / 'copy'}"])
    copy, full = server_keys(cfg), load_server_keys(tmp_path / "full")
    assert (copy.public, copy.secret, copy.roles) == (full.public, full.secret, full.roles)


def test_non_loopback_host_needs_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["buffer.host=0.0.0.0"])
    message = str(err.value)
    assert message.startswith("bad value for 'buffer.host'")
    assert "verl-async keys" in message and "buffer.keys_dir" in message


def test_a_non_loopback_weight_sync_host_needs_keys(tmp_path):
    """The weight-sync rendezvous off loopback, with the buffer on loopback and no keys,
    used to pass: every endpoint off loopback needs the run's keys."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["weights.host=10.0.0.2", "weights.port=29600"])
    message = str(err.value)
    assert message.startswith("bad value for 'weights.host': '10.0.0.2' is not loopback")
    assert "verl-async keys" in message and "buffer.keys_dir" in message
    make_keys(tmp_path / "k", ["a"])
    keyed = [f"buffer.keys_dir={tmp_path / 'k'}", "weights.host=10.0.0.2", "weights.port=29600"]
    assert load_config(None, keyed).weights.host == "10.0.0.2"
    assert load_config(None, ["weights.host=127.0.0.1"]).weights.host == "127.0.0.1"


@pytest.mark.parametrize("key", ["buffer.host", "weights.host"])
def test_ipv6_hosts_are_refused_where_they_are_set(key):
    """Ports are picked and endpoints written for IPv4: '::1' used to pass as loopback and
    fail in the launcher (an IPv4 socket cannot bind it)."""
    with pytest.raises(ConfigError, match=f"bad value for '{key}': '::1' is an IPv6 address"):
        load_config(None, [f"{key}=::1"])
    assert load_config(None, ["buffer.host=127.0.0.2"]).buffer.host == "127.0.0.2"  # loopback


def _config_error(tmp_path, *overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_key_set_problems_name_the_key(tmp_path):
    make_keys(tmp_path / "k", ["a", "b"])
    missing = tmp_path / "nope"
    msg = _config_error(tmp_path, f"buffer.keys_dir={missing}")
    assert msg.startswith("bad value for 'buffer.keys_dir'") and "verl-async keys" in msg
    (tmp_path / "empty").mkdir()
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path / 'empty'}")
    assert msg.startswith("bad value for 'buffer.keys_dir'") and "holds neither" in msg
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path / 'k'}", "buffer.client_key=c")
    assert msg.startswith("bad value for 'buffer.client_key'") and "['a', 'b']" in msg
    msg = _config_error(tmp_path, "buffer.client_key=a")
    assert msg.startswith("bad value for 'buffer.client_key'")


def test_missing_or_exposed_key_files_name_keys_dir(tmp_path):
    make_keys(tmp_path, ["a"])
    (tmp_path / "server/server.key_secret").chmod(0o644)
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path}")
    assert re.match(r"bad value for 'buffer\.keys_dir': '.*server\.key_secret' is readable", msg)
    (tmp_path / "server/server.key_secret").chmod(0o600)
    (tmp_path / "clients/a/server.key").unlink()
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path}")
    assert re.match(r"bad value for 'buffer\.keys_dir': '.*clients/a/server\.key' is missing", msg)
    (tmp_path / "clients/a/server.key").write_text("not a key\n")
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path}")
    assert msg.startswith("bad value for 'buffer.keys_dir'") and "not a CurveZMQ key" in msg
    shutil.rmtree(tmp_path / "clients")
    for f in (tmp_path / "server/authorized_clients").rglob("*.key"):
        f.unlink()
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path}")
    assert msg.startswith("bad value for 'buffer.keys_dir'") and "no client public key" in msg


def test_several_clients_and_none_chosen_is_an_error_when_a_client_starts(tmp_path):
    make_keys(tmp_path, ["a", "b"])
    cfg = load_config(None, [f"buffer.keys_dir={tmp_path}"])  # fine for the servers
    with pytest.raises(ConfigError, match=r"^bad value for 'buffer\.client_key'.*several"):
        client_keys(cfg)
    cfg = load_config(None, [f"buffer.keys_dir={tmp_path}", "buffer.client_key=b"])
    assert client_keys(cfg) == load_client_keys(tmp_path, "b", LEARNER)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refusal_log_names_each_peer_once_and_counts_the_rest(caplog):
    clock = Clock()
    refusals = RateLimitedLog(
        logging.getLogger("test.auth"), burst=3, window_s=60, clock=clock, what="refused handshakes"
    )
    assert REFUSALS_WINDOW_S == 60  # what the CurveZMQ guard uses

    def refuse(message, peer=None, kind="peer"):  # as auth.py logs a refusal: named or not
        refusals.log(kind, message, once=peer, once_a_window=peer is None)

    with caplog.at_level(logging.WARNING, "test.auth"):
        for _ in range(5):  # one peer retrying: one line, ever
            refuse("peer 1", peer=("10.0.0.1", b"k1"))
        for _ in range(5):  # unnamed failures of one kind: one line per window
            refuse("no curve", kind="no-curve")
        refuse("peer 2", peer=("10.0.0.2", b"k2"))
        refuse("peer 3", peer=("10.0.0.3", b"k3"))  # past the burst: counted
        assert [r.message for r in caplog.records] == ["peer 1", "no curve", "peer 2"]
        clock.now = 61
        refusals.flush()
        assert caplog.records[-1].message.startswith("9 more refused handshakes in the last 61s")
        refuse("peer 1", peer=("10.0.0.1", b"k1"))  # still known
        refuse("no curve", kind="no-curve")  # a new window: named again
        assert [r.message for r in caplog.records][-1] == "no curve"
        assert len(caplog.records) == 5
