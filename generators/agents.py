"""Agent programs as episodes: an unmodified ``openai`` client program talks to this
generator's chat endpoint, and what the endpoint sampled for it becomes the trajectory.

    run_group: n episodes of one prompt, all at once; each:
        key, base_url = endpoint.open_episode(sampling, max_calls)
        reward = await agent(AsyncOpenAI(base_url), row, **args)  # the agents' loop,
                                                                   # under episode_timeout_s
        trace = endpoint.close_episode(key)
        -> trace.samples() -> Trajectories (generators/trajectory.py)

The endpoint (generators/endpoint.py) records every call token for token; calls that
extend one another are one sample, a call that rewrote the conversation starts another
(``EpisodeStats.prefix_breaks``, on the episode's first sample). Every sample of an
episode is scored as the episode: the run's reward sources read its final answer (the
last reply's text) and the agent's returned reward, times ``multiturn.env_reward_weight``,
sits at each sample's last sampled token. Samples carry their episode's index
(``EpisodeStats.episode``), so the buffer counts a group in episodes.

Agents run on an event loop of their own, in a thread: an agent that blocks stalls the
other agents' episodes, never the generator (they time out, counted). An agent that
raises, passes ``multiturn.episode_timeout_s`` (``budget`` "episode_timeout") or returns
what is not a reward costs only its own episode and is counted (``tool_errors``,
``tool_timeouts``); one that never called the model gives an episode without turns (an
empty response, scored as a failed answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from typing import Any

from generators.endpoint import EndpointServer
from generators.interface import RolloutEngine, Sampling
from generators.render import Renderer
from generators.traces import EpisodeTrace, TraceSample
from generators.trajectory import Trajectory
from verl_async import protocol as P
from verl_async.envs import EnvRow
from verl_async.numerics import finite32
from verl_async.schema import AgentConfig, MultiTurnConfig

log = logging.getLogger("verl_async.generator")

CLOSE_GRACE_S = 5.0  # past the episode's deadline, how long the generator waits for an agent


class AgentRunner:
    """The chat endpoint and the agents' event loop of one generator."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        renderer: Renderer,
        mt: MultiTurnConfig,
        sampling: Sampling,
        model_name: str = "policy",
    ) -> None:
        self.mt = mt
        self.server = EndpointServer(
            engine,
            tokenizer,
            sampling,
            model_name=model_name,
            max_episode_tokens=mt.max_episode_tokens,
            max_calls=max((a.max_calls for a in mt.agents), default=16),
            parse_calls=ToolCalls(mt.tool_parser, tokenizer),
            eos_ids=renderer.eos_ids,
            renderer=renderer,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ssl = None  # the SSL context every agent's HTTP client is built on
        self._logged: set[str] = set()

    async def start(self) -> None:
        await self.server.start()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="agents", daemon=True).start()

    async def stop(self) -> None:
        await self.server.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def run_group(
        self, spec: AgentConfig, fn: Any, group: P.PromptGroup, n: int, how: Sampling
    ) -> list[Trajectory]:
        """``n`` episodes of ``group``'s prompt at once, as trajectories (one or more per
        episode, in episode order); never raises for the agent's faults."""
        row = EnvRow(group.prompt, group.ground_truth, group.data_source, dict(group.extra_info))
        episodes = await asyncio.gather(
            *(self._episode(spec, fn, row, group, how, i) for i in range(n))
        )
        return [t for trajectories in episodes for t in trajectories]

    async def _episode(self, spec, fn, row: EnvRow, group, how: Sampling, index: int):
        key, base_url = self.server.open_episode(how, spec.max_calls)
        t0 = time.perf_counter()
        try:
            reward, fault = await self._run_agent(spec, fn, row, base_url)
        finally:
            trace = self.server.close_episode(key)
        seconds = time.perf_counter() - t0
        return self._trajectories(trace, group, reward, fault, seconds, index)

    async def _run_agent(self, spec, fn, row, base_url) -> tuple[float | None, str]:
        """(the agent's reward or None, "" | "error" | "timeout")."""
        timeout_s = self.mt.episode_timeout_s
        done = asyncio.run_coroutine_threadsafe(
            self._agent_call(fn, base_url, row, spec.args, timeout_s), self._loop
        )
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
            self._log(spec, f"raised {type(exc).__name__}: {exc}")
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

    def _trajectories(
        self, trace: EpisodeTrace, group, reward, fault: str, seconds: float, index: int
    ) -> list[Trajectory]:
        samples = trace.samples() or [TraceSample(list(group.prompt_ids))]
        last = trace.calls[-1] if trace.calls else None
        final = (last.reply.get("content") or "") if last else ""
        messages = [*last.messages, last.reply] if last else []
        weighted = self.mt.env_reward_weight * reward if reward is not None else None
        if weighted is not None and not finite32(weighted):
            weighted, fault = None, "error"
        tool_calls = sum(len(c.reply.get("tool_calls") or []) for c in trace.calls)
        out = []
        for i, s in enumerate(samples):
            t = _trajectory(s, final)
            if weighted is not None:
                t.add_reward(weighted)
            sampled = t.sampled_versions()
            stats = P.EpisodeStats(
                turns=len(t.turns),
                tool_calls=tool_calls if i == 0 else 0,
                tool_errors=(trace.stats.errors + (fault == "error")) if i == 0 else 0,
                tool_timeouts=int(fault == "timeout") if i == 0 else 0,
                env_seconds=seconds if i == 0 else 0.0,
                observation_tokens=t.loss_mask.count(0),
                budget="episode_timeout" if fault == "timeout" else "",
                versions_spanned=max(sampled) - min(sampled) if sampled else 0,
                template_mismatch=False,
                env_reward=reward if reward is not None and i == 0 else 0.0,
                tool_parse_errors=trace.stats.tool_call_errors if i == 0 else 0,
                prefix_breaks=len(samples) - 1 if i == 0 else 0,
                episode=index,
            )
            out.append(t.finish(stats, messages))
        return out

    def _log(self, spec: AgentConfig, what: str) -> None:
        """Once per agent and kind of fault; later ones are only counted."""
        kind = f"{spec.agent}: {what.split(':')[0]}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(
                "agent %s %s; its episode ends without it (later faults of this kind are "
                "only counted: multiturn/tool_errors, multiturn/tool_timeouts)",
                spec.agent, what,
            )  # fmt: skip


