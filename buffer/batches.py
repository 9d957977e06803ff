"""A step's batch as the learner receives it: one ``Batch`` message for every rank.

The step's groups are consumed from the ledger in issue order (buffer/ledger.py), checked
for staleness (``filter_stale``) and split over the ranks by tokens (``shard_samples``);
its samples are laid out rank by rank (``shard_sizes``) in sample-major arrays,
concatenated over tokens. Encoded once per step: every rank is sent the same message. It
names the groups dynamic sampling dropped between the step's groups (buffer/filtering.py),
for the audit trail. The multi-turn fields (loss mask, turn rewards, episode stats) travel
only in a step that holds a multi-turn sample.
"""

from __future__ import annotations

import logging

import numpy as np

from buffer.ledger import LedgerError, PromptLedger, StepBatch, StoredGroup
from verl_async import protocol as P
from verl_async.staleness import check_sample

log = logging.getLogger("verl_async.buffer")


class StepBatches:
    """The steps handed out to the learner ranks, by step number.

    A step is consumed from the ledger when its first rank asks for it (once every group of
    it has returned, and only after the step before it), checked for staleness against the
    learner's version, split over the ranks, and kept for the other ranks and for
    checkpoint cuts a few steps more.
    """

    # Step batches kept behind the newest one asked for: a checkpoint at step s stores the
    # groups of steps >= s already handed out. A rank's prefetcher runs up to two steps
    # ahead of the step it trains, and with several ranks one of them may be one step
    # further than the rank 0 taking the checkpoint.
    KEEP_STEPS_BEHIND = 3

    def __init__(self, ledger: PromptLedger, max_staleness: int) -> None:
        self.ledger = ledger
        self.max_staleness = max_staleness
        self.steps: dict[int, StepBatch] = {}
        self.dropped_stale_total = 0  # samples the batch-time staleness check removed

    def get(self, req: P.GetBatch) -> StepBatch | None:
        """Step ``req.step``, consumed now if it is complete and next; None if not yet."""
        step = self.steps.get(req.step)
        if step is not None:
            return step
        lg = self.ledger
        if req.step < lg.consumed_steps:
            raise LedgerError(f"step {req.step} was handed out already and is not held any more")
        # A later step waits for the one before it: steps are consumed in order.
        if req.step > lg.consumed_steps or lg.missing_for(req.step):
            return None
        groups, filtered, past_bound = lg.consume_step(req.step)
        kept, dropped = filter_stale(groups, req.learner_version, self.max_staleness)
        if dropped:
            log.error(
                "dropped %d stale samples at step %d: staleness control is broken",
                dropped,
                req.step,
            )
        self.dropped_stale_total += dropped
        step = StepBatch(
            req.step,
            kept,
            shard_samples(kept, req.world_size),
            dropped,
            groups,
            filtered=[(k, lg.issued_prompt(k)[0]) for k in filtered],
            past_bound=past_bound,
            filtered_total=lg.start - lg.consumed_steps * lg.admission.groups_per_step,
            past_bound_total=lg.past_bound_total,
        )
        self.steps[req.step] = step
        for old in [s for s in self.steps if s < req.step - self.KEEP_STEPS_BEHIND]:
            del self.steps[old]
        return step


def step_message(step: StepBatch, rank: int, num_sources: int, **counts: int):
    """The whole step for ``rank``, samples ordered rank by rank (``shard_sizes``); encoded
    once, so every rank receives the same message."""
    if len(step.shards) <= rank:
        raise ValueError(f"rank {rank} asked for step {step.step} cut for {len(step.shards)} ranks")
    if step.encoded is None:
        step.encoded = encode_step(step, num_sources, **counts)
    return step.encoded


