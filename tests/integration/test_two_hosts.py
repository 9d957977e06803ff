"""Two hosts on one machine: two network namespaces joined by a veth pair, each with one
address on that link and nothing else (no route out). Host A runs the buffer and the
learner, host B a generator, each started with its role command; the buffer listens on
A's link address with CurveZMQ keys, and the weight-sync group (gloo, its store on A)
crosses the link. A client on B without the run's keys is refused. The same run is then
repeated over a slow link, on both ends: 20 ms of delay and 1 % loss (``tc netem``), and
20 Mbit/s (``tc tbf``).

Each test builds its namespaces and removes them, veth pair included, whatever happens.
Where namespaces cannot be made (not root, no ``ip``, a container without the
capability), or a kernel lacks a queueing discipline, the tests skip, saying why. Run alone::

    .venv/bin/python -m pytest tests/integration/test_two_hosts.py -v
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT, run_cli

STEPS = 60


@dataclass(frozen=True)
class Hosts:
    a: str  # namespace names
    b: str
    addr_a: str  # their addresses on the link
    addr_b: str
    dev_a: str  # their ends of the veth pair
    dev_b: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    net = f"10.213.{random.randrange(1, 250)}"
    h = Hosts(
        f"vasync-{tag}-a", f"vasync-{tag}-b", f"{net}.1", f"{net}.2", f"va{tag}a", f"va{tag}b"
    )
    made: list[str] = []
    try:
        try:
            for ns in (h.a, h.b):
                _ip("netns", "add", ns)
                made.append(ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"network namespaces cannot be made here: {exc.stderr.strip()}")
        _ip("link", "add", h.dev_a, "netns", h.a, "type", "veth", "peer", "name", h.dev_b,
            "netns", h.b)  # fmt: skip
        for ns, dev, addr in ((h.a, h.dev_a, h.addr_a), (h.b, h.dev_b, h.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # each host's own loopback
        yield h
    finally:
        for ns in made:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _start(ns: str, args: list[str], log: Path) -> subprocess.Popen:
    """``verl-async ARGS`` as a process of host ``ns``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "verl_async.launch.cli", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _train_across(h: Hosts, tmp: Path, keys: Path) -> str:
    """Buffer and learner on A, a generator on B, a keyless client on B; returns what the
    run measured: seconds from the first step to the last, median step, weights a step."""
    port = 20000 + random.randrange(20000)
    address = f"tcp://{h.addr_a}:{port}"
    run_dir = tmp / "run"
    logs = {name: tmp / f"{name}.out" for name in ("buffer", "learner", "generator", "keyless")}
    join = ["--buffer", address, "--keys-dir", str(keys)]
    procs = {
        "buffer": _start(
            h.a,
            [
                "buffer",
                "configs/tiny.yaml",
                f"trainer.total_steps={STEPS}",
                f"buffer.host={h.addr_a}",
                f"buffer.port={port}",
                f"buffer.keys_dir={keys}",
                f"weights.host={h.addr_a}",
                f"weights.port={port + 1}",
                "weights.shared_memory=false",  # one machine: memory would skip the link
                "checkpoint.every_steps=0",
                "--run-dir",
                str(run_dir),
            ],
            logs["buffer"],
        ),  # fmt: skip
        "learner": _start(h.a, ["learner", *join, "--timeout-s", "120"], logs["learner"]),
        "generator": _start(
            h.b,
            ["generator", *join, "--index", "0", "--run-dir", str(tmp / "b")],
            logs["generator"],
        ),
    }
    try:
        # A client on B without the run's keys: refused, and the run goes on.
        keyless = _start(
            h.b,
            ["generator", "--buffer", address, "--timeout-s", "8", "--run-dir", str(tmp / "x")],
            logs["keyless"],
        )
        assert keyless.wait(timeout=120) == 1, logs["keyless"].read_text()[-2000:]
        for name, proc in procs.items():
            code = proc.wait(timeout=420)
            assert code == 0, f"{name} exited {code}:\n{logs[name].read_text()[-3000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert f"cannot join the run at {address}" in logs["keyless"].read_text()
    buffer_log = logs["buffer"].read_text()
    if (run_dir / "logs" / "buffer.log").is_file():
        buffer_log += (run_dir / "logs" / "buffer.log").read_text()
    # libzmq does not name the peer of a handshake that fails before authentication
    assert f"refused a client on {address}: it" in buffer_log, buffer_log[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * 8)), "a group was lost or trained twice"
    learner_log = logs["learner"].read_text()  # a role command logs to its output
    assert "weight-sync group ready: updates go through the network" in learner_log
    loaded = [
        int(line.split("loaded version ")[1].split()[0])
        for line in logs["generator"].read_text().splitlines()
        if "loaded version " in line
    ]
    assert loaded and max(loaded) >= STEPS // 2, loaded[-5:]  # weights crossed the link
    steps = sorted(r["step_s"] for r in rows)
    return (
        f"{STEPS} steps in {rows[-1]['wall_s'] - rows[0]['wall_s']:.1f} s from the first to "
        f"the last, median step {steps[len(steps) // 2]:.3f} s, "
        f"{rows[-1]['weight_sync_mb']:.2f} MiB of weights a step"
    )


@pytest.fixture
def keys(tmp_path) -> Path:
    assert run_cli(["keys", str(tmp_path / "keys")], timeout=60).returncode == 0
    return tmp_path / "keys"


def test_roles_on_two_hosts_train_over_curve_and_refuse_a_keyless_client(hosts, keys, tmp_path):
    print(f"two hosts: {_train_across(hosts, tmp_path, keys)}")


SLOW_LINKS = {
    "20ms-1pct-loss": ["netem", "delay", "20ms", "loss", "1%"],
    "20mbit": ["tbf", "rate", "20mbit", "burst", "64kb", "latency", "200ms"],
}


@pytest.mark.parametrize("link", list(SLOW_LINKS))
def test_a_run_across_a_slow_link_trains_every_group_once(hosts, keys, tmp_path, link):
    """The same run with the link slowed down on both ends: 20 ms of delay and 1 % loss
    (``netem``), or 20 Mbit/s (``tbf``). A kernel without the qdisc skips its case."""
    if shutil.which("tc") is None:
        pytest.skip("iproute2's `tc` is not installed")
    for ns, dev in ((hosts.a, hosts.dev_a), (hosts.b, hosts.dev_b)):
        added = subprocess.run(
            ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *SLOW_LINKS[link]],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if added.returncode != 0:
            pytest.skip(
                f"`tc qdisc add ... {SLOW_LINKS[link][0]}` fails here: {added.stderr.strip()}"
            )
    print(f"two hosts, link {link}: {_train_across(hosts, tmp_path, keys)}")
