"""Log-probs and entropies of a causal LM at the positions a loss reads, and nowhere else.

A model's head turns each position's hidden state into V logits (V = 49,152 for
SmolLM2). The learner needs them only where the next token is a sampled response token
(the loss mask): not over the prompt, not over a multi-turn sample's observations, not
over padding. ``token_stats`` runs the model once with

- ``logits_to_keep`` set to the columns that hold at least one such position, so the
  transformer's last hidden states are sliced before the head, and
- the head replaced, for that one call, by a function that takes only the masked
  positions' hidden states and computes, in chunks of ``chunk_tokens`` positions,
  log softmax at the target and (when asked) the entropy. Under autograd every chunk
  after the first is recomputed in backward (activation checkpointing), so the
  [tokens, vocab] logits of the whole batch never exist at once. The model returns these
  per-token values as its "logits".

The replacement runs inside the model's own forward, so FSDP2 (which gathers the head's
weight around that forward, and hooks the backward on the forward's outputs) and tied
embeddings work unchanged.

Values equal the full computation (``logits_of`` then ``token_logprobs`` and
``token_entropy``) at every masked position: the same float32 formulas, the temperature
applied after the cast to float32. Everywhere else both outputs hold 0. A model whose
forward takes no ``logits_to_keep`` or that changes logits after the head (Gemma-2's
soft-capping) gets the full computation, then the same selection.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 1024  # positions whose logits exist at once: 1024 x 49,152 x 4 B = 200 MB


@dataclass
class TokenStats:
    logp: torch.Tensor  # [N, T-1] float32: log pi(target t+1 | ids <= t), 0 where not masked
    entropy: torch.Tensor | None  # [N, T-1] float32 at the same positions, when asked


def logits_of(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """All logits [N, T, V] divided by the sampling temperature (vLLM's processed
    log-probs are taken after the same division). The full computation: for checks and
    for models ``token_stats`` cannot slice."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits if temperature == 1.0 else logits / temperature


def _stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """(log-prob of each target, entropy or None) of logits [M, V], in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    logp = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logprobs.exp() * logprobs).sum(-1) if entropy else None
    return logp, ent


def _head_stats(hidden, weight, bias, targets, temperature: float, entropy: bool):
    logp, ent = _stats(F.linear(hidden, weight, bias), targets, temperature, entropy)
    return (logp, ent) if entropy else (logp,)


def _inner(model):
    """The transformers model under DistributedDataParallel-like wrappers and peft (whose
    forward passes ``logits_to_keep`` on to it)."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _sliceable(model) -> bool:
    """Whether ``model``'s forward slices hidden states by ``logits_to_keep`` right before
    a plain linear head and hands back what the head returned."""
    inner = _inner(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return False
    config = getattr(inner, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        return False
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def token_stats(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
) -> TokenStats:
    """Log-probs (and entropies) of ids [N, T] at the positions where ``mask`` [N, T-1]
    is non-zero; gradients flow when grad mode is on.

    One forward pass always runs, even for a mask with no token (a placeholder row keeps
    FSDP2's collectives in step): its last column is computed then, and left in the
    outputs at a position every reader masks, so the loss stays connected to the graph."""
    n, t = input_ids.shape
    targets = input_ids[:, 1:]
    keep = mask > 0
    if not keep.any():
        keep = torch.zeros_like(keep)
        keep[:, -1] = True
    if not _sliceable(model):
        logp, ent = _stats(
            logits_of(model, input_ids, attention_mask)[:, :-1], targets, temperature, entropy
        )
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        return TokenStats(
            torch.where(keep, logp, zero), None if ent is None else torch.where(keep, ent, zero)
        )
    cols = keep.any(dim=0).nonzero().flatten()  # columns with a masked position
    sub_keep = keep[:, cols]  # [N, K]
    sub_targets = targets[:, cols][sub_keep]  # [M]
    inner = _inner(model)
    head = inner.get_output_embeddings()
    calls = []

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:  # hidden: [N, K, H]
        """What the model returns as its "logits": [M, 1] log-probs, or [M, 2] with the
        entropies, of the masked positions. The loss is computed from this very output,
        so FSDP2's hooks on the root module's outputs see the backward pass."""
        calls.append(1)
        chosen = hidden[sub_keep]  # [M, H]
        parts = []
        for start in range(0, len(chosen), chunk_tokens):
            args = (
                chosen[start : start + chunk_tokens], head.weight, head.bias,
                sub_targets[start : start + chunk_tokens], temperature, entropy,
            )  # fmt: skip
            if start > 0 and torch.is_grad_enabled():
                parts.append(checkpoint(_head_stats, *args, use_reentrant=False))
            else:
                parts.append(_head_stats(*args))
        return torch.stack([torch.cat(column) for column in zip(*parts, strict=True)], dim=-1)

    head.forward = head_forward  # an instance attribute: this call only
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=cols)
    finally:
        del head.forward
    values = out.logits
    if not calls or values.shape != (len(sub_targets), 2 if entropy else 1):
        raise RuntimeError(f"{type(inner).__name__}'s forward did not return its head's output")

    def place(flat: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((n, len(cols)), dtype=flat.dtype, device=flat.device)
        out = out.masked_scatter(sub_keep, flat)
        full = torch.zeros((n, t - 1), dtype=flat.dtype, device=flat.device)
        return full.index_copy(1, cols, out)

    return TokenStats(place(values[:, 0]), place(values[:, 1]) if entropy else None)