def encode_step(step: StepBatch, num_sources: int, **counts: int) -> tuple[P.Batch, P.Frames]:
    """The ``Batch`` of ``step`` and its frames; ``counts`` are the buffer's data counts it
    carries (buffer_size, prompts_skipped). No clocks: those are ``Stats``'."""
    groups = step.groups
    samples = [(groups[gi], i) for shard in step.shards for gi, i in shard]
    frames = P.Frames()
    cat = lambda arrays, dt: np.concatenate(arrays, dtype=dt) if arrays else np.zeros(0, dt)  # noqa: E731
    body = P.Batch(
        step=step.step,
        group_ids=[g.group_id for g in groups],
        group_prompts=[g.prompt_id for g in groups],
        group_generators=[g.generator_id for g in groups],
        sample_group=[g.group_id for g, _ in samples],
        sample_index=[i for _, i in samples],
        shard_sizes=[len(shard) for shard in step.shards],
        prompt_lengths=[len(g.prompt_ids) for g, _ in samples],
        response_lengths=[len(g.responses[i]) for g, i in samples],
        scores=[g.scores[i] for g, i in samples],
        failed=[sum(col) for col in zip(*(g.failed for g in groups), strict=True)]
        if groups
        else [0] * num_sources,
        data_sources=[g.data_source for g in groups],
        prompt_ids=frames.add(cat([g.prompt_ids for g, _ in samples], np.int32)),
        response_ids=frames.add(cat([g.responses[i] for g, i in samples], np.int32)),
        behav_logprobs=frames.add(cat([g.behav_logprobs[i] for g, i in samples], np.float32)),
        token_versions=frames.add(cat([g.token_versions[i] for g, i in samples], np.int32)),
        dropped_stale=step.dropped_stale,
        filtered_groups=[k for k, _ in step.filtered],
        filtered_prompts=[p for _, p in step.filtered],
        filtered_total=step.filtered_total,
        past_bound=step.past_bound,
        past_bound_total=step.past_bound_total,
        **_optional_fields(samples, frames),
        **counts,
    )
    return body, frames


def _optional_fields(samples: list[tuple[StoredGroup, int]], frames: P.Frames) -> dict:
    """``Batch.loss_mask``, ``turn_rewards``, ``episodes`` and ``teacher_logprobs`` of
    ``samples``, each present only when some sample has it: a step of single-turn samples
    sends none of the first three, a run without teacher processes not the last."""

    def column(attr: str, fill, dtype: type) -> P.TensorRef | None:
        """Per-sample arrays ``attr`` concatenated; ``fill`` stands in for samples without."""
        if all(getattr(g, attr) is None for g, _ in samples):
            return None
        parts = [
            fill(len(g.responses[i]), dtype) if getattr(g, attr) is None else getattr(g, attr)[i]
            for g, i in samples
        ]
        return frames.add(np.concatenate(parts, dtype=dtype))

    multiturn = any(g.episodes for g, _ in samples)
    return {
        "loss_mask": column("loss_masks", np.ones, np.uint8),  # single-turn: all sampled
        "turn_rewards": column("turn_rewards", np.zeros, np.float32),
        "teacher_logprobs": column("teacher_logprobs", np.zeros, np.float32),
        "episodes": [g.episodes[i] if g.episodes else None for g, i in samples]
        if multiturn
        else [],
    }


# ----------------------------------------------------------------------------- staleness, shards


def filter_stale(
    groups: list[StoredGroup], learner_version: int, max_staleness: int
) -> tuple[list[StoredGroup], int]:
    """Safety net: drop samples older than eta; returns (kept groups, samples dropped)."""
    kept: list[StoredGroup] = []
    dropped = 0
    for g in groups:
        keep = [
            i
            for i in range(len(g.responses))
            if check_sample(
                learner_version,
                int(g.sampled_versions(i).min(initial=learner_version)),
                max_staleness,
            )
        ]
        dropped += len(g.responses) - len(keep)
        if keep:
            kept.append(g.select(keep))
    return kept, dropped


def shard_samples(groups: list[StoredGroup], world_size: int) -> list[list[tuple[int, int]]]:
    """Token-balanced split of the step's samples over ``world_size`` ranks.

    Longest-processing-time greedy over samples (prompt + response tokens): the heaviest
    sample first onto the lightest rank (ties: fewer samples, then lower rank). The token
    loads of any two ranks then differ by at most one sample's tokens. Groups may span
    ranks: advantages are computed over the whole step on every rank. Each shard lists
    (position in ``groups``, sample index) in batch order.
    """
    sizes = [
        ((gi, i), len(g.prompt_ids) + len(r))
        for gi, g in enumerate(groups)
        for i, r in enumerate(g.responses)
    ]
    shards: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for key, tokens in sorted(sizes, key=lambda s: s[1], reverse=True):
        r = min(range(world_size), key=lambda k: (load[k], len(shards[k]), k))
        shards[r].append(key)
        load[r] += tokens
    return [sorted(shard) for shard in shards]
