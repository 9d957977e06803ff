"""Log-probs and entropies at the loss mask's positions only (learners/logprobs.py),
pinned against the full computation: every position's logits, then the mask."""

import pytest
import torch

from learners.logprobs import PassOptions, _packing, logits_of, token_stats
from verl_async.algos import token_entropy, token_logprobs

VOCAB = 97


def _model(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.float32)


def _batch():
    """Right-padded rows with different prompt lengths; the mask covers each row's response
    but for an observation gap in row 1; prompts and padding hold junk ids."""
    g = torch.Generator().manual_seed(1)
    n, t = 4, 14
    ids = torch.randint(0, VOCAB, (n, t), generator=g)
    lengths = [(5, 6), (3, 10), (8, 4), (2, 12)]  # (prompt, response)
    attn = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t - 1)
    for i, (p, r) in enumerate(lengths):
        attn[i, : p + r] = 1
        mask[i, p - 1 : p - 1 + r] = 1
    mask[1, 5:8] = 0  # an observation inside row 1's response
    return ids, attn, mask


class NoSlicing(torch.nn.Module):
    """A model whose forward takes no ``logits_to_keep``: the full path."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def _full_stats(model, ids, attn, temperature):
    """Every position's log-probs and entropies [N, T-1] from the whole logits: float32
    (``token_logprobs``, ``token_entropy``), or float64 for a float64 model."""
    full = logits_of(model, ids, attn, temperature)
    if full.dtype != torch.float64:
        return token_logprobs(full, ids[:, 1:]), token_entropy(full)[:, :-1]
    logprobs = torch.log_softmax(full[:, :-1], dim=-1)
    logp = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp, -(logprobs.exp() * logprobs).sum(-1)


# (values, gradients) tolerances, (atol, rtol): float64 to rounding of sums taken in
# another order; float32 as the head's matmul over 32 hidden units in chunks or whole.
TOL = {
    torch.float64: ({"atol": 1e-12, "rtol": 1e-10}, {"atol": 1e-12, "rtol": 1e-9}),
    torch.float32: ({"atol": 1e-5, "rtol": 1e-5}, {"atol": 1e-5, "rtol": 1e-4}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [1024, 5, 1, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_full_computation(dtype, tie, chunk, temperature):
    """Chunked (and ``chunk_tokens=0``: the model's own head over the kept columns)
    against every position's logits, with the untied head and the tied one of SmolLM2."""
    model = _model(tie).to(dtype)
    ids, attn, mask = _batch()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))

    ref_logp, ref_ent = _full_stats(model, ids, attn, temperature)
    ((ref_logp * weights + 0.1 * ref_ent) * mask).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    options = PassOptions(chunk_tokens=chunk)
    stats = token_stats(model, ids, attn, mask, temperature, entropy=True, options=options)
    ((stats.logp * weights + 0.1 * stats.entropy) * mask).sum().backward()
    on = mask > 0
    values, grads = TOL[dtype]
    assert stats.logp.dtype == stats.entropy.dtype == ref_logp.dtype
    torch.testing.assert_close(stats.logp[on], ref_logp[on], **values)
    torch.testing.assert_close(stats.entropy[on], ref_ent[on], **values)
    assert (stats.logp[~on] == 0).all() and (stats.entropy[~on] == 0).all()
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, **grads)


def test_prompt_junk_changes_nothing_the_mask_covers():
    """Targets outside the mask are never read: other junk ids after the responses (in
    padding) leave every masked value as it was."""
    model = _model()
    ids, attn, mask = _batch()
    before = token_stats(model, ids, attn, mask, entropy=True)
    junk = ids.clone()
    junk[attn == 0] = (junk[attn == 0] + 13) % VOCAB
    after = token_stats(model, junk, attn, mask, entropy=True)
    torch.testing.assert_close(after.logp, before.logp)
    torch.testing.assert_close(after.entropy, before.entropy)


def test_a_model_without_logits_to_keep_takes_the_full_path():
    model = _model()
    ids, attn, mask = _batch()
    sliced = token_stats(model, ids, attn, mask, 0.7, entropy=True)
    whole = token_stats(NoSlicing(model), ids, attn, mask, 0.7, entropy=True)
    torch.testing.assert_close(sliced.logp, whole.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sliced.entropy, whole.entropy, atol=1e-5, rtol=1e-5)


def test_an_empty_mask_still_runs_a_pass_with_a_gradient():
    """A placeholder micro-batch (nothing to learn from) must still run forward and
    backward, so FSDP2 ranks stay in step: its loss is connected to the weights."""
    model = _model()
    ids, attn, mask = _batch()
    empty = torch.zeros_like(mask)
    stats = token_stats(model, ids[:1], attn[:1], empty[:1])
    (stats.logp * empty[:1]).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert stats.entropy is None


