"""Per-token quantities read off a model's logits.

token_logprobs(logits, targets)  log softmax(logits)[target], computed in float32
token_entropy(logits)            -sum_v p_v log p_v, computed in float32
entropy_from_logits(logits)      logsumexp(logits) - sum_v p_v * logit_v, in the logits'
                                 dtype (verl's formula; equal to token_entropy up to
                                 rounding)
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [N, T, V], targets [N, T] -> logprob of each target [N, T] (float32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, T, V] -> entropy of each position [N, T]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> entropy [...] as logsumexp(logits) - sum(softmax(logits) * logits)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
