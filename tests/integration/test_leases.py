"""A live run beside a client that takes work and never returns it: leases save the run.

While ``verl-async train configs/tiny.yaml`` runs 20 steps with ``buffer.lease_timeout_s``
of 15 s, a rogue DEALER socket of this test's asks the buffer for prompt groups twice, as
the run starts and mid-run (claiming the newest weights, so admission hands it groups
before the real generator has loaded them), and never returns them. Each of its leases must run out, its
groups go to the real generator, and the run must finish every step with every group
0..159 trained exactly once. The rogue is refused more than its per-connection bound, its
late rollout of an expired group is dropped by name (``Dropped``), and the buffer's log
names each expired batch with the rogue's connection.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq

from verl_async import protocol as P
from verl_async.auth import GENERATOR, load_role_token

from ..unit.test_buffer_validation import make_group
from .conftest import ROOT
from .test_buffer_fuzz import _buffer_endpoint

STEPS, B, GROUP_SIZE = 20, 8, 8  # configs/tiny.yaml: 8 groups a step, 8 samples a group
# A tiny group takes well under a second, but the first ones after the engine starts take
# several on a busy 2-core machine; a live generator whose lease runs out stops the run.
LEASE_S = 15.0
BOUND = 48  # 2 x generators.max_inflight_groups (24 in configs/tiny.yaml)
ROGUE = b"rogue-client"
TAKES = (0, 8)  # the rogue takes groups once the learner has consumed these steps
REPLY_TIMEOUT_S = 10.0


def _launch(run_dir: Path, out: Path) -> subprocess.Popen:
    args = ["train", "configs/tiny.yaml", "--run-dir", str(run_dir)]
    overrides = [
        f"trainer.total_steps={STEPS}",
        "checkpoint.every_steps=0",
        f"buffer.lease_timeout_s={LEASE_S}",
    ]
    with open(out, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "verl_async.launch.cli", *args, *overrides],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=f,
            stderr=subprocess.STDOUT,
        )


class Rogue:
    """A DEALER with a known identity (so the buffer's log names it) holding the run's
    generator token, under the real generator's id (as a compromised generator could);
    one request, one reply."""

    def __init__(self, endpoint: str, run_dir: Path) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, ROGUE)
        load_role_token(run_dir, GENERATOR).apply(self.sock)
        self.sock.connect(endpoint)
        self.rid = 0

    def request(self, body: P.Body, frames: P.Frames | None = None) -> P.Body:
        self.rid += 1
        self.sock.send_multipart(P.encode(body, self.rid, frames))
        assert self.sock.poll(int(REPLY_TIMEOUT_S * 1000)), f"no reply to {body!r:.80}"
        env, _ = P.decode(self.sock.recv_multipart())
        assert env.request_id == self.rid
        return env.body

    def take(self, want: int, until_s: float) -> list[P.PromptGroup]:
        """Ask until some groups come (admission hands them out a few at a time)."""
        deadline = time.monotonic() + until_s
        while time.monotonic() < deadline:
            version = self.request(P.GetStats()).target_version
            reply = self.request(
                P.GetPrompts(generator_id=0, loaded_version=version, max_groups=want)
            )
            assert isinstance(reply, P.Prompts), reply
            if reply.groups:
                return reply.groups
            time.sleep(0.01)
        raise AssertionError(f"the rogue got no groups in {until_s:.0f}s")

    def wait_for(self, what, timeout_s: float = 120.0) -> P.Stats:
        deadline = time.monotonic() + timeout_s
        while not what(stats := self.request(P.GetStats())):
            assert time.monotonic() < deadline, f"stats never got there: {stats}"
            time.sleep(0.05)
        return stats

    def close(self) -> None:
        self.sock.close(linger=0)


def _late_push(rogue: Rogue, issued: P.PromptGroup) -> str:
    """A rollout of ``issued`` that is valid in every field: only its lease ran out."""
    ver = np.zeros(2 * GROUP_SIZE, np.int32)
    k = issued.group_id
    prompt = np.array(issued.prompt_ids, np.int32)
    group, frames = make_group(
        k=k, n=GROUP_SIZE, tokens=2, generator_id=0, lease=issued.lease, ver=ver, prompt=prompt
    )
    group = msgspec.structs.replace(
        group, prompt_id=issued.prompt_id, data_source=issued.data_source
    )
    reply = rogue.request(P.PushRollouts(groups=[group]), frames)
    assert reply == P.Dropped(group_ids=[k], reason="lease expired"), reply
    return reply.reason


def _play_rogue(rogue: Rogue) -> tuple[list[list[int]], str, str]:
    """(the groups of each take, the bound's error, the late push's error)."""
    too_many = rogue.request(P.GetPrompts(generator_id=0, loaded_version=0, max_groups=BOUND + 1))
    assert isinstance(too_many, P.Error), too_many
    takes = [rogue.take(4, until_s=60.0)]  # at once, while the generator's engine starts
    first = len(takes[0])
    rogue.wait_for(lambda s: s.leases_expired >= first, LEASE_S + 30)
    late = _late_push(rogue, takes[0][0])  # its lease ran out: returned too late
    for at_step in TAKES[1:]:
        rogue.wait_for(lambda s, at=at_step: s.consumed >= at * B)
        takes.append(rogue.take(4, until_s=60.0))
    return [[g.group_id for g in t] for t in takes], too_many.message, late


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_groups_a_client_never_returns_are_issued_again_and_trained_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, tmp_path / "cli.log")
    rogue = None
    try:
        rogue = Rogue(_buffer_endpoint(run_dir, proc), run_dir)
        takes, bound_error, late_error = _play_rogue(rogue)
        taken = [g for t in takes for g in t]
        rc = proc.wait(timeout=300)
    finally:
        if rogue is not None:
            rogue.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    cli_log = (tmp_path / "cli.log").read_text()
    assert rc == 0, cli_log[-3000:]
    # A lapsed group goes back to the head of the queue, so the rogue, which claims the
    # newest weights, may be handed it again before the real generator asks: allowed, as
    # long as that lease lapses too (the log check below counts every lease it held).
    assert len(taken) >= len(TAKES) and all(len(t) == len(set(t)) for t in takes), takes
    assert f"a connection may hold at most {BOUND} at once" in bound_error, bound_error
    assert late_error == "lease expired"

    # Exactly once: every step trained, every group of the run in it once, nothing dropped.
    rows, trail = _rows(run_dir / "metrics.jsonl"), _rows(run_dir / "trained.jsonl")
    assert [r["step"] for r in rows] == [t["step"] for t in trail] == list(range(STEPS))
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * B)), "a group was lost or trained twice"
    assert all(r["dropped_stale"] == 0 and r["samples"] == B * GROUP_SIZE for r in rows)

    # The log names every expired batch: the rogue's, and only the rogue's.
    log = (run_dir / "logs" / "buffer.log").read_text()
    expired = re.findall(r"lease of (\d+) groups on connection (\w+) \(generator (\d+)\)", log)
    assert expired, log[-2000:]
    assert {(c, g) for _, c, g in expired} == {(ROGUE.hex(), "0")}, expired
    assert sum(int(n) for n, _, _ in expired) == len(taken)
    assert "Traceback" not in log
