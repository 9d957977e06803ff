"""Rollout transport: generator processes -> buffer -> learner client, against raw ZeroMQ.

    python benchmarks/transport.py [--sizes 8192,1048576] [--counts 20000,600]
                                   [--producers 1] [--window 32] [--out runs/transport]

Our path is the real one: a ``python -m buffer`` process, producer processes that speak
the generator's protocol (GetPrompts for up to ``--window`` groups, then the generator's own
``RolloutPusher``: one acknowledged PushRollouts in flight, finished groups coalesced), and a learner-side ``BufferClient`` that long-polls GetBatch
step by step and maps every tensor frame. One rollout is one prompt group whose tensors
(response ids, behaviour logprobs, token versions: 12 bytes a token) add up to the size.

The baseline moves the same number of messages with the same tensor bytes from the same
number of processes over raw PUSH/PULL on the same loopback TCP, one hop, no replies. A
second reference sends them through a ``zmq.proxy`` process: the same two hops as our
path with no Python per message, i.e. the floor for any store-and-forward buffer. All are
timed from a common start signal to the last byte at the consumer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

GROUPS_PER_STEP = 8


def rollout_arrays(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = max(size // 12, 1)
    return (
        np.arange(tokens, dtype=np.int32) % 14,
        np.full(tokens, -0.5, np.float32),
        np.zeros(tokens, np.int32),
    )


# ----------------------------------------------------------------------------- our path


def produce_through_buffer(
    endpoint: str, run_dir: Path, index: int, size: int, window: int, go
) -> None:
    import uvloop

    import generators.main  # noqa: F401  (imported before the clock starts)

    go.wait()
    uvloop.run(_produce(endpoint, run_dir, index, size, window))


async def _produce(endpoint: str, run_dir: Path, index: int, size: int, window: int) -> None:
    """The generator's client side: GetPrompts, then each group through ``RolloutPusher``."""
    from generators.leases import RolloutPusher
    from generators.trajectory import Packed
    from verl_async import protocol as P
    from verl_async.auth import GENERATOR, load_role_token
    from verl_async.rewards.scorer import GroupScores
    from verl_async.transport import AsyncBufferClient

    client = AsyncBufferClient(endpoint, 60.0, load_role_token(run_dir, GENERATOR))
    pusher = RolloutPusher(client, index)
    resp, logprobs, versions = rollout_arrays(size)
    scored = GroupScores(scores=[[1.0]], failed=[0])  # one reward source, one sample

    inflight: set[asyncio.Task] = set()
    exhausted = False
    while not (exhausted and not inflight):
        room = window - len(inflight)
        if room > 0 and not exhausted:
            reply, _ = await client.request(
                P.GetPrompts(generator_id=index, loaded_version=0, max_groups=room)
            )
            exhausted = reply.exhausted
            inflight |= {
                asyncio.create_task(
                    pusher.push(
                        g, Packed(g.prompt_ids, resp, logprobs, versions, [len(resp)]), scored, 0.0
                    )
                )
                for g in reply.groups
            }
        if inflight:
            done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    client.close()


def through_buffer(size: int, count: int, args) -> tuple[float, int]:
    """Seconds and bytes for ``count`` rollouts of ``size`` bytes through the real buffer."""
    from verl_async import protocol as P
    from verl_async.auth import LEARNER, load_role_token
    from verl_async.config import load_config
    from verl_async.launch.local import spawn
    from verl_async.launch.plan import stop_roles
    from verl_async.launch.prepare import prepare
    from verl_async.transport import BufferClient

    steps = count // GROUPS_PER_STEP
    run_dir = args.out / f"buffer-{size}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            f"trainer.total_steps={steps}",
            f"learner.groups_per_step={GROUPS_PER_STEP}",
            f"staleness.max={steps}",  # admission never holds producers back here
            # what the buffer accepts: one sample of the message's tokens per group
            "generators.group_size=1",
            f"generators.max_new_tokens={max(size // 12, 1)}",
            f"generators.max_model_len={max(size // 12, 1) + 256}",  # room for the prompts
            # one generator id per producer (the buffer serves only the run's ids)
            f"placement.generators=[{','.join(['cpu:0'] * args.producers)}]",
        ],
    )
    endpoint = prepare(cfg, run_dir).buffer
    buffer = spawn("buffer", "buffer", run_dir, None)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    producers = [
        ctx.Process(
            target=produce_through_buffer, args=(endpoint, run_dir, i, size, args.window, go)
        )
        for i in range(args.producers)
    ]
    client = BufferClient(endpoint, 60.0, load_role_token(run_dir, LEARNER))
    try:
        client.request(P.GetStats())  # the buffer is up
        for p in producers:
            p.start()
        time.sleep(1.0)  # let the producers import and connect before the clock starts
        received = 0
        t0 = time.perf_counter()
        go.set()
        for step in range(steps):
            reply, frames = client.request(
                P.GetBatch(step=step, rank=0, world_size=1, learner_version=step, wait_s=30.0),
                extra_wait_s=30.0,
            )
            if not isinstance(reply, P.Batch):
                raise RuntimeError(f"step {step}: {reply}")
            for ref in (reply.response_ids, reply.behav_logprobs, reply.token_versions):
                received += P.tensor(ref, frames).nbytes
        seconds = time.perf_counter() - t0
        for p in producers:
            p.join(30)
            if p.exitcode != 0:
                raise RuntimeError(f"producer exited with {p.exitcode}")
        return seconds, received
    finally:
        client.close()
        for p in producers:
            if p.is_alive():
                p.kill()
        stop_roles([buffer])