def test_the_head_is_restored_after_the_call():
    model = _model()
    ids, attn, mask = _batch()
    token_stats(model, ids, attn, mask)
    assert "forward" not in vars(model.lm_head)
    assert model(input_ids=ids, attention_mask=attn).logits.shape == (*ids.shape, VOCAB)


# ------------------------------------------------------------------ shared prefixes


def _groups(sizes=(4, 3, 1), prompts=(20, 16, 18), junk_pad: bool = True):
    """GRPO-like rows: groups of samples sharing a prompt, responses of different
    lengths (one with an observation gap), right-padded with junk ids."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for size, p in zip(sizes, prompts, strict=True):
        prompt = torch.randint(0, VOCAB, (p,), generator=g)
        for k in range(size):
            r = 2 + (3 * k + p) % 5
            rows.append((prompt, torch.randint(0, VOCAB, (r,), generator=g)))
    n, t = len(rows), max(len(p) + len(r) for p, r in rows)
    ids = torch.randint(0, VOCAB, (n, t), generator=g) if junk_pad else torch.zeros(n, t).long()
    attn = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t - 1)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p)], ids[i, len(p) : len(p) + len(r)] = p, r
        attn[i, : len(p) + len(r)] = 1
        mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
    mask[1, len(rows[1][0])] = 0  # an observation token inside row 1's response
    return ids, attn, mask


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("pack_tokens", [2048, 30])
def test_shared_prefixes_give_the_single_pass_values_and_gradients(attn_impl, pack_tokens):
    """Rows of a group compute their prompt once (packed with a block mask, or, when a
    packed row would pass ``pack_tokens``, several packed rows with a copy of it each):
    every masked log-prob and entropy, and every gradient, equal the plain pass's."""
    model = _model(tie=True)
    model.config._attn_implementation = attn_impl
    ids, attn, mask = _groups()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))

    def run(share: bool):
        model.zero_grad()
        options = PassOptions(share_prefix=share, pack_tokens=pack_tokens)
        stats = token_stats(model, ids, attn, mask, 0.8, entropy=True, options=options)
        ((stats.logp * weights + 0.1 * stats.entropy) * mask).sum().backward()
        return stats, [p.grad.clone() for p in model.parameters()]

    (plain, plain_grads), (shared, shared_grads) = run(False), run(True)
    on = mask > 0
    torch.testing.assert_close(shared.logp[on], plain.logp[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.entropy[on], plain.entropy[on], atol=1e-5, rtol=1e-5)
    assert (shared.logp[~on] == 0).all() and (shared.entropy[~on] == 0).all()
    for got, ref in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    # What was computed: the plain pass every padded position; the packed one each prompt
    # once (less its last token, the first of every remainder; once per packed row),
    # without padding but at the packed rows' ends.
    assert plain.computed == ids.numel() and plain.real == plain.tokens == int(attn.sum())
    assert shared.tokens == plain.tokens
    once = plain.tokens - (4 - 1) * (20 - 1) - (3 - 1) * (16 - 1)
    if pack_tokens >= 2048:
        assert shared.real == once
    else:  # rows of a group in several packed rows, each with its own copy of the prompt
        assert once < shared.real < plain.tokens
    assert shared.computed < plain.computed


def test_rows_that_share_no_prefix_take_the_plain_pass():
    model = _model()
    ids, attn, mask = _batch()  # four different prompts
    stats = token_stats(model, ids, attn, mask)
    assert stats.computed == ids.numel()


@pytest.mark.parametrize("padding_free", [False, True])
def test_padding_junk_changes_nothing_with_shared_prefixes(padding_free):
    model = _model()
    ids, attn, mask = _groups()
    zeros = _groups(junk_pad=False)[0]
    options = PassOptions(padding_free=padding_free)
    a = token_stats(model, ids, attn, mask, entropy=True, options=options)
    b = token_stats(model, zeros, attn, mask, entropy=True, options=options)
    assert a.computed < ids.numel()  # packed
    torch.testing.assert_close(a.logp, b.logp)
    torch.testing.assert_close(a.entropy, b.entropy)


@pytest.mark.parametrize("padding_free", [False, True])
def test_gradient_checkpointing_takes_the_plain_pass(padding_free):
    """Checkpointed layers keep no keys and values between segments' recomputation; the
    packed pass is left to models without it (the values agree either way)."""
    model = _model()
    model.gradient_checkpointing_enable()
    model.train()
    ids, attn, mask = _groups()
    stats = token_stats(model, ids, attn, mask, options=PassOptions(padding_free=padding_free))
    assert stats.computed == ids.numel()


def test_a_packed_row_longer_than_the_sliding_window_takes_the_plain_pass():
    """A mask given to the model replaces its own, sliding window included: packing is
    left out where a packed row would pass the window."""
    model = _model()
    ids, attn, mask = _groups()
    assert token_stats(model, ids, attn, mask).computed < ids.numel()
    model.config.sliding_window = 24
    assert token_stats(model, ids, attn, mask).computed == ids.numel()


# ------------------------------------------------------------------ padding-free passes


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("rows", ["distinct", "groups"])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize(("chunk", "pack_tokens"), [(1024, 2048), (3, 30), (0, 27)])
def test_padding_free_gives_the_padded_pass_values_and_gradients(
    attn_impl, rows, share, chunk, pack_tokens
):
    """Rows end to end (with or without a shared prompt; in one packed row, or several
    of at most ``pack_tokens``): every masked log-prob and entropy, and every gradient,
    equal the padded pass's (float64; to float32's precision where the model computes in
    float32, below)."""
    model = _model(tie=True).to(torch.float64)
    model.config._attn_implementation = attn_impl
    ids, attn, mask = _batch() if rows == "distinct" else _groups()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))

    def run(options: PassOptions):
        model.zero_grad()
        stats = token_stats(model, ids, attn, mask, 0.8, entropy=True, options=options)
        ((stats.logp * weights + 0.1 * stats.entropy) * mask).sum().backward()
        return stats, [p.grad.clone() for p in model.parameters()]

    plain, plain_grads = run(PassOptions(chunk_tokens=chunk, share_prefix=False))
    free = PassOptions(chunk, share, padding_free=True, pack_tokens=pack_tokens)
    packed, packed_grads = run(free)
    on = mask > 0
    # Float32 inside a float64 model: transformers' eager attention takes its softmax in
    # float32, and Llama's RMSNorm its whole computation, so a shared prompt's gradient
    # (one sum in the packed pass, each row's share rounded to float32 in the padded one)
    # agrees to float32's precision only.
    exact = attn_impl == "sdpa" and not (share and rows == "groups")
    values, grads = TOL[torch.float64 if exact else torch.float32]
    torch.testing.assert_close(packed.logp[on], plain.logp[on], **values)
    torch.testing.assert_close(packed.entropy[on], plain.entropy[on], **values)
    assert (packed.logp[~on] == 0).all() and (packed.entropy[~on] == 0).all()
    for got, ref in zip(packed_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, ref, **grads)
    tokens = int(attn.sum())
    assert plain.computed == ids.numel() and packed.tokens == tokens
    assert packed.computed <= plain.computed
    if rows == "distinct":  # 11 + 13 + 12 + 14 tokens: in one row, or rows of 25 and 25
        assert packed.computed == packed.real == tokens
    elif pack_tokens >= 2048:  # one packed row: no padding, each shared prompt once
        assert packed.computed == packed.real
        once = tokens - (4 - 1) * (20 - 1) - (3 - 1) * (16 - 1)
        assert packed.real == (once if share else tokens)


