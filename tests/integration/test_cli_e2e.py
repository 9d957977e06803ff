"""``verl-async`` as a user runs it, output redirected (not a terminal): --version, a bad
data file, progress lines, a preempted run without a checkpoint started over with
``checkpoint.resume=true``, and ``--resume RUN_DIR`` without the config."""

import json
import re
from importlib.metadata import version

from verl_async.checkpoint import MANIFEST, list_checkpoints

from .conftest import run_cli


def _steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _progress(stderr: str) -> list[str]:
    return re.findall(r"^step (\d+/\d+) .*reward .*lag .*tok/s.*elapsed .*ETA \S+$", stderr, re.M)


def test_version():
    res = run_cli(["--version"], timeout=60)
    assert res.returncode == 0 and res.stdout == f"verl-async {version('verl-async')}\n"


def test_a_malformed_data_line_stops_train_with_one_line_and_exit_2(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b" "answer": "2"}\n')
    run_dir = tmp_path / "run"
    res = run_cli(
        ["train", "configs/tiny.yaml", "--run-dir", str(run_dir), f"data.path={data}"], timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr == (
        f"verl-async: config error: bad value for 'data.path': line 2 of '{data}' is not "
        "valid JSON (Expecting ',' delimiter, column 16)\n"
    )
    assert not run_dir.exists()


def test_progress_lines_a_restart_without_checkpoint_and_resume_without_config(tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "configs/tiny.yaml", "--run-dir", str(run_dir)]

    # 1. Without a terminal: a plain progress line every trainer.log_every steps.
    first = run_cli(
        [*train, "trainer.total_steps=4", "trainer.log_every=2", "checkpoint.every_steps=0"],
        timeout=400,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert _progress(first.stderr) == ["2/4", "4/4"], first.stderr
    assert _steps(run_dir) == [0, 1, 2, 3] and not list_checkpoints(run_dir)

    # 2. The same directory with checkpoint.resume=true and no checkpoint: started over.
    second = run_cli(
        [*train, "checkpoint.resume=true", "trainer.total_steps=6", "checkpoint.every_steps=3"],
        timeout=400,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "starts over" in second.stderr
    assert _steps(run_dir) == [0, 1, 2, 3, 4, 5]
    assert "starts over" in (run_dir / "logs" / "learner.log").read_text()
    assert (run_dir / "checkpoints" / "step_00000006" / MANIFEST).is_file()

    # 3. --resume without the config: RUN_DIR/config.yaml, plus the overrides given.
    third = run_cli(["train", "--resume", str(run_dir), "trainer.total_steps=8"], timeout=400)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resuming from step_00000006" in third.stderr
    assert _steps(run_dir) == list(range(8))
    assert _progress(third.stderr)[-1] == "8/8"
