"""Multi-turn episodes: an environment and the engine, turn by turn, into one sample.

    run_episode:  env = Class(**args); prompt = env.reset(row)
                  loop: turn = engine.sample(prompt + ids so far)        (same engine)
                        step = env.step(turn text)    -> observation, reward, done
                        ids += observation delta      (generators/render.py)
                  -> Episode: ids, loss mask, log-probs, versions, turn rewards, stats

A turn is one engine request; ``engine.sample`` returns only whole turns (a request cut
by an abort-mode weight swap goes on from its prefix inside it), so a tool call is never
parsed from a partial turn. A turn ends at an end-of-sequence token or at its token budget
(``generators.max_new_tokens``): the environment answers both alike, and after a cut turn
the template's end-of-turn token is appended as a non-sampled token before the observation
(what a full render of the conversation writes there). A turn cut by what is left of
``multiturn.max_episode_tokens`` ends the episode.

Environment calls (the constructor, ``reset``, ``step``, ``close``) never run on the
generator's event loop: plain methods run in a daemon thread each, ``async def`` ones on an
event loop of the environments' own (``EnvCalls``). Each call has a deadline
(``multiturn.step_timeout_s``, and what is left of ``episode_timeout_s``); a call that
raises or passes it ends its turn with an error observation and is counted, and a call that
never returns leaves only its thread behind: no other episode waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from generators.interface import RolloutEngine, Sample, Sampling
from generators.render import Renderer
from verl_async import protocol as P
from verl_async.envs import EnvRow, Step, as_step
from verl_async.numerics import finite32
from verl_async.schema import EnvironmentConfig, MultiTurnConfig

log = logging.getLogger("verl_async.generator")

# An observation's text is cut to this many characters per allowed token before it is
# tokenized at all: a tool that returns megabytes costs no tokenizer time.
_CHARS_PER_TOKEN = 8
_ERROR_CHARS = 300  # an error observation quotes at most this much of the exception


class EnvCallError(Exception):
    """An environment call that raised (``cause``) or passed its deadline (``timed_out``)."""

    def __init__(
        self, what: str, cause: BaseException | None, timed_out: bool, running: bool = False
    ) -> None:
        super().__init__(what)
        self.cause = cause
        self.timed_out = timed_out
        self.running = running  # timed out in a thread that cannot be stopped: still running

    def observation(self) -> str:
        if self.timed_out:
            return f"error: the environment's {self} timed out"
        return f"error: {type(self.cause).__name__}: {self.cause}"[:_ERROR_CHARS]


class EnvCalls:
    """Runs environment methods off the caller's event loop, each under a deadline."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.abandoned = 0  # calls past their deadline whose thread may still be running

    def _env_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="env-loop", daemon=True).start()
            self._loop = loop
        return self._loop

    async def call(self, what: str, fn, *args, timeout_s: float):
        """``fn(*args)`` in a thread (or on the environments' loop when it is a coroutine
        function); raises ``EnvCallError`` when it raises or is not done in ``timeout_s``."""
        if inspect.iscoroutinefunction(fn):
            future = asyncio.run_coroutine_threadsafe(fn(*args), self._env_loop())
        else:
            future = concurrent.futures.Future()
            future.set_running_or_notify_cancel()  # a running thread cannot be cancelled

            def run() -> None:
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                    future.set_exception(exc)
                else:
                    future.set_result(result)

            # A daemon thread per call: a call that hangs forever keeps its thread, never
            # a pool's worker (and never the process at exit).
            threading.Thread(target=run, name=f"env-{what}", daemon=True).start()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            cancelled = future.cancel()  # a coroutine is cancelled; a thread runs on
            self.abandoned += not cancelled
            raise EnvCallError(what, None, timed_out=True, running=not cancelled) from None
        except Exception as exc:  # noqa: BLE001 (the environment's own error)
            raise EnvCallError(what, exc, timed_out=False) from exc


@dataclass
class Episode:
    """One finished episode as a sample: every token after the prompt, turns and
    observations, with what the learner needs per token."""

    prompt_ids: list[int]
    sample: Sample  # token_ids / logprobs / versions over the whole response
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled, 0: observation
    turn_rewards: list[float] = field(default_factory=list)  # weighted, at turns' last tokens
    final_text: str = ""  # the last turn's text (what the reward sources score)
    messages: list[dict] = field(default_factory=list)  # the conversation, for reward models
    stats: P.EpisodeStats | None = None


@dataclass
class _Counts:
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_seconds: float = 0.0
    observation_tokens: int = 0
    env_reward: float = 0.0

    def failed(self, err: EnvCallError) -> None:
        if err.timed_out:
            self.tool_timeouts += 1
        else:
            self.tool_errors += 1


