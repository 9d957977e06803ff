"""Two hosts on one machine: two network namespaces joined by a veth pair, each with one
address on that link and nothing else (no route out). Host A runs the buffer and the
learner, host B a generator, each started with its role command; the buffer listens on
A's link address with CurveZMQ keys, and the weight-sync group (gloo, its store on A)
crosses the link. A client on B without the run's keys is refused. The same run is then
repeated over a slow link, on both ends: 20 ms of delay and 1 % loss (``tc netem``), and
20 Mbit/s (``tc tbf``); and over a link made in user space where the kernel has no netem
(impaired_link.py: TUN devices, 20 ms each way and 1 % loss, against the same link
unimpaired). Last, a two-node Ray cluster (head on A, worker on B, token authentication)
runs ``launcher: ray`` with the generator placed on B.

Each test builds its namespaces and removes them, veth pair included, whatever happens.
Where namespaces cannot be made (not root, no ``ip``, a container without the
capability), or a kernel lacks a queueing discipline, the tests skip, saying why. Run alone::

    .venv/bin/python -m pytest tests/integration/test_two_hosts.py -v
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT, process_tree, processes_mentioning, run_cli
from .test_role_commands import start, wait_all

STEPS = 30
SLOW_STEPS = 20  # over a slowed link every step waits for its weights: 20 show it as well


@dataclass(frozen=True)
class Hosts:
    a: str  # namespace names
    b: str
    addr_a: str  # their addresses on the link
    addr_b: str
    dev_a: str  # their ends of the link
    dev_b: str
    link: subprocess.Popen | None = None  # the user-space link (impaired_link.py), if any


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def _two_hosts(impairment: tuple[float, float] | None = None) -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair or, with ``impairment`` (delay in ms, loss
    probability), by impaired_link.py's TUN devices; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    net = f"10.213.{random.randrange(1, 250)}"
    names = (f"vasync-{tag}-a", f"vasync-{tag}-b", f"{net}.1", f"{net}.2", f"va{tag}a", f"va{tag}b")
    made: list[str] = []
    link = None
    try:
        try:
            for ns in names[:2]:
                _ip("netns", "add", ns)
                made.append(ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"network namespaces cannot be made here: {exc.stderr.strip()}")
        h = Hosts(*names)
        if impairment is None:
            _ip("link", "add", h.dev_a, "netns", h.a, "type", "veth", "peer", "name", h.dev_b,
                "netns", h.b)  # fmt: skip
        else:
            link = _start_link(h, *impairment)
            h = Hosts(*names, link=link)
        for ns, dev, addr in ((h.a, h.dev_a, h.addr_a), (h.b, h.dev_b, h.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # each host's own loopback
        yield h
    finally:
        if link is not None and link.poll() is None:
            link.kill()
            link.wait(timeout=30)
        for ns in made:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _start_link(h: Hosts, delay_ms: float, loss: float) -> subprocess.Popen:
    """impaired_link.py between the two namespaces, once it has made both devices."""
    link = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("impaired_link.py")), h.a, h.dev_a,
         h.b, h.dev_b, "--delay-ms", str(delay_ms), "--loss", str(loss)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ready, _, _ = select.select([link.stdout], [], [], 60)
    if not ready or link.stdout.readline().strip() != "ready":
        link.kill()
        pytest.skip(f"a TUN link cannot be made here: {link.stderr.read().strip()[-500:]}")
    return link


def _link_counts(h: Hosts) -> dict[str, int]:
    """Stop the user-space link; the packets it carried, lost on purpose and could not
    deliver, both directions together."""
    h.link.terminate()
    out, _ = h.link.communicate(timeout=30)
    stats = json.loads(out.strip().splitlines()[-1])
    return {
        key: sum(d[key] for d in stats.values()) for key in ("carried", "lost", "undeliverable")
    }


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with _two_hosts() as h:
        yield h


# A ZeroMQ client without the run's keys: connects to argv[1], asks for the run, waits.
BARE_CLIENT = """
import sys, time, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.linger = 0
sock.connect(sys.argv[1])
sock.send_multipart([b"", b"hello"])
time.sleep(20)
"""


def _start(ns: str, args: list[str], log: Path) -> subprocess.Popen:
    """``verl-async ARGS`` as a process of host ``ns``."""
    return start(args, log, prefix=["ip", "netns", "exec", ns])


def _train_across(h: Hosts, tmp: Path, keys: Path, steps: int = STEPS) -> str:
    """Buffer and learner on A, a generator on B, a keyless client on B; returns what the
    run measured: seconds from the first step to the last, median step, weights a step."""
    port = 20000 + random.randrange(20000)
    address = f"tcp://{h.addr_a}:{port}"
    run_dir = tmp / "run"
    logs = {name: tmp / f"{name}.out" for name in ("buffer", "learner", "generator", "keyless")}
    join = ["--buffer", address, "--keys-dir", str(keys)]
    buffer = _start(
        h.a,
        [
            "buffer",
            "configs/tiny.yaml",
            f"trainer.total_steps={steps}",
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
    )  # fmt: skip
    procs = {"buffer": buffer}

    def buffer_log() -> str:  # the role command's output, then the buffer's own log
        log = run_dir / "logs" / "buffer.log"
        return logs["buffer"].read_text() + (log.read_text() if log.is_file() else "")

    # A role command on B without keys refuses to join a buffer off loopback, before it
    # connects: a buffer it reached could be anyone's.
    keyless_cmd = _start(
        h.b, ["generator", "--buffer", address, "--run-dir", str(tmp / "x")], logs["keyless"]
    )
    assert keyless_cmd.wait(timeout=120) == 1, logs["keyless"].read_text()[-2000:]
    assert "only with its CurveZMQ keys: pass --keys-dir" in logs["keyless"].read_text()
    # A client on B that skips that check (a bare ZeroMQ socket, no keys) is refused by the
    # buffer, which says so, before the run's own roles join; then the run goes on beside it.
    # libzmq does not name the peer of a handshake that fails before authentication.
    refusal = f"refused a client on {address}: it"
    bare = None
    try:
        deadline = time.monotonic() + 180
        while refusal not in buffer_log():
            if bare is None or bare.poll() is not None:  # connect again until it is refused
                bare = subprocess.Popen(
                    ["ip", "netns", "exec", h.b, sys.executable, "-c", BARE_CLIENT, address],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            assert buffer.poll() is None, f"the buffer ended:\n{buffer_log()[-3000:]}"
            assert time.monotonic() < deadline, "the buffer logged no refusal in 180 s"
            time.sleep(0.1)
        procs["learner"] = _start(h.a, ["learner", *join, "--timeout-s", "120"], logs["learner"])
        procs["generator"] = _start(
            h.b,
            ["generator", *join, "--index", "0", "--run-dir", str(tmp / "b")],
            logs["generator"],
        )
    finally:
        if bare is not None:
            bare.kill()
            bare.wait(timeout=30)
        wait_all(procs, logs, timeout=420)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(steps * 8)), "a group was lost or trained twice"
    learner_log = logs["learner"].read_text()  # a role command logs to its output
    assert "weight-sync epoch 0: updates go through the network" in learner_log
    loaded = [
        int(line.split("loaded version ")[1].split()[0])
        for line in logs["generator"].read_text().splitlines()
        if "loaded version " in line
    ]
    assert loaded and max(loaded) >= steps // 2, loaded[-5:]  # weights crossed the link
    times = sorted(r["step_s"] for r in rows)
    return (
        f"{steps} steps in {rows[-1]['wall_s'] - rows[0]['wall_s']:.1f} s from the first to "
        f"the last, median step {times[len(times) // 2]:.3f} s, "
        f"{rows[-1]['weight_sync_mb']:.2f} MiB of weights a step"
    )


@pytest.fixture
def keys(tmp_path) -> Path:
    assert run_cli(["keys", str(tmp_path / "keys")], timeout=60).returncode == 0
    return tmp_path / "keys"


def test_roles_on_two_hosts_train_over_curve_and_refuse_a_keyless_client(hosts, keys, tmp_path):
    print(f"two hosts: {_train_across(hosts, tmp_path, keys)}")


@pytest.fixture
def ray_cluster(hosts) -> Iterator[str]:
    """A Ray cluster of two nodes: the head on host A with 2 CPUs (the buffer's and the
    learner's bundles), a worker on host B with 1 (the generator's). Every process of it
    is stopped afterwards (those of its session folders and their children; ``ray stop``
    would stop every Ray process on the machine)."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    ray = str(Path(sys.executable).with_name("ray"))
    port = 20000 + random.randrange(20000)
    top = tempfile.mkdtemp(prefix="vray-")  # short: Ray's socket paths must fit 107 bytes
    dirs = [f"{top}/a", f"{top}/b"]
    starts = [
        (hosts.a, ["--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard",
                   "false", "--node-ip-address", hosts.addr_a, "--temp-dir", dirs[0]]),
        (hosts.b, ["--address", f"{hosts.addr_a}:{port}", "--num-cpus", "1",
                   "--node-ip-address", hosts.addr_b, "--temp-dir", dirs[1]]),
    ]  # fmt: skip
    try:
        for ns, args in starts:
            started = subprocess.run(
                ["ip", "netns", "exec", ns, ray, "start", "--num-gpus", "0", *args],
                env=env, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        os.environ.update({k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})
        yield f"{hosts.addr_a}:{port}"
    finally:
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            os.environ.pop(key, None)
        ours = [pid for d in dirs for pid in processes_mentioning(d)]
        for pid in process_tree(*ours):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(top, ignore_errors=True)


def test_launcher_ray_on_a_two_node_cluster_places_the_generator_on_the_other_host(
    hosts, keys, ray_cluster, tmp_path
):
    run_dir = tmp_path / "run"
    steps = 20
    res = subprocess.run(
        ["ip", "netns", "exec", hosts.a, sys.executable, "-m", "verl_async.launch.cli",
         "train", "configs/tiny.yaml", "--run-dir", str(run_dir), "launcher=ray",
         f"ray.address={ray_cluster}", f"buffer.host={hosts.addr_a}", f"buffer.keys_dir={keys}",
         "weights.shared_memory=false", f"trainer.total_steps={steps}",
         "checkpoint.every_steps=0"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    for role, host in (("buffer", hosts.addr_a), ("learner", hosts.addr_a),
                       ("generator0", hosts.addr_b)):  # fmt: skip
        assert re.search(rf"^ray: {role} in actor \w+ on {re.escape(host)} ", res.stderr, re.M), (
            role,
            res.stderr[-3000:],
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(steps * 8)), "a group was lost or trained twice"
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "weight-sync epoch 0: updates go through the network" in log
    loaded = re.findall(r"loaded version (\d+)", (run_dir / "logs" / "generator0.log").read_text())
    assert loaded and max(map(int, loaded)) >= steps // 2, loaded[-5:]


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
    print(f"two hosts, link {link}: {_train_across(hosts, tmp_path, keys, steps=SLOW_STEPS)}")


# A user-space link (impaired_link.py): where the kernel has netem, the case above covers
# the same; the case without impairment is only the timing baseline for the same kind of
# link (BENCHMARKS.md section 16), opt-in with the benchmark smoke runs (``-m bench``).
IMPAIRED_LINKS = {"tun-plain": (0.0, 0.0), "tun-20ms-1pct-loss": (20.0, 0.01)}


@pytest.mark.parametrize(
    "link", [pytest.param("tun-plain", marks=pytest.mark.bench), "tun-20ms-1pct-loss"]
)
def test_a_run_across_a_link_with_delay_and_loss_in_user_space_trains_every_group_once(
    keys, tmp_path, link
):
    """20 ms each way and 1 % of packets lost, both directions, between TUN devices of the
    two hosts (tests/integration/impaired_link.py), against the same link unimpaired."""
    delay_ms, loss = IMPAIRED_LINKS[link]
    with _two_hosts((delay_ms, loss)) as h:
        summary = _train_across(h, tmp_path, keys, steps=SLOW_STEPS)
        counts = _link_counts(h)
    if loss:  # the loss was real: TCP retransmitted what the link dropped
        assert counts["lost"] >= 0.5 * loss * (counts["carried"] + counts["lost"]), counts
    else:
        assert counts["lost"] == 0, counts
    print(f"two hosts, link {link}: {summary}; packets {counts}")
