"""Chaos: a multi-turn run through real processes whose environment hangs, raises and
floods, whose tools raise SystemExit and KeyboardInterrupt or run sandboxed programs that
fork, setsid and fill /tmp, whose agents exit, interrupt, stay silent beside calling ones,
go past their call limit or outlive their timeout at start-up, whose model writes tool
calls nested 10,000 deep, whose reward function returns NaN, ±inf and 1e39 now and then,
while a driver
SIGKILLs a random role (a generator, the learner, the buffer, a generator's reward
worker) at random points. The one command must end by itself (exit code 0) with every
step trained, every group and prompt trained exactly once (``trained.jsonl``), finite
weights in every checkpoint, and every fault counted: each kill as the restart it caused,
each kind of environment and reward fault in the run's counters.

The faults come from tests/chaos.py (by hash of the seed, the prompt and the call; each
one injected is written to ``faults.jsonl``). The driver paces the learner through its
gate (tests/slow_learner.py ``--gate``): the run advances to a drawn step, is held there
while a role is killed after a drawn delay, and goes on once the killed role is back. So
where the kills land depends on the seed alone, never on the machine's speed. The seed
is printed (and in every failure message); ``VERL_ASYNC_CHAOS_SEED=<seed>`` replays it.

Two forms:

- CI (``test_chaos_short``): 24 steps, four kills, one of each role in a drawn order.
- Long, opt-in (``test_chaos_long``): ``VERL_ASYNC_CHAOS_STEPS=<steps>`` (and optionally
  ``VERL_ASYNC_CHAOS_KILLS=<kills>``, default one per 8 steps) or ``make test-chaos``
  (240 steps, 30 kills); it prints the figures recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from benchmarks.custom_learner import command
from tests.chaos import LEFT_BEHIND, TOOL_WORDS
from verl_async.checkpoint import list_checkpoints, verify

from .conftest import ROOT, cmdline, committed_steps, processes_mentioning, steps_done

B, GROUP, EVERY, ETA = 4, 4, 3, 2
ROLES = ("generator", "learner", "buffer", "reward_worker")
MODULES = {  # role -> what its command line holds (python -m MODULE)
    "generator": " -m generators ",
    "learner": " -m tests.slow_learner ",
    "buffer": " -m buffer ",
    "reward_worker": " -m verl_async.rewards.worker ",
}
# Steps the learner may train right after a kill of these roles: the learner then reaches
# its wait for a batch, where it rebuilds the weight-sync group with a new generator.
STEPS_AFTER = {"generator": ETA + 2, "reward_worker": 1}
WAIT_S = 300.0  # any one thing the driver waits for; the run is paced by the driver
AGENT_EVERY = 4  # every fourth prompt is an agent's (data source "agent")
EPISODE_TIMEOUT_S = 10.0


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Chaos:
    """One run: its directory, launcher process, gate, and what was done to it."""

    tmp: Path
    steps: int
    seed: int
    rng: random.Random = field(init=False)
    run_dir: Path = field(init=False)
    out: Path = field(init=False)
    gate: Path = field(init=False)
    faults: Path = field(init=False)
    proc: subprocess.Popen | None = None
    base: int = 0  # the step the learner process now running started from
    held: int = 0  # the step the driver last let the run go to
    gap: int = 3  # a kill comes 1 to gap steps after the step the run was held at
    kills: list[tuple[str, int]] = field(default_factory=list)  # (role, steps done when killed)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.run_dir = self.tmp / "run"
        self.out = self.tmp / "launcher.log"
        self.gate = self.tmp / "gate"
        self.faults = self.tmp / "faults.jsonl"

    # ------------------------------------------------------------------ the run

    def overrides(self, restarts: int, generator_restarts: int) -> list[str]:
        data = self.tmp / "prompts.jsonl"
        lines = (ROOT / "configs/data/max_digit.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines[: B * self.steps]]
        for i, row in enumerate(rows):
            row["data_source"] = "agent" if i % AGENT_EVERY == 0 else "max_digit"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        faults = str(self.faults)
        tools = [
            {"function": "tests.chaos:ExitCli", "args": {"faults": faults}},
            {"function": "tests.chaos:Interrupt", "args": {"faults": faults}},
            {"function": "tests.chaos:ChaosPython", "args": {
                "faults": faults, "python": "/usr/bin/python3", "wall_s": 10.0}},
        ]  # fmt: skip
        env = {
            "env": "tests.chaos:ChaosEnv",
            "args": {
                "faults": faults, "seed": self.seed, "hang_s": 6.0,
                "max_attempts": 3, "feedback": "wrong", "extract": "first_word",
                "right_reward": 0.0, "wrong_reward": -0.25,
            },
            "tools": tools,
        }  # fmt: skip
        agent = {
            "agent": "tests.chaos:chaos_agent", "data_sources": ["agent"], "max_calls": 3,
            "args": {"faults": faults, "seed": self.seed, "max_calls": 3,
                     "timeout_s": EPISODE_TIMEOUT_S},
        }  # fmt: skip
        chaos = {
            "name": "chaos", "kind": "function", "function": "tests.chaos:chaos_reward",
            "kwargs": {"faults": str(self.faults)}, "weight": 0.5, "default_score": 0.0,
        }  # fmt: skip
        correct = {"name": "correct", "kind": "exact", "extract": "first_word"}
        return [
            f"data.path={data}",
            f"trainer.total_steps={self.steps}",
            f"learner.groups_per_step={B}",
            f"generators.group_size={GROUP}",
            f"generators.max_inflight_groups={(ETA + 1) * B}",
            f"staleness.max={ETA}",
            "eval.every_steps=0",
            f"checkpoint.every_steps={EVERY}",
            "checkpoint.keep_last=100000",  # every checkpoint stays, to be checked
            f"trainer.max_restarts={restarts}",
            f"generators.max_restarts={generator_restarts}",
            "multiturn.step_timeout_s=3",
            f"multiturn.episode_timeout_s={EPISODE_TIMEOUT_S}",
            f"multiturn.environments={json.dumps([env])}",
            f"multiturn.agents={json.dumps([agent])}",
            "multiturn.tool_parser=hermes",
            "multiturn.tool_template=tiny_tools",
            f"model.tiny.extra_words={json.dumps(['wrong', *TOOL_WORDS])}",
            f"rewards.sources={json.dumps([correct, chaos])}",
        ]

    def launch(self, restarts: int, generator_restarts: int) -> None:
        self.open_gate(0)
        args = ["train", "configs/tiny_multiturn.yaml", "--run-dir", str(self.run_dir)]
        args += self.overrides(restarts, generator_restarts)
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                command("tests.slow_learner", ["--gate", str(self.gate)], args),
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    def open_gate(self, step: int) -> None:
        """Let the learner train up to ``step`` (its gate counts the updates of its process)."""
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(max(step - self.base, 0)))
        tmp.replace(self.gate)

    def wait(self, done, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.where()}: the run ended before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.where()}: no {what} in {WAIT_S:.0f}s:\n{self.tail()}")
            time.sleep(0.05)

    def where(self) -> str:
        return f"chaos seed {self.seed} (replay: VERL_ASYNC_CHAOS_SEED={self.seed}), kills {self.kills}"

    def tail(self) -> str:
        return self.out.read_text()[-3000:] if self.out.is_file() else ""

    def log(self, name: str) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    # ------------------------------------------------------------------ kills

    def marks(self) -> tuple[int, int, int]:
        """(run restarts, generator restarts, reward worker starts) so far."""
        out = self.out.read_text() if self.out.is_file() else ""
        return (
            len(re.findall(r"^restart \d+/\d+: ", out, re.M)),
            out.count("the generator0 process exited with code -9; restarting it"),
            self.log("reward_worker0").count("scoring process up on"),
        )

    def victims(self, role: str) -> list[int]:
        return sorted(
            p
            for p in processes_mentioning(str(self.run_dir))
            if MODULES[role] in cmdline(p) and "torch.distributed.run" not in cmdline(p)
        )

    def resumes(self) -> list[int]:
        """The steps the learner resumed from, in order (its log)."""
        return [int(n) for n in re.findall(r"resumed from \S+: step (\d+)", self.log("learner"))]

    def kill(self, role: str) -> None:
        """Hold the run at a drawn step, kill ``role`` after a drawn delay, and wait until
        the run has recovered from it. For half the kills of the learner or the buffer one
        more step is let through once the run is held, so the kill can land inside it. A
        kill of a generator or a reward worker lets steps through right after it: a new
        generator joins the weight-sync group only at the learner's next publish (or its
        wait for a batch), within weights.join_timeout_s, and a killed reward worker is
        started again at its generator's next request."""
        after = STEPS_AFTER.get(role, 0)
        # Room at the end: steps let through after a kill still leave groups to sample.
        room = self.steps - 4 - max(STEPS_AFTER.values())
        target = min(self.held + self.rng.randint(1, self.gap), room)
        if role in ("learner", "buffer"):  # resume from a checkpoint, not from scratch
            target = max(target, EVERY)
        self.open_gate(target)
        self.wait(lambda: steps_done(self.run_dir) >= target, f"step {target}")
        if role in ("learner", "buffer"):
            self.wait(lambda: committed_steps(self.run_dir), "a committed checkpoint")
        self.held = target + (after or int(self.rng.random() < 0.5))
        if not after:
            self.open_gate(self.held)
        before, resumed = self.marks(), len(self.resumes())
        time.sleep(self.rng.uniform(0.0, 1.5))
        self.wait(lambda: self.victims(role), f"a {role} process")
        if role in ("learner", "buffer"):
            self.open_gate(0)  # the next learner process waits for the driver
        os.kill(self.rng.choice(self.victims(role)), signal.SIGKILL)
        self.kills.append((role, steps_done(self.run_dir)))
        restarts, generators, workers = before
        if role in ("learner", "buffer"):
            # The whole run resumes: a new learner from a checkpoint, a new generator
            # with a new reward worker.
            self.wait(lambda: self.marks()[0] > restarts, "the run's restart")
            self.wait(lambda: len(self.resumes()) > resumed, "the learner's resume")
            self.base = self.held = self.resumes()[-1]
        else:
            self.open_gate(self.held)
        if role == "generator":
            self.wait(lambda: self.marks()[1] > generators, "the generator's restart")
        # A generator's reward worker starts with it; a killed one is started again by its
        # generator at its next request.
        self.wait(lambda: self.marks()[2] > workers, "a reward worker's start")

    # ------------------------------------------------------------------ the verdict

    def finish(self) -> None:
        self.open_gate(10 * self.steps)
        try:
            self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"{self.where()}: the run did not end:\n{self.tail()}")
        assert self.proc.returncode == 0, (self.where(), self.tail())
        # Nothing the run started outlives it (reward workers of killed generators included).
        deadline = time.monotonic() + 60
        while processes_mentioning(str(self.run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [cmdline(p) for p in processes_mentioning(str(self.run_dir))]
        assert not left, (self.where(), left)
        # Nor what a sandboxed program forked, setsid and exec'd, nor its files.
        sleeping = [p for p in _all_processes() if LEFT_BEHIND[0] in cmdline(p)]
        assert not sleeping, (self.where(), sleeping)
        kept = [path for path in LEFT_BEHIND[1:] if os.path.exists(path)]
        assert not kept, (self.where(), kept)

    def audit(self) -> dict:
        """Every verdict of the run; returns its figures."""
        where, run_dir, steps = self.where(), self.run_dir, self.steps
        # Every step trained once, in order.
        trail = _rows(run_dir / "trained.jsonl")
        rows = _rows(run_dir / "metrics.jsonl")
        assert [t["step"] for t in trail] == [r["step"] for r in rows] == list(range(steps)), where
        # Every group and prompt of the epoch trained exactly once; no rollout twice.
        groups = Counter(g for t in trail for g, _ in t["groups"])
        prompts = Counter(p for t in trail for _, p in t["groups"])
        lost = B * steps - len(groups)
        repeated = sum(n - 1 for n in groups.values())
        assert sorted(groups) == list(range(B * steps)) and repeated == 0, (where, groups)
        assert sorted(prompts) == list(range(B * steps)), (where, prompts)
        samples = [s for t in trail for s in t["samples"]]
        # An agent's episode may give several samples (a call past its limit's history).
        assert len(samples) == len(set(samples)) >= B * steps * GROUP, where
        for row in rows:
            bad = {k: v for k, v in row.items() if isinstance(v, float) and not np.isfinite(v)}
            assert not bad, (where, row["step"], bad)
            assert row["skipped_steps/nonfinite_loss"] == row["skipped_steps/nonfinite_grad"] == 0
            # No rollout the buffer had to refuse: nothing a generator sent was malformed.
            assert row["rollouts_refused"] == row["groups_ended"] == 0, (where, row["step"])
        # Finite weights in every checkpoint, each one verified.
        checkpoints = list_checkpoints(run_dir)
        assert checkpoints and checkpoints[-1].name == f"step_{steps:08d}", where
        for ckpt in checkpoints:
            assert verify(ckpt) == [], (where, ckpt.name)
            for name in ("model", "state"):
                tensors = load_file(ckpt / f"learner/{name}.safetensors")
                floats = [t for t in tensors.values() if t.dtype.kind == "f"]
                assert floats and all(np.isfinite(t).all() for t in floats), (where, ckpt.name)
        # Every kill counted as the restart it caused.
        killed = Counter(role for role, _ in self.kills)
        out = self.out.read_text()
        for role in ("learner", "buffer"):
            pattern = rf"^restart \d+/\d+: the {role} process exited with code -9"
            assert len(re.findall(pattern, out, re.M)) == killed[role], (where, role)
        run_restarts, generator_restarts, worker_starts = self.marks()
        assert generator_restarts == killed["generator"], where
        launches = 1 + killed["learner"] + killed["buffer"]
        starts = launches + killed["generator"] + killed["reward_worker"]
        # A generator stopped for a resume may start a worker on its way out, if its own
        # died first under a request: at most one more per resume.
        assert starts <= worker_starts <= starts + run_restarts, (where, worker_starts)
        assert len(self.resumes()) == run_restarts, where
        # Every kind of fault injected shows in the counters, never more than injected.
        injected = Counter(
            json.loads(line)["kind"] for line in self.faults.read_text().splitlines()
        )
        total = lambda key: sum(r.get(key, 0) for r in rows)  # noqa: E731
        errors, timeouts = total("multiturn/tool_errors"), total("multiturn/tool_timeouts")
        erring = ("reset_raise", "raise", "flood", "many", "reward", "tool_exit",
                  "tool_interrupt", "python", "agent_exit", "agent_interrupt", "agent_over_limit")  # fmt: skip
        assert 0 < errors <= sum(injected[k] for k in erring), (where, errors, injected)
        timing_out = injected["hang"] + injected["agent_slow_start"]
        assert 0 < timeouts <= timing_out + errors, (where, timeouts, injected)
        for kind in (*erring[5:], "hang", "agent_silent", "agent_slow_start"):
            assert injected[kind] > 0, (where, kind, injected)  # every kind happened
        assert total("multiturn/tool_parse_errors") > 0, where  # the nested call, at least
        failed = total("reward_failed/chaos")
        # A killed reward worker fails the one request it had (one group) or the next.
        worst = injected["reward_fn"] + GROUP * killed["reward_worker"]
        assert 0 < failed <= worst, (where, failed, injected)
        assert total("reward_failed/correct") <= GROUP * killed["reward_worker"], where
        generator_log = "".join(self.log(f"generator{i}") for i in range(1))
        for text in (
            "chaos: reset raised", "chaos: step raised", "timed out",
            "observation messages", "finite in float32 or None", "reward source 'chaos' failed",
            "tool exit_cli: error: SystemExit: 2", "tool interrupt: error: KeyboardInterrupt",
            "raised SystemExit: 2", "raised KeyboardInterrupt", "passed multiturn.episode_timeout_s",
        ):  # fmt: skip
            assert text in generator_log, (where, text)
        return {
            "seed": self.seed,
            "steps": steps,
            "groups": len(groups),
            "lost": lost,
            "repeated": repeated,
            "kills": dict(killed),
            "run_restarts": run_restarts,
            "generator_restarts": generator_restarts,
            "reward_worker_starts": worker_starts,
            "faults_injected": dict(sorted(injected.items())),
            "counted": {
                "multiturn/tool_errors": errors,
                "multiturn/tool_timeouts": timeouts,
                "reward_failed/chaos": failed,
                "reward_failed/correct": total("reward_failed/correct"),
            },
        }


def _all_processes() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _seed() -> int:
    seed = os.environ.get("VERL_ASYNC_CHAOS_SEED")
    return int(seed) if seed else random.randrange(2**32)


def run_chaos(tmp_path: Path, steps: int, n_kills: int) -> dict:
    """A chaos run of ``steps`` steps and ``n_kills`` kills: each role once in a drawn
    order, then roles drawn at random; returns its figures, after every verdict."""
    chaos = Chaos(tmp_path, steps, _seed())
    chaos.gap = max(3, steps // n_kills)
    print(f"chaos seed {chaos.seed}", flush=True)
    kills = chaos.rng.sample(ROLES, len(ROLES))
    kills += [chaos.rng.choice(ROLES) for _ in range(n_kills - len(ROLES))]
    kills = kills[:n_kills]
    run_kills = sum(role in ("learner", "buffer") for role in kills)
    chaos.launch(restarts=run_kills, generator_restarts=len(kills) + 1)
    t0 = time.monotonic()
    try:
        for role in kills:
            chaos.kill(role)
        chaos.finish()
    finally:
        if chaos.proc.poll() is None:
            chaos.proc.kill()
    figures = chaos.audit()
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    print("chaos figures " + json.dumps(figures), flush=True)
    return figures


def test_chaos_short(tmp_path):
    """One kill of each role, in a drawn order, over 24 steps."""
    run_chaos(tmp_path, 24, len(ROLES))


LONG_STEPS = int(os.environ.get("VERL_ASYNC_CHAOS_STEPS", "0"))


@pytest.mark.skipif(
    not LONG_STEPS, reason="opt-in: VERL_ASYNC_CHAOS_STEPS=<steps> (make test-chaos)"
)
@pytest.mark.timeout(7200)
def test_chaos_long(tmp_path):
    kills = int(os.environ.get("VERL_ASYNC_CHAOS_KILLS", "0")) or max(LONG_STEPS // 8, 4)
    run_chaos(tmp_path, LONG_STEPS, kills)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", "-p", "no:cacheprovider"]))