# ----------------------------------------------------------------------------- raw baseline


def produce_raw(endpoint: str, size: int, count: int, go) -> None:
    resp, logprobs, versions = rollout_arrays(size)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    go.wait()
    head = b"x" * 64  # a small header frame, like our envelope
    for _ in range(count):
        sock.send_multipart([head, resp, logprobs, versions], copy=False)
    sock.close(linger=-1)  # deliver everything before exiting
    ctx.term()


def forwarder(front: str, back: str) -> None:
    """The cheapest possible store-and-forward hop: libzmq's own proxy, no Python per message."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(front)
    push.bind(back)
    zmq.proxy(pull, push)


def raw_zmq(size: int, count: int, args, forwarded: bool = False) -> tuple[float, int]:
    """Seconds and tensor bytes for raw PUSH/PULL of the same messages; ``forwarded`` puts
    a ``zmq.proxy`` process in between (one extra hop, as our buffer adds)."""
    from verl_async.runtime import free_port

    mpctx = mp.get_context("spawn")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    proxy = None
    if forwarded:
        front = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        back = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        proxy = mpctx.Process(target=forwarder, args=(front, back), daemon=True)
        proxy.start()
        sock.connect(back)
    else:
        front = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    go = mpctx.Event()
    shares = [count // args.producers + (i < count % args.producers) for i in range(args.producers)]
    producers = [mpctx.Process(target=produce_raw, args=(front, size, n, go)) for n in shares]
    try:
        for p in producers:
            p.start()
        time.sleep(1.0)
        received = 0
        t0 = time.perf_counter()
        go.set()
        for _ in range(count):
            parts = sock.recv_multipart(copy=False)
            received += sum(len(f.buffer) for f in parts[1:])
        return time.perf_counter() - t0, received
    finally:
        for p in producers:
            p.join(30)
        if proxy is not None:
            proxy.kill()
        sock.close(linger=0)
        ctx.term()


@dataclass
class Row:
    size: int
    count: int
    ours_s: float
    raw_s: float
    forwarded_s: float  # raw through a zmq.proxy hop: the floor for any store-and-forward path
    ours_rollouts_per_s: float
    raw_msgs_per_s: float
    ours_gb_per_s: float
    raw_gb_per_s: float
    ratio: float  # ours / raw, in messages/s and GB/s alike (same count, same bytes)


def measure(size: int, count: int, args) -> Row:
    count -= count % GROUPS_PER_STEP
    raw_s, raw_bytes = raw_zmq(size, count, args)
    forwarded_s, _ = raw_zmq(size, count, args, forwarded=True)
    ours_s, ours_bytes = through_buffer(size, count, args)
    if ours_bytes != raw_bytes:
        raise RuntimeError(f"bytes differ: ours {ours_bytes}, raw {raw_bytes}")
    return Row(
        size=size,
        count=count,
        ours_s=ours_s,
        raw_s=raw_s,
        forwarded_s=forwarded_s,
        ours_rollouts_per_s=count / ours_s,
        raw_msgs_per_s=count / raw_s,
        ours_gb_per_s=ours_bytes / ours_s / 1e9,
        raw_gb_per_s=raw_bytes / raw_s / 1e9,
        ratio=raw_s / ours_s,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,1048576", help="rollout tensor bytes")
    ap.add_argument("--counts", default="20000,600", help="rollouts per size")
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--window", type=int, default=32, help="pushes in flight per producer")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/transport")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    sizes = [int(x) for x in args.sizes.split(",")]
    counts = [int(x) for x in args.counts.split(",")]
    rows = [measure(s, n, args) for s, n in zip(sizes, counts, strict=True)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transport.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"machine: {machine()}; producers: {args.producers}; window: {args.window}")
    print(
        "| rollout | count | ours rollouts/s | raw msgs/s | ours GB/s | raw GB/s | ours / raw "
        "| raw with one forwarding hop / raw |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.size / 1024:.0f} KiB | {r.count} | {r.ours_rollouts_per_s:,.0f} "
            f"| {r.raw_msgs_per_s:,.0f} | {r.ours_gb_per_s:.3f} | {r.raw_gb_per_s:.3f} "
            f"| {r.ratio:.2f} | {r.raw_s / r.forwarded_s:.2f} |"
        )
    print(
        "summary: "
        + "; ".join(
            f"{r.size / 1024:.0f} KiB at {r.ratio:.2f}x raw ZeroMQ ({r.ours_gb_per_s:.2f} GB/s)"
            for r in rows
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
