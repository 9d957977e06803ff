"""The environment instances of a group's episodes: built, reset, agreed on one initial
prompt, stepped and closed, every fault of theirs counted in its episode.

    start_group:  n instances, each Class(**args) then reset(row), on a thread of its own
                  (generators/env_threads.py); the initial prompt most of them gave that
                  renders and leaves room for a turn is the group's (the row's if none)
    step:         env.step(text), checked; a failure is an error observation
    close:        once per instance built, however its episode ended

What an instance gives back is checked on its own thread (``as_prompt``, ``checked_step``),
so even a flood of messages costs the generator's event loop nothing. A fault, whatever it
is, is counted in the instance's episode (``tool_errors`` or ``tool_timeouts``) and the
first of each kind per environment is logged; an instance that failed to start, or whose
prompt is not the group's, is closed and its episode runs as one turn without it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from generators.env_threads import EnvCallError, EnvThreads, InstanceThread
from generators.recorder import EpisodeCounts
from generators.render import Renderer
from verl_async import protocol as P
from verl_async.envs import EnvRow, Step, as_prompt, as_step
from verl_async.numerics import finite32
from verl_async.schema import EnvironmentConfig, MultiTurnConfig

log = logging.getLogger("verl_async.generator")

# An initial prompt longer than this many characters per episode token is refused before it
# is rendered (no tokenizer spells a token with more on average).
_MAX_CHARS_PER_TOKEN = 64


@dataclass(eq=False)
class EnvInstance:
    """One episode's environment instance: its thread, its counts and deadline."""

    spec: EnvironmentConfig
    counts: EpisodeCounts
    deadline: float  # time.monotonic() past which its calls end the episode
    thread: InstanceThread | None = None  # once one was free
    obj: Any = None  # the instance, once built (set on its thread)
    initial: Any = None  # its initial prompt; None: its episode runs without it
    closed: bool = False

    def usable(self) -> bool:
        return self.obj is not None and not self.closed and not self.thread.stuck


