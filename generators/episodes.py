"""Multi-turn episodes: an environment and the engine, turn by turn, into one sample.

    run_group:    env = Class(**args); prompt = env.reset(row)     (n instances, one prompt)
    each episode: loop: turn = engine.sample(prompt + ids so far)   (same engine)
                        step = env.step(turn text)  -> observation, reward, done
                        ids += observation delta    (generators/render.py)
                  env.close()
                  -> Trajectory: ids, loss mask, log-probs, versions, turn rewards, stats
                     (generators/trajectory.py)

A turn is one engine request; ``engine.sample`` returns only whole turns (a request cut
by an abort-mode weight swap goes on from its prefix inside it), so a tool call is never
parsed from a partial turn. A turn ends at an end-of-sequence token or at its token budget
(``generators.max_new_tokens``): the environment answers both alike, and after a cut turn
the template's end-of-turn token is appended as a non-sampled token before the observation
(what a full render of the conversation writes there). A turn cut by what is left of
``multiturn.max_episode_tokens`` ends the episode; a prompt that leaves no room for a
token gives an episode without turns (an empty response, scored as a failed answer).

Environment calls never run on the generator's event loop: each instance runs on a thread
of its own (generators/env_threads.py), under a deadline (``multiturn.step_timeout_s`` and
what is left of ``episode_timeout_s``), and generators/env_instances.py builds, resets,
steps and closes them. ``run_group`` never raises for an environment's faults, whatever they
are: a call that raises (anything, ``SystemExit`` included), passes its deadline or returns
something that is not what the contract says; an initial prompt that cannot be rendered,
does not fit the episode or differs from the group's other episodes'; an observation the
chat template refuses or with too many messages. Each ends its turn with an error
observation (or runs its episode without the environment), is counted in the episode's
``tool_errors`` / ``tool_timeouts``, and the first of each kind is logged. Every instance
that was built is closed exactly once, however its episode ends (a failed reset, an engine
error in its group, a cancelled group), ``close`` with a deadline of its own.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import replace

from generators.env_instances import EnvInstance, Environments
from generators.env_threads import EnvCallError, error_text
from generators.interface import RolloutEngine, Sampling
from generators.render import Renderer
from generators.tool_calls import ToolBox
from generators.trajectory import Trajectory
from verl_async import protocol as P
from verl_async.envs import EnvironmentTable
from verl_async.schema import EnvironmentConfig, MultiTurnConfig
from verl_async.tools.chat_templates import tool_template

# An observation's text is cut to this many characters per allowed token before it is
# tokenized at all: a tool that returns megabytes costs no tokenizer time.
_CHARS_PER_TOKEN = 8


class EpisodeRunner:
    """Runs episodes of the environments in ``multiturn`` on one engine.

    ``episodes_in_flight`` is how many episodes the generator may run at once; each
    environment gets ``multiturn.env_threads`` threads, or twice that many."""

    def __init__(
        self,
        engine: RolloutEngine,
        renderer: Renderer,
        tokenizer,
        mt: MultiTurnConfig,
        episodes_in_flight: int = 64,
        table: EnvironmentTable | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.mt = mt
        self.envs = Environments(renderer, mt, mt.env_threads or 2 * episodes_in_flight)
        # The tools of each environment entry that has some, by the entry (its config).
        self.toolboxes: dict[int, ToolBox] = {}
        for spec, tools, methods in table.tool_entries() if table is not None else []:
            template = tool_template(mt.tool_template)
            self.toolboxes[id(spec)] = ToolBox(tools, methods, mt, tokenizer, renderer, template)

    async def run_group(
        self, spec: EnvironmentConfig, cls: type, group: P.PromptGroup, n: int, how: Sampling
    ) -> list[Trajectory]:
        """``n`` episodes of ``group``'s prompt, all in flight at once; never raises for the
        environment's faults (only the engine's errors and cancellation go through). Every
        episode starts from the same prompt (the group is compared with itself): the one
        most of the instances' resets gave; an episode whose environment failed to start,
        or gave another, runs as a single turn on it without its environment."""
        tools = self.toolboxes.get(id(spec))
        prompt, prompt_ids, envs = await self.envs.start_group(spec, cls, group, n, tools)
        plays = [asyncio.ensure_future(self._play(env, prompt, prompt_ids, how)) for env in envs]
        try:
            return await asyncio.gather(*plays)
        except BaseException:
            for task in plays:
                task.cancel()
            self.envs.close_later(envs)
            raise

    # ------------------------------------------------------------------ one episode

    async def _play(self, env: EnvInstance, prompt, prompt_ids: list[int], how: Sampling):
        """One episode from ``prompt``: its turns, then its environment closed."""
        traj = Trajectory(list(prompt_ids))
        budget, ended = await self._turns(env, traj, how)
        await self.envs.close(env)
        return self._episode(env, prompt, traj, budget, ended)

    async def _turns(self, env: EnvInstance, traj: Trajectory, how: Sampling) -> tuple[str, bool]:
        """Turns until the environment is done or a budget ends the episode: (the budget
        that ended it or "", whether its last turn ended with an end-of-sequence token)."""
        mt = self.mt
        renderer = env.renderer or self.renderer
        ended = False
        while True:
            room = mt.max_episode_tokens - traj.length()
            if room <= 0:
                return "episode_tokens", ended
            turn_budget = min(how.max_tokens, room)
            turn = await self.engine.sample(traj.ids(), replace(how, max_tokens=turn_budget))
            ended = bool(turn.token_ids) and turn.token_ids[-1] in renderer.eos_ids
            text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            traj.add_turn(turn, text)
            cut = not ended and len(turn.token_ids) >= turn_budget
            if cut and turn_budget < how.max_tokens:
                return "episode_tokens", ended  # cut by what was left of the episode
            # A turn cut by its own budget (generators.max_new_tokens) or a stop string is
            # still a whole turn: the environment answers it, and the template's
            # end-of-turn closes it below.
            budget = "turn_tokens" if cut else ""
            if not env.usable():
                return budget, ended
            answer = await self._answer(env, traj, text)
            if answer is None:  # the call still runs: calling the instance again would wait
                return "episode_timeout" if time.monotonic() >= env.deadline else budget, ended
            messages, done, counted = answer
            if done:
                return budget, ended
            if len(traj.turns) >= mt.max_turns:
                return "turns", ended
            if time.monotonic() >= env.deadline:
                return "episode_timeout", ended
            observation = self._observation(env, messages, counted)
            if observation is None:
                return budget, ended
            messages, ids = observation
            if not ended:  # not sampled: what the template writes after a turn's content
                ids = [renderer.end_of_turn, *ids]
            if traj.length() + len(ids) >= mt.max_episode_tokens:
                return "episode_tokens", ended  # no room for the observation and a token
            traj.add_observation(messages, ids)
            env.counts.observation_tokens += len(ids)

    async def _answer(self, env: EnvInstance, traj: Trajectory, text: str):
        """What answers a turn: (observation messages, done, whether a fault in them is
        counted already), or None when the environment's call still runs. A turn with tool
        calls (in an episode with tools) is answered by them; any other by ``step``."""
        tools = env.tools
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

    def _observation(self, env: EnvInstance, messages: list[dict], counted: bool = False):
        """(messages, delta ids) of an observation within ``max_observation_tokens`` (a
        longer one is cut and counted, unless its call's fault is ``counted`` already: one
        fault, one count); one the chat template refuses becomes an error observation,
        counted; None if even that cannot be rendered."""
        renderer = env.renderer or self.renderer
        try:
            messages, ids, cut = self._render_observation(renderer, messages)
        except Exception as exc:  # noqa: BLE001 (the observation's fault: a role, a text)
            self.envs.fault(env, EnvCallError("observation", exc, timed_out=False))
            counted = True
            error = [{"role": "user", "content": error_text(exc)}]
            try:
                messages, ids, cut = self._render_observation(renderer, error)
            except Exception:  # noqa: BLE001 (then the template cannot render a user turn)
                return None
        env.counts.tool_errors += int(cut and not counted)
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

    def _episode(self, env: EnvInstance, prompt, traj: Trajectory, budget: str, ended: bool):
        renderer, counts = env.renderer or self.renderer, env.counts
        try:
            full = renderer.full_ids(prompt, traj.turns, traj.observations)
            mismatch = not renderer.matches_full_render(traj.ids(), full, ended)
        except Exception:  # noqa: BLE001 (the template cannot render the whole conversation)
            mismatch = True
        sampled = traj.sampled_versions()
        stats = P.EpisodeStats(
            turns=len(traj.turns),
            tool_calls=counts.tool_calls,
            tool_errors=counts.tool_errors,
            tool_timeouts=counts.tool_timeouts,
            env_seconds=counts.env_seconds,
            observation_tokens=counts.observation_tokens,
            budget=budget,
            versions_spanned=max(sampled) - min(sampled) if sampled else 0,
            template_mismatch=mismatch,
            env_reward=counts.env_reward,
            tool_parse_errors=counts.tool_parse_errors,
        )
        return traj.finish(stats, _conversation(prompt, traj.turns, traj.observations))


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
