"""What the generator loop needs of an engine (``RolloutEngine``) and the types it speaks.

Two engines implement it: ``generators/vllm_engine.py: VllmEngine`` (vLLM AsyncLLM,
continuous batching) and ``generators/hf_engine.py: HFEngine`` (transformers in this
process, sampled in waves); ``generators/engines.py: start_engine`` starts the one
``generators.engine`` names. The generator loop (generators/main.py) and the rollouts
built on it see only this module, so the contract below is what both engines really do,
no more.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from verl_async.protocol import WeightUpdate
from verl_async.schema import RunConfig


@dataclass(frozen=True)
class Sampling:
    """What one request samples with (training or evaluation settings)."""

    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()

    @classmethod
    def training(cls, cfg: RunConfig) -> Sampling:
        g = cfg.generators
        return cls(g.max_new_tokens, g.temperature, g.top_p, g.top_k, tuple(g.stop))

    @classmethod
    def evaluation(cls, cfg: RunConfig) -> Sampling:
        g = cfg.generators
        return cls(g.max_new_tokens, cfg.eval.temperature, g.top_p, g.top_k, tuple(g.stop))


@dataclass
class Sample:
    """One streamed completion; ``versions[i]`` is the weights version that produced token i."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # the prompt as the engine received it (first request)


@runtime_checkable
class RolloutEngine(Protocol):
    """An engine that samples rollouts and swaps in the learner's weights as they come.

    Versions: ``loaded_version`` starts at 0 and only moves forward, to each update's
    version once it is loaded. Every sampled token is stamped with a version no newer than
    the weights that computed it, so a sample's ``versions`` never decrease and staleness is
    never understated (the transformers engine's stamps are exact; vLLM's can only err
    towards older, ``VllmEngine.sample`` says why).

    ``weights.mode`` decides what an update does to requests in flight. ``keep``: none is
    cut; the vLLM engine pauses them and goes on under the new weights (later tokens are
    stamped new), the transformers engine lets its running wave finish first (the wave's
    tokens are all stamped old). ``abort``: requests in flight are cut; each goes on from
    its prefix, re-read by the new weights, so its remaining tokens are stamped new and
    ``resubmitted`` counts it. Requests made after ``apply_update`` returns are sampled by
    the new weights.

    LoRA runs (``model.lora``): the vLLM engine serves each version as an adapter of its
    own, bound to a request when it is submitted, so in ``keep`` mode a running request
    finishes on the adapter it started with (all its tokens stamped old, none paused), and
    a failed update leaves the adapters in service whole (sampling goes on with them).

    All methods run on the event loop that started the engine.
    """

    loaded_version: int  # the version of the weights sampled with now (0: the model's own)
    version_changed: asyncio.Event  # set (then replaced) each time loaded_version moves
    sync_epoch: int  # the weight-sync group's epoch this engine is a member of
    weights_lost: bool  # an update failed midway: sampling paused until a whole one lands
    resubmitted: int  # requests cut by abort-mode updates and continued from their prefix

    async def sample(self, prompt_ids: list[int], how: Sampling) -> Sample:
        """One completion of ``prompt_ids`` (one request; many may be in flight at once):
        at most ``how.max_tokens`` tokens, each with its log-prob under the processed
        distribution it was drawn from (temperature, top-k, top-p) and its version; ends at
        end-of-sequence, a stop string or the budget. Raises when the engine can no longer
        sample (its loop or processes died), never returns a partial sample for that."""

    async def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Log-prob of each of ``ids[1:]`` given its prefix, under the loaded weights at
        temperature 1 (the check that a weight push took effect)."""

    async def join_weight_sync(
        self, host: str, port: int, world_size: int, rank_offset: int, backend: str, epoch: int = 0
    ) -> None:
        """Join the weight-sync group of ``epoch`` as rank ``rank_offset`` (and on, one per
        worker); returns once the whole group has joined (``weights.join_timeout_s`` at
        most; each broadcast over it then ``weights.timeout_s``)."""

    async def rejoin_weight_sync(self, epoch: int) -> None:
        """The learner rebuilt the group: drop the old one and join ``epoch`` (blocks until
        the whole group has)."""

    async def leave_weight_sync(self, timeout_s: float = 5.0) -> None:
        """Leave the weight-sync group before shutting down (best effort: an engine that
        already died, or never joined, has nothing to leave)."""

    async def apply_update(self, update: WeightUpdate) -> float:
        """Pause (per ``weights.mode``), receive ``update`` over the weight-sync group, resume
        at ``update.version``; returns the seconds it took. A receive that fails midway sets
        ``weights_lost``, leaves sampling paused and raises; the next whole update resumes."""

    def shutdown(self) -> None:
        """Stop the engine and release what it holds (once sampling is over)."""
