"""Sparse weight updates as bytes: which form a bucket takes, and that applying it gives
the new bucket bit for bit (weight_delta.py). The wire itself: tests/integration/
test_weight_delta_sync.py."""

import pytest
import torch

from verl_async import weight_delta as wd

WORDS = 1000  # a bf16 bucket of 1000 words: 2000 bytes, a 128-byte bitmap (125 padded)


def _bf16_bucket(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(WORDS, generator=g).to(torch.bfloat16).view(torch.uint8).clone()


def _changed(last: torch.Tensor, count: int) -> torch.Tensor:
    """``last`` with ``count`` words made different (each by a large step)."""
    cur = last.clone()
    values = cur.view(torch.bfloat16)
    index = torch.randperm(WORDS, generator=torch.Generator().manual_seed(count))[:count]
    values[index] = values[index] + 1.0
    return cur


def test_the_smallest_form_is_picked_and_applying_it_gives_the_new_bytes():
    # indices: 6 B a word; bitmap: 128 B + 2 B a word; whole: 2000 B.
    # 10 words: 60 B by indices (bitmap 148); 100: 328 B by bitmap (indices 600);
    # 950: the bitmap's 2028 B pass the bucket's 2000, so the bucket goes whole.
    last = _bf16_bucket()
    for count, kind, size in [(10, wd.INDICES, 60), (100, wd.BITMAP, 328), (950, wd.WHOLE, 2000)]:
        cur = _changed(last, count)
        got_kind, got_count, payload = wd.encode(cur, last, 2)
        assert (got_kind, payload.numel()) == (kind, size)
        assert payload.numel() == wd.payload_nbytes(got_kind, got_count, WORDS, 2)
        base = last.clone()
        wd.apply(base, got_kind, got_count, payload, 2)
        assert torch.equal(base, cur)


def test_no_change_sends_nothing_and_no_base_sends_the_bucket():
    last = _bf16_bucket()
    assert wd.encode(last.clone(), last, 2)[:2] == (wd.SAME, 0)
    assert wd.encode(last, last.clone(), 2)[2].numel() == 0
    kind, count, payload = wd.encode(last, None, 2)
    assert (kind, count) == (wd.WHOLE, WORDS) and payload is last


def test_float32_steps_that_leave_the_bf16_value_alone_are_not_sent():
    # 1.0 in bf16 has 7 mantissa bits: a step of 2**-10 rounds back to 1.0, one of 2**-7
    # reaches the next value. Only the second kind of change crosses the wire.
    weights = torch.ones(WORDS)  # the learner's float32
    last = weights.to(torch.bfloat16).view(torch.uint8).clone()
    weights[:500] += 2**-10
    weights[500:503] += 2**-7
    cur = weights.to(torch.bfloat16).view(torch.uint8)
    kind, count, payload = wd.encode(cur, last, 2)
    assert (kind, count) == (wd.INDICES, 3)
    assert payload[:12].view(torch.int32).tolist() == [500, 501, 502]


def test_bit_patterns_travel_exactly_nans_and_signed_zeros_included():
    # As floats NaN != NaN and -0.0 == 0.0; compared as words, a NaN that stays is not
    # sent and a zero that changes sign is.
    last = torch.tensor([float("nan"), 0.0, 1.0, 2.0] * 4).view(torch.uint8).clone()
    cur = torch.tensor([float("nan"), -0.0, 1.0, 2.0] * 4).view(torch.uint8).clone()
    cur.view(torch.int32)[4] = 0x7FC00001  # another NaN payload in place of 0.0
    kind, count, payload = wd.encode(cur, last, 4)
    # the four -0.0 and the new NaN: a 4-byte bitmap and 20 bytes (indices: 40)
    assert (kind, count, payload.numel()) == (wd.BITMAP, 5, 24)
    base = last.clone()
    wd.apply(base, kind, count, payload, 4)
    assert torch.equal(base, cur)


def test_bitmap_layout_is_pinned():
    mask = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    bitmap = wd.pack_bits(mask)
    assert bitmap.tolist() == [0b101, 0b1, 0, 0]  # padded to whole int32 words
    assert torch.equal(wd.unpack_bits(bitmap, 9), mask)


def test_a_delta_whose_header_disagrees_with_its_payload_is_refused():
    last = _bf16_bucket()
    kind, count, payload = wd.encode(_changed(last, 10), last, 2)
    assert kind == wd.INDICES
    empty_bitmap = torch.zeros(128 + count * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="names 0 words, its header 10"):
        wd.apply(last.clone(), wd.BITMAP, count, empty_bitmap, 2)


def test_the_digest_sees_one_flipped_bit():
    buf = _bf16_bucket()
    before = wd.digest(buf)
    buf[1234] ^= 0x01
    assert wd.digest(buf) != before
    assert wd.digest(buf) == wd.digest(buf.clone())
