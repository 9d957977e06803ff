"""Rewards through the real processes: a tiny sequence-classification reward model in its
own process beside two rule sources, evaluation rounds, and a reward model that dies."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from benchmarks.custom_learner import command
from benchmarks.tiny_reward_model import build_tiny_reward_model

from .conftest import ROOT, cmdline, launch_gated, processes_mentioning, steps_done, wait_for

STEPS = 30  # the reward-model restart test: killed after 5, back before the last 15

SOURCES = (
    "rewards.sources=["
    "{name: correct, kind: exact, extract: first_word},"
    "{name: rm, kind: model, path: %s, weight: 0.5, normalize: group},"
    "{name: one_word, kind: format, pattern: '^[0-9]$', full_match: true, weight: 0.1}]"
)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _stored_rollouts(run_dir):
    """Every group stored in the buffer files of the run's checkpoints."""
    from buffer.snapshot import rollouts_from_arrow

    groups = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        groups += rollouts_from_arrow((ckpt / "buffer/rollouts.arrow").read_bytes())
    return groups


def test_model_and_rule_rewards_score_real_rollouts(tmp_path, reward_model_dir):
    from transformers import AutoTokenizer

    from reward_model.scoring import load_reward_model, score_conversations

    val = tmp_path / "val.jsonl"
    val.write_text(
        "".join((ROOT / "configs/data/max_digit.jsonl").read_text().splitlines(True)[:16])
    )
    run_dir = tmp_path / "run"
    # Three steps of groups in the buffer before step 0 (benchmarks/bench_learner.py
    # --prefill-steps): every checkpoint barrier then finds scored groups stored, which the
    # test re-scores below.
    res = subprocess.run(
        command(
            "benchmarks.bench_learner",
            ["--prefill-steps=3"],
            [
                "train",
                "configs/tiny.yaml",
                "--run-dir",
                str(run_dir),
                "trainer.total_steps=6",
                "checkpoint.every_steps=1",
                "checkpoint.keep_last=10",
                f"data.val_path={val}",
                "eval.every_steps=3",
                SOURCES % reward_model_dir,
            ],
        ),
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(run_dir / "metrics.jsonl")
    assert len(rows) == 6
    for row in rows:
        for name in ("correct", "rm", "one_word"):
            assert np.isfinite(row[f"reward/{name}"]) and row[f"reward_failed/{name}"] == 0
        assert np.isfinite(row["reward_ds/default"])
    assert len({round(r["reward/rm"], 6) for r in rows}) > 1, "reward-model scores never change"

    evals = _rows(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert all(e["eval/prompts"] == 16 and np.isfinite(e["eval/reward/rm"]) for e in evals)
    # Each round is scored by the weights it was started at, the first by the initial ones
    # although training did not wait for it.
    assert all(e["eval/version_min"] == e["eval/version_max"] == e["version"] for e in evals)

    # The stored rollouts carry each source's raw score: re-score them here.
    groups = _stored_rollouts(run_dir)
    assert groups, "no scored group was stored at any checkpoint"
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    prompts = [json.loads(line) for line in (ROOT / "configs/data/max_digit.jsonl").open()]
    model, rm_tok = load_reward_model(str(reward_model_dir), "cpu")
    for g in groups:
        record = prompts[g.prompt_id]
        texts = [tok.decode(r, skip_special_tokens=True) for r in g.responses]
        convs = [
            [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": t}]
            for t in texts
        ]
        expected_rm = score_conversations(model, rm_tok, convs, 32, 1024)
        scores = np.array(g.scores)  # [N, S]
        np.testing.assert_allclose(scores[:, 1], expected_rm, atol=1e-4)
        words = [t.split() for t in texts]
        expected_correct = [float(bool(w) and w[0] == record["answer"]) for w in words]
        np.testing.assert_array_equal(scores[:, 0], expected_correct)


def test_a_dead_reward_model_is_restarted_and_the_run_goes_on(tmp_path, reward_model_dir):
    """The learner is gated (tests/slow_learner.py): it waits after 5 steps while the
    reward model is killed, trains on while the model restarts (those groups' model scores
    fail and get the default), and trains its last steps only once the new process has
    loaded, so they are scored by it, on any machine."""
    run_dir, gate, out = tmp_path / "run", tmp_path / "gate", tmp_path / "out.txt"
    rm_log = run_dir / "logs" / "reward_model_rm.log"
    gate.write_text("5")
    args = [
        "train",
        "configs/tiny.yaml",
        "--run-dir",
        str(run_dir),
        f"trainer.total_steps={STEPS}",
        "rewards.timeout_s=2",
        SOURCES % reward_model_dir,
    ]
    proc = launch_gated(args, gate, out)  # fmt: skip
    try:
        wait_for(proc, lambda: steps_done(run_dir) == 5, "step 5", out)
        victims = [p for p in processes_mentioning(str(run_dir)) if "-m reward_model" in cmdline(p)]
        assert len(victims) == 1, "reward-model process not found"
        os.kill(victims[0], signal.SIGKILL)
        gate.write_text(str(STEPS // 2))  # scored while the model is down or loading
        wait_for(proc, lambda: rm_log.read_text().count("loaded ") == 2, "reloaded model", out)
        gate.write_text(str(STEPS))
        assert proc.wait(timeout=400) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    err = out.read_text()
    assert "reward_model_rm process exited" in err and "restarting it (1/5)" in err
    rows = _rows(run_dir / "metrics.jsonl")
    assert len(rows) == STEPS
    assert sum(r["reward_failed/rm"] for r in rows) > 0, "no request failed while it was down"
    # Recovered: a whole step of the last ones scored by the new process. Not necessarily
    # the very last: under load a request can still outlast rewards.timeout_s (2 s here).
    last = [r["reward_failed/rm"] for r in rows[-STEPS // 3 :]]
    assert min(last) == 0, f"scoring did not recover after the restart: {last}"
    assert all(r["reward_failed/correct"] == 0 for r in rows)  # other sources unaffected
    assert rm_log.read_text().count("loaded ") == 2
    assert "reward source 'rm' failed" in (run_dir / "logs/generator0.log").read_text()
    deadline = time.monotonic() + 30  # PR_SET_PDEATHSIG is asynchronous
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"
