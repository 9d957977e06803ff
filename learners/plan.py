"""How one rank walks its shard through an update: minibatches, micro-batches, and the
denominators that make L data-parallel ranks compute the gradient one rank would.

Every rank holds the whole step's batch (``TrainBatch.shard_sizes`` says which rows are
whose), so each rank computes the same plan for everybody without talking to the others:

- Minibatch k (``algo.minibatches`` optimizer steps) is the union over ranks of chunk k
  of each shard (``np.array_split``: always exactly that many chunks, some maybe empty).
- Each chunk is cut into micro-batches of at most ``max_tokens_per_microbatch`` padded
  tokens (rows x the shard's width); gradients accumulate over them, one optimizer step
  per minibatch. Every rank runs the same number of forward/backward passes, the most
  any rank needs (FSDP2 gathers parameters inside each pass, so a rank that skipped one
  would hang the others); a rank with nothing left runs a placeholder row whose loss
  mask is zero.
- The loss of a micro-batch is its masked sum divided by a denominator of the *global*
  minibatch: its response tokens (token-mean) or sequences (seq-mean modes), divided by
  the number of ranks because the gradient is averaged over ranks. Summed over
  micro-batches and averaged over ranks this is exactly the minibatch's loss on one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Minibatch:
    micro: list[torch.Tensor]  # local row indices per micro-batch; empty -> placeholder
    tokens: float  # response tokens of the global minibatch / ranks (token-mean)
    seqs: float  # sequences with a response token in the global minibatch / ranks (seq-mean)
    world: int = 1

    def agg_kwargs(self, loss_scale_factor: float | None) -> dict:
        """The denominators for ``agg_loss`` (seq-mean-token-sum-norm's constant is split
        over the ranks as well)."""
        return {
            "batch_num_tokens": self.tokens,
            "global_batch_size": self.seqs,
            "loss_scale_factor": None
            if loss_scale_factor is None
            else loss_scale_factor / self.world,
        }


def shard_bounds(shard_sizes: list[int], rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s rows in the step's batch (rows come rank by rank)."""
    start = sum(shard_sizes[:rank])
    return start, start + shard_sizes[rank]


def _shard_width(attention_mask: torch.Tensor, start: int, stop: int) -> int:
    return int(attention_mask[start:stop].sum(dim=1).max()) if stop > start else 1


def plan_update(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    shard_sizes: list[int],
    rank: int,
    minibatches: int,
    max_tokens_per_microbatch: int = 0,
) -> list[Minibatch]:
    """The plan of ``rank`` over the step's batch (masks of the whole step: [N, T-1], [N, T]).

    ``max_tokens_per_microbatch`` 0: one micro-batch per minibatch.
    """
    world = len(shard_sizes)
    bounds = [shard_bounds(shard_sizes, r) for r in range(world)]
    chunks = [np.array_split(np.arange(stop - start), minibatches) for start, stop in bounds]
    has_tokens = loss_mask.sum(dim=1) > 0
    plan = []
    for k in range(minibatches):
        rows = [torch.as_tensor(bounds[r][0] + chunks[r][k]) for r in range(world)]
        tokens = sum(float(loss_mask[idx].sum()) for idx in rows)
        seqs = sum(int(has_tokens[idx].sum()) for idx in rows)
        count = 1
        if max_tokens_per_microbatch:
            per_rank = []
            for r, (start, stop) in enumerate(bounds):
                fit = max(1, max_tokens_per_microbatch // _shard_width(attention_mask, start, stop))
                per_rank.append(math.ceil(len(chunks[r][k]) / fit))
            count = max(1, *per_rank)
        micro = [
            torch.as_tensor(m, dtype=torch.long) for m in np.array_split(chunks[rank][k], count)
        ]
        plan.append(Minibatch(micro, tokens / world, seqs / world, world))
    return plan


def micro_rows(idx: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, loss mask) of one micro-batch; an empty one becomes a placeholder:
    the first local row, with nothing to learn from (its forward pass keeps the ranks'
    collectives in step)."""
    if len(idx):
        idx = idx.to(loss_mask.device)
        return idx, loss_mask[idx]
    idx = torch.zeros(1, dtype=torch.long, device=loss_mask.device)
    return idx, torch.zeros_like(loss_mask[idx])