class Environments:
    """Every environment instance of a generator's episodes, with their threads."""

    def __init__(self, renderer: Renderer, mt: MultiTurnConfig, threads_per_env: int) -> None:
        self.renderer = renderer
        self.mt = mt
        self.threads_per_env = threads_per_env
        self._threads: dict[tuple, EnvThreads] = {}
        self._closing: set[asyncio.Task] = set()  # closes of groups that raised or were cancelled
        self._logged: set[tuple] = set()

    async def start_group(
        self, spec: EnvironmentConfig, cls: type, group: P.PromptGroup, n: int, renderer: Renderer
    ) -> tuple[Any, list[int], list[EnvInstance], bool]:
        """``n`` instances reset on ``group``'s row, the group's initial prompt and its ids
        rendered by ``renderer`` (with an entry's tool schemas, when it has tools), and
        whether they were (False: that prompt could not be rendered with them, so the
        episodes run with the generator's renderer and without tools). Never raises for
        the instances' faults (cancelled, it closes what it built)."""
        envs: list[EnvInstance] = []
        try:
            await asyncio.gather(*(self._start(spec, cls, group, envs) for _ in range(n)))
            prompt, prompt_ids, rendered = await self._group_prompt(group, envs, renderer)
        except BaseException:
            self.close_later(envs)
            raise
        return prompt, prompt_ids, envs, rendered

    def _pool(self, spec: EnvironmentConfig) -> EnvThreads:
        # An entry's data sources are its own (check_environments), so this names the entry.
        key = (spec.env, tuple(spec.data_sources))
        if key not in self._threads:
            name = spec.env.rpartition(":")[2]
            self._threads[key] = EnvThreads(name, self.threads_per_env)
        return self._threads[key]

    async def call(self, env: EnvInstance, what: str, fn, *args, then=None, timeout_s=None):
        """``fn(*args)`` on the instance's thread, timed into its ``env_seconds``; raises
        ``EnvCallError`` (generators/env_threads.py)."""
        t0 = time.perf_counter()
        if timeout_s is None:
            timeout_s = min(self.mt.step_timeout_s, env.deadline - time.monotonic())
        try:
            return await env.thread.call(what, fn, *args, timeout_s=timeout_s, then=then)
        finally:
            env.counts.env_seconds += time.perf_counter() - t0

    def fault(self, env: EnvInstance, err: EnvCallError) -> None:
        """Count a failure in its episode; log the first of each kind per environment."""
        env.counts.fault(err.timed_out)
        name = env.spec.env
        kind = (name, str(err), err.timed_out or type(err.cause).__name__)
        if kind in self._logged:
            return
        self._logged.add(kind)
        log.warning(
            "environment %s: %s (%s); later failures of this kind are only counted "
            "(multiturn/tool_errors, multiturn/tool_timeouts)",
            name, err.observation(), err,
        )  # fmt: skip

    async def _start(self, spec, cls: type, group: P.PromptGroup, envs: list) -> None:
        """A new instance, reset on the group's row, appended to ``envs`` (its ``initial``
        stays None if it failed; it is then closed already)."""
        env = EnvInstance(spec, EpisodeCounts(), time.monotonic() + self.mt.episode_timeout_s)
        envs.append(env)
        row = EnvRow(group.prompt, group.ground_truth, group.data_source, dict(group.extra_info))
        try:
            left = min(self.mt.step_timeout_s, env.deadline - time.monotonic())
            env.thread = await self._pool(spec).acquire(left)
            build = functools.partial(cls, **spec.args)
            await self.call(env, "constructor", build, then=functools.partial(_keep, env))
            reset = functools.partial(_invoke, env, "reset")
            initial = await self.call(env, "reset", reset, row, then=self._initial)
        except EnvCallError as err:
            self.fault(env, err)
            await self.close(env)
            return
        env.initial = group.prompt if initial is None else initial

    def _initial(self, value: Any) -> Any:
        """(On the instance's thread) ``reset``'s value if it is a prompt of a size that
        can fit the episode."""
        prompt = as_prompt(value)
        limit = self.mt.max_episode_tokens
        if isinstance(prompt, list) and len(prompt) > limit:
            raise ValueError(f"reset gave {len(prompt)} messages, more than the episode's tokens")
        chars = (
            len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt or [])
        )
        if chars > limit * _MAX_CHARS_PER_TOKEN:
            raise ValueError(
                f"reset gave a prompt of {chars} characters, which cannot fit "
                f"multiturn.max_episode_tokens ({limit})"
            )
        return prompt

    async def _group_prompt(self, group: P.PromptGroup, envs: list[EnvInstance], renderer):
        """The group's initial prompt and its ids: the one most instances gave that renders
        and leaves room for a turn (the row's when none does). The instances that gave
        another are faults: closed, their episodes run without them."""
        candidates: list[tuple[Any, list[EnvInstance]]] = []
        for env in envs:
            if env.initial is None:
                continue
            same = next((c for c in candidates if c[0] == env.initial), None)
            if same is None:
                candidates.append((env.initial, [env]))
            else:
                same[1].append(env)
        chosen, errors = None, {}
        for i, (prompt, members) in enumerate(candidates):
            try:
                ids = self._prompt_ids(group, prompt, renderer)
            except Exception as exc:  # noqa: BLE001 (the environment's prompt's fault)
                errors[i] = exc
                continue
            if chosen is None or len(members) > len(candidates[chosen[0]][1]):
                chosen = (i, prompt, ids)
        odd = ValueError(
            "reset(row) gave the episodes of one prompt different initial prompts; it must "
            "depend on the row only"
        )
        failed = []
        for i, (_, members) in enumerate(candidates):
            if chosen is not None and i == chosen[0]:
                continue
            for env in members:
                env.initial = None
                what = "reset" if i in errors else "reset (another prompt than the group's)"
                self.fault(env, EnvCallError(what, errors.get(i, odd), timed_out=False))
                failed.append(self.close(env))
        await asyncio.gather(*failed)
        if chosen is not None:
            return chosen[1], chosen[2], True
        if renderer is self.renderer:
            return group.prompt, list(group.prompt_ids), True
        try:  # the row's own prompt, with the tools' schemas
            return group.prompt, self._prompt_ids(group, group.prompt, renderer), True
        except Exception as exc:  # noqa: BLE001 (then the episodes run without tools)
            for env in envs:
                self.fault(env, EnvCallError("prompt with tools", exc, timed_out=False))
            return group.prompt, list(group.prompt_ids), False

    def _prompt_ids(self, group: P.PromptGroup, prompt, renderer: Renderer) -> list[int]:
        """``prompt``'s ids (the buffer rendered the row's own, without tools), if it leaves
        room for a turn."""
        if prompt == group.prompt and renderer is self.renderer:
            return list(group.prompt_ids)
        ids = renderer.prompt_ids(prompt)
        if len(ids) >= self.mt.max_episode_tokens:
            raise ValueError(
                f"reset gave a prompt of {len(ids)} tokens, which leaves no room for a turn in "
                f"multiturn.max_episode_tokens ({self.mt.max_episode_tokens})"
            )
        return ids

    async def close(self, env: EnvInstance) -> None:
        """Close the instance (once, whatever happened to it), under a deadline of its own;
        then its thread goes back to the pool. A stuck instance's close is queued behind
        the call that still runs, and not waited for."""
        if env.closed:
            return
        env.closed = True
        if env.thread is None:
            return
        try:
            if env.thread.stuck:
                env.thread.submit(_close, env)
            else:
                await self.call(env, "close", _close, env, timeout_s=self.mt.step_timeout_s)
        except EnvCallError as err:
            self.fault(env, err)
        finally:
            env.thread.end()

    def close_later(self, envs: list[EnvInstance]) -> None:
        """Close every instance of ``envs`` not closed yet, each in a task of its own: their
        group raised or was cancelled and does not wait (failures are logged; no episode
        is left to count them in)."""
        for env in envs:
            if not env.closed:
                task = asyncio.ensure_future(self.close(env))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def step(self, env: EnvInstance, text: str) -> Step | None:
        """The environment's answer to a turn (its reward counted); an error observation
        if the call failed; None if it still runs (the instance is stuck)."""
        counts = env.counts
        check = functools.partial(checked_step, mt=self.mt, total=counts.weighted_reward)
        try:
            step = await self.call(env, "step", _invoke, env, "step", text, then=check)
        except EnvCallError as err:
            self.fault(env, err)
            if err.running:
                return None
            return Step([{"role": "user", "content": err.observation()}])
        counts.tool_calls += int(step.tool_call)
        if step.reward is not None:
            counts.env_reward += step.reward
            counts.weighted_reward += self.mt.env_reward_weight * step.reward
        return step


