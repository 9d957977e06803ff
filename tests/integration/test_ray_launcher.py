"""``launcher: ray``: the tiny task with two vLLM generators and a learner, each role a
Ray actor in its placement group on a local Ray instance (CPU), run through the CLI, with
the learner killed once mid-run (the run resumes by itself in a new Ray instance); and the
GPUs a multi-GPU role is handed, on a local instance told of GPUs it does not have.

Short on purpose (a Ray start costs seconds on a 2-core machine): what it checks is the
launcher (every role placed, watched, stopped and started again, Ray gone afterwards), not
learning, which test_scale_out.py checks in the same shape."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from verl_async.config import load_config
from verl_async.launch import ray_roles
from verl_async.launch.plan import RolePlan

from .conftest import ROOT, cmdline, committed_steps, processes_mentioning, steps_done

STEPS = 12
ROLES = ("buffer", "learner", "generator0", "generator1")


def test_two_generators_and_a_learner_train_as_ray_actors(tmp_path):
    run_dir = tmp_path / "run"
    seed = random.randrange(2**32)  # in the failure message: the kill point replays
    kill_at = random.Random(seed).randint(4, 8)  # a step after the first checkpoint (3)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "verl_async.launch.cli",
            "train", "configs/tiny.yaml", "--run-dir", str(run_dir), "launcher=ray",
            f"trainer.total_steps={STEPS}", "checkpoint.every_steps=3",
            "trainer.max_restarts=1",
            "placement.generators=[cpu, cpu]", "placement.learners=[cpu]",
        ],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        # A kill before the first commit would start the run over instead of resuming it.
        while steps_done(run_dir) < kill_at or not committed_steps(run_dir):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the kill point"
            time.sleep(0.05)
        learner = [p for p in processes_mentioning(str(run_dir)) if " -m learners " in cmdline(p)]
        assert len(learner) == 1, learner
        os.kill(learner[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (kill_at, seed, err[-3000:])
    assert "restart 1/1: the learner process exited with code -9" in err
    sessions = re.findall(r"local instance \(4 CPU, 0 GPU; session files in (\S+)\)", err)
    assert len(sessions) == 2, err[-3000:]  # sized to the 4 bundles, not to this machine
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * 8))  # every group trained exactly once
    assert "resumed from step_" in (run_dir / "logs" / "learner.log").read_text()
    for role in ROLES:  # placed by the launcher, and started from inside its actor, twice
        assert len(re.findall(rf"^ray: {role} in actor \w+ on \S+ \(placement group \w+",
                              err, re.M)) == 2  # fmt: skip
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert re.search(
            rf"verl-async: {role} in Ray actor \w+ on node \S+ \(placement group \w+", log
        )
    for i in (0, 1):  # both engines generated and followed the pushed weights
        gen = (run_dir / "logs" / f"generator{i}.log").read_text()
        loaded = [int(v) for v in re.findall(r"loaded version (\d+)", gen)]
        assert loaded and max(loaded) >= STEPS // 2, (i, loaded[-5:])
    # The launch that lost its learner keeps Ray's logs (docs/ray.md), the last one does not.
    assert f"Ray's own logs: {sessions[0]}" in err
    assert processes_mentioning(sessions[0]) == []
    shutil.rmtree(sessions[0])
    _assert_ray_is_gone(Path(sessions[1]))


def _assert_ray_is_gone(session: Path) -> None:
    """No process of this test's Ray instance (raylet, gcs_server, workers) is left, and
    its session folder was removed (the run succeeded)."""
    deadline = time.monotonic() + 60  # raylet, gcs and workers on 2 loaded cores
    while processes_mentioning(str(session)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(session)) == []
    assert not session.exists()


def test_a_role_over_two_gpus_sees_both_of_its_bundles_gpus(tmp_path, monkeypatch):
    """The GPU hand-over without GPUs: a local instance is told of the three GPUs the
    placement names (Ray schedules logical GPUs), and each role prints what it sees. A
    two-GPU group's actor holds one bundle; the other bundle's GPU is added for its role."""
    show = [sys.executable, "-c", "import os; print('sees', os.environ['CUDA_VISIBLE_DEVICES'])"]
    plans = [
        RolePlan("pair", "x", {}, devices=["cuda:0", "cuda:1"], argv=show),
        RolePlan("single", "x", {}, devices=["cuda:2"], argv=show),
    ]
    monkeypatch.setattr(ray_roles, "plan_roles", lambda cfg, run_dir: plans)
    (tmp_path / "logs").mkdir()
    console = Console(file=io.StringIO(), width=200)
    with ray_roles.ray_roles(load_config(None, ["launcher=ray"]), tmp_path, console) as roles:
        assert [role.proc.wait(timeout=60) for role in roles] == [0, 0]
    out = console.file.getvalue()
    assert "local instance (3 CPU, 3 GPU;" in out  # a CPU per bundle
    seen = {}
    for name in ("pair", "single"):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        seen[name] = re.search(r"^sees (\S+)$", log, re.M).group(1).split(",")
    assert len(seen["pair"]) == 2 and len(seen["single"]) == 1
    assert sorted(seen["pair"] + seen["single"]) == ["0", "1", "2"]  # each GPU once
    _assert_ray_is_gone(Path(re.search(r"session files in (\S+)\)", out).group(1)))
