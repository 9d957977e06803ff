"""Tools that misbehave in every way a tool can end a process or a thread, for the
tool-call tests (``tests.unit.hostile_tools:exits``)."""

from __future__ import annotations

import asyncio


def exits(code: int) -> str:
    """A wrapped command-line program whose argument parser rejects the call.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


async def aexits(code: int) -> str:
    """The same, as a coroutine.

    Args:
        code: The exit status.
    """
    await asyncio.sleep(0)
    raise SystemExit(code)


async def interrupts() -> str:
    """A coroutine that raises KeyboardInterrupt."""
    raise KeyboardInterrupt


async def spawns() -> str:
    """A coroutine that starts a task of its own which raises SystemExit on its loop."""
    asyncio.get_running_loop().create_task(_exit_later())
    await asyncio.sleep(0.05)
    return "spawned"


async def _exit_later() -> None:
    raise SystemExit(3)


async def echo(text: str) -> str:
    """Say it back.

    Args:
        text: What to say.
    """
    await asyncio.sleep(0)
    return text


def deep() -> list:
    """A result nested far deeper than JSON can be written."""
    value: list = []
    for _ in range(100_000):
        value = [value]
    return value
