"""Learner process (one Accelerate job): the RL loop, one short named step at a time.

    restore (when resuming) -> republish the restored weights
    for step s:  collect -> compute_advantages -> update -> publish_weights
                 -> checkpoint (every checkpoint.every_steps) -> log_metrics

The learner version at step s is s: weights are published after every step, so the
batch of step s is checked against version s for staleness (verl_async/staleness.py).
Rank 0 owns the weight-sync group; every rank takes part in gathering full tensors
(FSDP2 DTensors) before rank 0 broadcasts, and gathers never interleave with it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from learners import checkpointing
from learners.advantages import Advantages, estimate, kl_controller
from learners.batching import Prefetcher, TrainBatch
from learners.critic import (
    CriticStats,
    critic_update,
    critic_values,
    reference_logprobs,
)
from learners.evaluation import EvalTracker
from learners.publish import BackgroundBroadcast, full_state_dict
from learners.step_metrics import algo_metrics, step_row
from learners.update import StepStats, policy_update, prox_pass
from verl_async import protocol as P
from verl_async.metrics import MetricsWriter
from verl_async.rewards.aggregate import RunningStats, combine, summarize
from verl_async.runtime import RunContext
from verl_async.transport import BufferClient
from verl_async.weight_sync import (
    SyncGroup,
    pack_weights,
    param_specs,
    send_weights,
)

log = logging.getLogger("verl_async.learner")

ALTERNATE_ENV = "VERL_ASYNC_BENCH_CKPT_ALTERNATE"


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
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.acc = accelerator
        self.model = model
        # unwrapped once: accelerate's unwrap_model probes for installed packages per call
        self.raw_model = accelerator.unwrap_model(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.group = group
        self.pad_id = pad_id
        self.critic = critic  # algo.adv_estimator: gae
        self.raw_critic = accelerator.unwrap_model(critic) if critic is not None else None
        self.critic_optimizer = critic_optimizer
        self.reference = reference  # algo.kl.in_reward or algo.kl.loss_coef > 0
        self.kl_ctrl = kl_controller(self.cfg.algo.kl)  # checkpointed
        self.algo = msgspec.structs.replace(  # the divisor of seq-mean-token-sum-norm resolved
            self.cfg.algo,
            loss_scale_factor=self.cfg.algo.loss_scale_factor or self.cfg.generators.max_new_tokens,
        )
        self.version = 0
        self.steps_done = 0
        self.broadcast = (  # None: no group, or broadcasts inside the step
            BackgroundBroadcast(group, self.cfg.weights.timeout_s)
            if group is not None and self.cfg.weights.overlap
            else None
        )
        self.client = BufferClient(ctx.endpoints.buffer, self.cfg.buffer.request_timeout_s)
        main = accelerator.is_main_process
        self.metrics = MetricsWriter(ctx.path) if main else None
        self.trail = open(ctx.path / "trained.jsonl", "a", buffering=1) if main else None  # noqa: SIM115 (closed in finish())
        self.t_start = time.monotonic()
        self.gen_clock = (0.0, 0.0)  # (blocked, idle) generator seconds at the previous batch
        # Running statistics of each reward source (``normalize: running``); checkpointed.
        self.running = {src.name: RunningStats() for src in self.cfg.rewards.sources}
        self.evals = EvalTracker(self.cfg, self.client, ctx.path) if main else None
        ck = self.cfg.checkpoint
        self.checkpointer = (
            checkpointing.Checkpointer(
                ctx.path, ck.keep_last, ck.write_timeout_s, {"model_path": ctx.endpoints.model_path}
            )
            if main and ck.every_steps
            else None
        )
        self.checkpoint_wait_s = 0.0  # of the last checkpoint: waiting for a staging slot
        # Benchmark only (benchmarks/checkpoint.py --alternate B): checkpoint only in every
        # other block of B steps, so one run measures steps with and without checkpoints.
        self.alternate_block = int(os.environ.get(ALTERNATE_ENV, "0"))

    def train(self) -> None:
        resumed = self.restore()
        if resumed:
            self.publish_weights(new_version=False)  # before anyone waits for a rollout
        steps = range(self.steps_done, self.cfg.trainer.total_steps)
        prefill_s = None if resumed else self.wait_for_prefill()
        batches = self.open_prefetcher(steps)
        self.maybe_evaluate()  # the weights before any (further) training, all of it at
        if self.evals is not None:  # this version: the baseline every later round is read against
            self.evals.finish(self.cfg.eval.timeout_s)
        try:
            for step in steps:
                t0 = time.monotonic()
                batch = self.collect(batches)
                advantages = self.compute_advantages(batch)
                stats, critic_stats = self.update(batch, advantages)
                sync_s = self.publish_weights()
                self.steps_done = step + 1
                self.record_trail(step, batch)
                self.maybe_evaluate()
                ckpt_s = self.checkpoint()
                step_s = time.monotonic() - t0
                self.log_metrics(
                    step,
                    batch,
                    (stats, critic_stats, advantages),
                    sync_s,
                    step_s,
                    prefill_s,
                    ckpt_s,
                )
                prefill_s = None
        except KeyboardInterrupt:  # SIGTERM from the launcher (Ctrl-C) lands here too
            log.warning("interrupted after %d steps", self.steps_done)
            if self.checkpointer is not None:
                self.checkpointer.close(grace_s=self.cfg.checkpoint.write_timeout_s)
            raise
        self.finish()

    # ------------------------------------------------------------------ steps

    def wait_for_prefill(self) -> float | None:
        """``trainer.prefill_steps`` > 0: wait until the buffer holds that many steps of groups.

        Returns the seconds the fill took (generation alone, the learner idle), or None.
        """
        want = self.cfg.trainer.prefill_steps * self.cfg.learner.groups_per_step
        if want == 0:
            return None
        t0 = time.monotonic()
        deadline = t0 + self.cfg.weights.join_timeout_s
        while (returned := self.client.request(P.GetStats())[0].returned) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"buffer pre-fill stuck at {returned}/{want} groups")
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        log.info("buffer pre-filled with %d groups in %.2fs", want, seconds)
        self.t_start = time.monotonic()
        return seconds

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
            self.acc.process_index,
            self.acc.num_processes,
            self.pad_id,
            pin=torch.cuda.is_available(),
            deadline_s=cfg.weights.join_timeout_s,
        )

    def collect(self, batches: Prefetcher) -> TrainBatch:
        return batches.get().to(self.acc.device)

    def compute_advantages(self, batch: TrainBatch) -> Advantages:
        """Combine the reward sources into one reward per sample, then the estimator's
        per-token advantages, with what it needs first: reference log-probs, pi_prox for
        a KL in the reward, the critic's values (learners/advantages.py)."""
        group_index = batch.group_index.cpu()
        rewards = combine(batch.scores, group_index.numpy(), self.cfg.rewards.sources, self.running)
        batch.rewards = torch.from_numpy(np.asarray(rewards, np.float32))  # [N]
        algo, temperature = self.algo, self.cfg.generators.temperature
        if self.reference is not None:
            batch.logp_ref = reference_logprobs(self.reference, batch, temperature)
        if algo.kl.in_reward:  # the KL of the policy the update starts from
            batch.logp_prox, _ = prox_pass(self.model, batch, temperature)
        if self.critic is not None:
            with torch.no_grad():
                batch.values = critic_values(self.critic, batch.input_ids, batch.attention_mask)
        device = self.acc.device
        return estimate(
            algo,
            batch.rewards.to(device),
            group_index.to(device),
            batch.loss_mask,
            batch.values,
            batch.logp_prox,
            batch.logp_ref,
            self.kl_ctrl,
        )

    def update(self, batch: TrainBatch, adv: Advantages) -> tuple[StepStats, CriticStats | None]:
        """The critic's steps (gae), then the actor's; during ``critic.warmup_steps`` the
        actor's losses are computed but its weights stay."""
        cfg, critic_stats = self.cfg, None
        if self.critic is not None:
            self.critic.train()
            critic_stats = critic_update(
                self.critic,
                self.critic_optimizer,
                batch,
                batch.values,
                adv.returns,
                self.algo,
                cfg.critic.cliprange_value,
                backward=self.acc.backward,
                clip_grad=lambda: self.acc.clip_grad_norm_(
                    self.critic.parameters(), cfg.critic.grad_clip
                ),
            )
        warming = self.critic is not None and self.steps_done < cfg.critic.warmup_steps
        self.model.train()
        stats = policy_update(
            self.model,
            self.optimizer,
            batch,
            adv.advantages,
            self.algo,
            backward=self.acc.backward,
            clip_grad=lambda: self.acc.clip_grad_norm_(
                self.model.parameters(), cfg.learner.grad_clip
            ),
            temperature=cfg.generators.temperature,
            logp_prox=batch.logp_prox,
            logp_ref=batch.logp_ref,
            step=not warming,
        )
        if self.scheduler is not None and not warming:
            self.scheduler.step()
        return stats, critic_stats

    def publish_weights(self, new_version: bool = True) -> float:
        """Gather full tensors on every rank, then rank 0 announces and broadcasts them.

        ``new_version=False`` re-sends the current version (after a restore: generators
        start from the initial weights and must load the checkpoint's).
        """
        t0 = time.monotonic()
        tensors = full_state_dict(self.raw_model)
        self.version += int(new_version)
        if self.group is not None:
            specs = param_specs(tensors.items())
            bucket = self.cfg.weights.bucket_mb << 20
            update = P.WeightUpdate(version=self.version, params=specs, bucket_bytes=bucket)
            if self.broadcast is not None:
                self.broadcast.wait()  # the previous version has reached every generator
                buffers = pack_weights(tensors, specs, bucket)
                self.client.request(P.AnnounceWeights(update=update))
                self.broadcast.start(buffers)
            else:
                self.client.request(P.AnnounceWeights(update=update))
                send_weights(self.group, tensors, specs, bucket)
        return time.monotonic() - t0

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> float | None:
        """At the barrier after every ``checkpoint.every_steps``-th step: snapshot learner and
        buffer state into host memory and hand it to the background writer. Returns the
        seconds the step spent on it (None when no checkpoint was due)."""
        every = self.cfg.checkpoint.every_steps
        if self.checkpointer is None or self.steps_done % every:
            return None
        if self.alternate_block and (self.steps_done // self.alternate_block) % 2 == 0:
            return None  # an "off" block of the benchmark's alternation
        t0 = time.monotonic()
        stager = self.checkpointer.stager()  # waits only if both staging slots are busy
        self.checkpoint_wait_s = time.monotonic() - t0
        step = self.steps_done
        # The buffer takes its cut (of state as of ``step``, whenever it runs) while the
        # learner stages its own; the reply must be in before the writer may fetch the cut.
        cut = self.client.send(P.SnapshotBuffer(step=step, version=self.version))
        info = {
            "wall_s": time.monotonic() - self.t_start,
            "gen_blocked_s": self.gen_clock[0],
            "gen_idle_s": self.gen_clock[1],
            "reward_running": {k: v.state_dict() for k, v in self.running.items()},
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }
        snap = checkpointing.take_snapshot(
            stager,
            step,
            self.version,
            full_state_dict(self.raw_model),
            self.optimizer.state_dict(),
            self.scheduler.state_dict() if self.scheduler else None,
            info,
            lambda: fetch_buffer_files(
                self.ctx.endpoints.buffer, self.cfg.buffer.request_timeout_s, step
            ),
            critic=None
            if self.critic is None
            else (full_state_dict(self.raw_critic), self.critic_optimizer.state_dict()),
        )
        self.client.receive(cut)
        self.checkpointer.save(snap)
        return time.monotonic() - t0

    def restore(self) -> bool:
        """Load the checkpoint the launcher chose (``endpoints.resume_from``), if any."""
        if not self.ctx.endpoints.resume_from:
            return False
        ckpt = Path(self.ctx.endpoints.resume_from)
        critic = None if self.critic is None else (self.raw_critic, self.critic_optimizer)
        info = checkpointing.load(ckpt, self.raw_model, self.optimizer, self.scheduler, critic)
        self.steps_done = info["step"]
        self.version = info["version"]
        self.t_start = time.monotonic() - info["wall_s"]
        self.gen_clock = (info["gen_blocked_s"], info["gen_idle_s"])
        for name, state in info.get("reward_running", {}).items():
            if name in self.running:
                self.running[name].load_state_dict(state)
        if "kl_ctrl" in info:
            self.kl_ctrl.load_state_dict(info["kl_ctrl"])
        log.info("resumed from %s: step %d, version %d", ckpt.name, self.steps_done, self.version)
        return True

    def log_metrics(
        self,
        step: int,
        batch: TrainBatch,
        update: tuple[StepStats, CriticStats | None, Advantages],
        sync_s: float,
        step_s: float,
        prefill_s: float | None = None,
        checkpoint_s: float | None = None,
    ) -> None:
        if self.metrics is None:
            return
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
        )
        row.update(algo_metrics(batch, stats, critic_stats, adv, self.kl_ctrl))
        # Admission's hold on the generators since the previous batch (summed over generators).
        row["gen_blocked_s"] = round(batch.gen_blocked_s - self.gen_clock[0], 4)
        row["gen_idle_s"] = round(batch.gen_idle_s - self.gen_clock[1], 4)
        self.gen_clock = (batch.gen_blocked_s, batch.gen_idle_s)
        row["prompts_skipped"] = batch.prompts_skipped
        row.update(
            summarize(
                batch.scores,
                batch.rewards.numpy(),
                batch.failed,
                batch.sample_sources,
                self.cfg.rewards.sources,
            )
        )
        if self.broadcast is not None:
            row["weight_broadcast_s"] = round(self.broadcast.seconds, 4)  # last finished one
        if prefill_s is not None:
            row["prefill_s"] = round(prefill_s, 4)
        if checkpoint_s is not None:
            row["checkpoint_s"] = round(checkpoint_s, 4)
            row["checkpoint_wait_s"] = round(self.checkpoint_wait_s, 4)
            row["checkpoint_write_s"] = round(self.checkpointer.last_write_s, 4)  # last finished
            row["checkpoint_write_cpu_s"] = round(self.checkpointer.last_write_cpu_s, 4)
        if self.scheduler is not None:
            row["lr"] = self.scheduler.get_last_lr()[0]
        self.metrics.write(row)
        if (step + 1) % self.cfg.trainer.log_every == 0:
            log.info(
                "step %d reward %.3f staleness max %d",
                step,
                row["reward_mean"],
                row["staleness_max"],
            )

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
            "samples": batch.sample_digests,
        }
        self.trail.write(json.dumps(trail) + "\n")

    def finish(self) -> None:
        if self.broadcast is not None:
            self.broadcast.wait()
        if self.evals is not None:
            self.evals.finish(self.cfg.eval.timeout_s)  # the final weights' evaluation
        if self.checkpointer is not None:
            self.checkpointer.wait()  # the last checkpoint is committed before we say done
        if self.acc.is_main_process:
            self.client.request(P.Shutdown())
        if self.metrics is not None:
            self.metrics.close()
            self.trail.close()
        self.client.close()

    def close(self) -> None:
        """At exit, however the loop ended: stop the writer thread and shut the weight-sync
        group down while the interpreter is fully alive (not during its teardown)."""
        if self.checkpointer is not None:
            self.checkpointer.stop()
        if self.group is not None:
            try:
                self.group.close()
            except Exception as exc:  # a peer already gone; never mask the loop's own error
                log.warning("weight-sync group shutdown failed: %s", exc)


def fetch_buffer_files(endpoint: str, timeout_s: float, step: int) -> dict[str, memoryview]:
    """The buffer's files of the cut taken at ``step`` (on the checkpoint writer's thread,
    with a socket of its own: the buffer encodes them while training goes on), as views
    on the received frames: written and hashed from there without a copy."""
    client = BufferClient(endpoint, timeout_s)
    try:
        reply, frames = client.request(P.FetchSnapshot(step=step))
    finally:
        client.close()
    return {name: memoryview(P.tensor(ref, frames)) for name, ref in reply.files.items()}
