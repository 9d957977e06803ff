"""The fused head (learners/fused_head.py) against the chunked head of
learners/logprobs.py: the same log-probs and entropies and the same gradients (hidden
states, weight, bias), with and without temperature and entropy; through a model's pass
(``PassOptions.fused_head``); and nothing of the [tokens x vocabulary] logits kept for
the backward (the saved tensors, inspected)."""

import pytest
import torch

from learners.fused_head import FusedHead, head_values
from learners.logprobs import Asked, PassOptions, _head_values, token_stats
from tests.unit.test_logprobs import _batch, _model

M, H, V = 13, 16, 97


def _inputs(dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(M, H, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (M,), generator=g)
    upstream = torch.randn(M, 2, generator=g, dtype=dtype)  # what the loss sends back
    return hidden, weight, b, targets, upstream


def _chunked(hidden, weight, bias, targets, temperature, entropy, chunk):
    """The chunked head as learners/logprobs.py runs it: ``_head_values`` per chunk,
    every chunk after the first under activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    parts = []
    for start in range(0, M, chunk):
        args = (hidden[start : start + chunk], weight, bias, targets[start : start + chunk],
                temperature, Asked(entropy), None)  # fmt: skip
        parts.append(checkpoint(_head_values, *args, use_reentrant=False) if start else
                     _head_values(*args))  # fmt: skip
    return torch.cat(parts)


def _grads(values, upstream, leaves):
    loss = (values * upstream[:, : values.shape[1]]).sum()
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [4, 0, 64])
def test_values_and_gradients_equal_the_chunked_head(temperature, entropy, bias, chunk):
    hidden, weight, b, targets, upstream = _inputs(bias=bias)
    leaves = (hidden, weight, b)
    ref = _chunked(hidden, weight, b, targets, temperature, entropy, chunk or M)
    fused = head_values(hidden, weight, b, targets, temperature, entropy, chunk)
    assert fused.shape == ref.shape == (M, 2 if entropy else 1) and fused.dtype == ref.dtype
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(fused, upstream, leaves), _grads(ref, upstream, leaves),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_entropy_gradient_is_minus_p_times_log_p_plus_entropy():
    """Float64 finite differences of the function itself (torch.autograd.gradcheck),
    with a bias, a temperature and both outputs."""
    g = torch.Generator().manual_seed(3)
    hidden, weight, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                         for s in ((7, 4), (11, 4), (11,)))  # fmt: skip
    targets = torch.randint(0, 11, (7,), generator=g)

    def f(h, w, bias):
        return FusedHead.apply(h, w, bias, targets, 0.7, True, 3, None)

    assert torch.autograd.gradcheck(f, (hidden, weight, b), eps=1e-6, atol=1e-6)


def test_gradients_of_a_model_equal_the_chunked_pass():
    """Through a model's forward (the head replaced for the call, as the learner does):
    every parameter's gradient, with entropy and temperature, a tied and an untied head."""
    for tie in (False, True):
        ids, attn, mask = _batch()
        weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
        runs = []
        for fused in (False, True):
            model = _model(tie)
            options = PassOptions(chunk_tokens=5, fused_head=fused)
            stats = token_stats(model, ids, attn, mask, 0.7, entropy=True, options=options)
            ((stats.logp * weights + 0.1 * stats.entropy) * mask).sum().backward()
            runs.append((stats, [p.grad for p in model.parameters()]))
        (plain, plain_grads), (fused, fused_grads) = runs
        torch.testing.assert_close(fused.logp, plain.logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused.entropy, plain.entropy, atol=1e-5, rtol=1e-5)
        for got, want in zip(fused_grads, plain_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _saved_shapes(run) -> list[tuple[int, ...]]:
    """Shapes of every tensor autograd saves for the backward while ``run`` builds its
    graph."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return shapes


def test_no_logits_are_saved_for_the_backward():
    """The chunked head saves its first chunk's [chunk, V] logits and log-softmax (the
    check sees them); the fused head saves its inputs only: the weight is the one
    tensor with V rows."""
    hidden, weight, b, targets, _ = _inputs()
    chunked = _saved_shapes(lambda: _chunked(hidden, weight, b, targets, 0.7, True, 4))
    assert any(s[-1] == V and len(s) == 2 and s[0] <= M for s in chunked)
    fused = _saved_shapes(lambda: head_values(hidden, weight, b, targets, 0.7, True, 4))
    assert sorted(fused) == sorted([(M, H), (V, H), (V,), (M,)])


def test_autocast_runs_the_product_in_its_dtype_as_the_chunked_head_does():
    """Under bf16 autocast (a CUDA learner's; CPU autocast here) the product runs in
    bf16 and the statistics in float32, forward and backward, as in the chunked head."""
    hidden, weight, b, targets, upstream = _inputs(bias=False)
    leaves = (hidden, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _chunked(hidden, weight, None, targets, 1.0, True, 4)
        fused = head_values(hidden, weight, None, targets, 1.0, True, 4)
    assert fused.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    got, want = _grads(fused, upstream, leaves), _grads(ref, upstream, leaves)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)  # bf16 products
