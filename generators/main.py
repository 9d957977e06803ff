"""Generator process: keep an engine busy with prompt groups and ship rollouts.

    run_generator -> start_and_join (generators/startup.py) -> Generator.run:
        sample_loop:    GetPrompts -> start_group -> generate_group -> sample -> score_and_push
                                                              (score, RolloutPusher.push)
                                   -> evaluate_group -> sample -> score -> PushEval
        follow_weights: PollVersion -> finish_eval_first -> load -> engine.apply_update
                        (pause, receive, resume)
        renew_leases:   RenewLeases (every third of buffer.lease_timeout_s) -> cancel lost

The engine is a ``RolloutEngine`` (generators/interface.py): vLLM or transformers, as
``generators.engine`` says (generators/engines.py); this module knows neither.

Scoring never runs on this event loop: rule rewards go to a scoring process of the
generator's own and model rewards to their reward-model processes (verl_async/rewards);
the loop only awaits their replies, each with a deadline.

Up to ``max_inflight_groups * group_size`` requests are in flight (a group's slot is
freed when its sampling ends; at most ``max_inflight_groups`` more groups wait for their
scores), and a group's samples are separate requests so they share the prompt's prefix
cache (vLLM batches them continuously, the transformers engine in waves). The version reported to the buffer is the one *loaded*, never the newest
published: admission depends on it (verl_async/staleness.py).

Every training group is held under the lease it was issued with (generators/leases.py):
renewed while this process works on it, one copy per group id, and a rollout that comes
too late is dropped by the buffer and counted here, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter

from generators.interface import RolloutEngine, Sampling
from generators.leases import HeldGroups, RolloutPusher
from generators.rollouts import Rollouts
from generators.startup import credentials, start_and_join
from generators.trajectory import Trajectory, pack
from verl_async import placement
from verl_async import protocol as P
from verl_async.rewards.scorer import GroupScores, Scorer
from verl_async.runtime import RunContext, descendants_cpu, mark, mark_cpu
from verl_async.teachers import Teachers
from verl_async.transport import AsyncBufferClient
from verl_async.weight_sync import failure_line

log = logging.getLogger("verl_async.generator")
ROOM_POLL_S = 0.05  # ask the buffer again this soon when it had nothing for us
ADMISSION_POLL_S = 1.0  # ... when admission refused us: only a new version opens it


class Generator:
    def __init__(
        self,
        ctx: RunContext,
        index: int,
        engine: RolloutEngine,
        tokenizer,
        scorer: Scorer,
        teachers: Teachers | None = None,
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.index = index
        self.engine = engine
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.teachers = teachers  # distillation.scoring: process (verl_async/teachers.py)
        self.train_sampling = Sampling.training(self.cfg)
        self.eval_sampling = Sampling.evaluation(self.cfg)
        self.buffer = AsyncBufferClient(
            ctx.endpoints.buffer, self.cfg.buffer.request_timeout_s, credentials(ctx)
        )
        self.stop = False
        self.failure: BaseException | None = None  # first error of a group or the weight loop
        self.inflight: set[asyncio.Task] = set()  # groups being sampled
        self.scoring: set[asyncio.Task] = set()  # groups sampled, being scored and pushed
        self.pusher = RolloutPusher(self.buffer, index, on_error=self._finished)
        self.held = HeldGroups()  # training groups here, by id, with their leases
        # Evaluation prompts in flight per loaded version, and the version of the oldest
        # round the buffer still has prompts of (its last reply): while either is the
        # loaded version, newer weights wait (finish_eval_first).
        self.eval_inflight: Counter[int] = Counter()
        self.eval_version = -1
        self.nudge = asyncio.Event()  # ask the buffer for prompts now, whatever the wait
        self.sampled = 0  # training groups sampled by this process
        self.ramping = True  # see sample_loop
        # On cores the learner also computes on, nothing beside its first step (the buffer
        # knows when that is: BufferServer.learner_on_first_step).
        self.defers = placement.shares_cores_with_learner(self.cfg, index)
        self.deferred_since: float | None = None  # the first request the buffer deferred
        # How each data source's prompts are sampled: one response, an environment's
        # episodes or an agent's (generators/rollouts.py; classes loaded now, so a bad one
        # fails at start).
        self.rollouts = Rollouts(self.cfg, engine, tokenizer)

    async def run(self) -> None:
        await self.rollouts.start()
        loops = [
            asyncio.create_task(self.follow_weights()),
            asyncio.create_task(self.renew_leases()),
        ]
        for task in loops:
            task.add_done_callback(self._finished)
        try:
            await self.sample_loop()
        finally:
            for task in loops:
                task.cancel()
            for task in self.inflight | self.scoring:
                task.cancel()
            await self.rollouts.stop()
            self.buffer.close()
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ sampling

    async def sample_loop(self) -> None:
        limit = self.cfg.generators.max_inflight_groups
        first = self.cfg.learner.groups_per_step
        while not self.stop:
            room = limit - len(self.inflight)
            # Ramp-up: until one step's groups are sampled, those go through the engine
            # alone (no other prompt's prefill slows them down), so the learner gets its
            # first batch as early as this engine can make it. A generator that defers to
            # the learner also waits until they are pushed: by its next request the buffer
            # has handed them to a waiting learner, and it issues nothing more until the
            # learner's first step is done.
            ramping = self.ramping and (
                self.sampled < first or (self.defers and bool(self.scoring))
            )
            if ramping:
                room = min(room, first - self.sampled - len(self.inflight))
            if len(self.scoring) >= limit:
                room = 0  # scoring lags behind sampling: take no more prompts until it catches up
            fetched, blocked = 0, False
            # Asked even once training prompts are exhausted: evaluation prompts may come.
            if room > 0:
                reply, _ = await self.buffer.request(
                    P.GetPrompts(
                        generator_id=self.index,
                        loaded_version=self.engine.loaded_version,
                        max_groups=room,
                        evaluate=not ramping,
                        defer_to_learner=self.defers,
                    )
                )
                for group in reply.groups:
                    self.start_group(group)
                for group in reply.eval_groups:
                    self._spawn(self.evaluate_group(reply.eval_round, group))
                self.eval_version = reply.eval_version
                fetched = len(reply.groups) + len(reply.eval_groups)
                blocked = reply.blocked_by_admission or reply.deferred
                self._note_deferral(reply.deferred)
                if reply.exhausted or (blocked and not reply.groups):
                    self.ramping = False  # no more training work now: evaluation may come
            if fetched == 0:
                # Admission opens when this engine loads a newer version, and a deferral
                # ends when one is announced (follow_weights nudges): no need to ask again
                # before that (or a group finishing), beyond a slow poll for evaluation
                # prompts. An idle generator then costs next to no CPU.
                await self._wait_for_room(ADMISSION_POLL_S if blocked else ROOM_POLL_S)

    def _note_deferral(self, deferred: bool) -> None:
        """Log the learner's first step as this generator saw it: when the buffer first
        deferred a request and how long until it took one again."""
        if deferred and self.deferred_since is None:
            self.deferred_since = time.monotonic()
            log.info("sharing cores with the learner: nothing sampled during its first step")
        elif not deferred and self.deferred_since is not None:
            waited = time.monotonic() - self.deferred_since
            self.deferred_since = None
            log.info("the learner's first step is done: sampling again after %.1fs", waited)

    def _spawn(self, coro, into: set[asyncio.Task] | None = None) -> asyncio.Task:
        task = asyncio.create_task(coro)
        (self.inflight if into is None else into).add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self.inflight.discard(task)
        self.scoring.discard(task)
        self.held.release(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %r", task.get_coro().__name__, task.exception())
            self.failure = self.failure or task.exception()
            self.stop = True

    async def _wait_for_room(self, timeout_s: float) -> None:
        """Sleep until a group finishes, the loaded version changes, or ``timeout_s`` pass."""
        waiters = [
            asyncio.ensure_future(self.engine.version_changed.wait()),
            asyncio.ensure_future(self.nudge.wait()),
            *self.inflight,
            *self.scoring,
        ]
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        waiters[0].cancel()
        waiters[1].cancel()
        self.nudge.clear()

    async def sample(self, group: P.PromptGroup, n: int, how: Sampling) -> list[Trajectory]:
        """``n`` episodes of the group's prompt, each one trajectory or more: one response,
        or an episode of the environment or agent that takes the group's data source."""
        return await self.rollouts.of(group.data_source).run_group(group, n, how)

    async def score(self, group: P.PromptGroup, samples: list[Trajectory]) -> GroupScores:
        """The trajectories' scores: their last turns' texts (a reward model reads an
        episode's whole conversation)."""
        texts = [t.text for t in samples]
        conversations = [t.messages for t in samples] if samples[0].stats is not None else None
        lengths = [len(t.token_ids) for t in samples]
        return await self.scorer.score_group(group, texts, conversations, lengths)

    def start_group(self, group: P.PromptGroup) -> None:
        """Sample a group the buffer issued. A copy of it still running here lost its
        lease (the group ran out and came back to this connection first in line): that
        copy is cancelled, so one group never runs twice at once."""
        old = self.held.cancel_older(group)
        self.held.hold(group, self._spawn(self.generate_group(group)))
        if old is not None:
            log.warning(
                "group %d was issued again (lease %d) while its copy under lease %d still "
                "ran here: that copy is cancelled (%d so far)",
                group.group_id, group.lease, old.lease, self.held.replaced,
            )  # fmt: skip

    async def generate_group(self, group: P.PromptGroup) -> None:
        """Sample the group; then its slot goes to the next prompt while a task of its
        own scores and pushes it (a slow reward model does not idle the engine)."""
        t0 = time.perf_counter()
        samples = await self.sample(group, self.cfg.generators.group_size, self.train_sampling)
        self.sampled += 1
        self.held.hold(group, self._spawn(self.score_and_push(group, samples, t0), self.scoring))

    async def score_and_push(self, group: P.PromptGroup, samples: list, t0: float) -> None:
        """Rewards, then (distillation by teacher processes) the teacher's log-probs of
        the sampled tokens, asked until its process answers; then the push."""
        scored = await self.score(group, samples)
        packed = pack(list(group.prompt_ids), samples)
        if self.teachers is not None:
            packed.teacher = await self.teachers.score(
                group.data_source, packed.prompt_ids, packed.tokens, packed.lengths,
                packed.loss_mask,
            )  # fmt: skip
        await self.pusher.push(group, packed, scored, time.perf_counter() - t0)

    async def evaluate_group(self, round_: int, group: P.PromptGroup) -> None:
        """An evaluation prompt: sampled with the eval settings, only its scores go back."""
        version = self.engine.loaded_version
        self.eval_inflight[version] += 1
        try:
            await self._evaluate(round_, group)
        finally:
            self.eval_inflight[version] -= 1

    async def _evaluate(self, round_: int, group: P.PromptGroup) -> None:
        samples = await self.sample(group, self.cfg.eval.samples, self.eval_sampling)
        scored = await self.score(group, samples)
        episodes = [t.stats for t in samples if t.stats is not None]
        result = P.EvalResult(
            group_id=group.group_id,
            data_source=group.data_source,
            scores=scored.scores,
            failed=scored.failed,
            response_lengths=[len(t.token_ids) for t in samples],
            versions=[t.versions[0] if t.versions else self.engine.loaded_version for t in samples],
            example=samples[0].text,
            env_rewards=[e.env_reward for e in episodes],
            turns=[e.turns for e in episodes],
        )
        await self.buffer.request(P.PushEval(round=round_, results=[result]))

    # ------------------------------------------------------------------ leases

    async def renew_leases(self) -> None:
        """Every third of ``buffer.lease_timeout_s``, renew the leases of every group held
        here, however long its episodes take; cancel the copies whose lease the buffer
        says is over (their rollouts would be dropped)."""
        every_s = self.cfg.buffer.lease_timeout_s / 3
        while not self.stop:
            await asyncio.sleep(every_s)
            leases = self.held.leases()
            if not leases:
                continue
            reply, _ = await self.buffer.request(P.RenewLeases(leases=leases))
            lost = self.held.lose(reply.lost)
            if lost:
                log.warning(
                    "the leases of groups %s were over before this renewal (%d copies "
                    "cancelled so far): they went out again; this process did not renew "
                    "them for buffer.lease_timeout_s or held them buffer.lease_max_s",
                    lost, self.held.lost,
                )  # fmt: skip

    # ------------------------------------------------------------------ weights

    async def follow_weights(self) -> None:
        """Long-poll the buffer for new versions and swap them in as they are announced;
        rejoin the weight-sync group when it was rebuilt (buffer/sync_epochs.py)."""
        wait_s = 1.0
        engine = self.engine
        while not self.stop:
            status, _ = await self.buffer.request(
                P.PollVersion(
                    generator_id=self.index,
                    loaded_version=engine.loaded_version,
                    wait_s=wait_s,
                    sync_epoch=engine.sync_epoch,
                ),
                extra_wait_s=wait_s,
            )
            if status.stop:
                self.stop = True
                return
            update = status.update
            if update is None:
                continue
            if update.epoch > engine.sync_epoch:
                log.info("the weight-sync group was rebuilt: joining epoch %d", update.epoch)
                await engine.rejoin_weight_sync(update.epoch)
            elif update.version <= engine.loaded_version or engine.weights_lost:
                # Nothing new; or this epoch's group failed us: wait for the next one.
                await asyncio.sleep(0.2 if engine.weights_lost else 0)
                continue
            self.eval_version = status.eval_version
            self.nudge.set()  # a deferral to the learner has ended (sample_loop)
            await self.finish_eval_first(update.version)
            await self.load(update)

    def holds_eval(self) -> bool:
        """Whether an evaluation round started at the loaded version is still being sampled
        here, or still has prompts at the buffer."""
        v = self.engine.loaded_version
        return self.eval_inflight[v] > 0 or self.eval_version == v

    async def finish_eval_first(self, version: int) -> None:
        """Keep the loaded weights until the evaluation round started at them is sampled,
        so that a round scores one version (the first one the initial weights, while the
        learner trains its first steps). Training goes on meanwhile, within the staleness
        bound. The learner's broadcast of ``version`` waits for this generator, so the wait
        is bounded by half of ``weights.timeout_s``; after that the round mixes versions
        (``eval/version_max`` in eval.jsonl says so)."""
        if not self.holds_eval():
            return
        self.nudge.set()  # the round's prompts may still be at the buffer: fetch them now
        t0 = time.monotonic()
        limit_s = self.cfg.weights.timeout_s / 2
        while self.holds_eval() and not self.stop and time.monotonic() - t0 < limit_s:
            await asyncio.sleep(0.05)
        waited = time.monotonic() - t0
        if self.holds_eval() and not self.stop:
            log.warning(
                "the evaluation round at version %d is still running after %.0fs "
                "(weights.timeout_s / 2): loading version %d; the round mixes versions",
                self.engine.loaded_version,
                waited,
                version,
            )
        else:
            log.info(
                "held version %d %.1fs for its evaluation round", self.engine.loaded_version, waited
            )

    async def load(self, update: P.WeightUpdate) -> None:
        """Receive and load one update; one that fails midway leaves the engine paused
        until the learner has rebuilt the group and sent the weights again."""
        try:
            seconds = await self.engine.apply_update(update)
        except Exception as exc:  # noqa: BLE001 (a member died mid-broadcast; not fatal)
            log.warning(
                "receiving version %d failed (%s); sampling is paused until the learner "
                "rebuilds the weight-sync group and sends the weights again",
                update.version,
                failure_line(exc),
            )
            return
        log.info(
            "loaded version %d in %.3fs (%s mode; resubmitted %d requests so far)",
            update.version,
            seconds,
            self.cfg.weights.mode,
            self.engine.resubmitted,
        )


