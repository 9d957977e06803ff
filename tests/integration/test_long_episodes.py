"""Episodes longer than ``buffer.lease_timeout_s``, through real processes: one
generator keeps its groups by renewing their leases, and the groups that outlive even
``buffer.lease_max_s`` are issued again to that same generator, which runs each group
once at a time and does not die of its late copies.

``configs/tiny_multiturn.yaml`` (transformers engine, one generator, staleness 2) on 16
max-digit prompts of two data sources, one turn per episode (tests/slow_env.py):

    slow   every step sleeps 1.5 x lease_timeout_s: each episode outlives its lease by
           construction, so only renewals keep its group (before leases were renewed, the
           group went out again to the same generator, whose two copies ended it: "group
           ... was already returned", the generator restarted three times, the run failed);
    once   the first episode of each prompt sleeps 1.5 x lease_max_s: its group's lease runs
           out at the cap however often it is renewed, the group comes back to the same
           generator first in line, the stalled copy is cancelled and the new one (whose
           episodes answer at once) is trained.

The verdict does not depend on the machine's speed: every "slow" episode outlives its
lease and every first "once" copy outlives the cap whatever the engine's pace, so the run
must end with every group trained once, exactly the 8 "once" groups' leases run out (each
once, at the cap), and no process restarted. The same holds for an agent program's
episodes through the chat endpoint (``configs/tiny_agent.yaml``, an agent that waits
1.5 x lease_timeout_s between its two calls).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .conftest import ROOT, processes_mentioning, run_cli

CONFIG = "configs/tiny_multiturn.yaml"
STEPS, B, GROUP_SIZE = 4, 4, 4
LEASE_S, CAP_S = 4.0, 9.0  # renewed every 1.33 s; a lease lapses if none comes for 4 s
RETRY_ARGS = {"max_attempts": 3, "feedback": "wrong", "extract": "first_word"}


def _data(tmp_path: Path) -> Path:
    """The first STEPS * B max-digit prompts (one epoch: each trained once), alternately
    of the data sources "slow" and "once"."""
    lines = (ROOT / "configs/data/max_digit.jsonl").read_text().splitlines()[: STEPS * B]
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps({**json.loads(line), "data_source": ("slow", "once")[i % 2]}))
            f.write("\n")
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_episodes_longer_than_their_lease_train_every_group_once_without_a_restart(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    envs = [
        {
            "env": "tests.slow_env:SlowEnv",
            "args": {**RETRY_ARGS, "sleep_s": 1.5 * LEASE_S},
            "data_sources": ["slow"],
        },
        {
            "env": "tests.slow_env:SlowEnv",
            "args": {**RETRY_ARGS, "sleep_s": 1.5 * CAP_S, "first_only_dir": str(marks)},
            "data_sources": ["once"],
        },
    ]
    run_dir = tmp_path / "run"
    res = run_cli(
        ["train", CONFIG, "--run-dir", str(run_dir), f"data.path={_data(tmp_path)}",
         "eval.every_steps=0", "checkpoint.every_steps=0", f"trainer.total_steps={STEPS}",
         f"learner.groups_per_step={B}", f"generators.group_size={GROUP_SIZE}",
         "multiturn.max_turns=1", f"multiturn.environments={json.dumps(envs)}",
         f"buffer.lease_timeout_s={LEASE_S}", f"buffer.lease_max_s={CAP_S}"],
        timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert "restart" not in res.stderr, res.stderr[-3000:]
    assert not any("verl-async: restart" in text for text in logs.values())
    assert "started again" not in logs["buffer.log"]  # no generator rejoined

    # Every group trained exactly once, every step complete.
    trail, rows = _rows(run_dir / "trained.jsonl"), _rows(run_dir / "metrics.jsonl")
    assert [t["step"] for t in trail] == [r["step"] for r in rows] == list(range(STEPS))
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * B)), "a group was lost or trained twice"
    assert all(r["samples"] == B * GROUP_SIZE and r["dropped_stale"] == 0 for r in rows)

    # The "slow" episodes were trained, each longer than its lease: renewals kept them.
    env_seconds = sum(r["multiturn/env_seconds"] * r["samples"] for r in rows)
    slow_episodes = STEPS * B // 2 * GROUP_SIZE
    assert env_seconds >= slow_episodes * 1.5 * LEASE_S * 0.99, env_seconds
    assert rows[-1]["leases_renewed"] > 0

    # Exactly the "once" groups' leases ran out, each once, every one at the cap.
    expired = re.findall(
        r"lease of (\d+) groups on .* expired: [^;(]*(?:\((\d+) of them held buffer[^;]*)?;",
        logs["buffer.log"],
    )
    assert sum(int(n) for n, _ in expired) == STEPS * B // 2, expired
    assert all(n == at_cap for n, at_cap in expired), expired
    assert rows[-1]["leases_expired"] == STEPS * B // 2
    # The generator cancelled each stalled copy (told by a renewal or by the re-issue).
    cancelled = logs["generator0.log"].count("cancelled")
    assert cancelled >= 1, logs["generator0.log"][-2000:]
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"


def test_agent_episodes_longer_than_their_lease_train_every_group_once(tmp_path):
    """An agent through the chat endpoint whose every episode waits 1.5 x lease_timeout_s
    between its two calls (tests/hostile_agents.py: slow): renewals keep each group, every
    group is trained once, nothing restarts, and each episode stays one sample."""
    agents = [{"agent": "tests.hostile_agents:slow", "args": {"sleep_s": 1.5 * LEASE_S}}]
    run_dir = tmp_path / "run"
    res = run_cli(
        ["train", "configs/tiny_agent.yaml", "--run-dir", str(run_dir),
         f"data.path={_data(tmp_path)}", "eval.every_steps=0", "checkpoint.every_steps=0",
         f"trainer.total_steps={STEPS}", f"learner.groups_per_step={B}",
         f"generators.group_size={GROUP_SIZE}", f"multiturn.agents={json.dumps(agents)}",
         f"buffer.lease_timeout_s={LEASE_S}", f"buffer.lease_max_s={10 * CAP_S}"],
        timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restart" not in res.stderr, res.stderr[-3000:]
    trail, rows = _rows(run_dir / "trained.jsonl"), _rows(run_dir / "metrics.jsonl")
    assert [t["step"] for t in trail] == [r["step"] for r in rows] == list(range(STEPS))
    groups = [g for t in trail for g, _ in t["groups"]]
    assert sorted(groups) == list(range(STEPS * B)), "a group was lost or trained twice"
    assert all(r["samples"] == B * GROUP_SIZE for r in rows)  # one sample an episode
    assert all(r["multiturn/prefix_breaks"] == 0 for r in rows)
    assert all(r["multiturn/turns_mean"] == 2 for r in rows)  # both calls, one sample
    agent_seconds = sum(r["multiturn/env_seconds"] * r["samples"] for r in rows)
    assert agent_seconds >= STEPS * B * GROUP_SIZE * 1.5 * LEASE_S * 0.99, agent_seconds
    assert rows[-1]["leases_renewed"] > 0 and rows[-1]["leases_expired"] == 0
    assert all(0 <= r["multiturn/versions_spanned_max"] <= 2 for r in rows)
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"
