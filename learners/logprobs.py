"""Log-probs and entropies of a causal LM at the positions a loss reads, and nowhere else.

A model's head turns each position's hidden state into V logits (V = 49,152 for
SmolLM2, 151,936 for Qwen2.5). The learner needs them only where the next token is a
sampled response token (the loss mask): not over the prompt, not over a multi-turn
sample's observations, not over padding. ``token_stats`` runs the model once with

- ``logits_to_keep`` set to the columns that hold at least one such position, so the
  transformer's last hidden states are sliced before the head, and
- the head replaced, for that one call, by a function that takes only the masked
  positions' hidden states and computes, in chunks of ``chunk_tokens`` positions,
  log softmax at the target and (when asked) the entropy. Under autograd every chunk
  after the first is recomputed in backward (activation checkpointing), so the
  [tokens, vocab] logits of the whole batch never exist at once: at most one chunk's
  [chunk_tokens, vocab] (and the few tensors of the same size its log softmax and its
  backward make). The model returns these per-token values as its "logits".
  ``chunk_tokens=0`` keeps the model's own head over every kept column instead, so the
  [N, K, V] logits exist at once (the plain path, for comparison). On request the same
  chunks also give each position's ``top_k`` most likely tokens and their log-probs, or
  the log-probs of ids given per position (``at_ids``, with their gradient): the two
  sides of distillation's forward_kl_topk (``Asked`` lays out the columns).

The replacement runs inside the model's own forward, so FSDP2 (which gathers the head's
weight around that forward, and hooks the backward on the forward's outputs) and tied
embeddings work unchanged.

Values equal the full computation (``logits_of`` then ``token_logprobs`` and
``token_entropy``) at every masked position: the same formulas in float32 (float64 for
a float64 model), the temperature applied after the cast. Everywhere else both outputs
hold 0. A model whose forward takes no ``logits_to_keep`` or that changes logits after
the head (Gemma-2's soft-capping) gets the full computation, then the same selection.

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

**Padding-free passes.** With ``padding_free`` the rows go end to end, several rows (or
prefix families) per packed row up to ``pack_tokens``, each token at its position in
its own row, so the pass computes no padding but at the packed rows' ends. With sdpa
or eager attention this is the same packing under a block-diagonal causal mask (rows
sharing a prefix still share it when ``share_prefix`` is on). With a flash attention
implementation (``config._attn_implementation`` starting with "flash_attention") no
mask is given: every row goes into one packed row [1, S] whose position ids restart
at 0 at each row's start, and transformers derives the variable-length boundaries from
them. Each row is then one contiguous causal sequence, so prefixes are not shared
there, and ``pack_tokens`` does not apply (no S x S mask). That path needs CUDA and the
flash-attn kernels: the CPU tests check its packing, not its values. Padding-free passes
are used wherever they compute fewer positions than the padded pass, not with gradient
checkpointing (not verified), and with sdpa and eager not where a packed row would be
longer than the sliding window. Values and gradients equal the padded pass's (float64
tests, sdpa and eager).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from learners.fused_head import head_values

CHUNK_TOKENS = 1024  # positions whose logits exist at once: 1024 x 49,152 x 4 B = 200 MB
PACK_TOKENS = 2048  # the longest packed row: its attention mask is S x S
SHARE_WHEN = 0.8  # pack when the packed rows hold at most this share of the padded positions


@dataclass(frozen=True)
class PassOptions:
    """How ``token_stats`` runs its pass (the learner's settings: ``PassOptions.of``)."""

    chunk_tokens: int = CHUNK_TOKENS  # positions whose logits exist at once; 0: all of them
    share_prefix: bool = True  # rows that begin alike compute their prefix once
    padding_free: bool = False  # rows end to end, no padding computed
    pack_tokens: int = PACK_TOKENS  # the longest packed row (sdpa and eager)
    fused_head: bool = False  # the head fused with its log-probs (learners/fused_head.py)

    @classmethod
    def of(cls, learner) -> PassOptions:
        """The options a ``LearnerConfig`` sets."""
        return cls(
            learner.logprob_chunk_tokens, learner.share_prefix, learner.padding_free,
            fused_head=learner.fused_head,
        )  # fmt: skip


@dataclass
class TokenStats:
    # [N, T-1] float32 (float64 for a float64 model): log pi(target t+1 | ids <= t), 0
    # where not masked
    logp: torch.Tensor
    entropy: torch.Tensor | None  # [N, T-1] float32 at the same positions, when asked
    # Positions the model computed (padding included) and the real tokens among them; with
    # a shared prefix both count it once. ``tokens``: the real tokens of the rows.
    computed: int = 0
    real: int = 0
    tokens: int = 0
    # With ``top_k``: the K most likely tokens' log-probs [N, T-1, K] (largest first) and
    # their ids (long); with ``at_ids``: the log-probs of those ids [N, T-1, K]. 0 where
    # not masked.
    top_logp: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    ids_logp: torch.Tensor | None = None


@dataclass(frozen=True)
class Asked:
    """What a pass computes at each masked position, as columns of one [..., width]
    tensor (a head's output is one tensor): the target's log-prob, its entropy, the
    ``top_k`` largest log-probs and their ids (as floats: exact below 2^24, above any
    vocabulary), and the log-probs of ``ids`` given ids."""

    entropy: bool = False
    top_k: int = 0
    ids: int = 0  # K of the given ids (0: none)

    @property
    def width(self) -> int:
        return 1 + self.entropy + 2 * self.top_k + self.ids

    def split(self, values: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """``values`` [..., width] -> ``TokenStats``' fields (the ids as long)."""
        cuts = [1, int(self.entropy), self.top_k, self.top_k, self.ids]
        parts = dict(zip(("logp", "entropy", "top_logp", "top_ids", "ids_logp"),
                         values.split(cuts, dim=-1), strict=True))  # fmt: skip
        out: dict[str, torch.Tensor | None] = {"logp": parts["logp"][..., 0]}
        out["entropy"] = parts["entropy"][..., 0] if self.entropy else None
        out["top_logp"] = parts["top_logp"] if self.top_k else None
        out["top_ids"] = parts["top_ids"].long() if self.top_k else None
        out["ids_logp"] = parts["ids_logp"] if self.ids else None
        return out


def logits_of(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """All logits [N, T, V] divided by the sampling temperature (vLLM's processed
    log-probs are taken after the same division). The full computation: for checks and
    for models ``token_stats`` cannot slice."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits if temperature == 1.0 else logits / temperature


def _values(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    asked: Asked,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``asked``'s columns [..., width] of logits [..., V] at targets [...] (and ``ids``
    [..., K] long), in float32 (or the logits' own dtype when wider)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    columns = [logprobs.gather(-1, targets.unsqueeze(-1))]
    if asked.entropy:
        columns.append(-(logprobs.exp() * logprobs).sum(-1, keepdim=True))
    if asked.top_k:
        top = logprobs.topk(asked.top_k, dim=-1)
        columns += [top.values, top.indices.to(logprobs.dtype)]
    if asked.ids:
        columns.append(logprobs.gather(-1, ids))
    return torch.cat(columns, dim=-1)


def _head_values(hidden, weight, bias, targets, temperature: float, asked: Asked, ids):
    return _values(F.linear(hidden, weight, bias), targets, temperature, asked, ids)


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
    options: PassOptions | None = None,
    plan: PassPlan | None = None,
    top_k: int = 0,
    at_ids: torch.Tensor | None = None,
) -> TokenStats:
    """Log-probs (and entropies) of ids [N, T] (right-padded) at the positions where
    ``mask`` [N, T-1] is non-zero; gradients flow when grad mode is on. ``options``
    (None: the defaults) choose the chunk size, prefix sharing and padding-free packing
    (above). ``plan``: the pass's decisions made beforehand on the host (``pass_plan`` of
    the same rows), so the pass reads nothing back from the device; None: made here from
    the tensors given (which reads them on the host). ``top_k``: also the K most likely
    tokens and their log-probs (a teacher's, for distillation's forward_kl_topk);
    ``at_ids`` [N, T-1, K] long: also the log-probs of those ids (the student's of the
    teacher's top k), with their gradient. Both are computed chunk by chunk like the
    sampled token's, so no [tokens, vocab] tensor of the whole pass exists at once.

    One forward pass always runs, even for a mask with no token (a placeholder row keeps
    FSDP2's collectives in step): its last column is computed then, and left in the
    outputs at a position every reader masks, so the loss stays connected to the graph."""
    options = options or PassOptions()
    if plan is None:
        plan = pass_plan(model, input_ids, attention_mask, mask, options)
    counts = {"computed": plan.computed, "real": plan.real, "tokens": plan.tokens}
    asked = Asked(entropy, top_k, 0 if at_ids is None else at_ids.shape[-1])
    if plan.select is None:  # a model whose head cannot be sliced: the full computation
        keep = mask > 0
        if plan.placeholder:
            keep = torch.zeros_like(keep)
            keep[:, -1] = True
        logits = logits_of(model, input_ids, attention_mask)[:, :-1]
        values = _values(logits, input_ids[:, 1:], temperature, asked, at_ids)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        values = torch.where(keep[..., None], values, zero)
        return TokenStats(**asked.split(values), **counts)
    if plan.pack is not None:
        return _packed_stats(model, input_ids, plan, temperature, asked, options, counts, at_ids)
    inputs = {"attention_mask": _padded_mask(attention_mask, plan.masking)}
    values = _sliced(model, input_ids, plan.select, temperature, asked, options, at_ids, **inputs)
    return TokenStats(**asked.split(values), **counts)


def _padded_mask(attention_mask: torch.Tensor, masking: str) -> torch.Tensor | None:
    """The attention mask a padded pass gives the model (``PassPlan.masking``): none for
    rows without padding (plain causal attention), or the [N, 1, T, T] causal mask over
    the real keys built here with fixed-shape operations, in the form sdpa (bool) or
    eager (additive float) attention takes. From a [N, T] mask, transformers would first
    ask whether it has any padding at all, a read of the device on the host."""
    if masking == "given":
        return attention_mask
    if masking == "causal":
        return None
    width = attention_mask.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool, device=attention_mask.device).tril()
    attend = causal[None, None] & (attention_mask[:, None, None, :] > 0)  # [N, 1, T, T]
    if masking == "eager":
        zero = torch.zeros((), device=attend.device)
        attend = torch.where(attend, zero, torch.finfo(torch.float32).min)
    return attend


@dataclass
class Selection:
    """The masked positions of a pass's [N, T-1] targets, as index tensors on the pass's
    device: the columns that hold at least one (the hidden states kept before the head),
    and each position's row and place among those columns, in row-major order."""

    cols: torch.Tensor  # [K] long
    rows: torch.Tensor  # [M] long
    at: torch.Tensor  # [M] long, into ``cols``

    @classmethod
    def of(cls, keep: torch.Tensor, device) -> Selection:
        """From a host mask ``keep`` [N, T-1] (bool)."""
        cols = keep.any(dim=0).nonzero().flatten()
        rows, at = keep[:, cols].nonzero(as_tuple=True)
        return cls(*(x.to(device) for x in (cols, rows, at)))


@dataclass
class PassPlan:
    """What one pass computes, decided from host copies of its ids and masks
    (``pass_plan``): which positions, whether its rows are packed and how, and what it
    computes and holds (``TokenStats``' counts)."""

    placeholder: bool  # no masked position: the last column is computed instead
    select: Selection | None  # None: the model's head cannot be sliced (full computation)
    pack: Packing | None = None  # the packed rows, or None for the padded pass
    # Packed: each masked position's row and column in the batch, and its packed row and
    # column there ([M] long each).
    place: tuple[torch.Tensor, ...] | None = None
    # The padded pass's attention mask (``_padded_mask``): "causal" (no padding: none),
    # "sdpa" or "eager" (a [N, 1, T, T] mask of that form), "given" (the [N, T] mask)
    masking: str = "given"
    computed: int = 0
    real: int = 0
    tokens: int = 0


def pass_plan(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    options: PassOptions | None = None,
    device: torch.device | None = None,
) -> PassPlan:
    """The plan of ``token_stats``' pass over ids [N, T] with ``mask`` [N, T-1], made from
    host copies of them (they are read on the host: call it with the host copies before
    the batch goes to the device, ``device`` being the pass's). Its tensors are on
    ``device`` (None: the ids')."""
    options = options or PassOptions()
    device = input_ids.device if device is None else device
    ids, attn, keep = input_ids.cpu(), attention_mask.cpu(), (mask > 0).cpu()
    n, t = ids.shape
    tokens = int(attn.sum())
    placeholder = not bool(keep.any())
    if placeholder:
        keep = torch.zeros_like(keep)
        keep[:, -1] = True
    counts = {"computed": n * t, "real": tokens, "tokens": tokens}
    if not _sliceable(model):
        return PassPlan(placeholder, None, **counts)
    pack = None
    if (options.share_prefix or options.padding_free) and not placeholder:
        pack = _packing(model, ids, attn, keep, options)
    if pack is None:
        masking = _masking(model, attn)
        return PassPlan(placeholder, Selection.of(keep, device), masking=masking, **counts)
    place, packed_keep = _placing(pack, keep)
    counts.update(computed=pack.ids.numel(), real=pack.real)
    moved = {f: getattr(pack, f) for f in ("ids", "positions", "row", "start", "cut", "rest")}
    attend = None if pack.attend is None else pack.attend.to(device)
    pack = Packing(**{k: v.to(device) for k, v in moved.items()}, attend=attend, real=pack.real)
    place = tuple(x.to(device) for x in place)
    return PassPlan(False, Selection.of(packed_keep, device), pack, place, **counts)


def _masking(model, attention_mask: torch.Tensor) -> str:
    """How a padded pass over rows with this host ``attention_mask`` [N, T] gives its mask
    (``PassPlan.masking``): built here for sdpa and eager attention (not where a row is
    longer than the model's sliding window, which a mask given replaces), else as is."""
    if bool(attention_mask.all()):
        return "causal"
    config = getattr(_inner(model), "config", None)
    attn_impl = str(getattr(config, "_attn_implementation", None))
    window = getattr(config, "sliding_window", None)
    if attn_impl in ("sdpa", "eager") and not (window and attention_mask.shape[1] > window):
        return attn_impl
    return "given"


def _sliced(
    model, input_ids, select: Selection, temperature, asked: Asked, options: PassOptions,
    at_ids=None, **inputs,
):  # fmt: skip
    """One forward pass of ids [N, T] (``inputs``: the model's other arguments) with the
    hidden states sliced to the columns ``select`` keeps and the log-softmax at the
    targets computed from them: ``asked``'s columns [N, T-1, width], 0 where ``select``
    holds no position (``at_ids`` [N, T-1, K]: the given ids). Index tensors only:
    nothing is read back on the host."""
    n, t = input_ids.shape
    cols = select.cols[select.at]  # [M] each position's column among the targets
    targets = input_ids[:, 1:][select.rows, cols]
    ids = None if at_ids is None else at_ids[select.rows, cols]  # [M, K]
    kept = _Kept((select.rows, select.at), targets, temperature, asked, ids)
    # use_cache off: a learner's pass never decodes, so no KV cache is built
    forward = partial(
        model, input_ids=input_ids, logits_to_keep=select.cols, use_cache=False, **inputs
    )
    if options.chunk_tokens > 0 or options.fused_head:
        values = _chunked_values(_inner(model), forward, kept, options)
    else:
        values = _full_values(forward, kept)

    full = torch.zeros((n, t - 1, asked.width), dtype=values.dtype, device=values.device)
    return full.index_put((select.rows, cols), values)


@dataclass
class _Kept:
    """The masked positions among a pass's kept columns, and what to compute there."""

    # The masked positions of the [N, K] kept columns: (rows [M], columns [M]) long, in
    # row-major order, so ``hidden[keep]`` [N, K, H] -> [M, H] (an index, not a boolean
    # mask: selecting by a mask would read its count back on the host)
    keep: tuple[torch.Tensor, torch.Tensor]
    targets: torch.Tensor  # [M] long: the target of each, in the same order
    temperature: float
    asked: Asked
    ids: torch.Tensor | None = None  # [M, K] long: given ids (``Asked.ids``)


def _chunked_values(inner, forward, kept: _Kept, options: PassOptions) -> torch.Tensor:
    """[M, 1] log-probs, or [M, 2] with the entropies, of the masked positions: the
    model's ``forward`` with its head (of ``inner``, the transformers model) replaced by
    the chunked log-softmax, or with ``options.fused_head`` by the fused head
    (learners/fused_head.py, chunks of ``chunk_tokens`` positions, 0: one)."""
    head = inner.get_output_embeddings()
    chunk_tokens, asked = options.chunk_tokens, kept.asked
    if options.fused_head and (asked.top_k or asked.ids):
        raise ValueError(
            "learner.fused_head computes the sampled token's log-prob and entropy only, not "
            "the top-k log-probs distillation.loss_mode=forward_kl_topk needs"
        )
    calls = []

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:  # hidden: [N, K, H]
        """What the model returns as its "logits". The loss is computed from this very
        output, so FSDP2's hooks on the root module's outputs see the backward pass."""
        calls.append(1)
        chosen = hidden[kept.keep]  # [M, H]
        if options.fused_head:
            return head_values(
                chosen, head.weight, head.bias, kept.targets, kept.temperature, asked.entropy,
                chunk_tokens,
            )  # fmt: skip
        parts = []
        for start in range(0, len(chosen), chunk_tokens):
            part = slice(start, start + chunk_tokens)
            args = (
                chosen[part], head.weight, head.bias, kept.targets[part], kept.temperature,
                asked, None if kept.ids is None else kept.ids[part],
            )  # fmt: skip
            if start > 0 and torch.is_grad_enabled():
                parts.append(checkpoint(_head_values, *args, use_reentrant=False))
            else:
                parts.append(_head_values(*args))
        return torch.cat(parts)

    head.forward = head_forward  # an instance attribute: this call only
    try:
        values = forward().logits
    finally:
        del head.forward
    if not calls or values.shape != (len(kept.targets), asked.width):
        raise RuntimeError(f"{type(inner).__name__}'s forward did not return its head's output")
    return values


def _full_values(forward, kept: _Kept) -> torch.Tensor:
    """As ``_chunked_values``, through the model's own head: the [N, K, V] logits of every
    kept column at once (``chunk_tokens=0``)."""
    logits = forward().logits  # [N, K, V]
    return _values(logits[kept.keep], kept.targets, kept.temperature, kept.asked, kept.ids)


@dataclass
class Packing:
    """Rows [N] packed into ``ids`` [B, S]: packed row ``row[i]`` holds row i's prefix (its
    first ``cut[i]`` tokens, shared with the other rows of its family there; none when
    ``cut[i]`` is 0) and row i's remainder ids[i, cut[i]:] from column ``start[i]`` on."""

    ids: torch.Tensor  # [B, S] long
    positions: torch.Tensor  # [B, S] long: each token's position in its own row
    # [B, 1, S, S]: where query (dim 2) may attend key (dim 3), in the form the model's
    # attention takes: bool for sdpa, additive float (0 or the float32 minimum) for eager;
    # None for flash attention (B = 1, boundaries where the positions restart at 0)
    attend: torch.Tensor | None
    row: torch.Tensor  # [N] long
    start: torch.Tensor  # [N] long
    cut: torch.Tensor  # [N] long
    rest: torch.Tensor  # [N] long: tokens of each row's remainder
    real: int  # real tokens in ``ids``


@dataclass
class _Piece:
    """A prefix and the rows whose remainders follow it, within one packed row."""

    prefix: tuple
    rows: list[int]
    size: int  # tokens: the prefix and the remainders


def _packing(model, input_ids, attention_mask, keep, options: PassOptions) -> Packing | None:
    """The packing of this pass's rows, or None where the padded pass is to run.

    Sharing: a row's prefix is everything before the position that predicts its first
    masked target, so every log-prob comes from a remainder; the rows of one prefix go
    into one piece while it stays within ``pack_tokens`` (else into several, each with
    its own copy of the prefix). Without sharing each row is a piece of its own with no
    prefix. Each piece is a packed row, or (padding-free) pieces fill packed rows end to
    end."""
    inner = _inner(model)
    attn_impl = str(getattr(getattr(inner, "config", None), "_attn_implementation", None))
    varlen = options.padding_free and attn_impl.startswith("flash_attention")
    if not varlen and attn_impl not in ("sdpa", "eager"):
        return None
    if getattr(inner, "is_gradient_checkpointing", False):
        return None
    n, t = input_ids.shape
    length = attention_mask.sum(dim=1)
    if bool((attention_mask != (torch.arange(t, device=length.device) < length[:, None])).any()):
        return None  # not right-padded
    cut = torch.zeros_like(length)
    if options.share_prefix and not varlen:
        first = torch.where(keep.any(dim=1), keep.int().argmax(dim=1), length - 1)
        cut = torch.minimum(first, length - 1).clamp(min=0)
        if not options.padding_free and bool((cut < 1).any()):
            return None
    ids, cuts, lengths = input_ids.tolist(), cut.tolist(), length.tolist()
    families: dict[tuple, list[int]] = {}
    for i, (row, c) in enumerate(zip(ids, cuts, strict=True)):
        families.setdefault(tuple(row[:c]), []).append(i)
    if not options.padding_free and len(families) == n:
        return None
    rests = [x - c for x, c in zip(lengths, cuts, strict=True)]
    pieces = _pieces(families, rests, options.pack_tokens)
    if not options.padding_free:
        packed = [[p] for p in pieces]
    else:
        packed = _fill(pieces, None if varlen else options.pack_tokens)
    b, width = len(packed), max(sum(p.size for p in r) for r in packed)
    saves = b * width < n * t if options.padding_free else b * width <= SHARE_WHEN * n * t
    window = getattr(inner.config, "sliding_window", None)
    if not saves or (not varlen and window and width > window):
        return None  # (a packed row would need the window in the mask given: it replaces it)
    return _build(packed, ids, cuts, lengths, attn_impl, varlen, input_ids.device)


def _pieces(families: dict[tuple, list[int]], rests: list[int], pack_tokens: int):
    """Each family's rows in pieces of at most ``pack_tokens`` (one row at least); rows
    without a prefix a piece each."""
    pieces: list[_Piece] = []
    for prefix, rows in families.items():
        for i in rows:
            last = pieces[-1] if pieces else None
            joins = bool(prefix) and last is not None and last.prefix is prefix
            if not joins or last.size + rests[i] > pack_tokens:
                last = _Piece(prefix, [], len(prefix))  # another copy of the prefix
                pieces.append(last)
            last.rows.append(i)
            last.size += rests[i]
    return pieces


def _fill(pieces: list[_Piece], pack_tokens: int | None) -> list[list[_Piece]]:
    """Pieces end to end in as few packed rows of at most ``pack_tokens`` (None: one row)
    as this finds, balanced: longest first, each onto the shortest row, so the rows end
    close together and little padding is left at their ends."""
    if pack_tokens is None:
        return [pieces]
    ordered = sorted(pieces, key=lambda p: -p.size)
    limit = max(pack_tokens, ordered[0].size)  # a piece longer than a row gets one alone
    b = -(-sum(p.size for p in pieces) // limit)
    while True:
        rows: list[list[_Piece]] = [[] for _ in range(b)]
        load = [0] * b
        for piece in ordered:
            at = load.index(min(load))
            rows[at].append(piece)
            load[at] += piece.size
        if max(load) <= limit:
            return rows
        b += 1


def _build(packed, ids, cuts, lengths, attn_impl, varlen: bool, device) -> Packing:
    """The tensors of the packed rows ``packed`` (lists of pieces), on ``device``."""
    n = len(ids)
    b, width = len(packed), max(sum(p.size for p in r) for r in packed)
    out = torch.zeros((b, width), dtype=torch.long)
    positions = torch.zeros_like(out)
    segment = torch.full((b, width), -2, dtype=torch.long)  # -1 prefix, i row i, -2 padding
    piece_of = torch.full((b, width), -1, dtype=torch.long)  # the piece, -1 padding
    row_of, start_of = [0] * n, [0] * n
    pieces_so_far = 0
    for r, pieces in enumerate(packed):
        at = 0
        for piece in pieces:
            c = len(piece.prefix)
            out[r, at : at + c] = torch.tensor(piece.prefix, dtype=torch.long)
            positions[r, at : at + c] = torch.arange(c)
            segment[r, at : at + c] = -1
            piece_of[r, at : at + piece.size] = pieces_so_far
            at, pieces_so_far = at + c, pieces_so_far + 1
            for i in piece.rows:
                rest = lengths[i] - cuts[i]
                out[r, at : at + rest] = torch.tensor(ids[i][cuts[i] : lengths[i]])
                positions[r, at : at + rest] = torch.arange(cuts[i], lengths[i])
                segment[r, at : at + rest] = i
                row_of[i], start_of[i] = r, at
                at += rest
    attend = None if varlen else _attend(segment, piece_of, attn_impl)
    cut = torch.tensor(cuts, device=device)
    return Packing(
        ids=out.to(device),
        positions=positions.to(device),
        attend=None if attend is None else attend.to(device),
        row=torch.tensor(row_of, device=device),
        start=torch.tensor(start_of, device=device),
        cut=cut,
        rest=torch.tensor(lengths, device=device) - cut,
        real=sum(p.size for r in packed for p in r),
    )


def _attend(segment: torch.Tensor, piece_of: torch.Tensor, attn_impl: str) -> torch.Tensor:
    """[B, 1, S, S] from each column's segment and piece [B, S]: causal within a row's
    remainder; a remainder also sees its own piece's prefix; padding sees itself."""
    width = segment.shape[1]
    cols = torch.arange(width)
    causal = cols[None, :] <= cols[:, None]
    same = segment[:, :, None] == segment[:, None, :]
    prefix = segment[:, None, :] == -1
    attend = causal & (piece_of[:, :, None] == piece_of[:, None, :]) & (same | prefix)
    attend |= torch.eye(width, dtype=torch.bool)
    if attn_impl == "eager":
        attend = torch.zeros(attend.shape).masked_fill(~attend, torch.finfo(torch.float32).min)
    return attend[:, None]


def _placing(pack: Packing, keep: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """On the host: where each masked position of ``keep`` [N, T-1] is computed among the
    packed rows. Returns ((rows, columns, packed rows, packed columns), [M] long each, in
    the packed targets' row-major order) and the packed rows' mask [B, S-1]."""
    b, width = pack.ids.shape
    # Row i's remainder offset s (a target inside the remainder) <-> packed column
    # start + s <-> the row's column cut + s.
    offsets = torch.arange(width - 1)
    inside = offsets[None, :] < (pack.rest - 1)[:, None]  # [N, S-1]
    rows, offs = inside.nonzero(as_tuple=True)
    orig = pack.cut[rows] + offs
    packed_row, packed_col = pack.row[rows], pack.start[rows] + offs
    wanted = keep[rows, orig]
    place = tuple(x[wanted] for x in (rows, orig, packed_row, packed_col))
    packed_keep = torch.zeros((b, width - 1), dtype=torch.bool)
    packed_keep[place[2], place[3]] = True
    return place, packed_keep


def _packed_stats(
    model, input_ids, plan: PassPlan, temperature, asked: Asked, options: PassOptions,
    counts: dict, at_ids=None,
) -> TokenStats:  # fmt: skip
    """One pass over the packed rows of ``plan``; outputs as ``token_stats``'s, [N, T-1]
    (``at_ids`` [N, T-1, K] moved to the packed rows' places first)."""
    n, t = input_ids.shape
    pack, (rows, orig, packed_row, packed_col) = plan.pack, plan.place
    inputs = {"position_ids": pack.positions}
    if pack.attend is not None:
        inputs["attention_mask"] = pack.attend
    if at_ids is not None:
        b, s = pack.ids.shape
        packed = at_ids.new_zeros((b, s - 1, at_ids.shape[-1]))
        at_ids = packed.index_put((packed_row, packed_col), at_ids[rows, orig])
    values = _sliced(model, pack.ids, plan.select, temperature, asked, options, at_ids, **inputs)
    full = torch.zeros((n, t - 1, asked.width), dtype=values.dtype, device=values.device)
    full = full.index_put((rows, orig), values[packed_row, packed_col])  # [B, S-1] -> [N, T-1]
    return TokenStats(**asked.split(full), **counts)