def checked_step(result, mt: MultiTurnConfig, total: float = 0.0) -> Step:
    """``as_step(result)`` that also holds at most ``multiturn.max_observation_messages``
    messages and whose reward, times ``multiturn.env_reward_weight``, stays finite in
    float32 alone and added to the episode's ``total`` so far: turn rewards are trained as
    float32 and summed over an episode, and one that is not finite would make the buffer
    refuse the whole group. Raises TypeError or ValueError (the environment's fault: an
    error observation, counted)."""
    observations = result[0] if isinstance(result, tuple) else getattr(result, "observations", None)
    if isinstance(observations, list) and len(observations) > mt.max_observation_messages:
        raise ValueError(
            f"step returned {len(observations)} observation messages, more than "
            f"multiturn.max_observation_messages ({mt.max_observation_messages})"
        )
    step = as_step(result)
    if step.reward is None:
        return step
    weighted = mt.env_reward_weight * step.reward
    if not finite32(weighted):
        raise TypeError(
            f"step's reward {step.reward!r} times multiturn.env_reward_weight "
            f"{mt.env_reward_weight!r} is not finite in float32"
        )
    if not finite32(total + weighted):
        raise TypeError(
            f"step's reward {step.reward!r} would make the episode's turn rewards sum to "
            f"{total + weighted:.3g}, which is not finite in float32"
        )
    return step


def _keep(env: EnvInstance, obj: Any) -> Any:
    """(On the instance's thread) the built instance, kept as soon as it exists: a close
    queued after a constructor that outlived its deadline still finds it."""
    env.obj = obj
    return obj


def _invoke(env: EnvInstance, method: str, *args) -> Any:
    """(On the instance's thread) one of its methods, looked up there too (a property
    that raises is the environment's fault like any other)."""
    return getattr(env.obj, method)(*args)


def _close(env: EnvInstance) -> Any:
    """(On the instance's thread) ``close()`` of the instance, if it was built and has one."""
    close = getattr(env.obj, "close", None)
    return close() if callable(close) else None
