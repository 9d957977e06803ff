"""Helpers shared by the benchmark scripts: run a real training job, read and smooth metrics."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from custom_learner import command

ROOT = Path(__file__).resolve().parents[1]


def train_command(
    config: Path, run_dir: Path, overrides: list[str], learner: list[str] | None = None
) -> list[str]:
    """``verl-async train CONFIG --run-dir RUN_DIR overrides...``; with ``learner``, the
    learner is benchmarks/bench_learner.py with those options (``--prefill-steps P``,
    ``--alternate B``)."""
    args = ["train", str(config), "--run-dir", str(run_dir), *overrides]
    if learner is not None:
        return command("benchmarks.bench_learner", learner, args)
    return [sys.executable, "-m", "verl_async.launch.cli", *args]


def run_to_end(cmd: list[str], what: str) -> float:
    """Run ``cmd`` from the repository root to its end; returns its seconds. A failure
    stops the benchmark with the end of the command's stderr, headed by ``what``."""
    t0 = time.monotonic()
    res = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if res.returncode != 0:
        raise SystemExit(f"{what} failed:\n{res.stderr[-3000:]}")
    return time.monotonic() - t0


def run_train(
    config: Path, run_dir: Path, overrides: list[str], learner: list[str] | None = None
) -> tuple[list[dict], float]:
    """Run ``train_command(...)`` to the end (from the repository root); returns (metrics
    rows, seconds)."""
    seconds = run_to_end(
        train_command(config, run_dir, overrides, learner),
        f"run {run_dir.name} ({' '.join(overrides)})",
    )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return rows, seconds


@contextmanager
def sampled_load(every_s: float = 5.0) -> Iterator[list[float]]:
    """The machine's 1-minute load average, sampled every ``every_s`` while the block runs:
    yields the list that the samples are appended to. On a shared machine it tells which
    timings other work slowed down."""
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append(os.getloadavg()[0])
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=sample, name="load-sampler", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def interrupt(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Stop a ``verl-async train`` as Ctrl-C would (SIGINT: roles stopped in order), and
    kill it if it has not exited after ``timeout_s``."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file ([] when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rolling(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def time_to_target(
    rewards: list[float], times: list[float], window: int, target: float
) -> tuple[int | None, float | None]:
    """(step, seconds) of the first step whose trailing ``window``-step mean reward is at
    least ``target``, counting only steps with a full window; (None, None) if none is."""
    for i, value in enumerate(rolling(rewards, window)):
        if i >= window - 1 and value >= target:
            return i, times[i]
    return None, None


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def machine() -> str:
    """'N cores, X GiB RAM, <GPU or no GPU>' for the benchmark tables."""
    cores = os.cpu_count()
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        ram = f"{kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        ram = "RAM unknown"
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no GPU"
    return f"{cores} cores ({platform.machine()}), {ram}, {gpu}"