def _trajectory(sample: TraceSample, final: str) -> Trajectory:
    """A recorded sample as a trajectory: its sampled runs are its turns."""
    t = Trajectory(list(sample.prompt_ids))
    # Up to its last sampled token: tokens after it (a call that sampled none) train nothing.
    keep = max((i + 1 for i, m in enumerate(sample.loss_mask) if m), default=0)
    t.token_ids, t.logprobs = list(sample.token_ids[:keep]), list(sample.logprobs[:keep])
    t.versions, t.loss_mask = list(sample.versions[:keep]), list(sample.loss_mask[:keep])
    t.rewards = [0.0] * keep
    mask = t.loss_mask
    for end in range(1, len(mask) + 1):
        if mask[end - 1] and (end == len(mask) or not mask[end]):  # a sampled run ends
            t.turn_ends.append(end)
            t.turns.append("")
    if t.turns:
        t.turns[-1] = final  # what the reward sources score: the episode's final answer
    return t


class ToolCalls:
    """The endpoint's tool-call parser: the run's ``multiturn.tool_parser`` for the tools
    each request gives (one vLLM parser per distinct tool set, kept)."""

    def __init__(self, name: str, tokenizer) -> None:
        self.name, self.tokenizer = name, tokenizer
        self._parsers: dict[str, Any] = {}

    def __call__(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict], list[str]]:
        from verl_async.tools.parsers import ToolCallParser

        key = json.dumps(tools, sort_keys=True)
        parser = self._parsers.get(key)
        if parser is None:
            parser = ToolCallParser(self.name, self.tokenizer, tools, "multiturn.tool_parser")
            self._parsers[key] = parser
        parsed = parser.parse(text)
        calls = [{"name": c.name, "arguments": c.arguments_json} for c in parsed.calls]
        return parsed.content, calls, list(parsed.errors)