def test_padding_free_in_float32():
    model = _model(tie=True)
    ids, attn, mask = _groups()
    plain = token_stats(model, ids, attn, mask, entropy=True, options=PassOptions(5, False))
    free = PassOptions(5, True, padding_free=True, pack_tokens=40)
    packed = token_stats(model, ids, attn, mask, entropy=True, options=free)
    assert packed.computed < plain.computed
    values, _ = TOL[torch.float32]
    torch.testing.assert_close(packed.logp, plain.logp, **values)
    torch.testing.assert_close(packed.entropy, plain.entropy, **values)


def test_flash_attention_packs_whole_rows_by_position_ids_alone():
    """With flash attention no mask is given: one packed row [1, S], every row whole (no
    shared prompt) and its positions from 0, which is where transformers starts a new
    sequence. Only the packing is checked here: the kernels need CUDA."""
    model = _model()
    model.config._attn_implementation = "flash_attention_2"
    ids, attn, mask = _groups()
    length = attn.sum(dim=1)
    pack = _packing(model, ids, attn, mask > 0, PassOptions(padding_free=True))
    assert pack.attend is None and pack.ids.shape == (1, int(length.sum()))
    assert (pack.row == 0).all() and (pack.cut == 0).all() and (pack.rest == length).all()
    for i, (start, n) in enumerate(zip(pack.start.tolist(), length.tolist(), strict=True)):
        assert torch.equal(pack.ids[0, start : start + n], ids[i, :n])
        assert torch.equal(pack.positions[0, start : start + n], torch.arange(n))
    assert sorted(pack.start.tolist()) == (pack.positions[0] == 0).nonzero().flatten().tolist()
    # Without padding_free flash attention keeps the padded pass (no mask to share by).
    assert _packing(model, ids, attn, mask > 0, PassOptions(share_prefix=True)) is None
