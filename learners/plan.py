"""How one rank walks its shard through an update: minibatches, micro-batches, and the
denominators that make L data-parallel ranks compute the gradient one rank would.

Every rank holds the whole step's batch (``TrainBatch.shard_sizes`` says which rows are
whose), so each rank computes the same plan for everybody without talking to the others:

- Minibatch k (``algo.minibatches`` optimizer steps) is the union over ranks of chunk k
  of each shard (``np.array_split``: always exactly that many chunks, some maybe empty).
- Each chunk is cut into micro-batches of at most ``max_tokens_per_microbatch`` padded
  tokens: its rows longest first, each micro-batch filled while (rows x its longest
  row's tokens) fits, so rows of like length share one (verl's dynamic batching).
  Gradients accumulate over them, one optimizer step per minibatch. Every rank runs the
  same number of forward/backward passes, the most any rank needs (FSDP2 gathers
  parameters inside each pass, so a rank that skipped one would hang the others); a rank
  with fewer runs placeholder rows whose loss mask is zero.
- A pass computes its rows' columns up to their longest row only (``MicroRows``): the
  batch is right-padded to the step's longest sequence, and the padding beyond a pass's
  own longest row is never computed.
- The loss of a micro-batch is aggregated with the denominators of the *global*
  minibatch (``GlobalBatch``, verl's ``global_batch_info``): its response tokens
  (token-mean) or its sequences (seq-mean modes), times the number of ranks because the
  gradient is averaged over ranks. Summed over micro-batches and averaged over ranks this
  is exactly the minibatch's loss on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learners.logprobs import PassOptions, PassPlan, pass_plan
from verl_async.algos.losses import GlobalBatch


@dataclass
class Minibatch:
    micro: list[torch.Tensor]  # local row indices per micro-batch; empty -> placeholder
    tokens: float  # response tokens of the global minibatch (token-mean)
    seqs: float  # sequences of the global minibatch, rows without a response token included
    world: int = 1

    def global_batch(self, loss_scale_factor: float | None) -> GlobalBatch:
        """The denominators for ``agg_loss``: verl's global batch info, whose
        ``global_batch_size`` counts the minibatch's rows, empty ones included."""
        return GlobalBatch(
            dp_size=self.world,
            batch_num_tokens=self.tokens,
            global_batch_size=self.seqs,
            loss_scale_factor=loss_scale_factor,
        )


def shard_bounds(shard_sizes: list[int], rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s rows in the step's batch (rows come rank by rank)."""
    start = sum(shard_sizes[:rank])
    return start, start + shard_sizes[rank]


def length_bins(rows: np.ndarray, lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """``rows`` (indices into ``lengths``) longest first, cut into consecutive micro-batches
    of at most ``budget`` padded tokens (rows x the first, longest row's length); a row
    longer than the budget goes alone."""
    order = rows[np.argsort(-lengths[rows], kind="stable")]
    bins: list[list[int]] = []
    for r in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
            bins[-1].append(int(r))
        else:
            bins.append([int(r)])
    return [np.asarray(b, dtype=np.int64) for b in bins]


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
    lengths = attention_mask.sum(dim=1).cpu().numpy()
    plan = []
    for k in range(minibatches):
        rows = [torch.as_tensor(bounds[r][0] + chunks[r][k]) for r in range(world)]
        tokens = sum(float(loss_mask[idx].sum()) for idx in rows)
        seqs = sum(len(idx) for idx in rows)
        if max_tokens_per_microbatch:
            bins = [
                length_bins(chunks[r][k], lengths[start:stop], max_tokens_per_microbatch)
                for r, (start, stop) in enumerate(bounds)
            ]
            count = max(1, *(len(b) for b in bins))
            mine = bins[rank] + [np.zeros(0, np.int64)] * (count - len(bins[rank]))
        else:
            mine = [chunks[rank][k]]
        micro = [torch.as_tensor(m, dtype=torch.long) for m in mine]
        plan.append(Minibatch(micro, tokens, seqs, world))
    return plan


@dataclass
class MicroRows:
    """The rows of one forward/backward pass and the columns they need: ``width`` tokens of
    the (right-padded) input, ``width - 1`` target positions. ``take`` cuts a per-token
    tensor of the batch ([N, T-1], or [N, 1] broadcast) to them."""

    idx: torch.Tensor
    width: int
    placeholder: bool
    plan: PassPlan | None = None  # the pass's positions and packing, decided on the host

    def take(self, t: torch.Tensor) -> torch.Tensor:
        t = t[self.idx]  # [n, T-1], [n, T-1, K]; [n] or [n, 1] (a value a row) kept whole
        return t[:, : self.width - 1] if t.dim() == 3 or (t.dim() == 2 and t.shape[1] > 1) else t

    def inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return input_ids[self.idx, : self.width], attention_mask[self.idx, : self.width]

    def mask(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """The loss mask of the pass (zero for a placeholder)."""
        m = self.take(loss_mask)
        return torch.zeros_like(m) if self.placeholder else m


def micro_rows(idx: torch.Tensor, attention_mask: torch.Tensor) -> MicroRows:
    """The pass over rows ``idx``, as wide as their longest row; an empty micro-batch
    becomes a placeholder: the first local row, with nothing to learn from (its forward
    pass keeps the ranks' collectives in step)."""
    placeholder = not len(idx)
    idx = torch.zeros(1, dtype=torch.long) if placeholder else idx
    idx = idx.to(attention_mask.device)
    width = max(2, int(attention_mask[idx].sum(dim=1).max()))
    return MicroRows(idx, min(width, attention_mask.shape[1]), placeholder)


def planned_rows(
    model, idx: torch.Tensor, host, options: PassOptions, device: torch.device
) -> MicroRows:
    """``micro_rows`` of rows ``idx`` with the pass's plan (``logprobs.pass_plan``), both
    made from ``host`` (a ``TrainBatch`` in host memory: the step's batch before its copy
    to the device), their tensors on ``device``: the pass then reads nothing back."""
    rows = micro_rows(idx, host.attention_mask)
    ids, attn = rows.inputs(host.input_ids, host.attention_mask)
    plan = pass_plan(model, ids, attn, rows.mask(host.loss_mask), options, device)
    return MicroRows(rows.idx.to(device), rows.width, rows.placeholder, plan)
