"""Buffer, generator and learner started as three separate commands, as a user would on
three machines: the roles find each other through the buffer's address alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import ROOT, run_cli
from verl_async.runtime import free_port

STEPS = 12


def start(args: list[str], log: Path, prefix: list[str] = ()) -> subprocess.Popen:
    """``verl-async ARGS`` in a session of its own, its output in ``log``; ``prefix``: what
    runs the command (``ip netns exec NS`` for a process of another host)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "verl_async.launch.cli", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout: float) -> None:
    try:
        for name, proc in procs.items():
            code = proc.wait(timeout=timeout)
            assert code == 0, f"{name} exited {code}:\n{logs[name].read_text()[-3000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def test_three_commands_train_the_tiny_task_over_authenticated_sockets(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    run_dir, gen_dir = tmp_path / "run", tmp_path / "generator_machine"
    keys = tmp_path / "keys"
    assert run_cli(["keys", str(keys)], timeout=60).returncode == 0
    logs = {name: tmp_path / f"{name}.out" for name in ("buffer", "generator", "learner")}
    join = ["--buffer", address, "--keys-dir", str(keys)]
    procs = {
        "buffer": start(
            [
                "buffer",
                "configs/tiny.yaml",
                f"trainer.total_steps={STEPS}",
                f"buffer.port={address.rsplit(':', 1)[1]}",
                f"buffer.keys_dir={keys}",
                "--run-dir",
                str(run_dir),
            ],
            logs["buffer"],
        ),  # fmt: skip
        # As on another machine: a run directory of its own.
        "generator": start(
            ["generator", *join, "--index", "0", "--run-dir", str(gen_dir)],
            logs["generator"],
        ),
        "learner": start(["learner", *join, "--timeout-s", "120"], logs["learner"]),
    }
    wait_all(procs, logs, timeout=420)

    assert f"verl-async learner --buffer {address}" in logs["buffer"].read_text()
    assert "refused a client" not in logs["buffer"].read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["samples"] > 0 for r in rows)
    # every group the learner trained on, exactly once
    trail = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    groups = [tuple(g) for t in trail for g in t["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * 8
    # the generator's directory holds the run's files; the model it loaded is the buffer's
    assert (gen_dir / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()
    model_path = json.loads((gen_dir / "endpoints.json").read_text())["model_path"]
    assert model_path == str(run_dir / "model")


def test_joining_a_buffer_that_never_answers_fails_naming_it(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "generator.out"
    proc = start(["generator", "--buffer", address, "--timeout-s", "2"], log)
    assert proc.wait(timeout=60) == 1
    assert f"cannot join the run at {address}" in log.read_text()


def test_generator_index_out_of_range_is_one_clear_error(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    buffer = start(
        ["buffer", "configs/tiny.yaml", f"buffer.port={address.rsplit(':', 1)[1]}",
         "--run-dir", str(run_dir)],
        tmp_path / "buffer.out",
    )  # fmt: skip
    try:
        log = tmp_path / "generator.out"
        gen = start(["generator", "--buffer", address, "--index", "3"], log)
        assert gen.wait(timeout=120) == 1
        assert "--index 3: placement.generators has 1 group(s) (0..0)" in log.read_text()
    finally:
        os.killpg(buffer.pid, 9)
        buffer.wait()
