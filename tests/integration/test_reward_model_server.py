"""The real reward-model process: scores, bad input, concurrent clients, crash and restart."""

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
from reward_model.scoring import load_reward_model, score_conversations
from verl_async import protocol as P
from verl_async.auth import GENERATOR, load_role_token
from verl_async.config import load_config, to_yaml
from verl_async.rewards.model_client import (
    RewardModelClient,
    RewardModelRejected,
    RewardModelUnavailable,
)
from verl_async.runtime import Endpoints, write_endpoints

from .conftest import ROOT

BATCH, MAX_LEN = 3, 32
START_S = 120.0  # first reply after a start: imports torch and loads the model (2 slow cores)


def conv(prompt: str, response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


CONVS = [
    conv(f"max {' '.join(str(d) for d in range(k % 10 + 1))} =", str(k % 10)) for k in range(7)
]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def expected(rm_path):
    model, tokenizer = load_reward_model(str(rm_path), "cpu")
    return lambda convs: score_conversations(model, tokenizer, convs, BATCH, MAX_LEN)


def write_run_dir(run_dir: Path, rm_path: Path, endpoint: str, *overrides: str) -> None:
    source = {"kind": "model", "name": "rm", "path": str(rm_path), "batch_size": BATCH}
    source["max_length"] = MAX_LEN
    cfg = load_config(None, [f"rewards.sources={json.dumps([source])}", *overrides])
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    endpoints = Endpoints(
        buffer="tcp://127.0.0.1:1",  # unused by this role
        weights_host="127.0.0.1",
        weights_port=1,
        model_path=str(rm_path),
        reward_models={"rm": endpoint},
    )
    write_endpoints(run_dir, endpoints)


def start(run_dir: Path) -> subprocess.Popen:
    log = open(run_dir / "reward_model.log", "ab")  # noqa: SIM115 (the child owns it)
    cmd = [sys.executable, "-m", "reward_model", "--run-dir", str(run_dir), "--name", "rm"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
    return proc.returncode


@pytest.fixture
def served(tmp_path, free_port, rm_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    write_run_dir(tmp_path, rm_path, endpoint)
    procs = [start(tmp_path)]
    yield endpoint, procs, tmp_path
    for proc in procs:
        stop(proc)


def generator(run_dir):
    """A generator's credential in the run (the reward models serve generators only)."""
    return load_role_token(run_dir, GENERATOR)


def test_scores_match_in_process_and_sigterm_exits_cleanly(served, expected):
    endpoint, procs, run_dir = served

    async def go() -> list[float]:
        client = RewardModelClient(endpoint, START_S, generator(run_dir))
        try:
            return await client.score(CONVS)
        finally:
            client.close()

    assert asyncio.run(go()) == pytest.approx(expected(CONVS), abs=1e-5)
    assert stop(procs[0]) == 0


def test_bad_messages_get_errors_and_server_keeps_serving(served, expected):
    endpoint, _, run_dir = served
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    generator(run_dir).apply(raw)
    raw.connect(endpoint)
    try:
        replies = []
        for parts in (
            [b"\xc1garbage"],
            P.encode(P.GetStats(), 7),
            P.encode(P.Scores(scores=[]), 8),
        ):
            raw.send_multipart(parts)
            assert raw.poll(int(START_S * 1000)), "no reply to a bad message"
            replies.append(P.decode(raw.recv_multipart())[0])
    finally:
        raw.close()
    assert all(isinstance(env.body, P.Error) for env in replies)
    assert [env.request_id for env in replies[1:]] == [7, 8]
    assert "ScoreConversations" in replies[1].body.message

    async def go() -> list[float]:
        client = RewardModelClient(endpoint, 30, generator(run_dir))
        try:
            return await client.score(CONVS[:2])
        finally:
            client.close()

    assert asyncio.run(go()) == pytest.approx(expected(CONVS[:2]), abs=1e-5)


def test_concurrent_clients_get_their_own_answers(served, expected):
    endpoint, _, run_dir = served
    asks = [CONVS[0:3], CONVS[3:4], CONVS[4:7]]

    async def go() -> list[list[float]]:
        clients = [RewardModelClient(endpoint, START_S, generator(run_dir)) for _ in asks]
        try:
            # Twice each, at once: requests of one client are told apart by request id.
            jobs = [c.score(a) for _ in range(2) for c, a in zip(clients, asks, strict=True)]
            return await asyncio.gather(*jobs)
        finally:
            for c in clients:
                c.close()

    got = asyncio.run(go())
    for i, ask in enumerate(asks * 2):
        assert got[i] == pytest.approx(expected(ask), abs=1e-5)


def test_killed_server_times_out_then_restart_serves_same_client(served, expected):
    endpoint, procs, run_dir = served

    async def go() -> None:
        client = RewardModelClient(endpoint, START_S, generator(run_dir))
        try:
            assert await client.score(CONVS[:1]) == pytest.approx(expected(CONVS[:1]), abs=1e-5)
            procs[0].kill()
            procs[0].wait(timeout=20)
            client.timeout_s = 1.0
            with pytest.raises(RewardModelUnavailable, match=endpoint):
                await client.score(CONVS[:1])
            procs.append(start(run_dir))
            deadline = time.monotonic() + START_S
            while True:  # the fresh process needs a while; late replies must be ignored
                try:
                    got = await client.score(CONVS[1:3])
                    break
                except RewardModelUnavailable:
                    assert time.monotonic() < deadline, "restarted reward model never answered"
            assert got == pytest.approx(expected(CONVS[1:3]), abs=1e-5)
        finally:
            client.close()

    asyncio.run(go())
    assert stop(procs[1]) == 0


def test_error_reply_raises_naming_the_endpoint(free_port):
    """A stand-in server that answers Error: the client raises RewardModelRejected."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(endpoint)

    async def go() -> None:
        client = RewardModelClient(endpoint, timeout_s=10)
        try:
            task = asyncio.create_task(client.score(CONVS[:1]))
            for _ in range(100):
                if server.poll(0):
                    break
                await asyncio.sleep(0.05)
            identity, *parts = server.recv_multipart()
            env, _ = P.decode(parts)
            server.send_multipart(
                [identity, *P.encode(P.Error(code="x", message="no"), env.request_id)]
            )
            with pytest.raises(RewardModelRejected, match=f"{endpoint}.*no"):
                await task
        finally:
            client.close()

    try:
        asyncio.run(go())
    finally:
        server.close()
