"""Which samples make one episode, for the estimators that compare a group's episodes.

An agent's episode through the chat endpoint may give several samples (a call that rewrote
the conversation starts a new sample of the same episode), every one carrying the whole
episode's reward. A group's baseline counts episodes, not samples: each episode's return
enters its group's statistics once, and every sample of the episode gets its episode's
advantage. ``Episodes`` is that map: ``once`` picks one value per episode (its first
sample's), ``sum`` adds a per-sample value up over each episode, ``spread`` hands an
episode's value back to each of its samples.

A batch where every episode is one sample has the identity map, and the estimators given it
compute exactly what they compute without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Episodes:
    of_sample: torch.Tensor  # [N] long: each sample's episode, 0 .. E-1 by first sample
    first: torch.Tensor  # [E] long: each episode's first sample

    @classmethod
    def of(cls, group_index: torch.Tensor | Sequence, episode: Sequence[int]) -> Episodes:
        """``group_index`` [N] (samples of one prompt group share it) and ``episode`` [N]:
        the index of the episode within its group, or -1 for a sample that is an episode
        of its own. Samples of one group with the same index >= 0 are one episode."""
        groups = group_index.tolist() if isinstance(group_index, torch.Tensor) else group_index
        if len(groups) != len(episode):
            raise ValueError(f"{len(groups)} group indices but {len(episode)} episode indices")
        ids: dict = {}
        of_sample, first = [], []
        for i, (g, e) in enumerate(zip(groups, episode, strict=True)):
            key = (g, int(e)) if e >= 0 else ("sample", i)
            if key not in ids:
                ids[key] = len(first)
                first.append(i)
            of_sample.append(ids[key])
        long = torch.long
        return cls(torch.tensor(of_sample, dtype=long), torch.tensor(first, dtype=long))

    @property
    def singles(self) -> bool:
        """Whether every episode is one sample."""
        return len(self.first) == len(self.of_sample)

    def count(self, device: torch.device | None = None) -> torch.Tensor:
        """[E] samples of each episode (long)."""
        return torch.bincount(self.of_sample, minlength=len(self.first)).to(device)

    def once(self, x: torch.Tensor | Sequence):
        """[N, ...] -> [E, ...]: each episode's first sample's entry (a tensor, or any
        sequence such as uid strings)."""
        if isinstance(x, torch.Tensor):
            return x[self.first.to(x.device)]
        return [x[i] for i in self.first.tolist()]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[N] -> [E]: the sum over each episode's samples."""
        zeros = x.new_zeros((len(self.first), *x.shape[1:]))
        return zeros.index_add(0, self.of_sample.to(x.device), x)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[E, ...] -> [N, ...]: each sample gets its episode's entry."""
        return x[self.of_sample.to(x.device)]
