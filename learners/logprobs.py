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

**Shared prefixes.** The samples of a GRPO group start with the same prompt, and with
short answers the prompt is most of every row: SmolLM2's chat template makes a sum's
prompt 44 tokens, its answer 6. With ``share_prefix`` the rows of a pass that begin
with the same tokens before their first masked position are packed into one sequence:
that prefix once, then each row's remainder (from the prefix's last token on), each
token at its position in its own row, under an attention mask that lets a remainder
see its prefix and itself only. One forward pass over the packed rows computes every
masked position, and under autograd the prefix's gradient collects every row's share,
as in the padded pass. Values and gradients equal the padded pass's to float precision.
It is used when the packed rows hold at most ``SHARE_WHEN`` of the padded batch's
positions, with sdpa or eager attention (flash attention takes no such mask), not with
gradient checkpointing, and not where a packed row would be longer than the model's
sliding window (the mask given replaces the model's own). A packed row holds at most
``pack_tokens`` (its mask is S x S); a group that does not fit gets another with its own
copy of the prefix.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 1024  # positions whose logits exist at once: 1024 x 49,152 x 4 B = 200 MB
PACK_TOKENS = 2048  # the longest packed row: its attention mask is S x S
SHARE_WHEN = 0.8  # pack when the packed rows hold at most this share of the padded positions


@dataclass
class TokenStats:
    logp: torch.Tensor  # [N, T-1] float32: log pi(target t+1 | ids <= t), 0 where not masked
    entropy: torch.Tensor | None  # [N, T-1] float32 at the same positions, when asked
    # Positions the model computed (padding included) and the real tokens among them; with
    # a shared prefix both count it once. ``tokens``: the real tokens of the rows.
    computed: int = 0
    real: int = 0
    tokens: int = 0


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
    share_prefix: bool = True,
    pack_tokens: int = PACK_TOKENS,
) -> TokenStats:
    """Log-probs (and entropies) of ids [N, T] (right-padded) at the positions where
    ``mask`` [N, T-1] is non-zero; gradients flow when grad mode is on. ``share_prefix``:
    rows that begin alike compute their common prefix once (above).

    One forward pass always runs, even for a mask with no token (a placeholder row keeps
    FSDP2's collectives in step): its last column is computed then, and left in the
    outputs at a position every reader masks, so the loss stays connected to the graph."""
    n, t = input_ids.shape
    tokens = int(attention_mask.sum())
    keep = mask > 0
    placeholder = not keep.any()
    if placeholder:
        keep = torch.zeros_like(keep)
        keep[:, -1] = True
    if not _sliceable(model):
        logp, ent = _stats(
            logits_of(model, input_ids, attention_mask)[:, :-1], input_ids[:, 1:], temperature,
            entropy,
        )  # fmt: skip
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        return TokenStats(
            torch.where(keep, logp, zero), None if ent is None else torch.where(keep, ent, zero),
            computed=n * t, real=tokens, tokens=tokens,
        )  # fmt: skip
    pack = None
    if share_prefix and not placeholder:
        pack = _packing(model, input_ids, attention_mask, keep, pack_tokens)
    if pack is not None:
        return _packed_stats(
            model, input_ids, keep, pack, temperature, entropy, chunk_tokens, tokens
        )
    logp, ent = _sliced(
        model, input_ids, keep, temperature, entropy, chunk_tokens, attention_mask=attention_mask
    )
    return TokenStats(logp, ent, computed=n * t, real=tokens, tokens=tokens)


def _sliced(model, input_ids, keep, temperature, entropy, chunk_tokens, **inputs):
    """One forward pass of ids [N, T] (``inputs``: the model's other arguments) with the
    hidden states sliced to the columns ``keep`` [N, T-1] needs and the head replaced by
    the chunked log-softmax at the targets: (log-probs, entropies or None), [N, T-1] each,
    0 where ``keep`` is False."""
    n, t = input_ids.shape
    targets = input_ids[:, 1:]
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
        out = model(input_ids=input_ids, logits_to_keep=cols, **inputs)
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

    return place(values[:, 0]), place(values[:, 1]) if entropy else None


@dataclass
class Packing:
    """Rows [N] packed by shared prefix into ``ids`` [B, S]: packed row ``row[i]`` holds
    row i's prefix (its first ``cut[i]`` tokens, shared with the other rows packed there)
    at its start, and row i's remainder ids[i, cut[i]:] from column ``start[i]`` on."""

    ids: torch.Tensor  # [B, S] long
    positions: torch.Tensor  # [B, S] long: each token's position in its own row
    # [B, 1, S, S]: where query (dim 2) may attend key (dim 3), in the form the model's
    # attention takes: bool for sdpa, additive float (0 or the float32 minimum) for eager
    attend: torch.Tensor
    row: torch.Tensor  # [N] long
    start: torch.Tensor  # [N] long
    cut: torch.Tensor  # [N] long
    rest: torch.Tensor  # [N] long: tokens of each row's remainder
    real: int  # real tokens in ``ids``


