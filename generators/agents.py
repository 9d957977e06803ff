"""Agent episodes: an unmodified ``openai`` client program talks to this generator's chat
endpoint, and what the endpoint sampled for it becomes the episode's trajectories.

    AgentRunner     one per generator: the chat endpoint (generators/endpoint.py) and the
                    agents' event loop, started before the first episode
    AgentEpisodes   one per ``multiturn.agents`` entry, a rollout kind
                    (generators/rollouts.py):
      run_group: n episodes of one prompt, all at once; each:
        key, base_url = endpoint.open_episode(sampling, max_calls, index)
        reward = await agent(AsyncOpenAI(base_url), row, **args)  # the agents' loop,
                                                                   # under episode_timeout_s
        episode = endpoint.close_episode(key)
        -> episode.recorder.finish(...) -> Trajectories (generators/recorder.py)

The endpoint records every call token for token; calls that extend one another are one
sample, a call that rewrote the conversation starts another (``prefix_breaks``). Every
sample of an episode is scored as the episode: the run's reward sources read its final
answer (the last reply's text) and the agent's returned reward, times
``multiturn.env_reward_weight``, sits at each sample's last sampled token. Samples carry
their episode's index, so the buffer and the learner count a group in episodes (a group's
baseline weighs each episode once, however many samples it gave).

Agents run on an event loop of their own, in a thread (generators/user_code.py's
``LoopThread``): an agent that blocks stalls the other agents' episodes, never the
generator (they time out, counted). Whatever an agent does costs only its own episode,
counted: raising (``SystemExit`` and ``KeyboardInterrupt`` included: never the loop's
thread), passing ``multiturn.episode_timeout_s`` (``budget`` "episode_timeout"), returning
what is not a reward (``tool_errors``), never calling the model (an episode without turns:
an empty response, scored as a failed answer, beside the other episodes of its group).

vLLM's tool-call parsers take 10 s or more to import on a CPU: ``AgentRunner.start``
builds one before the first episode's clock starts.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from generators.endpoint import AgentEpisode, CachedParsers, EndpointServer
from generators.interface import RolloutEngine, Sampling
from generators.render import Renderer
from generators.trajectory import Trajectory
from generators.user_code import LoopThread, cause, error_text
from verl_async import protocol as P
from verl_async.envs import EnvRow
from verl_async.numerics import finite32
from verl_async.ratelimit import RateLimitedLog
from verl_async.schema import AgentConfig, MultiTurnConfig

log = logging.getLogger("verl_async.generator")

CLOSE_GRACE_S = 5.0  # past the episode's deadline, how long the generator waits for an agent
MODEL_NAME = "policy"  # what agents pass as ``model`` (GET /models lists it)
_WARM_UP_TOOLS = [
    {"type": "function", "function": {"name": "warm_up", "parameters": {"type": "object"}}}
]


class AgentRunner:
    """The chat endpoint and the agents' event loop of one generator."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        renderer: Renderer,
        mt: MultiTurnConfig,
        sampling: Sampling,
    ) -> None:
        from verl_async.tools.parsers import ToolCallParser

        self.mt = mt
        self.parsers = CachedParsers(
            lambda tools: ToolCallParser(mt.tool_parser, tokenizer, tools, "multiturn.tool_parser")
        )
        self.server = EndpointServer(
            engine,
            tokenizer,
            sampling,
            model_name=MODEL_NAME,
            max_episode_tokens=mt.max_episode_tokens,
            max_calls=max((a.max_calls for a in mt.agents), default=16),
            parse_calls=self.parsers,
            eos_ids=renderer.eos_ids,
            renderer=renderer,
        )
        self.loop: LoopThread | None = None
        self._ssl = None  # the SSL context every agent's HTTP client is built on
        self.faults = RateLimitedLog(log, what="agent faults")

    async def start(self) -> None:
        await asyncio.to_thread(self.parsers, "", _WARM_UP_TOOLS)  # see the module docstring
        await self.server.start()
        self.loop = LoopThread("agents")

    async def stop(self) -> None:
        await self.server.stop()
        if self.loop is not None:
            self.loop.stop()

    async def run_agent(self, spec: AgentConfig, fn: Any, row: EnvRow, base_url: str):
        """(the agent's reward or None, "" | "error" | "timeout"): one episode of the agent
        on the agents' loop, under ``multiturn.episode_timeout_s``."""
        timeout_s = self.mt.episode_timeout_s
        done = self.loop.submit(self._agent_call, fn, base_url, row, spec.args, timeout_s)
        try:
            async with asyncio.timeout(timeout_s + CLOSE_GRACE_S):
                result = await asyncio.wrap_future(done)
        except TimeoutError:
            done.cancel()
            self._log(spec, "passed multiturn.episode_timeout_s")
            return None, "timeout"
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 (the agent's own fault, whatever it is)
            if isinstance(cause(exc), TimeoutError):
                self._log(spec, "passed multiturn.episode_timeout_s")
                return None, "timeout"
            self._log(spec, f"raised {error_text(exc).removeprefix('error: ')}")
            return None, "error"
        if result is None:
            return None, ""
        if isinstance(result, bool) or not isinstance(result, int | float) or not finite32(result):
            self._log(spec, f"returned {result!r:.80}, which is not a reward finite in float32")
            return None, "error"
        return float(result), ""

    async def _agent_call(self, fn, base_url: str, row: EnvRow, args: dict, timeout_s: float):
        """(On the agents' loop) one episode of the agent, with an ``openai.AsyncOpenAI``
        and a connection of its own. Its HTTP client is built on the loop's one SSL context:
        building one per client costs some 50 ms (for a loopback URL that never uses it),
        and one connection pool shared by every episode costs more, as the pool scans all
        its connections on each request."""
        import openai

        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        http = openai.DefaultAsyncHttpxClient(verify=self._ssl)
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key="verl-async", max_retries=0, timeout=timeout_s,
            http_client=http,
        )  # fmt: skip
        try:
            async with asyncio.timeout(timeout_s):
                return await fn(client, row, **args)
        finally:
            await client.close()

    def _log(self, spec: AgentConfig, what: str) -> None:
        """Once per agent and kind of fault; later ones are only counted."""
        kind = " ".join([spec.agent, *what.split(":")[0].split()[:2]])  # "raised SystemExit"
        self.faults.log(
            kind,
            "agent %s %s; its episode ends without it (later faults of this kind are only "
            "counted: multiturn/tool_errors, multiturn/tool_timeouts)",
            spec.agent, what, once=kind,
        )  # fmt: skip


