"""A live training run under fire: hostile input on the buffer's socket changes nothing.

While ``verl-async train configs/tiny.yaml`` runs, this test fires thousands of
hypothesis-generated messages at its buffer from a DEALER socket of its own: random
bytes, broken envelopes, replies sent as requests, requests with a field out of range,
and rollouts for groups this socket was never issued (plausible ids: in flight to the
real generator, already returned, consumed; duplicates; thousands of groups at once).
Each must be answered with an ``Error``, and then the run must be exactly what it would
have been: it exits 0, trains every step, every group exactly once, nothing dropped, and
the buffer's log names the rejections in a few lines, not thousands.

The run lasts as long as the hostile traffic needs, on any machine: the learner is gated
(tests/slow_learner.py ``--gate``) and may take one step for every ``MESSAGES_PER_STEP``
messages fired, never its last one until the fuzzer has sent its quota and seen every kind
of rejection it aims for. Only then is the gate opened and the run let finish.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from benchmarks.custom_learner import command
from verl_async import protocol as P
from verl_async.auth import GENERATOR, LEARNER, load_role_token
from verl_async.transport import BufferClient, BufferUnavailable

from ..unit.test_buffer_validation import _envelope, hostile_messages, make_group, received
from .conftest import ROOT, processes_mentioning

STEPS, B, GROUP_SIZE = 200, 8, 8  # configs/tiny.yaml: 8 groups a step, 8 samples a group
QUOTA = 2_000  # hostile messages fired while the run trains
# Steps are let through at this pace, so the quota is reached about half-way: the
# second half of the run is still there for a kind of rejection not yet seen.
MESSAGES_PER_STEP = 2 * QUOTA // STEPS
REPLY_TIMEOUT_S = 10.0
BATCH = 50  # messages per hypothesis run; the run's progress is looked at in between
MAX_MESSAGES = 5 * QUOTA  # then it fails with its counts rather than fire on and on
AIMED = ("on another connection", "already returned", "never issued")  # rollouts' rejections


def _launch(run_dir: Path, gate: Path, out: Path) -> subprocess.Popen:
    args = ["train", "configs/tiny.yaml", "--run-dir", str(run_dir)]
    overrides = [f"trainer.total_steps={STEPS}", "checkpoint.every_steps=0"]
    with open(out, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command("tests.slow_learner", ["--gate", str(gate)], [*args, *overrides]),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def _buffer_endpoint(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> str:
    """The buffer's address once the launcher has written it and the buffer answers."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "endpoints.json"
    while not path.is_file():
        assert proc.poll() is None, "the run ended before it wrote endpoints.json"
        assert time.monotonic() < deadline, "no endpoints.json"
        time.sleep(0.2)
    endpoint = json.loads(path.read_text())["buffer"]
    client = BufferClient(endpoint, timeout_s=2.0, credentials=load_role_token(run_dir, LEARNER))
    try:
        while True:
            try:
                client.request(P.GetStats())
                return endpoint
            except BufferUnavailable:
                assert proc.poll() is None and time.monotonic() < deadline, "buffer never up"
    finally:
        client.close()


