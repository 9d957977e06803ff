"""On-policy distillation through the real processes: ``verl-async train
configs/tiny_distill.yaml`` (buffer, generator, learner, and a tiny teacher of another seed)
for a few asynchronous steps: k3 as a loss with the teacher in the learner, k1 as a
per-token reward through the PPO-clip loss on two learner ranks with the teacher in its own
process (the generator asks it before pushing each group), and forward_kl_topk as a loss
over the teacher's top 8 tokens (in the learner: a teacher process gives no top k). Every
group is trained
exactly once, no sample is ever staler than the bound, every sampled token is scored by
the teacher, and the per-token reverse KL to it is reported each step. A teacher process
SIGKILLed mid-run is started again by the launcher, and the run loses and repeats no
group."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, cmdline, processes_mentioning, run_cli

STEPS, GROUPS = 6, 4


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# k3 with a teacher process on one rank: test_a_sigkilled_teacher_process_... below.
CASES = {
    "k3-loss-teacher-in-learner": ["placement.learners=[cpu]", "distillation.scoring=learner"],
    "k1-reward-two-ranks": [
        "placement.learners=[cpu, cpu]",
        "distillation.loss_mode=k1",
        "distillation.use_policy_gradient=true",
    ],
    # the teacher's top 8 at each sampled token, the student's log-probs of them in its
    # update pass; the forward KL over them as the loss
    "forward_kl_topk-loss-one-rank": [
        "placement.learners=[cpu]",
        "distillation.scoring=learner",
        "distillation.loss_mode=forward_kl_topk",
        "distillation.topk=8",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_distillation_run_trains_every_group_once(tmp_path, case):
    run_dir = tmp_path / "run"
    res = run_cli(
        ["train", "configs/tiny_distill.yaml", "--run-dir", str(run_dir),
         f"trainer.total_steps={STEPS}", f"learner.groups_per_step={GROUPS}",
         "checkpoint.every_steps=0", *CASES[case]],
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows, trail = _rows(run_dir / "metrics.jsonl"), _rows(run_dir / "trained.jsonl")
    assert [r["step"] for r in rows] == [t["step"] for t in trail] == list(range(STEPS))
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * GROUPS)), "a group was lost or trained twice"
    _check_rows(rows, case, in_learner="distillation.scoring=learner" in CASES[case])
    assert (run_dir / "teachers" / "tiny_seed1" / "config.json").is_file()


def _check_rows(rows: list[dict], case: str, in_learner: bool) -> None:
    for r in rows:
        assert r["dropped_stale"] == 0 and r["staleness_max"] <= 2
        assert r["distill/scored_fraction"] == 1.0
        assert r["distill/tiny_seed1/tokens"] > 0
        kl = r["distill/tiny_seed1/reverse_kl"]
        # Two differently seeded random models disagree: the estimate is finite and not 0.
        assert math.isfinite(kl) and kl != 0.0
        assert math.isfinite(r["distill/loss"])
        if not case.startswith("k1"):
            assert r["distill/loss"] > 0  # k3 and forward_kl_topk >= 0; the models differ
        if in_learner:
            assert r["distill/score_s"] >= 0
        else:  # the generators waited for the teacher process, which computed part of it
            assert "distill/score_s" not in r
            if "distill/teacher_wait_s" in r:
                assert 0 < r["distill/teacher_busy_s"] <= r["distill/teacher_wait_s"]
    if not in_learner:
        assert any("distill/teacher_wait_s" in r for r in rows)


def _teacher_pids(run_dir: Path) -> list[int]:
    return [p for p in processes_mentioning(str(run_dir)) if " -m teacher " in cmdline(p)]


def test_a_sigkilled_teacher_process_is_restarted_and_no_group_is_lost_or_repeated(tmp_path):
    """The teacher's process is SIGKILLed after the third step, while the generator asks
    it for scores; the launcher starts it again, the generator asks again for what got no
    answer (distillation.timeout_s), and every group of the run is trained exactly once."""
    run_dir, steps = tmp_path / "run", 14
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_async.launch.cli", "train", "configs/tiny_distill.yaml",
         "--run-dir", str(run_dir), f"trainer.total_steps={steps}",
         f"learner.groups_per_step={GROUPS}", "checkpoint.every_steps=0",
         "placement.learners=[cpu]", "distillation.timeout_s=10"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and len(_rows(metrics)) >= 3):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no third step"
            time.sleep(0.05)
        first = _teacher_pids(run_dir)
        assert len(first) == 1
        os.kill(first[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "teacher_tiny_seed1" in out + err and "restart" in (out + err).lower()
    log = (run_dir / "logs" / "teacher_tiny_seed1.log").read_text()
    assert log.count("serving on") == 2, "the teacher was not started again"
    rows, trail = _rows(metrics), _rows(run_dir / "trained.jsonl")
    assert [r["step"] for r in rows] == [t["step"] for t in trail] == list(range(steps))
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(steps * GROUPS)), "a group was lost or trained twice"
    _check_rows(rows, "k3", in_learner=False)