def _packing(model, input_ids, attention_mask, keep, pack_tokens: int) -> Packing | None:
    """Where rows share prefixes worth computing once, their packing; else None.

    A row's prefix is everything before the position that predicts its first masked
    target, so every log-prob comes from a remainder. The rows of one prefix go into one
    packed row while it stays within ``pack_tokens`` (else into several, each with its
    own copy of the prefix)."""
    inner = _inner(model)
    attn_impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if attn_impl not in ("sdpa", "eager") or getattr(inner, "is_gradient_checkpointing", False):
        return None
    n, t = input_ids.shape
    length = attention_mask.sum(dim=1)
    if bool((attention_mask != (torch.arange(t, device=length.device) < length[:, None])).any()):
        return None  # not right-padded
    first = torch.where(keep.any(dim=1), keep.int().argmax(dim=1), length - 1)
    cut = torch.minimum(first, length - 1)
    if bool((cut < 1).any()):
        return None
    ids, cuts, lengths = input_ids.tolist(), cut.tolist(), length.tolist()
    families: dict[tuple, list[int]] = {}
    for i, (row, c) in enumerate(zip(ids, cuts, strict=True)):
        families.setdefault(tuple(row[:c]), []).append(i)
    if len(families) == n:
        return None
    packed: list[tuple[tuple, list[int]]] = []  # (prefix, rows) of each packed row
    sizes: list[int] = []  # tokens of each packed row
    for prefix, rows in families.items():
        for i in rows:
            rest = lengths[i] - cuts[i]
            if not packed or packed[-1][0] is not prefix or sizes[-1] + rest > pack_tokens:
                packed.append((prefix, []))  # a new family, or full: another copy of the prefix
                sizes.append(len(prefix))
            packed[-1][1].append(i)
            sizes[-1] += rest
    b, width = len(packed), max(sizes)
    if b * width > SHARE_WHEN * n * t:
        return None
    window = getattr(inner.config, "sliding_window", None)
    if window and width > window:  # a packed row would need the window in its own mask
        return None
    out = torch.zeros((b, width), dtype=torch.long)
    positions = torch.zeros_like(out)
    segment = torch.full((b, width), -2, dtype=torch.long)  # -1 prefix, i row i, -2 padding
    row_of, start_of = [0] * n, [0] * n
    for r, (prefix, rows) in enumerate(packed):
        c = len(prefix)
        out[r, :c] = torch.tensor(prefix, dtype=torch.long)
        positions[r, :c] = torch.arange(c)
        segment[r, :c] = -1
        at = c
        for i in rows:
            rest = lengths[i] - cuts[i]
            out[r, at : at + rest] = torch.tensor(ids[i][cuts[i] : lengths[i]], dtype=torch.long)
            positions[r, at : at + rest] = torch.arange(cuts[i], lengths[i])
            segment[r, at : at + rest] = i
            row_of[i], start_of[i] = r, at
            at += rest
    # Causal within a segment, every remainder sees its prefix, padding sees itself.
    cols = torch.arange(width)
    causal = cols[None, :] <= cols[:, None]
    same = segment[:, :, None] == segment[:, None, :]
    attend = causal & (same | (segment[:, None, :] == -1))
    attend |= torch.eye(width, dtype=torch.bool)
    if attn_impl == "eager":
        attend = torch.zeros(attend.shape).masked_fill(~attend, torch.finfo(torch.float32).min)
    device = input_ids.device
    return Packing(
        out.to(device), positions.to(device), attend[:, None].to(device),
        torch.tensor(row_of, device=device), torch.tensor(start_of, device=device),
        cut, length - cut, real=sum(sizes),
    )  # fmt: skip


def _packed_stats(
    model, input_ids, keep, pack: Packing, temperature, entropy, chunk_tokens, tokens
) -> TokenStats:
    """One pass over the packed rows; outputs as ``token_stats``'s, [N, T-1]."""
    n, t = input_ids.shape
    device = input_ids.device
    b, width = pack.ids.shape
    # Row i's remainder offset s (a target inside the remainder) <-> packed column
    # start + s <-> the row's column cut + s.
    offsets = torch.arange(width - 1, device=device)
    inside = offsets[None, :] < (pack.rest - 1)[:, None]  # [N, S-1]
    rows, offs = inside.nonzero(as_tuple=True)
    orig = pack.cut[rows] + offs
    packed_row, packed_col = pack.row[rows], pack.start[rows] + offs
    wanted = keep[rows, orig]
    rows, orig, packed_row, packed_col = (
        x[wanted] for x in (rows, orig, packed_row, packed_col)
    )  # fmt: skip
    packed_keep = torch.zeros((b, width - 1), dtype=torch.bool, device=device)
    packed_keep[packed_row, packed_col] = True
    logp, ent = _sliced(
        model, pack.ids, packed_keep, temperature, entropy, chunk_tokens,
        attention_mask=pack.attend, position_ids=pack.positions,
    )  # fmt: skip

    def place(values: torch.Tensor) -> torch.Tensor:  # [B, S-1] -> [N, T-1]
        full = torch.zeros((n, t - 1), dtype=values.dtype, device=device)
        return full.index_put((rows, orig), values[packed_row, packed_col])

    return TokenStats(
        place(logp), None if ent is None else place(ent),
        computed=b * width, real=pack.real, tokens=tokens,
    )  # fmt: skip
