"""Faults for the chaos test (tests/integration/test_chaos.py): an environment that hangs,
raises and floods now and then, and a reward function that returns numbers float32 cannot
hold now and then. Each fault it injects is appended to a file as one JSON line
({"kind": ...}), so the test can compare what was injected with what the run counted.

``ChaosEnv`` is ``RetryEnv`` (first word, ``max_attempts``) whose ``reset`` and ``step``
misbehave on the calls a hash of (seed, prompt, call) picks, with these shares in 1000
(``reset_raise`` of resets, the others of steps):

    reset_raise   reset raises                          (the episode runs without it)
    raise         step raises RuntimeError              (an error observation)
    hang          step blocks ``hang_s`` in time.sleep  (past multiturn.step_timeout_s)
    flood         step answers 1 MB in one message      (cut to max_observation_tokens)
    many          step answers 10,000 messages          (over max_observation_messages)
    reward        step's reward is 1e39, NaN or -inf    (not finite in float32)

Chosen by hash, not by a random generator: every episode of a group sees the same faults
on the same turns, and a run replays with its seed. ``chaos_reward`` is an ``exact``
first-word reward whose every ``every``-th call (by the scoring process's count) returns
1e39, NaN, inf, -inf or -1e39 in turn.

User code and model text that must not end a run:

- ``chaos_agent`` (the prompts of data source ``agent``): each episode, drawn by its
  number in the generator process, answers with one call, stays silent (so a group mixes
  silent episodes with calling ones), raises ``SystemExit`` after a call, raises
  ``KeyboardInterrupt``, or makes two calls more than its ``max_calls`` (each a history
  of its own, so the limit on samples is what stops it); the first ``SLOW_STARTS``
  episodes of each process outlive ``multiturn.episode_timeout_s``.
- the environment's tools, which the model calls by sampling whole-call words of the tiny
  vocabulary (``CALL_WORDS``): ``exit_cli`` raises ``SystemExit``, ``interrupt`` (async)
  raises ``KeyboardInterrupt``, ``python`` runs a sandboxed program that forks, calls
  ``setsid``, fills /tmp and /dev/shm and ``exec``s ``sleep 61.5`` in the child; and one
  word is a tool call nested 10,000 brackets deep, for the parser.

Every one of these appends its kind to the faults file as it happens (a sandboxed program
cannot: its wrapper does, before it runs).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import time
import zlib

from verl_async.envs import EnvRow, RetryEnv, Step
from verl_async.tools.sandbox import python_tool

SHARES = {"reset_raise": 80, "raise": 60, "hang": 50, "flood": 50, "many": 50, "reward": 50}
HUGE_BYTES = 1 << 20
_BAD_REWARDS = (1e39, math.nan, -math.inf)
_POISON = (1e39, math.nan, math.inf, -math.inf, -1e39)


def record(path: str, kind: str) -> None:
    """Append one injected fault to ``path`` (one short line: O_APPEND keeps lines whole)."""
    line = json.dumps({"kind": kind, "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def pick(seed: int, prompt, call: str, shares: dict[str, int] = SHARES) -> str:
    """The fault (or "") for ``call`` of an episode of ``prompt``."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    h = zlib.crc32(f"{seed}|{text}|{call}".encode()) % 1000
    for kind, share in shares.items():
        if h < share:
            return kind
        h -= share
    return ""


class ChaosEnv(RetryEnv):
    def __init__(self, faults: str, seed: int = 0, hang_s: float = 4.0, **retry_args) -> None:
        super().__init__(**retry_args)
        self.faults, self.seed, self.hang_s = faults, seed, hang_s
        self.prompt = ""
        self.steps = 0  # step calls so far (a step that raised counts too)

    def _fault(self, call: str) -> str:
        kind = pick(self.seed, self.prompt, call)
        if kind and (kind == "reset_raise") == (call == "reset"):
            record(self.faults, kind)
            return kind
        return ""

    def reset(self, row: EnvRow) -> None:
        self.prompt = row.prompt
        super().reset(row)
        if self._fault("reset"):
            raise RuntimeError("chaos: reset raised")

    def step(self, text: str) -> Step:
        kind = self._fault(f"step{self.steps}")
        self.steps += 1
        if kind == "raise":
            raise RuntimeError("chaos: step raised")
        if kind == "hang":
            time.sleep(self.hang_s)
        if kind == "flood":
            return Step([{"role": self.role, "content": "x" * HUGE_BYTES}], self.wrong_reward)
        if kind == "many":
            return Step([{"role": self.role, "content": "x"}] * 10_000, self.wrong_reward)
        step = super().step(text)
        if kind == "reward":
            bad = _BAD_REWARDS[zlib.crc32(text.encode()) % len(_BAD_REWARDS)]
            return Step(step.observations, bad, step.done, step.tool_call)
        return step


