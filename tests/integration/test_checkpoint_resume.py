"""Crash and resume: SIGKILL the whole process tree three times, resume, finish the epoch.

One run of one epoch (96 prompts = 24 steps of 4 groups), checkpoint every 3 steps:

1. killed between checkpoints (step 6 committed, step 7 or 8 trained);
2. resumed, and killed while the step-9 checkpoint is being written (the writer is slowed
   down by tests/slow_learner.py, so the kill lands inside the write);
3. resumed, and killed right after a generator loaded a version no checkpoint holds;
4. the newest checkpoint is damaged on purpose: ``ckpt verify`` reports it and the last
   resume falls back to the one before, with a log line, and finishes the epoch.

The audit then reads ``trained.jsonl`` and ``metrics.jsonl``: every prompt of the epoch
trained on exactly once, no rollout trained twice, steps and versions without gaps or
repeats, and the staleness bound held after every resume. Finally the last checkpoint is
exported and loaded by transformers and by vLLM, and both generate.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from benchmarks.custom_learner import command
from verl_async.checkpoint import MANIFEST, SHARDS, is_sharded, list_checkpoints
from verl_async.lifetime import RUN_LOCK, RunDirInUse, claim_run_dir, holders

from .conftest import (
    ROOT,
    cmdline,
    committed_steps,
    process_tree,
    processes_mentioning,
    run_cli,
    steps_done,
)

B, STEPS, EVERY, ETA = 4, 24, 3, 2
UPDATE_DELAY_S = 0.3


def _overrides(data: Path) -> list[str]:
    return [
        f"data.path={data}",
        f"trainer.total_steps={STEPS}",
        f"learner.groups_per_step={B}",
        "generators.group_size=4",
        f"generators.max_inflight_groups={(ETA + 1) * B}",
        f"staleness.max={ETA}",
        # Several optimizer steps per batch: the optimizer's state and the later
        # minibatches' proximal log-probs go through every resume.
        "algo.minibatches=4",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=3",
    ]


def _launch(
    args: list[str], write_delay_s: float = 0.0, gate: Path | None = None, ahead: bool = False
) -> subprocess.Popen:
    """``verl-async ARGS`` with the learner slowed down (tests/slow_learner.py): each update
    by ``UPDATE_DELAY_S``, so the generator usually runs ahead of it; with ``write_delay_s``
    each checkpoint write by that much, so a kill can land inside one; with ``gate`` each
    update waits for the file ``gate`` to allow it (``--gate``), so the run stops where the
    test wants it; with ``ahead`` the update of step s waits until the buffer has a group
    of a later step (``--ahead``), so every cut holds a finished rollout on any machine."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    slow = ["--update-delay-s", str(UPDATE_DELAY_S), "--write-delay-s", str(write_delay_s)]
    if gate is not None:
        slow += ["--gate", str(gate)]
    if ahead:
        slow.append("--ahead")
    return subprocess.Popen(
        command("tests.slow_learner", slow, args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _freeze(proc: subprocess.Popen) -> list[int]:
    """SIGSTOP the whole tree (repeat until no new process appears); returns its pids."""
    stopped: list[int] = []
    while True:
        new = [p for p in process_tree(proc.pid) if p not in stopped]
        if not new:
            return stopped
        _signal_all(new, signal.SIGSTOP)
        stopped += new


def _kill_when(proc: subprocess.Popen, moment, timeout_s: float = 300) -> None:
    """Poll ``moment()``; when true, freeze the tree, re-check on the frozen state, SIGKILL."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before the kill point:\n{proc.stderr.read()[-3000:]}")
        if moment():
            pids = _freeze(proc)
            if moment():  # still true with everything stopped: this is the moment
                _signal_all(pids, signal.SIGKILL)
                proc.wait(timeout=30)
                return
            _signal_all(pids, signal.SIGCONT)
        time.sleep(0.01)
    proc.kill()
    pytest.fail("the kill point was never reached")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _loaded_versions(run_dir: Path) -> list[int]:
    log = run_dir / "logs" / "generator0.log"
    if not log.is_file():
        return []
    return [
        int(line.split("loaded version ")[1].split()[0])
        for line in log.read_text().splitlines()
        if "loaded version " in line
    ]


def _settle(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Nothing may survive the tree kill, and the run directory must be free again before
    the next launch (a launcher refuses it while any process of the run holds its lock).
    PR_SET_PDEATHSIG is asynchronous, and a process with much memory mapped takes a while
    to leave /proc on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not processes_mentioning(str(run_dir)) and _free(run_dir):
            return
        time.sleep(0.2)
    assert not processes_mentioning(str(run_dir)), "processes outlived SIGKILL of the tree"
    assert _free(run_dir), holders(run_dir / RUN_LOCK)


def _free(run_dir: Path) -> bool:
    """Whether a launcher could claim ``run_dir`` now (the claim is let go at once)."""
    try:
        claim_run_dir(run_dir).release()
    except RunDirInUse:
        return False
    return True


# PPO with a critic and a KL loss to the reference: the learner holds three models, and
# the critic's weights and optimizer are part of every checkpoint.
CRITIC_AND_REFERENCE = ["algo.adv_estimator=gae", "critic.lr=1e-3", "algo.kl.loss_coef=0.01"]


# Two learner ranks (FSDP2 over gloo) and two generators, all on unpinned cores; the
# resume runs one learner rank, which reads the two ranks' shards (the critic and LoRA
# fixtures go the other way: one rank's full checkpoint read by two).
TWO_GENERATORS = ["placement.generators=[cpu, cpu]"]
TWO_LEARNERS = ["placement.learners=[cpu, cpu]"]
ONE_LEARNER = ["placement.learners=[cpu]"]
LORA = ["model.lora.rank=8", "model.lora.target_modules=[all-linear]"]


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory) -> Path:
    return _crash_and_resume(tmp_path_factory.mktemp("crash"), [])


# The other shapes crash once and resume from a damaged checkpoint's predecessor: what
# each crash point does is the same in every shape, and the fixture above goes through
# all three; these show the shape's own state survives a resume and a change of ranks.


@pytest.fixture(scope="module")
def crashed_and_resumed_with_critic(tmp_path_factory) -> Path:
    """One learner rank (full checkpoints of actor and critic), then two (sharded). Every
    checkpoint is kept, so the first launch's full ones are still there to look at."""
    shapes = [ONE_LEARNER, TWO_LEARNERS]
    tmp = tmp_path_factory.mktemp("crash_critic")
    extra = [*CRITIC_AND_REFERENCE, "checkpoint.keep_last=100"]
    return _crash_and_resume(tmp, extra, shapes, crashes=1)


@pytest.fixture(scope="module")
def crashed_and_resumed_scaled_out(tmp_path_factory) -> Path:
    """Two learner ranks (sharded checkpoints), then one (which reads the shards)."""
    shapes = [TWO_LEARNERS, ONE_LEARNER]
    tmp = tmp_path_factory.mktemp("crash_dp")
    return _crash_and_resume(tmp, TWO_GENERATORS, shapes, crashes=1)


@pytest.fixture(scope="module")
def crashed_and_resumed_lora(tmp_path_factory) -> Path:
    """LoRA adapters on one learner rank, then two FSDP2 ranks (the export reads shards)."""
    shapes = [ONE_LEARNER, TWO_LEARNERS]
    return _crash_and_resume(tmp_path_factory.mktemp("crash_lora"), LORA, shapes, crashes=1)


@pytest.fixture(scope="module")
def crashed_and_resumed_multiturn(tmp_path_factory) -> Path:
    return _crash_and_resume(
        tmp_path_factory.mktemp("crash_mt"),
        ["eval.every_steps=0", "trainer.total_steps=24"],
        config="configs/tiny_multiturn.yaml",
        crashes=1,
    )


@pytest.fixture(scope="module")
def crashed_and_resumed_agents(tmp_path_factory) -> Path:
    return _crash_and_resume(
        tmp_path_factory.mktemp("crash_agents"),
        ["eval.every_steps=0", "trainer.total_steps=24"],
        config="configs/tiny_agent.yaml",
        crashes=1,
    )


@pytest.fixture(scope="module")
def crashed_and_resumed_distill(tmp_path_factory) -> Path:
    return _crash_and_resume(
        tmp_path_factory.mktemp("crash_distill"),
        [],
        config="configs/tiny_distill.yaml",
        crashes=1,
    )


def _crash_and_resume(
    tmp: Path,
    extra: list[str],
    shapes: list[list[str]] | None = None,
    config: str = "configs/tiny.yaml",
    crashes: int = 3,
) -> Path:
    """``shapes``: further overrides of each launch (placement changes). ``crashes``: 3 (all
    three kill points, then the damaged checkpoint) or 1 (the first, then the damaged one)."""
    data = tmp / "prompts.jsonl"
    lines = (ROOT / "configs/data/max_digit.jsonl").read_text().splitlines()[: B * STEPS]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp / "run"
    shapes = iter(shapes or [[]] * 4)
    train = ["train", config, *_overrides(data), *extra, *next(shapes)]

    def resume() -> list[str]:
        return [
            "train",
            config,
            "--resume",
            str(run_dir),
            *_overrides(data),
            *extra,
            *next(shapes),
        ]

    # 1. Between checkpoints: step 6 committed, steps 7..8 trained, step 9 not reached.
    # The learner may take 8 updates and no more, so the step-6 write (in the background)
    # has all the time it needs to commit before the kill, however slow the disk. With
    # three crashes the cuts of this launch hold finished rollouts whatever the machine's
    # speed (``ahead``): the two resumes from step 6 restore stored groups.
    gate = tmp / "gate"
    gate.write_text("8")
    proc = _launch([*train, "--run-dir", str(run_dir)], gate=gate, ahead=crashes == 3)
    _kill_when(proc, lambda: 6 in committed_steps(run_dir) and steps_done(run_dir) == 8)
    _settle(run_dir)
    if crashes == 3:
        _crash_in_a_write_and_after_a_sync(run_dir, resume)
    _resume_from_a_damaged_checkpoint(run_dir, resume)
    log = (run_dir / "logs" / "learner.log").read_text()
    # The last resume before the damage: after the kill inside the step-9 write, or the first.
    assert f"resumed from step_0000000{6 if crashes == 3 else 3}" in log
    return run_dir


def _crash_in_a_write_and_after_a_sync(run_dir: Path, resume) -> None:
    """Two more crashes, each followed by a resume (``resume()``: its command line)."""
    # 2. During a checkpoint write: step_00000009 exists, its manifest does not.
    proc = _launch(resume(), write_delay_s=4)
    ckpt9 = run_dir / "checkpoints" / "step_00000009"
    _kill_when(
        proc,
        lambda: (
            (ckpt9 / "learner" / "trainer_state.json").is_file()
            and 9 not in committed_steps(run_dir)
        ),
    )
    _settle(run_dir)
    assert not (ckpt9 / MANIFEST).exists()

    # 3. Right after a weight sync that no checkpoint holds (a version past step 9's).
    proc = _launch(resume())
    seen = len(_loaded_versions(run_dir))
    _kill_when(
        proc,
        lambda: (
            9 in committed_steps(run_dir)
            and any(v > 9 and v % EVERY for v in _loaded_versions(run_dir)[seen:])
        ),
    )
    _settle(run_dir)


def _resume_from_a_damaged_checkpoint(run_dir: Path, resume) -> None:
    # 4. Damage the newest checkpoint; resume must fall back to the one before it.
    newest = max(committed_steps(run_dir))
    learner = run_dir / "checkpoints" / f"step_{newest:08d}" / "learner"
    # model.safetensors with one rank, a rank's shard file with several
    victim = max((p for p in learner.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:100])
    check = run_cli(["ckpt", "verify", str(run_dir), "--step", str(newest)], timeout=60)
    assert check.returncode == 1 and victim.name in check.stdout, check.stdout
    final = run_cli(resume(), timeout=400)
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"step_{newest:08d} fails verification" in final.stderr
    assert "falling back" in final.stderr
    _settle(run_dir)


def test_every_prompt_is_trained_exactly_once_across_three_crashes(crashed_and_resumed):
    _audit_exactly_once(crashed_and_resumed)
    # The first launch ran ``ahead``: its step-6 cut holds stored groups, restored by the
    # first two resumes (a resume from a cut of nothing but groups in flight is the
    # weaker case, met by the other fixtures on a fast generator or a slow one).
    restored = _restored(crashed_and_resumed)
    assert [r[0] for r in restored[:2]] == [6, 6], restored
    assert restored[0][1] > 0, "the step-6 cut held no stored rollout"


def test_exactly_once_holds_with_a_critic_and_a_reference(crashed_and_resumed_with_critic):
    run_dir = crashed_and_resumed_with_critic
    _audit_exactly_once(run_dir, resumes=1)
    forms = set()
    committed = [c for c in list_checkpoints(run_dir) if (c / MANIFEST).is_file()]
    # One rank wrote the first launch's (the damaged one among them), two the last's.
    for ckpt in [*committed, *run_dir.glob("checkpoints/damaged_step_*")]:
        if is_sharded(ckpt):  # written by two ranks
            meta = dcp.FileSystemReader(str(ckpt / SHARDS)).read_metadata()
            names = meta.state_dict_metadata
            assert any(n.startswith("critic.") for n in names)
            assert any(n.startswith("critic_optim.") for n in names)
            forms.add("sharded")
        else:
            assert (ckpt / "learner" / "critic.safetensors").is_file()
            assert (ckpt / "learner" / "critic_state.safetensors").is_file()
            forms.add("full")
    assert forms == {"sharded", "full"}, forms
    rows = _rows(run_dir / "metrics.jsonl")
    assert all("critic/vf_loss" in r and "actor/kl_loss" in r for r in rows)


def test_exactly_once_holds_with_two_learner_ranks_and_two_generators(
    crashed_and_resumed_scaled_out,
):
    run_dir = crashed_and_resumed_scaled_out
    _audit_exactly_once(run_dir, resumes=1)
    log = (run_dir / "logs" / "learner.log").read_text()
    # The first launch sharded the model over two ranks; the resume ran one.
    assert log.count("FSDP2 over 2 ranks (gloo)") == 1
    for i in (0, 1):
        assert "loaded version" in (run_dir / "logs" / f"generator{i}.log").read_text()


def test_exactly_once_holds_with_lora_adapters_on_two_learner_ranks(crashed_and_resumed_lora):
    """Checkpoints hold the adapter and its optimizer state; a resume on one rank or two
    continues them, and every weight update carried the adapter alone."""
    run_dir = crashed_and_resumed_lora
    _audit_exactly_once(run_dir, resumes=1)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.count("FSDP2 over 2 ranks (gloo)") == 1
    assert log.count("LoRA rank 8") == 2
    rows = _rows(run_dir / "metrics.jsonl")
    full_mb = sum(p.stat().st_size for p in (run_dir / "model").glob("*.safetensors")) / 2**20
    assert all(0 < r["weight_sync_mb"] < full_mb / 4 for r in rows), (full_mb, rows[-1])


def test_exactly_once_holds_with_multi_turn_episodes_in_flight(crashed_and_resumed_multiturn):
    """Episodes in flight at a kill are sampled again from their first turn (their group is
    issued again); finished ones stored in the snapshot are trained as they were."""
    run_dir = crashed_and_resumed_multiturn
    _audit_exactly_once(run_dir, resumes=1)
    rows = _rows(run_dir / "metrics.jsonl")
    assert all("multiturn/turns_mean" in r for r in rows)
    assert any(r["multiturn/turns_max"] > 1 for r in rows)


def test_exactly_once_holds_with_agent_episodes_in_flight(crashed_and_resumed_agents):
    """An agent's episodes in flight at a kill run again from the start (their group is
    issued again to the new generator, whose endpoint has none of the old keys)."""
    run_dir = crashed_and_resumed_agents
    _audit_exactly_once(run_dir, resumes=1)
    rows = _rows(run_dir / "metrics.jsonl")
    assert all("multiturn/turns_mean" in r for r in rows)
    assert sum(r["multiturn/tool_calls"] for r in rows) > 0


def test_exactly_once_holds_with_a_distillation_teacher_process(crashed_and_resumed_distill):
    """A teacher in a process of its own dies with the tree and starts again with each
    resume; groups in flight at a kill are sampled and scored again, stored ones keep the
    teacher log-probs the cut holds, and every trained token has its teacher's score."""
    run_dir = crashed_and_resumed_distill
    _audit_exactly_once(run_dir, resumes=1)
    rows = _rows(run_dir / "metrics.jsonl")
    assert all(r["distill/scored_fraction"] == 1.0 for r in rows)
    assert all(r["distill/tiny_seed1/tokens"] > 0 for r in rows)
    log = (run_dir / "logs" / "teacher_tiny_seed1.log").read_text()
    assert log.count("serving on") == 2  # the first launch and the resume


def _audit_exactly_once(run_dir: Path, resumes: int = 3) -> None:
    trail = _rows(run_dir / "trained.jsonl")
    rows = _rows(run_dir / "metrics.jsonl")
    assert [t["step"] for t in trail] == [r["step"] for r in rows] == list(range(STEPS))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    groups = [g for t in trail for g, _ in t["groups"]]
    prompts = [p for t in trail for _, p in t["groups"]]
    assert sorted(groups) == list(range(B * STEPS)), "a group was lost or trained twice"
    assert sorted(prompts) == list(range(B * STEPS)), "a prompt was lost or trained twice"
    samples = [s for t in trail for s in t["samples"]]
    assert len(samples) == len(set(samples)) == B * STEPS * 4, "a rollout was trained twice"
    for row in rows:
        assert row["staleness_max"] <= ETA and row["dropped_stale"] == 0, row
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.count("resumed from step_") == resumes
    assert len(_restored(run_dir)) == resumes


def _restored(run_dir: Path) -> list[tuple[int, int]]:
    """(step, groups stored) of each restore in buffer.log, in order; each must match the
    cut the buffer took at that step (its last ``snapshot at step`` line before the
    restore: a later launch that takes the same step again does so after the restore)."""
    cuts: dict[int, int] = {}
    restored = []
    for line in (run_dir / "logs" / "buffer.log").read_text().splitlines():
        if "snapshot at step " in line:
            step, rest = line.split("snapshot at step ")[1].split(": ", 1)
            cuts[int(step)] = int(rest.split(" groups stored")[0])
        elif "restored step " in line:
            step, rest = line.split("restored step ")[1].split(",", 1)
            stored = int(rest.split(": ")[1].split(" groups stored")[0])
            assert cuts.get(int(step)) == stored, (line, cuts)
            restored.append((int(step), stored))
    return restored


def _kill_role(run_dir: Path, module: str, rng: random.Random = random) -> None:
    """SIGKILL this run's process started as ``python -m MODULE`` (one of them at random when
    there are several: learner ranks; never ``torch.distributed.run``, which starts them)."""
    victims = [
        p
        for p in processes_mentioning(str(run_dir))
        if f" -m {module} " in cmdline(p) and "torch.distributed.run" not in cmdline(p)
    ]
    assert victims, module
    os.kill(rng.choice(victims), signal.SIGKILL)


def _wait_for(proc: subprocess.Popen, done, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_run_resumes_by_itself_after_its_learner_and_then_its_buffer_die(tmp_path):
    """trainer.max_restarts: SIGKILL of a learner rank at a random step, then of the buffer
    at a later random step; the one command ends with exit code 0, every step trained, and
    the exactly-once audit passing across both restarts. The learner runs two ranks
    (``torch.distributed.run``): killing one ends the job, and it resumes as a whole (one
    rank is the simpler case of the same restart)."""
    data = tmp_path / "prompts.jsonl"
    lines = (ROOT / "configs/data/max_digit.jsonl").read_text().splitlines()[: B * STEPS]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    seed = random.randrange(2**32)  # in every failure message: the kill points replay
    rng = random.Random(seed)
    first, second = rng.randint(4, 10), rng.randint(14, 20)
    args = ["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *_overrides(data)]
    proc = _launch([*args, *TWO_LEARNERS, "trainer.max_restarts=2"])
    try:
        # A kill before the first commit would start the run over instead of resuming it.
        _wait_for(
            proc,
            lambda: steps_done(run_dir) >= first and committed_steps(run_dir),
            f"step {first} and a committed checkpoint",
        )
        _kill_role(run_dir, "tests.slow_learner", rng)  # a learner rank (_launch)
        # Resumed at a checkpoint before ``first`` (<= 10), it trains on to ``second`` (>= 14).
        _wait_for(proc, lambda: steps_done(run_dir) >= second, f"step {second} after a restart")
        _kill_role(run_dir, "buffer")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    where = f"(killed at steps {first} and {second}, seed {seed})"
    assert proc.returncode == 0, (where, err[-3000:])
    # torch.distributed.run ended the job when one of its ranks died.
    assert "restart 1/2: the learner process exited with code " in err, where
    assert "restart 2/2: the buffer process exited with code -9" in err, where
    _settle(run_dir)
    _audit_exactly_once(run_dir, resumes=2)
    log = (run_dir / "logs" / "generator0.log").read_text()
    assert "verl-async: restart 2/2: the buffer process exited with code -9" in log
    learner = (run_dir / "logs" / "learner.log").read_text()
    assert learner.count("FSDP2 over 2 ranks (gloo)") == 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_finishes_the_checkpoint_write_in_progress_then_exits(tmp_path, sig):
    data = tmp_path / "prompts.jsonl"
    lines = (ROOT / "configs/data/max_digit.jsonl").read_text().splitlines()[: B * STEPS]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    proc = _launch(
        ["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *_overrides(data)],
        write_delay_s=3,
    )
    ckpt3 = run_dir / "checkpoints" / "step_00000003"
    deadline = time.monotonic() + 300
    while not (ckpt3 / "learner" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint write began"
        time.sleep(0.01)
    assert not (ckpt3 / MANIFEST).exists()
    proc.send_signal(sig)  # Ctrl-C in the terminal, or a scheduler preempting the job
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert f"resume with: verl-async train --resume {run_dir}" in err
    assert 3 in committed_steps(run_dir), "the write in progress was not finished"
    assert run_cli(["ckpt", "verify", str(run_dir)], timeout=60).returncode == 0
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "interrupted after" in log and "checkpoint write finished before exit" in log
    _settle(run_dir)


def test_ckpt_list_and_the_exported_model_loads_in_transformers_and_vllm(
    crashed_and_resumed, tmp_path
):
    run_dir = crashed_and_resumed
    listing = run_cli(["ckpt", "list", str(run_dir)], timeout=60)
    assert listing.returncode == 0 and f"step_{STEPS:08d}" in listing.stdout
    out = tmp_path / "exported"
    res = run_cli(["export", str(run_dir), str(out)], timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"step_{STEPS:08d}" in res.stdout

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = load_file(
        run_dir / "checkpoints" / f"step_{STEPS:08d}" / "learner" / "model.safetensors"
    )
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    ids = tok("max 3 7 1 4 =", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] > ids.shape[1]

    script = (
        "from vllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM(model={str(out)!r}, dtype='float32', enforce_eager=True, "
        "kv_cache_memory_bytes=32 << 20, max_model_len=64)\n"
        "    out = llm.generate(['max 3 7 1 4 ='], SamplingParams(max_tokens=3, temperature=0))\n"
        "    print('VLLM_TOKENS', len(out[0].outputs[0].token_ids))\n"
    )
    (tmp_path / "load_in_vllm.py").write_text(script)
    res = subprocess.run(
        [sys.executable, str(tmp_path / "load_in_vllm.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert "VLLM_TOKENS" in res.stdout, res.stderr[-3000:]
    assert int(res.stdout.split("VLLM_TOKENS")[1].split()[0]) > 0


def test_a_lora_export_gives_the_learner_s_log_probs_merged_and_as_an_adapter(
    crashed_and_resumed_lora, tmp_path
):
    """``export --adapter``: the merged directory (transformers) and base + the peft
    adapter directory give the log-probs of the checkpoint's own peft model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learners.logprobs import logits_of
    from verl_async import lora
    from verl_async.checkpoint import read_sharded_model
    from verl_async.config import load_config
    from verl_async.weight_sync import with_tied

    run_dir = crashed_and_resumed_lora
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    res = run_cli(["export", str(run_dir), str(merged), "--adapter", str(adapter)], timeout=120)
    assert res.returncode == 0, res.stderr
    assert (adapter / "adapter_config.json").is_file()

    def base():
        return AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)

    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert is_sharded(ckpt)  # the last launch ran two learner ranks
    state = read_sharded_model(ckpt)
    learner = lora.apply(base(), load_config(run_dir / "config.yaml").model.lora)
    learner.load_state_dict(with_tied(learner, state), strict=True)  # tied: once in shards
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    attn = torch.ones_like(ids)

    def logp(model):
        with torch.no_grad():
            return torch.log_softmax(logits_of(model.eval(), ids, attn), -1)

    want = logp(learner)
    assert (want - logp(base())).abs().max() > 1e-4  # the adapter changed the model
    torch.testing.assert_close(
        logp(AutoModelForCausalLM.from_pretrained(merged)), want, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        logp(PeftModel.from_pretrained(base(), adapter)), want, atol=1e-5, rtol=0
    )
