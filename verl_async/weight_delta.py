"""Sparse weight updates: one packed bucket as the words that changed since the last update.

After a small optimizer step most weights, once cast to the generator's bf16, have not
changed at all. Learner rank 0 keeps the bytes of each bucket it sent last (in the
generator's dtype, as they crossed the wire); every member keeps the bytes it received
(its receive buffers, ``SyncGroup.buffers``). The next update of a bucket then goes as
one of:

==========  ====================================================  =====================
kind        payload (bytes)                                       when
==========  ====================================================  =====================
``SAME``    nothing                                               no word changed
``INDICES`` k int32 word indices, then the k new words            few words changed
``BITMAP``  one bit per word (padded to 4 bytes), then k words    more changed
``WHOLE``   the bucket itself                                     a delta would be larger,
                                                                  or a member lacks a base
==========  ====================================================  =====================

A word is the bucket's smallest element size (2 bytes for bf16, 4 for float32), so the
comparison is of bit patterns, never of values: NaNs, signed zeros and the like travel
exactly, and applying a delta to the member's copy gives the same bytes a whole bucket
would, bit for bit. The digest (``digest``) proves it: a CRC-32 of a bucket's bytes that
rank 0 and every member compare from time to time (weight_sync.py).
"""

from __future__ import annotations

import zlib

import torch

SAME, INDICES, BITMAP, WHOLE = 0, 1, 2, 3  # a bucket's kind on the wire

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def word_dtype(word_bytes: int) -> torch.dtype:
    """The integer dtype a bucket is compared in (its smallest element size)."""
    return _WORDS[word_bytes]


def payload_nbytes(kind: int, count: int, words: int, word_bytes: int) -> int:
    """Bytes of a bucket's payload of ``kind`` with ``count`` changed words out of
    ``words`` (both ends compute it: no size travels but the kind and the count)."""
    if kind == SAME:
        return 0
    if kind == INDICES:
        return count * (4 + word_bytes)
    if kind == BITMAP:
        return _bitmap_nbytes(words) + count * word_bytes
    return words * word_bytes


def _bitmap_nbytes(words: int) -> int:
    return ((words + 7) // 8 + 3) // 4 * 4  # whole bytes, then whole int32 words


def encode(
    cur: torch.Tensor, last: torch.Tensor | None, word_bytes: int
) -> tuple[int, int, torch.Tensor]:
    """(kind, count, payload) of bucket bytes ``cur`` [nbytes] uint8 against ``last``, the
    bytes every member holds (None: they hold none, the whole bucket goes). The smaller of
    the two delta forms is picked; where neither is smaller than the bucket, the bucket."""
    words = cur.numel() // word_bytes
    if last is None or last.numel() != cur.numel() or last.device != cur.device:
        return WHOLE, words, cur
    wdt = word_dtype(word_bytes)
    changed = cur.view(wdt) != last.view(wdt)  # [words] bool
    index = changed.nonzero().view(-1)  # [count]
    count = index.numel()
    if count == 0:
        return SAME, 0, cur[:0]
    sizes = {BITMAP: payload_nbytes(BITMAP, count, words, word_bytes)}
    if words < 2**31:  # int32 indices
        sizes[INDICES] = payload_nbytes(INDICES, count, words, word_bytes)
    kind = min(sizes, key=sizes.__getitem__)
    if sizes[kind] >= cur.numel():
        return WHOLE, words, cur
    values = cur.view(wdt)[index].view(torch.uint8)
    head = index.to(torch.int32).view(torch.uint8) if kind == INDICES else pack_bits(changed)
    return kind, count, torch.cat([head, values])


def apply(
    base: torch.Tensor, kind: int, count: int, payload: torch.Tensor, word_bytes: int
) -> None:
    """Write a payload of ``encode`` into ``base`` [nbytes] uint8 (the member's copy of the
    bucket as of the last update), in place."""
    if kind == SAME:
        return
    if kind == WHOLE:
        base.copy_(payload)
        return
    words = base.numel() // word_bytes
    wdt = word_dtype(word_bytes)
    if kind == INDICES:
        index = payload[: count * 4].view(torch.int32).long()
    elif kind == BITMAP:
        head = _bitmap_nbytes(words)
        index = unpack_bits(payload[:head], words).nonzero().view(-1)
    else:
        raise ValueError(f"a weight bucket of unknown kind {kind}")
    if index.numel() != count:
        raise ValueError(f"a weight delta names {index.numel()} words, its header {count}")
    values = payload[payload.numel() - count * word_bytes :].view(wdt)
    base.view(wdt)[index] = values


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[n] bool -> [bitmap bytes] uint8, bit j of byte i = mask[8i + j] (padded to 4)."""
    n = mask.numel()
    padded = torch.zeros(_bitmap_nbytes(n) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    bits = _BITS.to(mask.device)
    return (padded.view(-1, 8) * bits).sum(-1, dtype=torch.uint8)


def unpack_bits(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: [n] bool."""
    bits = _BITS.to(bitmap.device)
    return (bitmap.view(-1, 1) & bits).ne(0).view(-1)[:n]


def digest(buf: torch.Tensor) -> int:
    """CRC-32 of a bucket's bytes (a copy to the host first when it lives on a GPU)."""
    data = buf.detach().cpu().contiguous()
    return zlib.crc32(memoryview(data.numpy()).cast("B"))