class Fuzzer:
    """One DEALER socket, holding the run's generator token (the worst a compromised
    generator can do: every role check passes for it, so its messages reach every
    handler a generator's can); one message out, its one reply in (every receive has a
    deadline). After each message it moves the learner's gate: one step per
    ``MESSAGES_PER_STEP`` messages, the last step only once ``satisfied``."""

    def __init__(self, endpoint: str, run_dir: Path, gate: Path) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        load_role_token(run_dir, GENERATOR).apply(self.sock)
        self.sock.connect(endpoint)
        self.run_dir = run_dir
        self.buffer_cmd = f"-m buffer --run-dir {run_dir}"
        self.sent = 0
        self.codes: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()
        self.over = False  # the buffer has exited (the run is over)
        self.gate, self.opened = gate, -1

    @property
    def satisfied(self) -> bool:
        return self.sent >= QUOTA and all(self.messages[kind] > 0 for kind in AIMED)

    def pace(self) -> None:
        steps = STEPS if self.satisfied else min(self.sent // MESSAGES_PER_STEP, STEPS - 1)
        if steps != self.opened:
            tmp = self.gate.with_suffix(".tmp")
            tmp.write_text(str(steps))
            tmp.replace(self.gate)  # the learner never reads half a number
            self.opened = steps

    def exchange(self, parts: list[bytes]) -> None:
        if self.over:
            return
        self.sock.send_multipart(parts)
        self.sent += 1
        self.pace()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self.sock.poll(200):
            if not processes_mentioning(self.buffer_cmd):
                self.over = True  # stopped at the end of the run (or crashed: rc says)
                return
            assert time.monotonic() < deadline, f"no reply in {REPLY_TIMEOUT_S}s to {parts[:1]}"
        env, _ = P.decode(self.sock.recv_multipart())
        assert isinstance(env.body, P.Error), f"{env.body} accepted from {parts[:1]}"
        assert env.body.code in ("protocol", "rejected", "unexpected", "forbidden"), env.body
        self.codes[env.body.code] += 1
        self.messages[_kind(env.body.message)] += 1
        self.pace()

    def fire(self, group_ids: st.SearchStrategy[int]) -> None:
        """BATCH hypothesis-generated messages, each answered before the next."""

        @settings(
            max_examples=BATCH,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(parts=hostile_messages(group_ids, GROUP_SIZE))
        def one(parts):
            self.exchange(parts)

        one()

    def collide(self, group_id: int) -> None:
        """One well-formed rollout of ``group_id`` under the real generator's id (0): if
        the group is in flight, only the connection check stands in its way."""
        frames = P.Frames()
        group, _ = make_group(
            k=group_id,
            n=GROUP_SIZE,
            tokens=2,
            frames=frames,
            ver=np.zeros(2 * GROUP_SIZE, np.int32),
        )
        self.exchange([_envelope(P.PushRollouts(groups=[group]), 1), *received(frames)])

    def close(self) -> None:
        self.sock.close(linger=0)


def _kind(message: str) -> str:
    for kind in ("on another connection", "never issued", "already returned", "twice"):
        if kind in message:
            return kind
    return "other"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _fuzz_until_the_run_ends(fuzzer: Fuzzer, endpoint: str, proc: subprocess.Popen) -> None:
    """Fire batches until the buffer is gone (the fuzzer opens the learner's gate fully
    once it is satisfied, so the run then ends). Each batch aims part of its rollouts at the groups in
    flight right now (asked with GetStats, a harmless request: about the last
    ``issued - returned`` ids issued) to collide with the real generator's, and one
    rollout straight at the latest group issued (hypothesis favours the ends of a range,
    and the low end is usually returned already)."""
    stats_client = BufferClient(
        endpoint, timeout_s=REPLY_TIMEOUT_S, credentials=load_role_token(fuzzer.run_dir, LEARNER)
    )
    try:
        while not fuzzer.over and proc.poll() is None and fuzzer.sent < MAX_MESSAGES:
            try:
                stats, _ = stats_client.request(P.GetStats())
            except BufferUnavailable:
                break  # the buffer is gone: the run is ending
            issued, out = stats.issued, max(stats.issued - stats.returned, 1)
            in_flight = st.integers(max(issued - out, 0), issued)
            if issued > 0:
                fuzzer.collide(issued - 1)
            fuzzer.fire(st.one_of(in_flight, in_flight, st.integers(-3, STEPS * B + 16)))
    finally:
        stats_client.close()


def test_a_run_under_hostile_input_completes_and_trains_every_group_once(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    gate = tmp_path / "gate"
    proc = _launch(run_dir, gate, tmp_path / "cli.log")
    fuzzer = None
    try:
        endpoint = _buffer_endpoint(run_dir, proc)
        fuzzer = Fuzzer(endpoint, run_dir, gate)
        t_fuzz = time.monotonic()
        _fuzz_until_the_run_ends(fuzzer, endpoint, proc)
        fuzz_s = time.monotonic() - t_fuzz
        gate.write_text(str(STEPS))  # satisfied or not (MAX_MESSAGES), let the run end
        rc = proc.wait(timeout=300)
    finally:
        if fuzzer is not None:
            fuzzer.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    cli_log = (tmp_path / "cli.log").read_text()
    print(
        f"sent {fuzzer.sent} hostile messages in {fuzz_s:.0f}s; replies {dict(fuzzer.codes)}; "
        f"rollouts {dict(fuzzer.messages)}; run {time.monotonic() - t0:.0f}s"
    )
    assert rc == 0, cli_log[-3000:]
    # The gate opened on the fuzzer's word alone: the quota was fired while the run
    # trained, and rollouts hit groups in flight, returned and never issued.
    assert fuzzer.opened == STEPS and fuzzer.satisfied, (fuzzer.sent, dict(fuzzer.messages))
    # (a learner's request from the generator's connection is "forbidden")
    assert {"protocol", "rejected", "unexpected"} <= set(fuzzer.codes)
    assert set(fuzzer.codes) <= {"protocol", "rejected", "unexpected", "forbidden"}

    # Exactly once: every step trained, every group of the run in it once, nothing dropped.
    rows, trail = _rows(run_dir / "metrics.jsonl"), _rows(run_dir / "trained.jsonl")
    assert [r["step"] for r in rows] == [t["step"] for t in trail] == list(range(STEPS))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * B)), "a group was lost or trained twice"
    assert all(r["dropped_stale"] == 0 and r["samples"] == B * GROUP_SIZE for r in rows)

    # The log names the rejections, rate-limited: a burst of 20 lines and one summary
    # per 10 s window, however many thousands arrived; no handler failed.
    log = (run_dir / "logs" / "buffer.log").read_text()
    lines = log.splitlines()
    rejected = [line for line in lines if "rejected " in line or "bad message from" in line]
    summaries = [line for line in lines if "were not logged" in line]
    windows = fuzz_s / 10.0 + 2
    assert rejected and summaries, log[-2000:]
    assert len(rejected) + len(summaries) <= 21 * windows, len(rejected)
    assert len(lines) < 40 * windows
    # A handler that raised logs "<Request> from <peer> failed" with its traceback; a
    # rejection may say "failed" too ("failed counts"), so match the handler's line.
    assert "Traceback" not in log and not re.search(r" from [0-9a-f]+ failed", log)
