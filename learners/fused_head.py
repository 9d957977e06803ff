"""The output head fused with the log-prob and entropy it feeds (``learner.fused_head``).

``head_values(hidden [M, H], weight [V, H], bias [V] | None, targets [M], ...)`` returns
[M, 1] log-probs at the targets, or [M, 2] with the entropies, of
``z = (hidden @ weight.T + bias) / temperature``, computed chunk by chunk over the M
positions. Autograd keeps only the inputs: each chunk's [chunk, V] logits are made in
the forward, reduced to two numbers a position and freed; the backward makes them once
more, chunk by chunk, and turns them into the gradients of ``hidden``, ``weight`` and
``bias`` at once. So no [M, V] tensor, nor one per chunk, is kept for the backward (the
chunked head of learners/logprobs.py keeps the first chunk's and recomputes the others
through activation checkpointing, which also runs each chunk's forward a second time to
rebuild its graph; here the backward builds no graph).

The gradients, per position with p = softmax(z), log p = log_softmax(z), t the target,
and g_lp, g_ent the gradients arriving at the two outputs:

    d log p_t / dz_j = [j = t] - p_j
    H = -sum_j p_j log p_j,   dH/dz_j = -p_j (log p_j + H)
    dL/dz = g_lp ([j = t] - p) - g_ent p (log p + H)

then through the division by the temperature and the linear map:
``dL/dlogits = dL/dz / T``, ``dL/dhidden = dL/dlogits @ weight``,
``dL/dweight = dL/dlogits.T @ hidden``, ``dL/dbias = sum over positions of dL/dlogits``.

Precision follows the chunked head's: the product runs in the autocast dtype when
autocast is on (bf16 on a CUDA learner), else in the inputs' dtype, and the softmax
statistics in float32 (float64 for a float64 model). The backward's products run in the
same dtype as the forward's, with the gradients returned in each input's own dtype, as
autocast's backward returns them.

Liger's ``LigerFusedLinearCrossEntropyFunction`` is not used, on CUDA either: it returns
the cross-entropy (a log-prob's negative) only, no entropy, and computes its gradients in
its forward for a loss reduced to one number (its backward scales them by that number's
gradient). In the releases that accept ``reduction="none"`` with a per-token upstream
gradient it could serve a pass without entropy; that path has not been run here (no
GPU), so this function serves every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def head_values(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    chunk_tokens: int,
) -> torch.Tensor:
    """[M, 1] log-probs at ``targets`` [M] (long) of the head over ``hidden`` [M, H], or
    [M, 2] with the entropies; ``chunk_tokens`` positions at a time (0: all at once)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    chunk = chunk_tokens if chunk_tokens > 0 else max(len(hidden), 1)
    return FusedHead.apply(hidden, weight, bias, targets, temperature, entropy, chunk, dtype)


def _log_softmax(h, weight, bias, temperature):
    """log_softmax [C, V] of a chunk's logits over the temperature, in float32 or wider;
    ``weight`` and ``bias`` already in the product's dtype."""
    logits = F.linear(h.to(weight.dtype), weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def _entropy(p: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sum_j p_j log p_j of each row of [C, V], as [C, 1], without a [C, V] product."""
    return -torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).squeeze(-1)


def _in(dtype, weight, bias):
    """The head's weight and bias in the product's dtype (cast once per pass)."""
    return weight.to(dtype), None if bias is None else bias.to(dtype)


class FusedHead(torch.autograd.Function):
    """``head_values`` under autograd (module docstring): the forward keeps the inputs
    alone, the backward recomputes each chunk's log-softmax."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, entropy, chunk, dtype):
        dtype = dtype or hidden.dtype
        width = 2 if entropy else 1
        stat = torch.promote_types(dtype, torch.float32)
        out = torch.empty((len(hidden), width), dtype=stat, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _in(dtype, weight, bias)
            for start in range(0, len(hidden), chunk):
                end = start + chunk
                logp = _log_softmax(hidden[start:end], w, b, temperature)
                out[start:end, 0] = logp.gather(-1, targets[start:end, None]).squeeze(-1)
                if entropy:
                    out[start:end, 1] = _entropy(logp.exp(), logp).squeeze(-1)
                del logp
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.settings = (temperature, entropy, chunk, dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: [M, width]
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, entropy, chunk, dtype = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)  # sums over the chunks
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _in(dtype, weight, bias)
            for start in range(0, len(hidden), chunk):
                end = start + chunk
                h, t = hidden[start:end], targets[start:end]
                # In place where it can be: a chunk's [C, V] float32 tensors are the
                # backward's peak (log p, p, dz).
                logp = _log_softmax(h, w, b, temperature)
                p = logp.exp()
                g = grad_out[start:end].to(p.dtype)
                dz = p * -g[:, :1]  # d log p_t / dz = onehot(t) - p
                dz.scatter_add_(1, t[:, None], g[:, :1])
                if entropy:  # dH/dz = -p (log p + H)
                    logp.add_(_entropy(p, logp)).mul_(p)
                    dz.addcmul_(logp, g[:, 1:2], value=-1.0)
                del logp, p
                if temperature != 1.0:
                    dz.div_(temperature)
                dz = dz.to(dtype)
                if need_h:
                    grad_h[start:end] = (dz @ w).to(hidden.dtype)
                if need_w:
                    grad_w += (dz.T @ h.to(dtype)).to(acc)
                if need_b:
                    grad_b += dz.sum(0).to(acc)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None
