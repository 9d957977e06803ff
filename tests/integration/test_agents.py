"""Agent programs through the chat endpoint, in real processes: buffer, generator,
learner. The example ReAct agent (examples/react_agent.py, the plain openai client)
learns the tiny task in a synchronous run whose bars hold over seeds
(``benchmarks/margins.py --suite agents``); agents that rewrite their history, raise,
hang, never call the model or return what is not a reward cost only their own episodes,
counted. Exactly-once across SIGKILL with agent episodes in flight is in
test_checkpoint_resume.py; the endpoint itself, with the openai client on both engines,
in test_endpoint.py."""

import json
from pathlib import Path

import yaml

from .conftest import ROOT, processes_mentioning, run_cli
from .learning import Case, Check, rows, tool_use, train_and_check

CONFIG = "configs/tiny_agent.yaml"
LEARN_STEPS, WINDOW = 200, 20


def measure(run_dir: Path) -> list[Check]:
    return tool_use(run_dir, WINDOW, 0.5)


CASES = {"hf": Case(CONFIG, (f"trainer.total_steps={LEARN_STEPS}",), measure)}


def test_the_example_agent_learns_through_the_endpoint(tmp_path):
    run_dir = tmp_path / "run"
    metrics = train_and_check(CASES["hf"], run_dir, LEARN_STEPS, timeout=900)
    for r in metrics:
        assert r["multiturn/tool_errors"] == 0 and r["multiturn/tool_timeouts"] == 0
        assert r["multiturn/versions_spanned_max"] == 0  # synchronous
        assert r["multiturn/prefix_breaks"] == 0  # every call extends the one before
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"


HOSTILE = ["rewrites", "raises", "hangs", "silent", "bad_reward", "exits", "interrupts",
           "sometimes_silent", "many_samples"]  # fmt: skip


def test_agent_faults_and_rewritten_histories_cost_only_their_own_episodes(tmp_path):
    """Besides raising, hanging and bad rewards: agents that raise SystemExit or
    KeyboardInterrupt, silent episodes in the same groups as calling ones, and an episode
    of 17 samples (max_calls 17). The generator is never restarted (weight_sync_epoch
    stays 0) and every step trains."""
    cfg = yaml.safe_load((ROOT / CONFIG).read_text())
    cfg["multiturn"]["agents"] = [
        {"agent": f"tests.hostile_agents:{name}", "data_sources": [name],
         **({"max_calls": 17} if name == "many_samples" else {})}
        for name in HOSTILE
    ]  # fmt: skip
    cfg["multiturn"]["episode_timeout_s"] = 3.0
    cfg["multiturn"]["max_episode_tokens"] = 64
    data = tmp_path / "rows.jsonl"
    with data.open("w") as f:
        for i in range(400):
            source = HOSTILE[i % len(HOSTILE)]
            f.write(json.dumps({"prompt": "secret =", "answer": str(i % 10),
                                "data_source": source}) + "\n")  # fmt: skip
    cfg["data"]["path"] = str(data)
    cfg["data"]["val_path"] = ""
    cfg["eval"]["every_steps"] = 0
    config = tmp_path / "hostile.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    steps = 9
    res = run_cli(["train", str(config), "--run-dir", str(run_dir),
                   f"trainer.total_steps={steps}"], timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))
    total = lambda key: sum(r[key] for r in metrics)  # noqa: E731
    # The rewriting agent's episodes gave two samples each, counted as breaks; groups are
    # still counted in episodes (the buffer took them).
    assert total("multiturn/prefix_breaks") > 0
    assert total("multiturn/tool_errors") > 0  # raised, or returned "very good"
    assert total("multiturn/tool_timeouts") > 0  # hung past episode_timeout_s
    assert total("multiturn/budget_hits/episode_timeout") > 0
    assert min(r["multiturn/turns_mean"] for r in metrics) >= 0  # silent: no turns
    assert max(r["weight_sync_epoch"] for r in metrics) == 0  # the generator never restarted
    assert all(r["staleness_mean"] >= 0 for r in metrics)  # empty samples carry no version
    lines = (run_dir / "logs" / "generator0.log").read_text().splitlines()
    faults = [line for line in lines if "its episode ends without it" in line]
    for says in ("raised RuntimeError: the agent broke", "returned 'very good'",
                 "raised SystemExit: 2", "raised KeyboardInterrupt"):  # fmt: skip
        assert sum(says in line for line in faults) == 1, says  # logged once, then counted
    # Timeouts: once per agent that had one (hangs, and any other past 3 s on a slow machine).
    timeouts = sum("passed multiturn.episode_timeout_s" in line for line in faults)
    assert 1 <= timeouts <= len(HOSTILE)
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"
