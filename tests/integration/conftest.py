import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from generators.engines import start_engine
from generators.interface import RolloutEngine
from verl_async.checkpoint import MANIFEST, list_checkpoints
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import TinyModelConfig

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:  # every collected test comes here: mark only this directory's
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


ENGINES = ["vllm", "hf"]  # generators.engine: every engine-level test runs on both


def start_test_engine(kind: str, cfg, model_path: Path, seed: int) -> RolloutEngine:
    """A generator engine of ``kind`` in this process, started as a generator starts it
    (``generators.engines.start_engine``); call it inside a running event loop."""
    generators = msgspec.structs.replace(cfg.generators, engine=kind)
    return start_engine(msgspec.structs.replace(cfg, generators=generators), str(model_path), seed)


def start_engine_in_group(kind: str, cfg, model_path: Path, seed: int = 0):
    """(event loop, engine, learner's end): a test engine of ``kind`` on an event loop of
    its own, joined as rank 1 to a real two-member gloo weight-sync group whose rank 0 is
    this process (what a test pushes weights through)."""
    from verl_async.runtime import free_port
    from verl_async.weight_sync import join_group

    loop = asyncio.new_event_loop()
    port = free_port()

    async def start():
        return start_test_engine(kind, cfg, model_path, seed)

    engine = loop.run_until_complete(start())
    holder = {}
    joiner = threading.Thread(
        target=lambda: holder.setdefault("g", join_group("127.0.0.1", port, 0, 2, "gloo", 60))
    )
    joiner.start()
    loop.run_until_complete(engine.join_weight_sync("127.0.0.1", port, 2, 1, "gloo"))
    joiner.join(60)
    return loop, engine, holder["g"]


@contextlib.contextmanager
def hf_wave_held_until_abort(engine, timeout_s: float = 30.0):
    """The transformers engine's next wave samples its first token only once an
    abort-mode swap has asked it to stop (``engine.abort``): every request of the wave
    then has one token of the old version and goes on under the new one, however fast
    the machine. Undone on exit."""
    from generators import hf_engine

    real, held = hf_engine.sample_processed, [False]

    def sample_processed(logits, how, rng):
        if not held[0]:
            held[0] = True
            assert engine.abort.wait(timeout_s), "no abort-mode swap came"
        return real(logits, how, rng)

    hf_engine.sample_processed = sample_processed
    try:
        yield
    finally:
        hf_engine.sample_processed = real


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"), TinyModelConfig())


def run_cli(args: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "verl_async.launch.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch_gated(args: list[str], gate: Path, out: Path) -> subprocess.Popen:
    """``verl-async ARGS`` in the background, its learner gated (tests/slow_learner.py
    ``--gate``: update n waits until the file ``gate`` holds n or more), its output in
    ``out``: the test, not the machine's speed, says how far the run may go."""
    from benchmarks.custom_learner import command

    with open(out, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command("tests.slow_learner", ["--gate", str(gate)], args),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def wait_for(proc: subprocess.Popen, done, what: str, out: Path, timeout_s: float = 300) -> None:
    """Poll ``done()`` until true; fail (with the end of ``out``) if the run ends first or
    ``timeout_s`` pass."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, f"the run ended before {what}:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f}s"
        time.sleep(0.05)


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (no pkill: we only look)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def steps_done(run_dir: Path) -> int:
    """Steps of the run in ``run_dir`` logged so far (lines of its metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def committed_steps(run_dir: Path) -> list[int]:
    """Steps of the checkpoints in ``run_dir`` whose manifest is written (committed ones)."""
    return [int(d.name[5:]) for d in list_checkpoints(run_dir) if (d / MANIFEST).is_file()]


def process_tree(*roots: int) -> list[int]:
    """``roots`` and all their descendants (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cmdline(pid: int) -> str:
    """The command line of process ``pid`` ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
