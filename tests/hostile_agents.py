"""Agent programs the agent tests name: one that rewrites its history, and ones that
fail in each way an agent can (tests/integration/test_agents.py)."""

from __future__ import annotations

import asyncio


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