def make_scorer(ctx: RunContext, index: int) -> Scorer:
    """Rule sources in a scoring process of this generator's; model sources through a
    client of each reward-model process (endpoints chosen by the launcher)."""
    clients = {}
    if ctx.endpoints.reward_models:
        from verl_async.rewards.model_client import RewardModelClient

        timeout_s = ctx.cfg.rewards.timeout_s
        clients = {
            name: RewardModelClient(endpoint, timeout_s, credentials(ctx))
            for name, endpoint in ctx.endpoints.reward_models.items()
        }
    return Scorer(
        ctx.run_dir,
        ctx.cfg.rewards,
        clients,
        log_name=f"reward_worker{index}",
        max_new_tokens=ctx.cfg.generators.max_new_tokens,
    )


def make_teachers(ctx: RunContext) -> Teachers | None:
    """Clients of the run's teacher processes (None: no teacher scores here)."""
    if not ctx.cfg.distillation.processes:
        return None
    return Teachers(
        ctx.cfg.distillation,
        ctx.endpoints.teachers,
        ctx.cfg.generators.temperature,
        credentials(ctx),
    )


async def run_generator(ctx: RunContext, index: int) -> None:
    """Start the engine, join the weight-sync group, generate until told to stop."""
    role = f"generator{index}"
    mark(ctx.path, role, "started")
    nice = ctx.cfg.placement.generator_nice
    if nice and placement.shares_cores_with_learner(ctx.cfg, index):
        os.nice(nice)  # before the engine starts: its processes inherit it
        log.info("sharing CPU cores with the learner: niceness %d", nice)
    engine = await start_and_join(ctx, index, role)
    if engine is None:
        return  # the run stopped before the learner rebuilt the group for this process
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ctx.endpoints.model_path)
        scorer = make_scorer(ctx, index)
        teachers = make_teachers(ctx)
        try:
            await Generator(ctx, index, engine, tokenizer, scorer, teachers).run()
        finally:
            scorer.close()
            if teachers is not None:
                teachers.close()
    finally:
        live = descendants_cpu()  # the engine's processes, which shutdown does not wait for
        try:
            await engine.leave_weight_sync()
        finally:
            engine.shutdown()
            mark_cpu(ctx.path, role, live)
