"""Agent episodes (generators/agents.py) through the real chat endpoint and the plain
``openai`` client, on a scripted engine and the tiny tokenizer: whatever an agent does
costs only its own episode, and every group it makes is one the buffer takes (checked by
the buffer's own ``unpack_rollout``). Real engines and whole runs: tests/integration/
test_agents.py and test_endpoint.py."""

import asyncio
import threading
from pathlib import Path

import pytest

from buffer.rollouts import RolloutLimits, max_response_tokens, max_samples_per_episode
from buffer.rollouts import unpack_rollout as unpack
from generators.interface import Sample, Sampling
from generators.leases import Finished
from generators.rollouts import Rollouts
from generators.trajectory import pack
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.launch.tiny_model import build_tokenizer
from verl_async.rewards.scorer import GroupScores
from verl_async.tasks.max_digit import VOCAB

ROOT = Path(__file__).resolve().parents[2]

WORDS = [*VOCAB, "secret", "tools", "lookup", "<tool_response>", "</tool_response>"]
GROUP_SIZE = 4
HOSTILE = ["exits", "interrupts", "spawns_exit", "sometimes_silent", "many_samples", "answers"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, WORDS)
    return AutoTokenizer.from_pretrained(d)


class Script:
    """Answers every request with "7" and end-of-sequence, at version 0."""

    def __init__(self, tok):
        self.ids = [tok.convert_tokens_to_ids("7"), tok.eos_token_id]
        self.requests = 0

    async def sample(self, prompt_ids, how):
        self.requests += 1
        await asyncio.sleep(0)
        return Sample(list(self.ids), [-0.5, -0.25], [0, 0], list(prompt_ids))


def config():
    agents = [
        {"agent": f"tests.hostile_agents:{name}", "data_sources": [name],
         **({"max_calls": 17} if name == "many_samples" else {})}
        for name in HOSTILE
    ]  # fmt: skip
    import json

    return load_config(
        ROOT / "configs/tiny_agent.yaml",
        [f"multiturn.agents={json.dumps(agents)}", "multiturn.episode_timeout_s=10",
         f"generators.group_size={GROUP_SIZE}"],
    )  # fmt: skip


def group(source: str, k: int, tok) -> P.PromptGroup:
    return P.PromptGroup(
        group_id=k, prompt_id=k, epoch=0, prompt_ids=tok("secret =")["input_ids"], prompt="secret =",
        ground_truth="7", data_source=source,
    )  # fmt: skip


def through_the_buffer(g: P.PromptGroup, trajectories, cfg, tok) -> None:
    """Pack the group and check it as the buffer does when it is pushed (raises
    ProtocolError if the buffer would refuse it)."""
    n = len(trajectories)
    scored = GroupScores(scores=[[0.0] * n], failed=[0])
    finished = Finished(g, pack(g.prompt_ids, trajectories), scored, 0.1, asyncio.Event())
    frames = P.Frames()
    msg = finished.message(0, frames)
    limits = RolloutLimits(
        num_sources=1, group_size=GROUP_SIZE, vocab_size=len(tok),
        max_response_tokens=max_response_tokens(cfg),
        max_samples_per_episode=max_samples_per_episode(cfg),
    )  # fmt: skip
    unpack(msg, frames.buffers, limits, (0, 0))


def test_agents_that_exit_interrupt_or_stay_silent_cost_only_their_episodes(tok):
    cfg = config()
    engine = Script(tok)
    rollouts = Rollouts(cfg, engine, tok)
    how = Sampling.training(cfg)
    threads_before = threading.active_count()

    async def main():
        await rollouts.start()
        try:
            out = {}
            for k, name in enumerate(HOSTILE * 2):  # twice: the loop lives on after each
                g = group(name, k, tok)
                out.setdefault(name, []).append(
                    (g, await rollouts.of(name).run_group(g, GROUP_SIZE, how))
                )
            return out
        finally:
            await rollouts.stop()

    out = asyncio.run(main())
    for name, groups in out.items():
        for g, trajectories in groups:
            through_the_buffer(g, trajectories, cfg, tok)  # every group is one it takes
            episodes = {t.stats.episode for t in trajectories}
            assert episodes == set(range(GROUP_SIZE)), (name, episodes)
    first = lambda name: [t.stats for t in out[name][0][1]]  # noqa: E731
    # SystemExit after a call: the call's sample stays, the episode counts an error.
    assert all(s.tool_errors == 1 and s.turns == 1 for s in first("exits"))
    # KeyboardInterrupt before any call: an empty response, counted.
    assert all(s.tool_errors == 1 and s.turns == 0 for s in first("interrupts"))
    # A task the agent started raised SystemExit on the agents' loop: it ran on.
    assert all(s.tool_errors == 0 and s.turns == 1 for s in first("spawns_exit"))
    # Silent and calling episodes in one group.
    turns = sorted(s.turns for s in first("sometimes_silent"))
    assert turns == [0, 0, 1, 1], turns
    # 17 calls each rewriting the history: 17 samples per episode, 16 breaks counted.
    many = out["many_samples"][0][1]
    assert len(many) == 17 * GROUP_SIZE
    assert sorted(t.stats.prefix_breaks for t in many if t.stats.prefix_breaks) == [16] * 4
    # The loop that runs agents is the one it started with (never replaced).
    assert rollouts.agents.loop.replaced == 0 and rollouts.agents.loop.escaped >= 2
    assert all(s.turns == 1 for _, ts in out["answers"] for s in (t.stats for t in ts))
    assert threading.active_count() <= threads_before + 4  # no thread per episode