class AgentEpisodes:
    """The episodes of one ``multiturn.agents`` entry, through the generator's endpoint."""

    def __init__(self, runner: AgentRunner, spec: AgentConfig, fn: Any) -> None:
        self.runner, self.spec, self.fn = runner, spec, fn

    async def run_group(self, group: P.PromptGroup, n: int, how: Sampling) -> list[Trajectory]:
        """``n`` episodes of ``group``'s prompt at once, as trajectories (one or more per
        episode, in episode order); never raises for the agent's faults."""
        row = EnvRow(group.prompt, group.ground_truth, group.data_source, dict(group.extra_info))
        episodes = await asyncio.gather(*(self._episode(row, group, how, i) for i in range(n)))
        return [t for trajectories in episodes for t in trajectories]

    async def _episode(self, row: EnvRow, group: P.PromptGroup, how: Sampling, index: int):
        server = self.runner.server
        key, base_url = server.open_episode(how, self.spec.max_calls, index)
        t0 = time.perf_counter()
        try:
            reward, fault = await self.runner.run_agent(self.spec, self.fn, row, base_url)
        finally:
            episode = server.close_episode(key)
        return self._trajectories(episode, group, reward, fault, time.perf_counter() - t0)

    def _trajectories(
        self, episode: AgentEpisode, group: P.PromptGroup, reward, fault: str, seconds: float
    ) -> list[Trajectory]:
        mt, rec = self.runner.mt, episode.recorder
        weighted = mt.env_reward_weight * reward if reward is not None else None
        if weighted is not None and not finite32(weighted):
            weighted, fault = None, "error"
        counts = rec.counts
        if fault:
            counts.fault(timed_out=fault == "timeout")
        counts.budget = "episode_timeout" if fault == "timeout" else ""
        counts.env_seconds = seconds
        counts.env_reward = reward if reward is not None else 0.0
        last = episode.calls[-1] if episode.calls else None
        final = (last.reply.get("content") or "") if last else ""
        messages = [*last.messages, last.reply] if last else []
        trajectories = rec.finish(list(group.prompt_ids), messages, final_text=final)
        if weighted is not None:
            for t in trajectories:
                t.add_reward(weighted)
        return trajectories
