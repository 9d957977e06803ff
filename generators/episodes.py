"""Environment episodes: an environment and the engine, turn by turn, into one sample.

    run_group:    env = Class(**args); prompt = env.reset(row)     (n instances, one prompt)
    each episode: loop: turn = engine.sample(prompt)                (same engine)
                        record(prompt, turn)                         (generators/recorder.py)
                        step = env.step(turn text)  -> observation, reward, done
                        prompt = continuation(ids so far, observation delta)
                  env.close()
                  -> Trajectory: ids, loss mask, log-probs, versions, turn rewards, stats

A turn is one engine request; ``engine.sample`` returns only whole turns (a request cut
by an abort-mode weight swap goes on from its prefix inside it), so a tool call is never
parsed from a partial turn. A turn ends at an end-of-sequence token or at its token budget
(``generators.max_new_tokens``): the environment answers both alike, and after a cut turn
the template's end-of-turn token goes before the observation (``Renderer.continuation``:
what a full render of the conversation writes there). A turn cut by what is left of
``multiturn.max_episode_tokens`` ends the episode; a prompt that leaves no room for a
token gives an episode without turns (an empty response, scored as a failed answer).

Environment calls never run on the generator's event loop: each instance runs on a thread
of its own (generators/env_threads.py), under a deadline (``multiturn.step_timeout_s`` and
what is left of ``episode_timeout_s``), and generators/env_instances.py builds, resets,
steps and closes them. ``run_group`` never raises for an environment's faults, whatever they
are: a call that raises (anything, ``SystemExit`` included), passes its deadline or returns
something that is not what the contract says; an initial prompt that cannot be rendered,
does not fit the episode or differs from the group's other episodes'; an observation the
chat template refuses or with too many messages; a tool call the model wrote
(generators/tool_calls.py). Each ends its turn with an error observation (or runs its
episode without the environment), is counted in the episode's ``tool_errors`` /
``tool_timeouts``, and the first of each kind is logged. Every instance that was built is
closed exactly once, however its episode ends (a failed reset, an engine error in its
group, a cancelled group), ``close`` with a deadline of its own.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, replace

from generators.env_instances import EnvInstance, Environments
from generators.env_threads import EnvCallError
from generators.interface import RolloutEngine, Sampling
from generators.recorder import EpisodeRecorder
from generators.render import Renderer
from generators.tool_calls import ToolBox
from generators.trajectory import Trajectory
from generators.user_code import error_text
from verl_async import protocol as P
from verl_async.schema import EnvironmentConfig, MultiTurnConfig

# An observation's text is cut to this many characters per allowed token before it is
# tokenized at all: a tool that returns megabytes costs no tokenizer time.
_CHARS_PER_TOKEN = 8


@dataclass
class _Episode:
    """One episode in play: its instance, recorder, and how it renders (with its entry's
    tools, or without when the group's prompt could not be rendered with them)."""

    env: EnvInstance
    recorder: EpisodeRecorder
    renderer: Renderer
    tools: ToolBox | None


class EnvironmentEpisodes:
    """The episodes of one ``multiturn.environments`` entry on one engine (a rollout kind,
    generators/rollouts.py). ``envs`` is the generator's pool of instances and threads,
    shared by its entries; ``tools`` the entry's tools, if it has some."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        mt: MultiTurnConfig,
        envs: Environments,
        spec: EnvironmentConfig,
        cls: type,
        tools: ToolBox | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.mt = engine, tokenizer, mt
        self.envs, self.spec, self.cls, self.tools = envs, spec, cls, tools

    async def run_group(self, group: P.PromptGroup, n: int, how: Sampling) -> list[Trajectory]:
        """``n`` episodes of ``group``'s prompt, all in flight at once; never raises for the
        environment's faults (only the engine's errors and cancellation go through). Every
        episode starts from the same prompt (the group is compared with itself): the one
        most of the instances' resets gave; an episode whose environment failed to start,
        or gave another, runs as a single turn on it without its environment."""
        renderer = self.tools.renderer if self.tools else self.envs.renderer
        prompt, prompt_ids, envs, with_tools = await self.envs.start_group(
            self.spec, self.cls, group, n, renderer
        )
        if not with_tools:
            renderer = self.envs.renderer
        tools = self.tools if with_tools else None
        episodes = [
            _Episode(env, EpisodeRecorder(i, env.counts), renderer, tools)
            for i, env in enumerate(envs)
        ]
        plays = [asyncio.ensure_future(self._play(e, prompt, prompt_ids, how)) for e in episodes]
        try:
            return [t for ts in await asyncio.gather(*plays) for t in ts]
        except BaseException:
            for task in plays:
                task.cancel()
            self.envs.close_later(envs)
            raise

    # ------------------------------------------------------------------ one episode

    async def _play(self, ep: _Episode, prompt, prompt_ids: list[int], how: Sampling):
        """One episode from ``prompt``: its turns, then its environment closed."""
        ep.env.counts.budget = await self._turns(ep, list(prompt_ids), how)
        await self.envs.close(ep.env)
        return self._finish(ep, prompt, prompt_ids)

    async def _turns(self, ep: _Episode, prompt: list[int], how: Sampling) -> str:
        """Turns until the environment is done or a budget ends the episode; returns the
        budget that ended it, or ""."""
        mt, env = self.mt, ep.env
        while True:
            room = mt.max_episode_tokens - len(prompt)
            if room <= 0:
                return "episode_tokens"
            turn_budget = min(how.max_tokens, room)
            turn = await self.engine.sample(prompt, replace(how, max_tokens=turn_budget))
            text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            traj = ep.recorder.record(prompt, turn, text)
            ended = bool(turn.token_ids) and turn.token_ids[-1] in ep.renderer.eos_ids
            cut = not ended and len(turn.token_ids) >= turn_budget
            if cut and turn_budget < how.max_tokens:
                return "episode_tokens"  # cut by what was left of the episode
            # A turn cut by its own budget (generators.max_new_tokens) or a stop string is
            # still a whole turn: the environment answers it, and the template's
            # end-of-turn closes it in the next prompt.
            budget = "turn_tokens" if cut else ""
            if not env.usable():
                return budget
            answer = await self._answer(ep, traj, text)
            if answer is None:  # the call still runs: calling the instance again would wait
                return "episode_timeout" if time.monotonic() >= env.deadline else budget
            messages, done, counted = answer
            if done:
                return budget
            if len(traj.turns) >= mt.max_turns:
                return "turns"
            if time.monotonic() >= env.deadline:
                return "episode_timeout"
            observation = self._observation(ep, messages, counted)
            if observation is None:
                return budget
            messages, delta = observation
            prompt = ep.renderer.continuation(traj.ids(), delta)
            if len(prompt) >= mt.max_episode_tokens:
                return "episode_tokens"  # no room for the observation and a token
            traj.observe(messages)

    async def _answer(self, ep: _Episode, traj: Trajectory, text: str):
        """What answers a turn: (observation messages, done, whether a fault in them is
        counted already), or None when the environment's call still runs. A turn with tool
        calls (in an episode with tools) is answered by them; any other by ``step``."""
        env, tools = ep.env, ep.tools
        parsed = tools.parse(text, len(traj.turns) - 1) if tools is not None else None
        if parsed is not None and (parsed.calls or parsed.errors):
            return await self._call_tools(env, tools, parsed), False, True
        faults = env.counts.tool_errors + env.counts.tool_timeouts
        step = await self.envs.step(env, text)
        if step is None:
            return None
        if step.reward is not None:  # at the turn's last sampled token
            traj.add_reward(self.mt.env_reward_weight * step.reward)
        # An error observation of a failed call is not counted again if it is cut.
        failed = env.counts.tool_errors + env.counts.tool_timeouts > faults
        return step.observations, step.done, failed

    async def _call_tools(self, env: EnvInstance, tools: ToolBox, parsed) -> list[dict]:
        """The turn's calls run and answered (generators/tool_calls.py), counted."""

        async def on_instance(name: str, kwargs: dict, timeout_s: float):
            method = functools.partial(_call_method, env, name, kwargs)
            return await self.envs.call(env, f"tool {name}", method, timeout_s=timeout_s)

        return await tools.answer(parsed, env.deadline, env.counts, on_instance)

    def _observation(self, ep: _Episode, messages: list[dict], counted: bool = False):
        """(messages, delta ids) of an observation within ``max_observation_tokens`` (a
        longer one is cut and counted, unless its call's fault is ``counted`` already: one
        fault, one count); one the chat template refuses becomes an error observation,
        counted; None if even that cannot be rendered."""
        try:
            messages, ids, cut = self._render_observation(ep.renderer, messages)
        except Exception as exc:  # noqa: BLE001 (the observation's fault: a role, a text)
            self.envs.fault(ep.env, EnvCallError("observation", exc, timed_out=False))
            counted = True
            error = [{"role": "user", "content": error_text(exc)}]
            try:
                messages, ids, cut = self._render_observation(ep.renderer, error)
            except Exception:  # noqa: BLE001 (then the template cannot render a user turn)
                return None
        ep.env.counts.tool_errors += int(cut and not counted)
        return messages, ids

    def _render_observation(
        self, renderer: Renderer, messages: list[dict]
    ) -> tuple[list[dict], list[int], bool]:
        """The observation's messages and delta ids within ``max_observation_tokens``: a
        longer one has its longest message cut (and marked) until it fits; returns whether
        it was cut."""
        limit = self.mt.max_observation_tokens
        cap = limit * _CHARS_PER_TOKEN
        messages = [dict(m, content=str(m.get("content", ""))) for m in messages]
        cut = False
        for m in messages:
            if len(m["content"]) > cap:
                m["content"] = m["content"][:cap] + " [truncated]"
                cut = True
        ids = renderer.observation_ids(messages)
        if len(ids) <= limit:
            return messages, ids, cut
        longest = max(messages, key=lambda m: len(m["content"]))
        text, keep = longest["content"], len(longest["content"])
        while len(ids) > limit:
            # Shrink in proportion to the overflow, and always by at least one character.
            keep = min(keep - 1, int(keep * limit / len(ids) * 0.9))
            if keep <= 0:
                return messages, ids[:limit], True  # the template's own tokens overflow
            longest["content"] = text[:keep] + " [truncated]"
            ids = renderer.observation_ids(messages)
        return messages, ids, True

    def _finish(self, ep: _Episode, prompt, prompt_ids: list[int]) -> list[Trajectory]:
        """The episode's trajectory, checked against a full render of its conversation."""
        traj, renderer = ep.recorder.last, ep.renderer
        turns = traj.turns if traj else []
        observations = traj.observations if traj else []
        try:
            full = renderer.full_ids(prompt, turns, observations)
            ended = bool(traj and traj.token_ids) and traj.token_ids[-1] in renderer.eos_ids
            ids = traj.ids() if traj else list(prompt_ids)
            mismatch = not renderer.matches_full_render(ids, full, ended)
        except Exception:  # noqa: BLE001 (the template cannot render the whole conversation)
            mismatch = True
        conversation = _conversation(prompt, turns, observations)
        return ep.recorder.finish(prompt_ids, conversation, template_mismatch=mismatch)


def _call_method(env: EnvInstance, name: str, kwargs: dict):
    """(On the instance's thread) one of its methods called as a tool."""
    return getattr(env.obj, name)(**kwargs)


def _conversation(prompt, turns: list[str], observations: list[list[dict]]) -> list[dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for i, text in enumerate(turns):
        messages.append({"role": "assistant", "content": text})
        if i < len(observations):
            messages.extend(observations[i])
    return messages
