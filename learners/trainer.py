"""Learner process (one Accelerate job): the RL loop, one short named step at a time.

    restore (when resuming) -> republish the restored weights
    for step s:  collect -> score_teachers -> compute_advantages -> update -> publish_weights
                 -> checkpoint (every checkpoint.every_steps) -> log_metrics

The learner version at step s is s: weights are published after every step, so the
batch of step s is checked against version s for staleness (verl_async/staleness.py).
Rank 0 owns the weight-sync group; every rank takes part in gathering full tensors
(FSDP2 DTensors) before rank 0 broadcasts, and gathers never interleave with it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time

import msgspec
import numpy as np
import torch

from learners.advantages import (
    Advantages,
    SourceScores,
    episode_returns,
    episodes_of,
    estimate,
    kl_controller,
)
from learners.batching import Prefetcher, TrainBatch
from learners.checkpoints.manager import Checkpoints, buffer_fetch
from learners.checkpoints.state import LearnerState
from learners.critic import (
    CriticStats,
    critic_update,
    critic_values,
    reference_logprobs,
    value_fit,
)
from learners.distributed import DataParallel
from learners.evaluation import EvalTracker
from learners.finite import SkipLog, require_finite
from learners.logprobs import PassOptions
from learners.plan import Minibatch, plan_update
from learners.publish import WeightSync, gathered_buckets, wire_specs
from learners.step_metrics import (
    GeneratorTiming,
    algo_metrics,
    multiturn_metrics,
    note_new_graphs,
    step_row,
)
from learners.teacher import score_step
from learners.update import (
    StepPlan,
    StepStats,
    UpdateHooks,
    plan_step,
    policy_update,
    prox_pass,
)
from learners.whole_step_correction import metric_names
from verl_async import lora
from verl_async import protocol as P
from verl_async.auth import LEARNER, client_credentials
from verl_async.checkpoint import in_run
from verl_async.metrics import MetricsWriter
from verl_async.rewards.aggregate import RunningStats, combine, summarize
from verl_async.runtime import RunContext, mark
from verl_async.transport import BufferClient
from verl_async.weight_sync import Bucket, SyncGroup, plan_buckets, without_tied

log = logging.getLogger("verl_async.learner")


class Learner:
    def __init__(
        self,
        ctx: RunContext,
        accelerator,
        model,
        optimizer,
        group: SyncGroup | None,
        pad_id: int,
        scheduler=None,
        critic=None,
        critic_optimizer=None,
        reference=None,
        teachers=None,
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.acc = accelerator
        self.dp = DataParallel.from_environment()
        self.model = model
        # unwrapped once: accelerate's unwrap_model probes for installed packages per call
        self.raw_model = accelerator.unwrap_model(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.pad_id = pad_id
        self.critic = critic  # algo.adv_estimator: gae
        self.raw_critic = accelerator.unwrap_model(critic) if critic is not None else None
        self.critic_optimizer = critic_optimizer
        self.reference = reference  # algo.kl.in_reward or algo.kl.loss_coef > 0
        self.kl_ctrl = kl_controller(self.cfg.algo.kl)  # checkpointed
        self.teachers = teachers  # distillation.enabled (learners/teacher.py)
        self.distill_row: dict = {}  # the last step's distill/* metrics
        self.actor_hooks = self.update_hooks(model, self.cfg.learner.grad_clip)
        self.critic_hooks = (
            None if critic is None else self.update_hooks(critic, self.cfg.critic.grad_clip)
        )
        self.algo = msgspec.structs.replace(  # the divisor of seq-mean-token-sum-norm resolved
            self.cfg.algo,
            loss_scale_factor=self.cfg.algo.loss_scale_factor or longest_response(self.cfg),
        )
        self.version = 0
        self.graphs = 0  # torch.compile's graphs so far (learner.compile)
        self.publish_bytes = 0  # what the last weight update sent (the adapter alone with LoRA)
        self.steps_done = 0
        self.curve = client_credentials(self.cfg, ctx.run_dir, LEARNER)  # every buffer socket's
        self.client = BufferClient(
            ctx.endpoints.buffer, self.cfg.buffer.request_timeout_s, self.curve
        )
        # rank 0: announce, broadcast, rebuild the group after a generator restart
        self.sync = None if group is None else WeightSync(group, self.client, self.cfg)
        main = accelerator.is_main_process
        self.metrics = MetricsWriter(ctx.path, ctx.cfg) if main else None
        self.trail = open(ctx.path / "trained.jsonl", "a", buffering=1) if main else None  # noqa: SIM115 (closed in finish())
        self.t_start = time.monotonic()
        self.gen_timing = GeneratorTiming()  # not checkpointed: the buffer's clocks restart too
        # Running statistics of each reward source (``normalize: running``); checkpointed.
        self.running = {src.name: RunningStats() for src in self.cfg.rewards.sources}
        self.evals = EvalTracker(self.cfg, self.client, ctx.path) if main else None
        self.skips = SkipLog() if main else None  # the first skipped step of each kind
        critic_state = None if critic is None else (self.raw_critic, critic_optimizer)
        self.checkpoints = Checkpoints(
            ctx.path,
            self.cfg.checkpoint,
            LearnerState(self.raw_model, optimizer, scheduler, critic_state),
            self.dp,
            main,
            self.client,
            buffer_fetch(ctx.endpoints.buffer, self.cfg.buffer.request_timeout_s, self.curve),
            meta={"model_path": ctx.endpoints.model_path},
        )

    def train(self) -> None:
        resumed = self.restore()
        if resumed:
            self.publish_weights(new_version=False)  # before anyone waits for a rollout
        steps = range(self.steps_done, self.cfg.trainer.total_steps)
        batches = self.open_prefetcher(steps)
        if self.sync is not None:  # while the first batch is sampled, not in the first step
            self.sync.reserve(self.published()[2], self.acc.device)
        # The weights before any (further) training: the baseline every later round is read
        # against. Training starts at once; generators keep this version loaded until they
        # have sampled the round (Generator.finish_eval_first).
        self.maybe_evaluate()
        try:
            with collector_between_steps() as between_steps:
                for step in steps:
                    self.step(step, steps.start, batches)
                    between_steps()
            batches.close()
        except KeyboardInterrupt:  # SIGTERM from the launcher (Ctrl-C) lands here too
            batches.close()
            log.warning("interrupted after %d steps", self.steps_done)
            self.checkpoints.interrupted()
            raise
        self.finish()

    def step(self, step: int, first: int, batches: Prefetcher) -> None:
        """One step of the loop (``first``: the first step of this launch)."""
        t0 = time.monotonic()
        batch, local = self.collect(batches)
        self.mark_start_up(step == first, "first batch")
        plan = self.plan(batch)
        self.score_teachers(batch, local)
        advantages = self.compute_advantages(batch, local)
        stats, critic_stats = self.update(batch, local, advantages, plan)
        sync_s = self.publish_weights()
        self.steps_done = step + 1
        self.record_trail(step, batch)
        self.maybe_evaluate()
        ckpt_s = self.checkpoint()
        step_s = time.monotonic() - t0
        if self.metrics is not None:  # rank 0
            update = (stats, critic_stats, advantages)
            row = self.metrics_row(step, batch, update, sync_s, step_s, ckpt_s)
            self.log_metrics(step, row)
        self.mark_start_up(step == first, "first step")

    def mark_start_up(self, first: bool, event: str) -> None:
        if first and self.metrics is not None:  # rank 0, first step of this launch
            mark(self.ctx.path, "learner", event)

    # ------------------------------------------------------------------ steps

    def maybe_evaluate(self) -> None:
        """Start an evaluation round when one is due; write the rounds that have finished."""
        if self.evals is not None:
            self.evals.maybe_start(self.steps_done, self.version)
            self.evals.poll()

    def open_prefetcher(self, steps: range) -> Prefetcher:
        cfg = self.cfg
        return Prefetcher(
            self.ctx.endpoints.buffer,
            cfg.buffer.request_timeout_s,
            steps,
            self.dp.rank,
            self.dp.world,
            self.pad_id,
            self.acc.device,
            deadline_s=cfg.weights.join_timeout_s,
            background=cfg.learner.prefetch,
            credentials=self.curve,
            on_wait=self.while_waiting,
            stats=self.metrics is not None,  # for the generator telemetry of the metrics line
        )

    def collect(self, batches: Prefetcher) -> tuple[TrainBatch, TrainBatch]:
        """The step's batch (every rank gets all of it) and this rank's rows of it."""
        batch = batches.get()
        return batch, self.dp.local(batch)

    def score_teachers(self, batch: TrainBatch, local: TrainBatch) -> None:
        """Distillation (learners/teacher.py): the teachers' log-probs of the step's sampled
        tokens, on this rank's rows, gathered (``batch.logp_teacher``); the update reads them."""
        if self.teachers is not None:
            self.distill_row = score_step(
                self.teachers, batch, local, self.dp, self.cfg.distillation
            )

    def plan(self, batch: TrainBatch) -> tuple[list[Minibatch], StepPlan]:
        """The update's minibatches (every rank's, learners/plan.py) and this rank's passes'
        shapes (``plan_step``), from the batch's host copy and before any of the step's
        work is queued on the device: the update then never waits for the device until
        it reads its metrics (learners/update.py), and the plan's few index tensors reach
        the device while it is idle."""
        host, dp = batch.host or batch, self.dp  # as it came, before its copy to the device
        plan = plan_update(
            host.loss_mask, host.attention_mask, batch.shard_sizes, dp.rank,
            self.algo.minibatches, self.cfg.learner.max_tokens_per_microbatch,
        )  # fmt: skip
        given = self.algo.kl.in_reward  # compute_advantages computes pi_prox
        device = batch.loss_mask.device
        return plan, plan_step(
            self.model, dp.local(host), plan, self.algo, self.cfg.learner, given, device
        )

    def compute_advantages(self, batch: TrainBatch, local: TrainBatch) -> Advantages:
        """Combine the reward sources into one outcome reward per sample, then the
        estimator's per-token advantages (with a multi-turn sample's turn rewards), with
        what it needs first: reference log-probs, pi_prox for a KL in the reward, the
        critic's values (learners/advantages.py). ``batch.rewards`` is each episode's
        whole return: the outcome reward plus its turn rewards.

        The model passes run on this rank's rows (``local``) and are gathered back, so
        rewards and advantages are computed over the whole step on every rank."""
        group_index = batch.group_index.cpu()
        episodes = episodes_of(group_index, batch.episodes)  # an episode counts once in its group
        first = None if episodes is None else episodes.first[episodes.of_sample].numpy()
        rewards_cfg = self.cfg.rewards.sources
        outcome = combine(batch.scores, group_index.numpy(), rewards_cfg, self.running, first)
        outcome = torch.from_numpy(np.asarray(outcome, np.float32))  # [N]
        batch.rewards = episode_returns(outcome, batch.turn_rewards)
        algo, temperature, dp = self.algo, self.cfg.generators.temperature, self.dp
        passes = PassOptions.of(self.cfg.learner)
        if self.reference is not None:
            local.logp_ref = reference_logprobs(self.reference, local, temperature, passes)
            batch.logp_ref = dp.gather_rows(local.logp_ref, batch)
        if algo.kl.in_reward:  # the KL of the policy the update starts from
            local.logp_prox, _ = prox_pass(self.model, local, temperature, options=passes)
            batch.logp_prox = dp.gather_rows(local.logp_prox, batch)
        if self.critic is not None:
            with torch.no_grad():
                local.values = critic_values(self.critic, local.input_ids, local.attention_mask)
            batch.values = dp.gather_rows(local.values, batch)
        device = self.acc.device
        # gdpo: each source's raw scores, not their sum
        sources = SourceScores.of(self.cfg, batch.scores) if algo.adv_estimator == "gdpo" else None
        return estimate(
            algo,
            outcome.to(device),
            group_index.to(device),
            batch.loss_mask,
            batch.values,
            batch.logp_prox,
            batch.logp_ref,
            self.kl_ctrl,
            batch.turn_rewards,
            sources,
            episodes,
        )

    def update(
        self, batch: TrainBatch, local: TrainBatch, adv: Advantages, planned: tuple
    ) -> tuple[StepStats, CriticStats | None]:
        """The critic's steps (gae), then the actor's, on this rank's rows as ``planned``
        (``plan``); during ``critic.warmup_steps`` the actor's losses are computed but its
        weights stay. Statistics are averaged over ranks."""
        cfg, critic_stats, dp = self.cfg, None, self.dp
        plan, step_plan = planned
        weight = float(dp.local(batch.host or batch).loss_mask.sum())  # read on the host
        if self.critic is not None:
            self.critic.train()
            critic_stats = critic_update(
                self.critic,
                self.critic_optimizer,
                local,
                local.values,
                dp.local_part(adv.returns, batch, local),
                self.algo,
                self.critic_hooks,
                cliprange_value=cfg.critic.cliprange_value,
                plan=plan,
            )
            critic_stats = dp.mean_stats(critic_stats, weight, sums=("vf_loss",))
            # Over the whole step, not averaged over ranks:
            critic_stats = value_fit(critic_stats, batch.values, adv.returns, batch.loss_mask)
        warming = self.critic is not None and self.steps_done < cfg.critic.warmup_steps
        self.model.train()
        stats = policy_update(  # local.logp_prox and local.logp_ref join in when computed
            self.model,
            self.optimizer,
            local,
            dp.local_part(adv.advantages, batch, local),
            self.algo,
            self.actor_hooks,
            plan=step_plan,
            version=self.version,
            step=not warming,
            temperature=cfg.generators.temperature,
            learner=cfg.learner,
            distill=cfg.distillation,
        )
        if cfg.learner.compile and self.acc.is_main_process:
            self.graphs = note_new_graphs(self.graphs, self.steps_done)
        if self.scheduler is not None and stats.optimizer_steps:  # none: warming up or skipped
            self.scheduler.step()
        if self.skips is not None:
            self.skips.report(self.steps_done, stats, critic_stats)
        corr, stats.rollout_corr = stats.rollout_corr, None
        stats = dp.mean_stats(stats, weight, sums=("loss", "pg_loss", "kl_loss", "distill_loss"))
        if corr is not None:  # verl's rollout_corr/* over every rank's rows
            names = metric_names(self.algo.rollout_correction.settings())
            stats.rollout_corr = dp.mean_metrics(corr, weight, names)
        return stats, critic_stats

    def update_hooks(self, model, max_norm: float) -> UpdateHooks:
        """This setup's backward, gradient clipping (``model``'s, to ``max_norm``) and
        collectives, for ``policy_update`` and ``critic_update``."""
        clip = lambda: self.clip_grad(model, max_norm)  # noqa: E731
        return UpdateHooks(self.acc.backward, clip, self.dp.any_rank, self.dp.all_sum)

    def clip_grad(self, model, max_norm: float) -> torch.Tensor:
        """Clip the gradient norm (over all ranks' shards under FSDP2); returns it, on the
        device (not read: ``step_unless_nonfinite`` decides there)."""
        if self.dp.world == 1:  # a DTensor too when one rank is sharded (cpu_offload)
            norm = self.acc.clip_grad_norm_(model.parameters(), max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def publish_weights(self, new_version: bool = True) -> float:
        """Gather full tensors bucket by bucket on every rank; rank 0 announces the version
        and broadcasts each bucket (gathers and broadcasts never run at the same time).

        ``new_version=False`` re-sends the current version (after a restore: generators
        start from the initial weights and must load the checkpoint's). Weights that are
        not finite are never sent: every rank raises ``NonFiniteWeights`` instead.
        """
        t0 = time.monotonic()
        state, specs, plan = self.published()
        version = self.version + int(new_version)
        require_finite(f"publish weights version {version}", state.items(), self.dp.any_rank)
        self.version = version
        self.publish_bytes = sum(b.nbytes for b in plan)  # whole, in the generators' dtype
        bucket = self.cfg.weights.bucket_mb << 20
        buckets = gathered_buckets(state, plan, self.acc.device)
        update = P.WeightUpdate(version=self.version, params=specs, bucket_bytes=bucket)
        if self.sync is None:  # other ranks: take part in the gathers
            for _ in buckets:
                pass
        else:
            self.sync.publish(update, buckets)
        return time.monotonic() - t0

    def published(self) -> tuple[dict[str, torch.Tensor], list[P.ParamSpec], list[Bucket]]:
        """What a publish sends: the state (DTensors under FSDP2; a LoRA run's adapter
        alone, the generators hold the base), its specs and its buckets."""
        state = without_tied(self.raw_model, self.raw_model.state_dict())
        if lora.enabled(self.cfg):
            state = lora.adapter_state(state)
        specs = wire_specs(state, self.cfg)
        return state, specs, plan_buckets(specs, self.cfg.weights.bucket_mb << 20)

    def while_waiting(self) -> None:
        """Called about once a second while the step's batch is not in. With one learner
        rank, a generator restarted meanwhile gets the current weights now: when every
        generator had died, no batch would come until it did (with several ranks the
        gathers need every rank, so the group is rebuilt at the next publish)."""
        if self.sync is not None and self.dp.world == 1 and self.sync.rebuild_wanted():
            self.publish_weights(new_version=False)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> float | None:
        """At the barrier after every ``checkpoint.every_steps``-th step: snapshot learner and
        buffer state into host memory and hand it to the background writers
        (learners/checkpoints/). Returns the seconds the step spent on it (None when no
        checkpoint was due). A state that is not finite is never written: every rank
        raises ``NonFiniteWeights`` instead."""
        if not self.checkpoints.due(self.steps_done):
            return None
        return self.checkpoints.save(self.steps_done, self.version, self.checkpoint_info)

    def checkpoint_info(self) -> dict:
        """Counters and running state of the JSON part of a checkpoint."""
        return {
            "wall_s": time.monotonic() - self.t_start,
            "reward_running": {k: v.state_dict() for k, v in self.running.items()},
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }

    def restore(self) -> bool:
        """Load the checkpoint the launcher chose (``endpoints.resume_from``), if any (every
        rank reads it and keeps its own shards). It must be one of this run's checkpoints:
        a role started with ``--buffer`` took the path from the buffer."""
        if not self.ctx.endpoints.resume_from:
            return False
        ckpt = in_run(self.ctx.path, self.ctx.endpoints.resume_from)
        info = self.checkpoints.load(ckpt)
        self.steps_done = info["step"]
        self.version = info["version"]
        self.t_start = time.monotonic() - info["wall_s"]
        for name, state in info.get("reward_running", {}).items():
            if name in self.running:
                self.running[name].load_state_dict(state)
        if "kl_ctrl" in info:
            self.kl_ctrl.load_state_dict(info["kl_ctrl"])
        if self.acc.is_main_process:
            log.info(
                "resumed from %s: step %d, version %d", ckpt.name, self.steps_done, self.version
            )
        return True

    def log_metrics(self, step: int, row: dict) -> None:
        """Write the step's row (``metrics_row``) and, every ``trainer.log_every``, a line."""
        self.metrics.write(row)
        if (step + 1) % self.cfg.trainer.log_every == 0:
            log.info(
                "step %d reward %.3f staleness max %d",
                step,
                row["reward_mean"],
                row["staleness_max"],
            )

    def metrics_row(
        self,
        step: int,
        batch: TrainBatch,
        update: tuple[StepStats, CriticStats | None, Advantages],
        sync_s: float,
        step_s: float,
        checkpoint_s: float | None,
    ) -> dict:
        """The step's line of metrics.jsonl (rank 0)."""
        stats, critic_stats, adv = update
        row = step_row(
            step,
            self.version,
            self.cfg.staleness.max,
            batch,
            stats,
            sync_s,
            step_s,
            time.monotonic() - self.t_start,
            self.publish_bytes,
        )
        row.update(algo_metrics(batch, stats, critic_stats, adv, self.kl_ctrl))
        row.update(multiturn_metrics(batch))
        if stats.distill_loss is not None:
            row.update(self.distill_row, **{"distill/loss": stats.distill_loss})
        row.update(self.gen_timing.row(batch.buffer_stats))  # the generators since the last batch
        row["prompts_skipped"] = batch.prompts_skipped
        if self.cfg.algo.filter_groups.enable and batch.filtered is not None:
            row.update(batch.filtered.metrics())
        row.update(
            summarize(
                batch.scores,
                batch.rewards.numpy(),
                batch.failed,
                batch.sample_sources,
                self.cfg.rewards.sources,
            )
        )
        if self.sync is not None:
            row.update(self.sync.metrics())
        if checkpoint_s is not None:
            row.update(self.checkpoints.metrics(checkpoint_s))
        if self.scheduler is not None:
            row["lr"] = self.scheduler.get_last_lr()[0]
        return row

    def record_trail(self, step: int, batch: TrainBatch) -> None:
        """The audit trail: which groups (prompt index) and samples (digest) a step used.

        Written before the step's checkpoint snapshot, so a committed checkpoint of step
        count s always has the trail lines of steps < s on disk."""
        if self.trail is None:
            return
        trail = {
            "step": step,
            "version": self.version,
            "groups": [list(p) for p in zip(batch.group_ids, batch.group_prompts, strict=True)],
            "generators": batch.group_generators,
            "samples": batch.sample_digests,
        }
        if batch.filtered is not None and batch.filtered.groups:
            trail["filtered"] = batch.filtered.groups  # dropped by dynamic sampling: done
        self.trail.write(json.dumps(trail) + "\n")

    def finish(self) -> None:
        if self.sync is not None:
            self.sync.finish()
        if self.evals is not None:
            self.evals.finish(self.cfg.eval.timeout_s)  # the final weights' evaluation
        self.checkpoints.finish()  # the last checkpoint is committed before we say done
        if self.acc.is_main_process:
            self.client.request(P.Shutdown())
        if self.metrics is not None:
            self.metrics.close()
            self.trail.close()
        self.client.close()

    def close(self) -> None:
        """At exit, however the loop ended: stop the writer thread and shut the weight-sync
        group down while the interpreter is fully alive (not during its teardown)."""
        self.checkpoints.close()
        if self.sync is not None:
            try:
                self.sync.close()
            except Exception as exc:  # a peer already gone; never mask the loop's own error
                log.warning("weight-sync group shutdown failed: %s", exc)


@contextlib.contextmanager
def collector_between_steps():
    """Python's garbage collector kept out of the steps: what exists now (model,
    optimizer, clients: long-lived) is frozen out of every later collection, automatic
    collection is off, and the caller runs the young generations' collection (what it is
    handed) between steps, where its pause delays no kernel launch. A collection that
    starts inside a step stalls the host while the device's queue drains, and a full one
    walks every object the model and its libraries hold. Restored on exit."""
    gc.collect()
    gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield lambda: gc.collect(1)
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()


def longest_response(cfg) -> int:
    """The most tokens a response may hold: one turn, or a whole episode when the run has
    environments (the default divisor of ``seq-mean-token-sum-norm``)."""
    if cfg.multiturn.has_episodes:
        return max(cfg.generators.max_new_tokens, cfg.multiturn.max_episode_tokens)
    return cfg.generators.max_new_tokens
