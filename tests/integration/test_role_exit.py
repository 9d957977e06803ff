"""A role that ends on an exception says why in its log's last line: a real tiny run whose
learner calls ``sys.exit(2)`` inside its first update (tests/exiting_learner.py)."""

from __future__ import annotations

import subprocess

from benchmarks.custom_learner import command

from .conftest import ROOT


def test_a_learner_that_exits_inside_its_loop_names_the_exit_last_in_its_log(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "train", "configs/tiny.yaml", "--run-dir", str(run_dir), "trainer.max_restarts=0",
        "checkpoint.every_steps=0", "eval.every_steps=0",
    ]  # fmt: skip
    res = subprocess.run(
        command("tests.exiting_learner", [], args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert "the learner process exited with code 2" in res.stderr, res.stderr[-3000:]
    lines = (run_dir / "logs" / "learner.log").read_text().splitlines()
    last = [line for line in lines if line.strip()][-1]
    assert " ERROR " in last, lines[-30:]
    assert "ended by SystemExit: 2, raised at tests/exiting_learner.py:" in last, last
    assert last.endswith("in give_up (exit code 2)"), last
    assert any("Traceback (most recent call last)" in line for line in lines[-40:])
