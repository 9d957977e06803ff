"""CurveZMQ on the real buffer and reward-model processes: listed clients are served,
each only what its role's key may ask; clients without keys, with an unknown key or with
another key set's server key are refused, each refusal is one line in the server's log,
and the server goes on serving."""

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from benchmarks.tiny_reward_model import build_tiny_reward_model
from verl_async import protocol as P
from verl_async.auth import GENERATOR, LEARNER, CurveKeys, load_client_keys, make_keys
from verl_async.config import load_config, to_yaml
from verl_async.rewards.model_client import (
    RewardModelClient,
    RewardModelRejected,
    RewardModelUnavailable,
)
from verl_async.runtime import Endpoints, write_endpoints
from verl_async.transport import BufferClient, BufferRejected, BufferUnavailable

from .conftest import ROOT

START_S = 120.0  # first reply after a start: imports and model loading (2 slow cores)
REFUSED_S = 2.0  # a refused client's request times out after this long


@pytest.fixture
def keys(tmp_path) -> Path:
    make_keys(tmp_path / "keys", ["learner", "spare"])
    return tmp_path / "keys"


def stranger(listed: CurveKeys) -> CurveKeys:
    """Valid keys that no key set authorises, holding the right server key."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(public=public, secret=secret, server=listed.server, role=listed.role)


def wrong_server(listed: CurveKeys) -> CurveKeys:
    """A listed client that holds another key set's server public key."""
    return CurveKeys(
        public=listed.public, secret=listed.secret, server=zmq.curve_keypair()[0], role=listed.role
    )


def wait_for_line(log: Path, text: str, timeout_s: float = 10.0) -> list[str]:
    """The log's lines holding ``text``, once there is one (or [] at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if text in ln]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)
        raise


@pytest.fixture
def buffer_proc(tmp_path, free_port, tiny_model, keys):
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [f"data.path={ROOT / 'configs/data/max_digit.jsonl'}", f"buffer.keys_dir={keys}"],
    )
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    write_endpoints(
        tmp_path,
        Endpoints(
            buffer=endpoint, weights_host="127.0.0.1", weights_port=1, model_path=str(tiny_model)
        ),
    )
    log = tmp_path / "buffer.log"
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "buffer", "--run-dir", str(tmp_path)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    yield endpoint, proc, log
    assert stop(proc) == 0, log.read_text()


def ask(endpoint: str, curve: CurveKeys | None, timeout_s: float, body: P.Body) -> P.Body:
    client = BufferClient(endpoint, timeout_s, curve)
    try:
        reply, _ = client.request(body)
    finally:
        client.close()
    return reply


def stats(endpoint: str, curve: CurveKeys | None, timeout_s: float) -> P.Stats:
    reply = ask(endpoint, curve, timeout_s, P.GetStats())
    assert isinstance(reply, P.Stats)
    return reply


def test_buffer_serves_listed_clients_and_logs_each_refused_one(buffer_proc, keys):
    endpoint, proc, log = buffer_proc
    listed = load_client_keys(keys, "learner", LEARNER)
    assert stats(endpoint, listed, START_S).issued == 0  # (a) a listed client is served
    # ... each only what its role's key may ask: a generator's key cannot take the
    # learner's checkpoint cut nor stop the run, the learner's cannot take prompts.
    generator = load_client_keys(keys, "learner", GENERATOR)
    with pytest.raises(BufferRejected, match=r"\(forbidden\).*not a generator"):
        ask(endpoint, generator, 20, P.SnapshotBuffer(step=0, version=0))
    with pytest.raises(BufferRejected, match=r"\(forbidden\).*not a generator"):
        ask(endpoint, generator, 20, P.Shutdown())
    with pytest.raises(BufferRejected, match=r"\(forbidden\).*not a learner"):
        ask(endpoint, listed, 20, P.GetPrompts(generator_id=0, loaded_version=0, max_groups=1))
    assert isinstance(
        ask(endpoint, generator, 20, P.GetPrompts(generator_id=0, loaded_version=0, max_groups=1)),
        P.Prompts,
    )

    with pytest.raises(BufferUnavailable):  # (b) no keys: refused, one line for its retries
        stats(endpoint, None, REFUSED_S)
    assert len(wait_for_line(log, f"refused a client on {endpoint}: ")) == 1, log.read_text()

    unknown = stranger(listed)  # (c) a valid key nobody listed: refused, named once
    with pytest.raises(BufferUnavailable):
        stats(endpoint, unknown, REFUSED_S)
    named = wait_for_line(log, unknown.public.decode())
    assert len(named) == 1, log.read_text()
    assert "refused a client at 127.0.0.1: its CURVE public key" in named[0]
    assert str(keys / "server" / "authorized_clients") in named[0]

    # A key listed under one role does not pass for another (the learner's key from a
    # copy of a generator machine's directory is simply absent there: ROLE.key_secret).
    assert load_client_keys(keys, "spare", LEARNER).public != generator.public

    with pytest.raises(BufferUnavailable):  # another key set's server key: refused
        stats(endpoint, wrong_server(listed), REFUSED_S)
    assert wait_for_line(log, "does not decrypt"), log.read_text()

    # (d) still serving: the listed client, and the second listed one
    assert stats(endpoint, listed, 20).issued == 1
    assert stats(endpoint, load_client_keys(keys, "spare", GENERATOR), 20).issued == 1
    assert proc.poll() is None
    assert len(wait_for_line(log, unknown.public.decode(), timeout_s=0)) == 1  # retries: no lines


def conv(prompt: str, response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


@pytest.fixture
def reward_proc(tmp_path, free_port, keys):
    rm_path = build_tiny_reward_model(tmp_path / "rm")
    source = {"kind": "model", "name": "rm", "path": str(rm_path), "batch_size": 2}
    cfg = load_config(None, [f"rewards.sources={json.dumps([source])}", f"buffer.keys_dir={keys}"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    write_endpoints(
        tmp_path,
        Endpoints(
            buffer="tcp://127.0.0.1:1",  # unused by this role
            weights_host="127.0.0.1",
            weights_port=1,
            model_path=str(rm_path),
            reward_models={"rm": endpoint},
        ),
    )
    log = tmp_path / "reward_model.log"
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "reward_model", "--run-dir", str(tmp_path), "--name", "rm"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    yield endpoint, proc, log
    assert stop(proc) == 0, log.read_text()


def score(endpoint: str, curve: CurveKeys | None, timeout_s: float) -> list[float]:
    async def go() -> list[float]:
        client = RewardModelClient(endpoint, timeout_s, curve)
        try:
            return await client.score([conv("max 1 2 =", "2"), conv("max 3 =", "1")])
        finally:
            client.close()

    return asyncio.run(go())


def test_reward_model_serves_listed_clients_and_logs_refused_ones(reward_proc, keys):
    endpoint, proc, log = reward_proc
    listed = load_client_keys(keys, "learner", GENERATOR)
    assert len(score(endpoint, listed, START_S)) == 2
    with pytest.raises(RewardModelRejected, match="forbidden"):  # generators score, nobody else
        score(endpoint, load_client_keys(keys, "learner", LEARNER), 20)

    with pytest.raises(RewardModelUnavailable):
        score(endpoint, None, REFUSED_S)
    assert len(wait_for_line(log, f"refused a client on {endpoint}: ")) == 1, log.read_text()
    unknown = stranger(listed)
    with pytest.raises(RewardModelUnavailable):
        score(endpoint, unknown, REFUSED_S)
    assert len(wait_for_line(log, unknown.public.decode())) == 1, log.read_text()

    assert len(score(endpoint, listed, 20)) == 2
    assert proc.poll() is None
