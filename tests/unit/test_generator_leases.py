"""The generator's side of leases (generators/leases.py, generators/main.py) against a real
buffer: a late rollout is dropped and counted, never fatal; a group issued again to the
generator that still holds it runs once, not twice at once; the held groups' leases are
renewed.

The buffer is a real ``BufferServer`` on a loopback TCP port, in this test's event loop,
whose leases read a clock the test moves: a lease runs out exactly when the test says,
whatever the machine's speed. The generator is the real ``Generator`` over an engine that
holds the requests of the prompts the test picks until they are cancelled (a stalled
engine, or an episode that outlives its lease).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

import msgspec
import numpy as np
import pytest

from buffer.evaluation import EvalRounds
from buffer.leases import Leases
from buffer.ledger import PromptLedger
from buffer.server import BufferServer
from generators.interface import Sample
from generators.leases import HeldGroups, RolloutPusher
from generators.main import Generator
from generators.trajectory import Packed
from verl_async import protocol as P
from verl_async.auth import LEARNER, load_role_token, load_role_tokens, write_role_tokens
from verl_async.config import load_config
from verl_async.data import PromptRecord
from verl_async.rewards.scorer import GroupScores
from verl_async.runtime import Endpoints, RunContext
from verl_async.staleness import Admission
from verl_async.transport import AsyncBufferClient, BufferRejected
from verl_async.transport.server import ServerOptions

from .test_leases import Clock

GROUP_SIZE, B, ETA, STEPS = 2, 2, 1, 3  # groups 0..3 are admitted at version 0; 4, 5 never
LEASE_S = 10.0  # the buffer's lease (on the test's clock)


# ----------------------------------------------------------------------------- held groups


def _group(k: int, lease: int) -> P.PromptGroup:
    return P.PromptGroup(
        group_id=k, prompt_id=k, epoch=0, prompt_ids=[1], prompt="p", ground_truth="", lease=lease
    )


def test_held_groups_keep_one_copy_per_group_and_cancel_the_lost():
    async def scenario() -> None:
        held = HeldGroups()
        never = asyncio.Event()
        tasks = [asyncio.create_task(never.wait()) for _ in range(4)]
        held.hold(_group(0, lease=1), tasks[0])
        held.hold(_group(1, lease=2), tasks[1])
        assert held.cancel_older(_group(0, lease=1)) is None  # the same copy, moving on
        assert sorted(held.leases()) == [1, 2]
        old = held.cancel_older(_group(0, lease=3))  # issued here again
        held.hold(_group(0, lease=3), tasks[2])
        assert (old.lease, old.task) == (1, tasks[0]) and held.replaced == 1
        held.release(tasks[0])  # the cancelled copy ends: the new one is still held
        assert sorted(held.leases()) == [2, 3]
        assert held.lose([2, 99]) == [1] and held.lost == 1 and held.leases() == [3]
        held.hold(_group(0, lease=3), tasks[3])  # sampled: its scoring task carries it on
        held.release(tasks[2])
        assert held.leases() == [3]
        held.release(tasks[3])
        assert held.leases() == []
        await asyncio.sleep(0)
        assert [t.cancelled() for t in tasks] == [True, True, False, False]
        for t in tasks:
            t.cancel()

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- a real buffer


def _buffer(port: int, clock: Clock, run_dir=None) -> BufferServer:
    """The buffer; with ``run_dir`` it admits the holders of that run's role tokens, as a
    run's buffer does (a ``Generator`` proves its role with them)."""
    prompts = [PromptRecord(f"p{i}", "", prompt_ids=(10 + i,)) for i in range(B * STEPS)]
    leases = Leases(LEASE_S, 16, clock)
    ledger = PromptLedger(prompts, Admission(B, ETA), STEPS, seed=0, leases=leases)
    options = None
    if run_dir is not None:
        write_role_tokens(run_dir)
        options = ServerOptions(load_role_tokens(run_dir))
    endpoint = f"tcp://127.0.0.1:{port}"
    return BufferServer(ledger, ETA, endpoint, evals=EvalRounds([]), options=options)