_calls = itertools.count()  # this scoring process's calls so far


def chaos_reward(
    prompt, response, ground_truth, data_source, extra_info, faults: str = "", every: int = 7
) -> float:
    """1.0 when the first word of ``response`` is ``ground_truth``, else 0.0; every
    ``every``-th call a value that is not finite in float32, recorded in ``faults``."""
    n = next(_calls)
    if n % every == every - 1:
        if faults:
            record(faults, "reward_fn")
        return _POISON[(n // every) % len(_POISON)]
    words = response.split()
    return 1.0 if words and words[0] == ground_truth.strip() else 0.0


# ---- user code and model text ---------------------------------------------------------

AGENT_SHARES = {"agent_silent": 250, "agent_exit": 100, "agent_interrupt": 100,
                "agent_over_limit": 80}  # fmt: skip
SLOW_STARTS = 2  # episodes of each generator process that outlive their timeout
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
FORK = (  # a program without spaces (one word of the tiny vocabulary)
    "o=__import__('os');p=o.fork();(p==0)and(o.setsid(),"
    "open('/tmp/verl-async-chaos','w').write('x'*9999),"
    "open('/dev/shm/verl-async-chaos','w').write('x'*999999),"
    "o.execv('/bin/sleep',['sleep','61.5']));print('forked')"
)
LEFT_BEHIND = ("sleep 61.5", "/tmp/verl-async-chaos", "/dev/shm/verl-async-chaos")
CALL_WORDS = [
    '<tool_call>{"name":"exit_cli","arguments":{"code":2}}</tool_call>',
    '<tool_call>{"name":"interrupt","arguments":{}}</tool_call>',
    '<tool_call>{"name":"python","arguments":{"code":"' + FORK + '"}}</tool_call>',
    "<tool_call>" + "[" * 10_000 + "</tool_call>",
]
TOOL_WORDS = ["tools", "exit_cli", "interrupt", "python", "lookup", "<tool_response>",
              "</tool_response>", *CALL_WORDS]  # fmt: skip
_episodes = itertools.count()  # this generator process's agent episodes so far


async def chaos_agent(client, row, faults: str, seed: int, max_calls: int, timeout_s: float):
    n = next(_episodes)
    if n < SLOW_STARTS:  # at start-up: past the episode's deadline (it is cancelled there)
        record(faults, "agent_slow_start")
        await asyncio.sleep(timeout_s + 5)
    kind = pick(seed, row.prompt, f"agent{n}", AGENT_SHARES)
    if kind:
        record(faults, kind)
    if kind == "agent_silent":
        return None
    if kind == "agent_interrupt":
        raise KeyboardInterrupt
    if kind == "agent_over_limit":
        record(faults, kind)  # a second error: the first call past the limit is refused
        for i in range(max_calls + 2):  # raises openai.BadRequestError at max_calls + 1
            await _ask(client, [{"role": "user", "content": f"{row.prompt} {i % 10}"}])
    reply = await _ask(client, [{"role": "user", "content": row.prompt}])
    if kind == "agent_exit":
        raise SystemExit(2)
    return None if reply else None


async def _ask(client, messages) -> str:
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP])
    return reply.choices[0].message.content or ""


class ExitCli:
    """A wrapped command-line program whose argument parser exits."""

    def __init__(self, faults: str) -> None:
        self.faults = faults

    def exit_cli(self, code: int) -> str:
        """Run the command-line program.

        Args:
            code: The status it exits with.
        """
        record(self.faults, "tool_exit")
        raise SystemExit(code)

    __call__ = exit_cli


class Interrupt:
    """A coroutine tool that raises KeyboardInterrupt."""

    def __init__(self, faults: str) -> None:
        self.faults = faults

    async def interrupt(self) -> str:
        """Interrupt."""
        record(self.faults, "tool_interrupt")
        raise KeyboardInterrupt

    __call__ = interrupt


class ChaosPython:
    """The sandboxed ``python`` tool, recording each call before it runs."""

    def __init__(self, faults: str, **limits) -> None:
        self.faults, self.tool = faults, python_tool(**limits)

    async def python(self, code: str) -> str:
        """Run a Python 3 program and return what it printed.

        Args:
            code: The complete Python program to run.
        """
        record(self.faults, "python")
        return await self.tool(code)

    __call__ = python