class EpisodeRunner:
    """Runs episodes of the environments in ``multiturn`` on one engine."""

    def __init__(
        self, engine: RolloutEngine, renderer: Renderer, tokenizer, mt: MultiTurnConfig
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.mt = mt
        self.calls = EnvCalls()

    async def run_group(
        self, spec: EnvironmentConfig, cls: type, group: P.PromptGroup, n: int, how: Sampling
    ) -> list[Episode]:
        """``n`` episodes of ``group``'s prompt, all in flight at once; never raises for the
        environment's faults. Every episode starts from the same prompt (the group is
        compared with itself): an episode whose environment failed to start runs as a single
        turn on the prompt the others got."""
        starts = await asyncio.gather(*(self._start(spec, cls, group) for _ in range(n)))
        prompts = [initial for _, initial, _, _ in starts if initial is not None]
        if any(p != prompts[0] for p in prompts):
            raise ValueError(
                f"environment {spec.env} gave the episodes of one prompt different initial "
                "prompts; reset(row) must depend on the row only"
            )
        prompt = prompts[0] if prompts else group.prompt
        # The buffer rendered the row's own prompt already.
        prompt_ids = (
            list(group.prompt_ids) if prompt == group.prompt else self.renderer.prompt_ids(prompt)
        )
        return await asyncio.gather(
            *(
                self._play(spec, env, prompt, prompt_ids, how, counts, deadline)
                for env, _, counts, deadline in starts
            )
        )

    async def _env_call(self, counts: _Counts, deadline: float, what: str, fn, *args):
        t0 = time.perf_counter()
        left = deadline - time.monotonic()
        try:
            return await self.calls.call(
                what, fn, *args, timeout_s=min(self.mt.step_timeout_s, left)
            )
        finally:
            counts.env_seconds += time.perf_counter() - t0

    async def _start(self, spec: EnvironmentConfig, cls: type, group: P.PromptGroup):
        """A new environment, reset on the group's row: (env and its initial prompt, or
        None and None if it failed; counts; the episode's deadline)."""
        counts = _Counts()
        deadline = time.monotonic() + self.mt.episode_timeout_s
        row = EnvRow(group.prompt, group.ground_truth, group.data_source, dict(group.extra_info))
        try:
            env = await self._env_call(counts, deadline, "constructor", lambda: cls(**spec.args))
            initial = await self._env_call(counts, deadline, "reset", env.reset, row)
            if initial is None:
                initial = group.prompt
        except EnvCallError as err:
            counts.failed(err)
            log_env_failure(spec, err)
            return None, None, counts, deadline
        return env, initial, counts, deadline

    async def _play(
        self, spec, env, prompt, prompt_ids: list[int], how: Sampling, counts: _Counts,
        deadline: float,
    ) -> Episode:  # fmt: skip
        """Turns until the environment is done or a budget ends the episode."""
        mt = self.mt
        budget = ""

        async def env_call(what: str, fn, *args):
            return await self._env_call(counts, deadline, what, fn, *args)

        out = Sample()
        mask: list[int] = []
        rewards: list[float] = []
        turns: list[str] = []
        observations: list[list[dict]] = []
        ended = False
        while True:
            room = mt.max_episode_tokens - len(prompt_ids) - len(out.token_ids)
            if room <= 0:
                budget = "episode_tokens"
                break
            turn_budget = min(how.max_tokens, room)
            turn = await self.engine.sample(
                prompt_ids + out.token_ids, replace(how, max_tokens=turn_budget)
            )
            _append(out, mask, rewards, turn)
            ended = bool(turn.token_ids) and turn.token_ids[-1] in self.renderer.eos_ids
            text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            turns.append(text)
            cut = not ended and len(turn.token_ids) >= turn_budget
            if cut and turn_budget < how.max_tokens:
                budget = "episode_tokens"  # cut by what was left of the episode
                break
            # A turn cut by its own budget (generators.max_new_tokens) or a stop string is
            # still a whole turn: the environment answers it, and the template's
            # end-of-turn closes it below.
            budget = "turn_tokens" if cut else ""
            if env is None:
                break
            try:
                step = weighted_step(await env_call("step", env.step, text), mt.env_reward_weight)
            except (EnvCallError, TypeError) as err:
                if not isinstance(err, EnvCallError):
                    err = EnvCallError("step", err, timed_out=False)
                counts.failed(err)
                log_env_failure(spec, err)
                if err.running:  # calling it again would race with the call still running
                    env = None
                    if time.monotonic() >= deadline:
                        budget = "episode_timeout"
                    break
                step = Step([{"role": "user", "content": err.observation()}])
            counts.tool_calls += int(step.tool_call)
            if step.reward is not None:
                counts.env_reward += float(step.reward)
                rewards[-1] += mt.env_reward_weight * float(step.reward)
            if step.done:
                break
            if len(turns) >= mt.max_turns:
                budget = "turns"
                break
            if time.monotonic() >= deadline:
                budget = "episode_timeout"
                break
            obs_messages, obs_ids, truncated = self._observation(step.observations)
            if truncated:
                counts.tool_errors += 1
            if not ended:  # not sampled: what the template writes after a turn's content
                obs_ids = [self.renderer.end_of_turn, *obs_ids]
            if len(prompt_ids) + len(out.token_ids) + len(obs_ids) >= mt.max_episode_tokens:
                budget = "episode_tokens"  # no room for the observation and a token after it
                break
            observations.append(obs_messages)
            last_version = out.versions[-1]
            out.token_ids += obs_ids
            out.logprobs += [0.0] * len(obs_ids)
            out.versions += [last_version] * len(obs_ids)
            mask += [0] * len(obs_ids)
            rewards += [0.0] * len(obs_ids)
            counts.observation_tokens += len(obs_ids)
        if env is not None and callable(getattr(env, "close", None)):
            try:
                await env_call("close", env.close)
            except EnvCallError as err:
                log_env_failure(spec, err)

        full = self.renderer.full_ids(prompt, turns, observations)
        sampled = [v for v, m in zip(out.versions, mask, strict=True) if m]
        stats = P.EpisodeStats(
            turns=len(turns),
            tool_calls=counts.tool_calls,
            tool_errors=counts.tool_errors,
            tool_timeouts=counts.tool_timeouts,
            env_seconds=counts.env_seconds,
            observation_tokens=counts.observation_tokens,
            budget=budget,
            versions_spanned=max(sampled) - min(sampled) if sampled else 0,
            template_mismatch=not self.renderer.matches_full_render(
                prompt_ids + out.token_ids, full, ended
            ),
            env_reward=counts.env_reward,
        )
        conversation = _conversation(prompt, turns, observations)
        return Episode(prompt_ids, out, mask, rewards, turns[-1], conversation, stats)

    def _observation(self, messages: list[dict]) -> tuple[list[dict], list[int], bool]:
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
        ids = self.renderer.observation_ids(messages)
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
            ids = self.renderer.observation_ids(messages)
        return messages, ids, True


def weighted_step(result, weight: float) -> Step:
    """``as_step(result)``, whose reward also stays finite in float32 once weighted
    (``multiturn.env_reward_weight``): it is trained as a float32 turn reward, and a turn
    reward that is not finite would make the buffer refuse the whole group. Raises
    TypeError as ``as_step`` does (the environment's fault: an error observation, counted)."""
    step = as_step(result)
    if step.reward is not None and not finite32(weight * step.reward):
        raise TypeError(
            f"step's reward {step.reward!r} times multiturn.env_reward_weight {weight!r} is not "
            "finite in float32"
        )
    return step


def _append(out: Sample, mask: list[int], rewards: list[float], turn: Sample) -> None:
    if out.prompt_ids is None:
        out.prompt_ids = turn.prompt_ids
    out.token_ids += turn.token_ids
    out.logprobs += turn.logprobs
    out.versions += turn.versions
    mask += [1] * len(turn.token_ids)
    rewards += [0.0] * len(turn.token_ids)


def _conversation(prompt, turns: list[str], observations: list[list[dict]]) -> list[dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for i, text in enumerate(turns):
        messages.append({"role": "assistant", "content": text})
        if i < len(observations):
            messages.extend(observations[i])
    return messages


_logged: set[tuple[str, str]] = set()


def log_env_failure(spec: EnvironmentConfig, err: EnvCallError) -> None:
    """The first failure of each kind per environment is logged; the rest are counted
    (``multiturn/tool_errors``, ``multiturn/tool_timeouts``)."""
    kind = (spec.env, "timeout" if err.timed_out else type(err.cause).__name__)
    if kind in _logged:
        return
    _logged.add(kind)
    log.warning(
        "environment %s: %s (%s); later failures of this kind are only counted",
        spec.env,
        err.observation(),
        err,
    )


@dataclass
class Packed:
    """A group's samples as the arrays of a ``RolloutGroup`` (concatenated over tokens)."""

    prompt_ids: list[int]
    tokens: object  # np.ndarray [sum T] int32
    logprobs: object  # float32
    versions: object  # int32
    lengths: list[int]
    loss_mask: object = None  # uint8, multi-turn only
    turn_rewards: object = None  # float32, multi-turn only
    episodes: list[P.EpisodeStats] = field(default_factory=list)


def pack_group(prompt_ids: list[int], samples: list) -> Packed:
    """Single-turn ``Sample``s or ``Episode``s of one group, packed."""
    import numpy as np

    from generators.interface import pack_samples

    if not samples or not isinstance(samples[0], Episode):
        return Packed(prompt_ids, *pack_samples(samples))
    packed = Packed(samples[0].prompt_ids, *pack_samples([e.sample for e in samples]))
    packed.loss_mask = np.fromiter((m for e in samples for m in e.loss_mask), np.uint8)
    packed.turn_rewards = np.fromiter((r for e in samples for r in e.turn_rewards), np.float32)
    packed.episodes = [e.stats for e in samples]
    return packed