async def _until(what, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not what():
            await asyncio.sleep(0.01)


def _packed(group: P.PromptGroup) -> Packed:
    tokens = np.full(2 * GROUP_SIZE, 5, np.int32)
    return Packed(
        list(group.prompt_ids),
        tokens,
        np.full(tokens.size, -0.5, np.float32),
        np.zeros(tokens.size, np.int32),
        [2] * GROUP_SIZE,
    )


SCORED = GroupScores(scores=[[1.0] * GROUP_SIZE], failed=[0])


def test_a_late_copy_is_dropped_and_counted_and_the_pusher_goes_on(free_port):
    """One connection holds a group, its lease runs out, the group comes back to it: its
    first copy's rollout is dropped (before the second's is taken, and after), the
    pusher's task ends without an error each time; a rollout the buffer refuses is still
    an error."""

    async def scenario() -> None:
        clock = Clock()
        server = _buffer(free_port(), clock)
        serving = asyncio.create_task(server.serve())
        client = AsyncBufferClient(server.endpoint, 10.0)
        errors = []
        pusher = RolloutPusher(client, 0, on_error=lambda t: errors.append(t.exception()))
        try:
            ask = P.GetPrompts(generator_id=0, loaded_version=0, max_groups=1)
            [first] = (await client.request(ask))[0].groups
            clock.now += LEASE_S
            [second] = (await client.request(ask))[0].groups
            assert first.group_id == second.group_id and first.lease != second.lease
            await pusher.push(first, _packed(first), SCORED, 1.0)
            await pusher.push(second, _packed(second), SCORED, 1.0)
            await pusher.push(first, _packed(first), SCORED, 1.0)
            await _until(lambda: len(errors) == 3)  # each flusher task ended, and how
            assert pusher.dropped == 2 and errors == [None, None, None]
            stats = (await client.request(P.GetStats()))[0]
            assert (stats.returned, stats.rollouts_dropped, stats.leases_expired) == (1, 2, 1)
            [third] = (await client.request(ask))[0].groups
            wrong = msgspec.structs.replace(third, lease=third.lease + 100)
            with pytest.raises(TimeoutError):  # never acknowledged: the flusher failed
                async with asyncio.timeout(2.0):
                    await pusher.push(wrong, _packed(wrong), SCORED, 1.0)
            assert isinstance(errors[-1], BufferRejected)
            assert f"issued under lease {third.lease}, not lease {third.lease + 100}" in str(
                errors[-1]
            )
        finally:
            client.close()
            server.terminated = True
            await serving

    asyncio.run(scenario())


def test_a_refused_group_costs_its_push_alone_and_the_pusher_goes_on(free_port, caplog):
    """Two groups in one push, one of them with NaN log-probs: the buffer takes the good
    one and issues the other again; both pushes return, the flusher ends without an error,
    and the refusal is counted and logged with the group's id and the buffer's reason."""

    async def scenario() -> int:
        server = _buffer(free_port(), Clock())
        serving = asyncio.create_task(server.serve())
        client = AsyncBufferClient(server.endpoint, 10.0)
        ask = P.GetPrompts(generator_id=0, loaded_version=0, max_groups=2)
        good, bad = (await client.request(ask))[0].groups
        sent, request = [], client.request

        async def counted(body, frames=None, extra_wait_s=0.0):
            sent.append(len(body.groups))
            return await request(body, frames, extra_wait_s)

        client.request = counted
        errors = []
        pusher = RolloutPusher(client, 0, on_error=lambda t: errors.append(t.exception()))
        broken = dataclasses.replace(
            _packed(bad), logprobs=np.full(2 * GROUP_SIZE, np.nan, np.float32)
        )
        try:
            pushes = asyncio.gather(
                pusher.push(good, _packed(good), SCORED, 1.0),
                pusher.push(bad, broken, SCORED, 1.0),
            )
            await _until(lambda: errors)  # the flusher task ended, and how
            assert errors == [None] and sent == [2]  # one message, not an error
            async with asyncio.timeout(30):
                await pushes  # both released
            assert (pusher.refused, pusher.ended, pusher.dropped) == (1, 0, 0)
            assert sorted(server.ledger.returned) == [good.group_id]
            assert list(server.ledger.reissue) == [bad.group_id]
            assert (await request(P.GetStats()))[0].rollouts_refused == 1
        finally:
            client.close()
            server.terminated = True
            await serving
        return bad.group_id

    with caplog.at_level(logging.WARNING, logger="verl_async.generator"):
        k = asyncio.run(scenario())
    assert (
        f"the buffer refused the rollout of group {k} (1 refused so far), issued again: "
        f"group {k}: behav_logprobs must be finite and <= 0"
    ) in caplog.text


class StallingEngine:
    """A one-token-per-sample engine whose first ``GROUP_SIZE`` requests of each prompt in
    ``stalled`` wait until cancelled; it records how many requests of a prompt were live
    at once."""

    def __init__(self, stalled: set[int]) -> None:
        self.loaded_version = 0
        self.version_changed = asyncio.Event()
        self.sync_epoch = 0
        self.weights_lost = False
        self.resubmitted = 0
        self.stalled = stalled  # prompt ids
        self.seen: Counter[int] = Counter()
        self.live: Counter[int] = Counter()
        self.most_live = 0

    async def sample(self, prompt_ids: list[int], how) -> Sample:
        [p] = prompt_ids
        self.seen[p] += 1
        self.live[p] += 1
        self.most_live = max(self.most_live, self.live[p])
        try:
            if p in self.stalled and self.seen[p] <= GROUP_SIZE:
                await asyncio.Event().wait()  # stalled: only a cancel ends it
            return Sample([5, 2], [-0.5, -0.5], [0, 0], list(prompt_ids))
        finally:
            self.live[p] -= 1


class Scorer:
    async def score_group(self, group, texts, conversations=None, lengths=None) -> GroupScores:
        return GroupScores(scores=[[1.0] * len(texts)], failed=[0])


class Tokenizer:
    eos_token_id = 2
    name_or_path = ""  # no model directory: the engine stops at eos_token_id alone

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "x"


@pytest.mark.parametrize("renew_every_s", [0.1, 20.0])
def test_a_group_back_at_its_stalled_generator_runs_once_and_the_generator_lives(
    free_port, renew_every_s, caplog, tmp_path
):
    """Groups 2 and 3 stall in the engine; their leases run out and they are issued again.
    The generator learns it from a renewal's reply (renewals every 0.1 s: the copies are
    cancelled as lost) or from the re-issue itself (renewals every 20 s: the copies are
    cancelled as replaced), samples each group again once, and keeps running: every
    group is returned once, no copy ran beside another, the run ends without a failure."""

    async def scenario() -> None:
        clock = Clock()
        server = _buffer(free_port(), clock, tmp_path)
        stalled = {10 + server.ledger.prompt_of(k)[1] for k in (2, 3)}
        engine = StallingEngine(stalled)
        cfg = load_config(
            None,
            [
                f"generators.group_size={GROUP_SIZE}",
                "generators.max_inflight_groups=4",
                f"learner.groups_per_step={B}",
                f"staleness.max={ETA}",
                f"trainer.total_steps={STEPS}",
                f"buffer.lease_timeout_s={3 * renew_every_s}",
            ],
        )
        ctx = RunContext(
            run_dir=str(tmp_path),
            cfg=cfg,
            endpoints=Endpoints(
                buffer=server.endpoint, weights_host="", weights_port=0, model_path=""
            ),
        )
        serving = asyncio.create_task(server.serve())
        gen = Generator(ctx, 0, engine, Tokenizer(), Scorer())
        running = asyncio.create_task(gen.run())
        try:
            await _until(lambda: sum(engine.seen[p] for p in stalled) == 2 * GROUP_SIZE)
            await _until(lambda: sorted(server.ledger.returned) == [0, 1])
            clock.now += LEASE_S  # 2 and 3 run out (the engine holds them)
            await _until(lambda: len(server.ledger.returned) == 4)
            assert gen.held.lost + gen.held.replaced == 2
            if renew_every_s > 10:
                assert gen.held.replaced == 2
            stop = AsyncBufferClient(server.endpoint, 10.0, load_role_token(tmp_path, LEARNER))
            await stop.request(P.Shutdown())
            stop.close()
            async with asyncio.timeout(30):
                await running  # raises the generator's failure, if any
        finally:
            running.cancel()
            server.terminated = True
            await serving
        assert server.ledger.leases.expired_total == 2
        assert all(engine.seen[p] == 2 * GROUP_SIZE for p in stalled)  # sampled again once
        assert engine.most_live == GROUP_SIZE  # never two copies of a group at once
        assert gen.pusher.dropped == 0 and gen.failure is None

    with caplog.at_level(logging.WARNING, logger="verl_async.generator"):
        asyncio.run(scenario())
    assert ("cancelled" in caplog.text) and "failed" not in caplog.text
