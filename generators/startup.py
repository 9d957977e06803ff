"""A generator's start: its engine up, then a member of the weight-sync group.

    start_and_join: start_engine -> sync_epoch (JoinSync; a restart waits for its epoch:
                    epoch_announced) -> engine.join_weight_sync

A restarted generator's group is built by the learner at its next publish, however long
its step is: the wait for that is no failure, and only the rendezvous after it has a
deadline (``weights.join_timeout_s``, the one the learner waits for members with).
"""

from __future__ import annotations

import asyncio
import logging

from generators.engines import start_engine
from generators.interface import RolloutEngine
from verl_async import placement
from verl_async import protocol as P
from verl_async.auth import GENERATOR, client_credentials
from verl_async.runtime import RunContext, mark
from verl_async.transport import AsyncBufferClient
from verl_async.weight_sync import resolve_backend

log = logging.getLogger("verl_async.generator")
EPOCH_POLL_S = 1.0  # a restarted generator asks this often whether its group is being built


async def start_and_join(ctx: RunContext, index: int, role: str) -> RolloutEngine | None:
    """This generator's engine (``generators.engine``), up and a member of the weight-sync
    group; None (the engine shut down) when the run stopped before that group was built."""
    cfg, ep = ctx.cfg, ctx.endpoints
    seed = cfg.learner.seed * 1000 + index
    tp = placement.tensor_parallel_size(placement.generator_groups(cfg)[index])
    engine = start_engine(cfg, ep.model_path, seed, tensor_parallel_size=tp)
    mark(ctx.path, role, "engine up")
    try:
        epoch = await sync_epoch(ctx, index, engine.loaded_version)
        if epoch is None:
            engine.shutdown()
            return None
        log.info("engine up; joining the weight-sync group (epoch %d)", epoch)
        await engine.join_weight_sync(
            ep.weights_host,
            ep.weights_port,
            placement.sync_world_size(cfg),  # every vLLM worker of every engine is a member
            placement.sync_rank_offset(cfg, index),
            resolve_backend(cfg.weights.backend, cfg.placement.colocate),
            epoch,
        )
    except BaseException:
        engine.shutdown()
        raise
    mark(ctx.path, role, "joined weight sync")
    return engine


async def sync_epoch(ctx: RunContext, index: int, loaded_version: int) -> int | None:
    """The weight-sync epoch to join, from the buffer, once its group is being built: 0 at
    the start of a run; a newer one when this generator was started again (the buffer then
    issues its groups again). None when the run stops first.

    A restarted generator's epoch is built by the learner at its next publish (or while it
    waits for a batch): until the learner announces weights over it, this waits, however
    long the learner's step is. Only the rendezvous that follows has a deadline
    (``weights.join_timeout_s``, the learner's own), so a slow learner is never taken for
    a failure that would make this process exit and start again."""
    cfg = ctx.cfg
    client = AsyncBufferClient(ctx.endpoints.buffer, cfg.buffer.request_timeout_s, credentials(ctx))
    try:
        reply, _ = await client.request(P.JoinSync(generator_id=index))
        if reply.wanted > reply.current:
            log.info(
                "waiting for the learner to build weight-sync epoch %d (at its next publish)",
                reply.wanted,
            )
            if not await epoch_announced(client, index, loaded_version, reply.wanted):
                return None
        return reply.wanted
    finally:
        client.close()


async def epoch_announced(
    client: AsyncBufferClient, index: int, loaded_version: int, epoch: int
) -> bool:
    """Wait until weights are announced over ``epoch`` (the learner then builds its group
    and waits for every member): True; False when the run stops first."""
    while True:
        status, _ = await client.request(
            P.PollVersion(
                generator_id=index,
                loaded_version=loaded_version,
                wait_s=EPOCH_POLL_S,
                sync_epoch=epoch - 1,
            ),
            extra_wait_s=EPOCH_POLL_S,
        )
        if status.stop:
            log.info("the run stopped before weight-sync epoch %d was built", epoch)
            return False
        if status.update is not None and status.update.epoch >= epoch:
            return True
        await asyncio.sleep(EPOCH_POLL_S)  # answered at once: a version this engine lacks


def credentials(ctx: RunContext):
    """This generator's key or token (verl_async/auth.py) for the buffer and reward models."""
    return client_credentials(ctx.cfg, ctx.run_dir, GENERATOR)
