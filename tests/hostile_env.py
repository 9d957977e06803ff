"""Environments that misbehave on some prompts: the generator must survive them.

``HostileEnv`` is ``RetryEnv`` on the max-digit task ("max 3 7 1 =", the first word of a
turn is the answer) that misbehaves in ``step`` on the prompts it picks:

    raise   raises RuntimeError
    hang    sleeps an hour in a plain ``time.sleep`` (only a thread's timeout ends it)
    huge    answers with one observation of 1 MB

A prompt is picked when ``zlib.crc32(prompt) % every == 0`` (the prompt's text, UTF-8; a
chat prompt as its JSON): stable across processes and runs, unlike ``hash``, and chosen
per prompt, so every sample of a group is hit or none is, and the other groups of a run go
on as usual. ``every: 1`` picks every prompt.

``AsyncHostileEnv`` is the same with ``async def`` methods; its ``hang`` awaits
``asyncio.sleep(3600)``, which a timeout can cancel.

    multiturn:
      environments:
        - env: tests.hostile_env:HostileEnv
          args: {mode: hang, every: 3}
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib

from verl_async.envs import EnvRow, RetryEnv, Step

MODES = ("raise", "hang", "huge")
HUGE_BYTES = 1 << 20
HANG_S = 3600.0


def picked(prompt: str | list[dict[str, str]], every: int) -> bool:
    """Whether ``prompt`` is one the hostile environments misbehave on."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return zlib.crc32(text.encode()) % every == 0


class HostileEnv(RetryEnv):
    """``RetryEnv`` (first word, 3 attempts) that misbehaves on picked prompts as ``mode``
    says."""

    def __init__(self, mode: str = "raise", every: int = 2, **retry_args) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        super().__init__(**retry_args)
        self.mode = mode
        self.every = every
        self.hit = False

    def reset(self, row: EnvRow) -> None:
        """As ``RetryEnv``; also decides whether this episode is one to misbehave in."""
        super().reset(row)
        self.hit = picked(row.prompt, self.every)

    def step(self, text: str) -> Step:
        """``RetryEnv.step``, or the misbehaviour on a picked prompt."""
        if self.hit and self.mode == "raise":
            raise RuntimeError("hostile environment: step raised")
        if self.hit and self.mode == "huge":
            return Step([{"role": self.role, "content": "x" * HUGE_BYTES}], self.wrong_reward)
        if self.hit and self.mode == "hang":
            time.sleep(HANG_S)
        return super().step(text)


class AsyncHostileEnv(HostileEnv):
    """``HostileEnv`` with ``async def`` methods; ``hang`` awaits instead of blocking."""

    async def reset(self, row: EnvRow) -> None:
        HostileEnv.reset(self, row)

    async def step(self, text: str) -> Step:
        if self.hit and self.mode == "hang":
            await asyncio.sleep(HANG_S)
            return RetryEnv.step(self, text)
        return HostileEnv.step(self, text)
