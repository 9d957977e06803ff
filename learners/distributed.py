"""Data parallelism over the learner ranks: who trains which rows, and the few collectives
that keep the ranks computing what one rank would.

The buffer sends every rank the whole step (``TrainBatch``), its rows ordered rank by
rank (``shard_sizes``). Each rank

- runs the models on its own rows only (``local``: the rows, trimmed to their width);
- gathers what those passes produced (reference log-probs, pi_prox for a KL in the
  reward, the critic's values) back to the step's shape (``gather_rows``), so rewards,
  advantages (group baselines, batch whitening) and the KL controller are computed over
  the whole step, identically on every rank;
- trains on its rows with the denominators of learners/plan.py;
- averages its update statistics with the others (``mean_stats``) for rank 0's metrics;
- takes the decisions every rank must take alike from what it sees alone (``any_rank``:
  whether to skip an optimizer step, whether its weights may be published).

With one rank every method is the identity and no process group is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from learners.batching import TrainBatch
from learners.plan import shard_bounds

# Per-row tensors of a TrainBatch (width-trimmed): input_ids and attention_mask are [N, T],
# the others [N, T-1]; turn_rewards and logp_teacher may be None.
_ROW_TENSORS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "behav_logprobs",
    "token_versions",
    "turn_rewards",
    "logp_teacher",
)


class DataParallel:
    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.world = world

    @classmethod
    def from_environment(cls) -> DataParallel:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def bounds(self, batch: TrainBatch) -> tuple[int, int]:
        sizes = batch.shard_sizes or [len(batch.input_ids)]
        if len(sizes) != self.world:
            raise ValueError(
                f"step {batch.step} was cut for {len(sizes)} ranks, this job has {self.world}"
            )
        return shard_bounds(sizes, self.rank)

    def local(self, batch: TrainBatch) -> TrainBatch:
        """This rank's rows of the step, trimmed to the longest of them."""
        if self.world == 1:
            return batch
        start, stop = self.bounds(batch)
        width = max(int(batch.attention_mask[start:stop].sum(dim=1).max()), 2)
        out = {f.name: getattr(batch, f.name) for f in fields(batch)}
        for name in _ROW_TENSORS:
            if out[name] is None:
                continue
            t = out[name][start:stop]
            out[name] = (
                t[:, :width] if name in ("input_ids", "attention_mask") else t[:, : width - 1]
            )
        out["group_index"] = batch.group_index[start:stop]
        out["response_lengths"] = batch.response_lengths[start:stop]
        out["shard_sizes"] = [stop - start]
        out["host"] = None if batch.host is None else self.local(batch.host)
        return TrainBatch(**out)

    def local_part(self, full: torch.Tensor, batch: TrainBatch, local: TrainBatch) -> torch.Tensor:
        """This rank's rows of a step-shaped [N, T-1] tensor, at the local width."""
        if self.world == 1:
            return full
        start, stop = self.bounds(batch)
        return full[start:stop, : local.loss_mask.shape[1]]

    def gather_rows(self, part: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """Every rank's [n_r, t_r] rows -> the step's [N, T-1], zero-padded (a collective)."""
        if self.world == 1:
            return part
        import torch.distributed as dist

        sizes = batch.shard_sizes
        width = batch.loss_mask.shape[1]
        padded = part.new_zeros((max(sizes), width))
        padded[: part.shape[0], : part.shape[1]] = part
        pieces = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(pieces, padded.contiguous())
        return torch.cat([p[:n] for p, n in zip(pieces, sizes, strict=True)])

    def mean_stats(self, stats, weight: float, sums: tuple[str, ...] = ()):
        """A dataclass of floats combined over ranks (for rank 0's metrics line).

        Means over a rank's tokens are averaged weighted by ``weight`` (its response
        tokens); fields in ``sums`` are already each rank's share of a step-wide mean (the
        losses, by the denominators of learners/plan.py), so the step's value is their
        plain mean, as is every field when no rank has a token (a step whose episodes all
        ended without one: its skip counts are every rank's alike); fields named ``*_max``
        take the maximum. None fields stay None."""
        if self.world == 1:
            return stats
        import torch.distributed as dist

        names = [f.name for f in fields(stats) if getattr(stats, f.name) is not None]
        values = torch.tensor([float(getattr(stats, n)) for n in names], dtype=torch.float64)
        is_max = torch.tensor([n.endswith("_max") for n in names])
        is_sum = torch.tensor([n in sums for n in names])
        weights = torch.where(is_sum, 1.0, weight)
        summed = torch.cat([torch.where(is_max, 0.0, values * weights), weights, values])
        dist.all_reduce(summed)
        peak = torch.where(is_max, values, torch.full_like(values, -float("inf")))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        n = len(names)
        total = summed[n : 2 * n]
        means = torch.where(
            total > 0, summed[:n] / total.clamp(min=1e-12), summed[2 * n :] / self.world
        )
        for name, value in zip(names, torch.where(is_max, peak, means).tolist(), strict=True):
            setattr(stats, name, value)
        return stats

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over ranks (a collective; ``x`` itself with one rank): the
        ``reduce`` of ``UpdateHooks`` that makes a statistic of the rollout correction
        the whole step's."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = x.detach().to(device=device, dtype=torch.float64).clone()
        dist.all_reduce(total)
        return total.to(device=x.device, dtype=x.dtype)

    def mean_metrics(self, metrics: dict[str, float], weight: float, keys: Sequence[str]) -> dict:
        """Named metrics combined over ranks (a collective): every rank passes the same
        ``keys``, a rank without some (no tokens) passes ``weight`` 0. Means are weighted
        by ``weight`` (plain means of the ranks that have the key when all weigh 0); keys
        ending in ``_max`` / ``_min`` take the largest / smallest; a key no rank has is
        left out, as with one rank."""
        if self.world == 1:
            return {k: metrics[k] for k in keys if k in metrics}
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        values = torch.tensor([metrics.get(k, 0.0) for k in keys], dtype=torch.float64)
        have = torch.tensor([k in metrics for k in keys])
        w = torch.where(have, float(weight), 0.0)
        hi = torch.where(have, values, -float("inf"))
        lo = torch.where(have, -values, -float("inf"))
        had = have.to(values.dtype)
        packed = torch.cat([values * w, w, values * had, had]).to(device)
        extremes = torch.stack([hi, lo]).to(device)
        dist.all_reduce(packed)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        n = len(keys)
        weighted, total, plain, ranks = packed.cpu().split(n)
        mean = torch.where(total > 0, weighted / total.clamp(min=1e-12), plain / ranks.clamp(min=1))
        hi, lo = extremes[0].cpu(), -extremes[1].cpu()
        out = {}
        for i, k in enumerate(keys):
            if ranks[i] == 0:
                continue
            pick = hi[i] if k.endswith("_max") else lo[i] if k.endswith("_min") else mean[i]
            out[k] = float(pick)
        return out

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a collective): for a decision every rank
        must take alike from what it sees of its own (its loss, its shards)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        # NCCL reduces CUDA tensors only; gloo (and a group with both) takes CPU ones.
        nccl = dist.get_backend() == "nccl"
        t = torch.tensor([float(flag)], device="cuda" if nccl else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
