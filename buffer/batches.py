"""A step's batch as the learner receives it: one ``Batch`` message for every rank.

The step's groups were consumed in issue order, filtered for staleness and split over the
ranks by buffer/ledger.py (``StepBatch``, ``shard_samples``); here its samples are laid
out rank by rank (``shard_sizes``) in sample-major arrays, concatenated over tokens.
Encoded once per step: every rank is sent the same message.
"""

from __future__ import annotations

import numpy as np

from buffer.ledger import StepBatch
from verl_async import protocol as P


def encode_step(step: StepBatch, num_sources: int, **meters: float) -> tuple[P.Batch, P.Frames]:
    """The ``Batch`` of ``step`` and its frames; ``meters`` are the buffer's gauges it
    carries (buffer_size, gen_tokens_per_s, gen_blocked_s, gen_idle_s, prompts_skipped)."""
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
        wait_s=0.0,
        **meters,
    )
    return body, frames
