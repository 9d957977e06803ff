"""Parked long polls: what thousands of them cost the buffer's loop.

    python benchmarks/parked_polls.py [--counts 2000,4000,8000] [--messages 2000]

A real ``BufferServer`` (in process, replies captured instead of sent) parks N
``PollVersion`` long polls, 16 per connection, N / 16 connections. Two numbers per N:

- expiry: the polls' deadline passes; seconds from then until the loop's 50 ms tick has
  answered every one of them;
- per message: seconds the loop spends on each of ``--messages`` ``GetStats`` requests
  (handle, reply, then look at the parked polls, as the loop does after every drain) with
  the N polls parked.

The baseline is the same server with no poll parked (per message; expiry of 1 poll), so the
ratios say what the parked polls add. The global bound on parked polls is lifted for the
measurement (``max_parked``) so that counts above it can be timed.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer.evaluation import EvalRounds  # noqa: E402
from buffer.ledger import PromptLedger  # noqa: E402
from buffer.server import BufferServer  # noqa: E402
from verl_async import protocol as P  # noqa: E402
from verl_async.data import PromptRecord  # noqa: E402
from verl_async.staleness import Admission  # noqa: E402

try:
    from verl_async.transport.server import Request  # noqa: E402
except ImportError:  # before roles: _dispatch took the decoded parts
    Request = None

PER_CONNECTION = 16
WAIT_S = 0.5


def make_server(n: int) -> BufferServer:
    prompts = [PromptRecord(f"p{i}", str(i), prompt_ids=(1, 2)) for i in range(16)]
    ledger = PromptLedger(prompts, Admission(2, 1), 4, seed=0)
    kwargs = {}
    if "max_parked" in inspect.signature(BufferServer).parameters:
        kwargs["max_parked"] = max(n, 1)
    server = BufferServer(
        ledger, 1, f"inproc://parked-{n}-{time.monotonic_ns()}", evals=EvalRounds([]), **kwargs
    )
    server.router.reply = lambda *args, **kw: None
    return server


def park(server: BufferServer, n: int) -> None:
    poll = P.PollVersion(generator_id=0, loaded_version=0, wait_s=WAIT_S)
    for i in range(n):
        identity = (i // PER_CONNECTION).to_bytes(4, "big")
        dispatch(server, identity, i + 1, poll)
    assert len(server.parked) == n, len(server.parked)


def dispatch(server: BufferServer, identity: bytes, rid: int, body: P.Body) -> None:
    """What the loop does with one decoded message (``BufferServer._drain``)."""
    envelope = P.Envelope(P.PROTOCOL_VERSION, rid, body)
    if hasattr(server.router, "roles"):  # the dispatch of a decoded Request
        server._dispatch(Request(identity, None, envelope, []))
    else:
        server._dispatch(identity, envelope, [])
    server._serve_parked()


def per_message_s(server: BufferServer, messages: int) -> float:
    t0 = time.perf_counter()
    for i in range(messages):
        dispatch(server, b"stats", i, P.GetStats())
    return (time.perf_counter() - t0) / messages


async def expiry_s(server: BufferServer) -> float:
    """Seconds from the deadline of every parked poll to the last one answered."""
    await asyncio.sleep(WAIT_S + 0.01)
    t0 = time.perf_counter()
    ticker = asyncio.create_task(server._tick())
    while len(server.parked):
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    ticker.cancel()
    return elapsed


def measure(n: int, messages: int) -> dict:
    server = make_server(n)
    try:
        park(server, n)
        per_message = per_message_s(server, messages)
        expiry = asyncio.run(expiry_s(server))
    finally:
        server.router.close()
    return {
        "parked": n,
        "expiry_s": round(expiry, 4),
        "per_message_us": round(per_message * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="2000,4000,8000")
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    base = measure(1, args.messages)
    print(json.dumps({"baseline": base}))
    for n in map(int, args.counts.split(",")):
        row = measure(n, args.messages)
        row["per_message_ratio"] = round(row["per_message_us"] / base["per_message_us"], 1)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
