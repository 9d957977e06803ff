"""CurveZMQ key sets: what ``verl-async keys`` writes, what each side loads, and the config
errors a user meets (each names its key)."""

import logging
import re
import shutil
import stat

import pytest
import zmq

from verl_async.auth import (
    REFUSALS_WINDOW_S,
    client_keys,
    load_client_keys,
    load_server_keys,
    make_keys,
    server_keys,
)
from verl_async.config import ConfigError, load_config
from verl_async.launch import cli
from verl_async.ratelimit import RateLimitedLog


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_command_writes_the_layout_with_private_secrets(tmp_path, capsys):
    out = tmp_path / "keys"
    assert cli.main(["keys", str(out), "--clients", "learner", "gen0"]) == 0
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "clients/gen0/gen0.key_secret",
        "clients/gen0/server.key",
        "clients/learner/learner.key_secret",
        "clients/learner/server.key",
        "server/authorized_clients/gen0.key",
        "server/authorized_clients/learner.key",
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
    assert [p.name for p in (out / "server/authorized_clients").iterdir()] == ["b.key"]


@pytest.mark.parametrize("names", [[], ["a", "a"], ["../x"], [".hidden"], ["a b"]])
def test_bad_client_names_are_refused(tmp_path, names):
    with pytest.raises(ValueError, match="client names"):
        make_keys(tmp_path / "k", names)
    assert not (tmp_path / "k").exists()


def test_each_side_loads_matching_keys(tmp_path):
    make_keys(tmp_path, ["a", "b"])
    server = load_server_keys(tmp_path)
    a, b = load_client_keys(tmp_path, "a"), load_client_keys(tmp_path, "b")
    assert a.server == b.server == server.public
    assert server.authorized == {a.public, b.public}
    assert zmq.curve_public(server.secret) == server.public
    assert zmq.curve_public(a.secret) == a.public


def test_a_client_machine_needs_only_its_own_directory(tmp_path, repo_root):
    make_keys(tmp_path / "full", ["a", "b"])
    client_only = tmp_path / "copy"
    shutil.copytree(tmp_path / "full/clients/b", client_only / "clients/b")
    cfg = load_config(None, [f"buffer.keys_dir={client_only}", "buffer.host=10.0.0.7"])
    assert client_keys(cfg) == load_client_keys(tmp_path / "full", "b")
    with pytest.raises(ConfigError, match=r"^bad value for 'buffer\.keys_dir'.*server\.key_secret"):
        server_keys(cfg)  # what a buffer started on that machine would meet


def test_a_server_machine_needs_only_the_server_directory(tmp_path):
    make_keys(tmp_path / "full", ["a"])
    shutil.copytree(tmp_path / "full/server", tmp_path / "copy/server")
    cfg = load_config(None, [f"buffer.keys_dir={tmp_path / 'copy'}"])
    copy, full = server_keys(cfg), load_server_keys(tmp_path / "full")
    assert (copy.public, copy.secret, copy.authorized) == (
        full.public,
        full.secret,
        full.authorized,
    )
    assert client_keys(load_config(None)) is None and server_keys(load_config(None)) is None


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
    for f in (tmp_path / "server/authorized_clients").iterdir():
        f.unlink()
    msg = _config_error(tmp_path, f"buffer.keys_dir={tmp_path}")
    assert msg.startswith("bad value for 'buffer.keys_dir'") and "no client public key" in msg


def test_several_clients_and_none_chosen_is_an_error_when_a_client_starts(tmp_path):
    make_keys(tmp_path, ["a", "b"])
    cfg = load_config(None, [f"buffer.keys_dir={tmp_path}"])  # fine for the servers
    with pytest.raises(ConfigError, match=r"^bad value for 'buffer\.client_key'.*several"):
        client_keys(cfg)
    cfg = load_config(None, [f"buffer.keys_dir={tmp_path}", "buffer.client_key=b"])
    assert client_keys(cfg) == load_client_keys(tmp_path, "b")


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
