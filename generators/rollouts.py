"""One rollout path: the interface every kind of rollout implements, the single-turn kind,
and the table that gives each data source its kind.

    RolloutKind.run_group(group, n, how) -> trajectories       (one or more per episode)
      SingleTurn            one response per episode             (this module)
      EnvironmentEpisodes   an environment, turn by turn         (generators/episodes.py)
      AgentEpisodes         an agent program through the chat    (generators/agents.py)
                            endpoint
    Rollouts.of(data_source) -> the kind its prompts run as (``multiturn.environments`` and
                                ``multiturn.agents`` name theirs; every other is single-turn)

All three record through one recorder (generators/recorder.py: ``EpisodeRecorder``) into
one shape (generators/trajectory.py: ``Trajectory``), so the generator's loop
(generators/main.py) samples, scores and pushes a group the same way whatever it is.

The contract of ``run_group``: ``n`` episodes of the group's prompt, in flight at once;
trajectories in episode order; never raises for what user code (environments, tools,
agents) or the model's text does, whatever it raises (those cost their call or episode,
counted in its ``EpisodeStats``); only the engine's errors and cancellation go through.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from generators.agents import AgentEpisodes, AgentRunner
from generators.env_instances import Environments
from generators.episodes import EnvironmentEpisodes
from generators.interface import RolloutEngine, Sampling
from generators.recorder import EpisodeRecorder
from generators.render import Renderer
from generators.tool_calls import ToolBox, templated
from generators.trajectory import Trajectory
from verl_async import protocol as P
from verl_async.envs import EnvironmentTable
from verl_async.schema import RunConfig
from verl_async.tools.chat_templates import tool_template


class RolloutKind(Protocol):
    """A way of sampling a prompt group (see the module docstring for the contract)."""

    async def run_group(self, group: P.PromptGroup, n: int, how: Sampling) -> list[Trajectory]:
        """``n`` episodes of ``group``'s prompt as trajectories, in episode order."""


class SingleTurn:
    """One response per episode: ``n`` requests of the group's prompt (the ids the buffer
    rendered), which share its prefix cache."""

    def __init__(self, engine: RolloutEngine, tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    async def run_group(self, group: P.PromptGroup, n: int, how: Sampling) -> list[Trajectory]:
        prompt = list(group.prompt_ids)
        samples = await asyncio.gather(*(self.engine.sample(prompt, how) for _ in range(n)))
        out = []
        for i, s in enumerate(samples):
            recorder = EpisodeRecorder(i)
            recorder.record(prompt, s, self.tokenizer.decode(s.token_ids, skip_special_tokens=True))
            out.append(recorder.single_turn())
        return out


class Rollouts:
    """The rollout kind of every data source, built from ``cfg.multiturn`` on one engine
    (environment classes, tools and agent functions loaded now: a bad one fails at start,
    naming its key)."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, tokenizer) -> None:
        mt = cfg.multiturn
        table = EnvironmentTable(mt)
        self.table = table
        self.single = SingleTurn(engine, tokenizer)
        self.agents: AgentRunner | None = None
        eos = engine_eos_ids(tokenizer)
        kinds: dict[tuple[str, int], RolloutKind] = {}
        if table.entries:
            renderer = Renderer(tokenizer, cfg.data.chat_template, eos)
            g = cfg.generators
            in_flight = g.max_inflight_groups * max(g.group_size, cfg.eval.samples)
            envs = Environments(renderer, mt, mt.env_threads or 2 * in_flight)
            template = tool_template(mt.tool_template)
            for i, ((spec, cls), (tools, methods)) in enumerate(
                zip(table.entries, table.tools, strict=True)
            ):
                box = None
                if tools or methods:
                    box = ToolBox(tools, methods, mt, tokenizer, renderer, template)
                kinds["env", i] = EnvironmentEpisodes(engine, tokenizer, mt, envs, spec, cls, box)
        if table.agents:
            self.agents = AgentRunner(
                engine, tokenizer, agent_renderer(cfg, tokenizer, eos), mt, Sampling.training(cfg)
            )
            for i, (spec, fn) in enumerate(table.agents):
                kinds["agent", i] = AgentEpisodes(self.agents, spec, fn)
        self._kinds = kinds

    def of(self, data_source: str) -> RolloutKind:
        """The kind ``data_source``'s prompts run as."""
        route = self.table.route(data_source)
        return self.single if route is None else self._kinds[route]

    async def start(self) -> None:
        if self.agents is not None:
            await self.agents.start()

    async def stop(self) -> None:
        if self.agents is not None:
            await self.agents.stop()


def agent_renderer(cfg: RunConfig, tokenizer, eos_ids: set[int]) -> Renderer:
    """How the chat endpoint renders an agent's calls: the tokenizer's chat template, or
    ``multiturn.tool_template`` in its place; an agent needs one."""
    template = tool_template(cfg.multiturn.tool_template)
    renderer = Renderer(tokenizer, True, eos_ids, template=template)
    return templated(renderer, "an agent's messages go into")


def engine_eos_ids(tokenizer) -> set[int]:
    """The tokens that end a turn: the tokenizer's end of sequence and the model's
    generation config's (what both engines stop at)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(tokenizer.name_or_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's alone
        extra = None
    ids.update(extra if isinstance(extra, list) else [] if extra is None else [extra])
    return ids
