"""Agent programs the agent tests name: one that rewrites its history, one that makes
many samples, one that is silent every other episode, and ones that fail in each way an
agent can (tests/integration/test_agents.py, tests/unit/test_agents.py)."""

from __future__ import annotations

import asyncio
import itertools


async def _ask(client, messages):
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return reply.choices[0].message.content or ""


async def rewrites(client, row):
    """Two calls; the second drops the first exchange (as an agent that summarises its
    context does): two samples of one episode."""
    first = await _ask(client, [{"role": "user", "content": row.prompt}])
    await _ask(client, [{"role": "user", "content": "secret"}, {"role": "user", "content": first}])
    return 0.5


async def raises(client, row):
    await _ask(client, [{"role": "user", "content": row.prompt}])
    raise RuntimeError("the agent broke")


async def hangs(client, row):
    await _ask(client, [{"role": "user", "content": row.prompt}])
    await asyncio.sleep(3600)


async def silent(client, row):
    """Never calls the model."""
    return None


async def bad_reward(client, row):
    await _ask(client, [{"role": "user", "content": row.prompt}])
    return "very good"


async def slow(client, row, sleep_s: float):
    """Two calls with ``sleep_s`` between them (longer than a lease, in the test)."""
    messages = [{"role": "user", "content": row.prompt}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    await asyncio.sleep(sleep_s)
    messages.append({"role": "user", "content": "secret"})
    await client.chat.completions.create(model="policy", messages=messages)
    return None


async def exits(client, row):
    """A wrapped command-line program whose argument parser rejects what it was given."""
    await _ask(client, [{"role": "user", "content": row.prompt}])
    raise SystemExit(2)


async def interrupts(client, row):
    raise KeyboardInterrupt


async def spawns_exit(client, row):
    """Starts a task of its own that raises SystemExit on the agents' loop."""
    asyncio.get_running_loop().create_task(_exit_later())
    return await answers(client, row)


async def _exit_later():
    raise SystemExit(3)


async def answers(client, row):
    """One call, its reply the final answer."""
    await _ask(client, [{"role": "user", "content": row.prompt}])
    return None


_TURNS = itertools.count()


def _silent_now() -> bool:
    return next(_TURNS) % 2 == 0


async def sometimes_silent(client, row):
    """Every other episode (in the order they start) never calls the model: the episodes
    of one group mix silent ones with calling ones."""
    if _silent_now():
        return None
    return await answers(client, row)


async def many_samples(client, row, calls: int = 17):
    """``calls`` calls, each rewriting the history (a self-consistency agent asking the
    same question afresh each time): one sample per call."""
    for i in range(calls):
        question = [
            {"role": "user", "content": row.prompt},
            {"role": "user", "content": str(i % 10)},
        ]
        await _ask(client, question)
    return None
