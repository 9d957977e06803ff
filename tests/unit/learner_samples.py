"""A step's ``Batch`` message built sample by sample, collated as the learner receives it
(for the learner's tests of empty samples and multi-sample episodes)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import msgspec
import numpy as np
import torch

from learners.batching import TrainBatch, collate
from verl_async import protocol as P
from verl_async.schema import RunConfig


@dataclass
class Sample:
    group: int
    reward: float
    # The response's loss mask: 1 for a sampled token, 0 for an observation token. [] is a
    # response of length 0 (an agent episode that never reached the model); all zeros, a
    # response with no sampled token.
    sampled: tuple[int, ...] = (1, 1)
    episode: int | None = -1  # EpisodeStats.episode; None: a single-turn sample
    version: int = 0  # the weights version of its tokens
    turn_rewards: tuple[float, ...] | None = None  # one per response token


def message(samples: list[Sample], step: int = 0, seed: int = 0):
    """(``Batch``, frames) of ``samples``, each with a 3-token prompt. Sample i's tokens
    and log-probs are drawn from its own seed (``seed``, i): the same whatever the others."""
    rngs = [np.random.default_rng((seed, i)) for i in range(len(samples))]
    prompts, ids, behav = [], [], []
    for rng, s in zip(rngs, samples, strict=True):
        prompts.append(rng.integers(3, 14, 3, dtype=np.int32))
        ids.append(rng.integers(3, 14, len(s.sampled), dtype=np.int32))
        behav.append(rng.uniform(-3, -1, len(s.sampled)).astype(np.float32))
    frames = P.Frames()
    groups = sorted({s.group for s in samples})
    lengths = [len(s.sampled) for s in samples]
    turn = None
    if any(s.turn_rewards is not None for s in samples):
        turn = [r for s in samples for r in (s.turn_rewards or (0.0,) * len(s.sampled))]
        turn = frames.add(np.array(turn, np.float32))
    multiturn = any(s.episode is not None for s in samples)
    body = P.Batch(
        step=step,
        group_ids=groups,
        sample_group=[s.group for s in samples],
        prompt_lengths=[3] * len(samples),
        response_lengths=lengths,
        prompt_ids=frames.add(np.concatenate(prompts)),
        response_ids=frames.add(np.concatenate([np.zeros(0, np.int32), *ids])),
        behav_logprobs=frames.add(np.concatenate([np.zeros(0, np.float32), *behav])),
        token_versions=frames.add(
            np.array([s.version for s in samples for _ in s.sampled], np.int32)
        ),
        scores=[[s.reward] for s in samples],
        failed=[0],
        data_sources=["default"] * len(groups),
        dropped_stale=0,
        buffer_size=0,
        loss_mask=frames.add(np.array([m for s in samples for m in s.sampled], np.uint8)),
        turn_rewards=turn,
        episodes=[_stats(s) for s in samples] if multiturn else [],
    )
    return body, [bytes(b) for b in frames.buffers]


def _stats(s: Sample) -> P.EpisodeStats | None:
    if s.episode is None:
        return None
    return P.EpisodeStats(
        turns=1, tool_calls=0, tool_errors=0, tool_timeouts=0, env_seconds=0.0,
        observation_tokens=0, budget="", versions_spanned=0, template_mismatch=False,
        env_reward=0.0, episode=s.episode,
    )  # fmt: skip


def batch(samples: list[Sample], step: int = 0, seed: int = 0) -> TrainBatch:
    return collate(*message(samples, step, seed), pad_id=0)


def fake_learner(**algo):
    """What ``Learner.compute_advantages`` reads of its learner, for a one-rank CPU run
    with the default reward source (the outcome reward is the sample's score) and
    ``algo`` set in the config; no reference model, no critic."""
    from learners.advantages import kl_controller
    from learners.distributed import DataParallel
    from verl_async.rewards.aggregate import RunningStats

    base = RunConfig()
    cfg = msgspec.structs.replace(base, algo=msgspec.structs.replace(base.algo, **algo))
    return SimpleNamespace(
        cfg=cfg,
        algo=cfg.algo,
        running={src.name: RunningStats() for src in cfg.rewards.sources},
        reference=None,
        model=None,
        critic=None,
        acc=SimpleNamespace(device=torch.device("cpu")),
        kl_ctrl=kl_controller(cfg.algo.kl),
        dp=DataParallel(),
    )
