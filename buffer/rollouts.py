"""Checks of a returned rollout group, and the group as the buffer stores it.

Pure, and every rejection raises ``ProtocolError`` naming the group and the field: nothing
is recorded from a group that fails here, and the learner never sees a batch it cannot
train on. Whether the sender may return the group at all is the ledger's question
(``check_issued``, leases), asked before any of this.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from buffer.ledger import StoredGroup
from verl_async.protocol import ProtocolError, RolloutGroup, vector


@dataclass(frozen=True)
class RolloutLimits:
    """What every returned group must look like. ``None``: not known to the buffer, so not
    checked (a buffer started without the generators' settings still runs)."""

    num_sources: int = 1  # reward sources: the width of every group's scores
    group_size: int | None = None  # samples per group (generators.group_size)
    vocab_size: int | None = None  # token ids are in [0, vocab_size)
    max_response_tokens: int | None = None  # generators.max_new_tokens


def unpack_rollout(
    g: RolloutGroup, frames: list, limits: RolloutLimits, versions: tuple[int, int]
) -> StoredGroup:
    """The group as the buffer stores it, after checking every field against ``limits``.

    ``versions`` = (oldest, newest) weights version its tokens may carry: the version the
    generator had loaded when the group was issued (versions only grow) and the newest one
    announced. Pure, and raises only ProtocolError: nothing is recorded from a group that
    fails here, and the learner never sees a batch it cannot train on.
    """
    where = f"group {g.group_id}"
    prompt = vector(g.prompt_ids, frames, "int32", f"{where}: prompt_ids")
    resp = vector(g.response_ids, frames, "int32", f"{where}: response_ids")
    lp = vector(g.behav_logprobs, frames, "float32", f"{where}: behav_logprobs")
    ver = vector(g.token_versions, frames, "int32", f"{where}: token_versions")
    _check_lengths(where, g.lengths, limits, (len(resp), len(lp), len(ver)))
    _check_token_ids(where, "prompt_ids", prompt, limits.vocab_size)
    _check_token_ids(where, "response_ids", resp, limits.vocab_size)
    if lp.size and not (lp.max() <= 0 and lp.min() > -np.inf):  # NaN fails both
        raise ProtocolError(f"{where}: behav_logprobs must be finite and <= 0")
    lo, hi = versions
    if ver.size and (ver.min() < lo or ver.max() > hi):
        raise ProtocolError(
            f"{where}: token versions {ver.min()}..{ver.max()} are outside {lo}..{hi} "
            "(loaded when issued .. newest announced)"
        )
    _check_scores(where, g.scores, g.failed, len(g.lengths), limits.num_sources)
    bounds = [0, *itertools.accumulate(g.lengths)]
    # Views on the received frames (numpy keeps each frame alive): no copy on the way in.
    split = lambda a: [a[bounds[i] : bounds[i + 1]] for i in range(len(g.lengths))]  # noqa: E731
    return StoredGroup(
        g.group_id,
        g.prompt_id,
        g.generator_id,
        prompt,
        split(resp),
        split(lp),
        split(ver),
        [list(sample) for sample in zip(*g.scores, strict=True)],  # [S][N] -> [N][S]
        list(g.failed),
        g.data_source,
    )


def _check_lengths(
    where: str, lengths: list[int], limits: RolloutLimits, sizes: tuple[int, int, int]
) -> None:
    """Sample lengths against the run's group size, token budget and the three tensors."""
    if not lengths:
        raise ProtocolError(f"{where}: no samples")
    if limits.group_size is not None and len(lengths) != limits.group_size:
        raise ProtocolError(
            f"{where}: {len(lengths)} samples, the run samples {limits.group_size} per group"
        )
    if min(lengths) < 0:
        raise ProtocolError(f"{where}: negative sample length")
    cap = limits.max_response_tokens
    if cap is not None and max(lengths) > cap:
        raise ProtocolError(f"{where}: a sample of {max(lengths)} tokens, the run allows {cap}")
    if sizes != (sum(lengths),) * 3:
        raise ProtocolError(
            f"{where}: lengths add up to {sum(lengths)} tokens; response_ids, "
            f"behav_logprobs and token_versions hold {sizes[0]}, {sizes[1]} and {sizes[2]}"
        )


def _check_token_ids(where: str, name: str, ids: np.ndarray, vocab_size: int | None) -> None:
    if not ids.size:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bound = "" if vocab_size is None else f", the vocabulary has {vocab_size}"
        raise ProtocolError(f"{where}: {name} holds token ids {low}..{high}{bound}")


def _check_scores(
    where: str, scores: list[list[float]], failed: list[int], n: int, num_sources: int
) -> None:
    """[S][n] scores: each source's row is all finite (scored) or all NaN (not routed)."""
    if len(scores) != num_sources or len(failed) != num_sources:
        raise ProtocolError(
            f"{where}: scores of {len(scores)} sources and failed counts of {len(failed)}, "
            f"the run has {num_sources} reward sources"
        )
    for s, (row, fails) in enumerate(zip(scores, failed, strict=True)):
        if len(row) != n:
            raise ProtocolError(f"{where}: source {s} scored {len(row)} samples of {n}")
        routed = [v == v for v in row]  # NaN != NaN: not routed to this group's data
        if any(routed) and not all(routed):
            raise ProtocolError(f"{where}: source {s} left some samples unscored (NaN)")
        if any(routed) and not all(math.isfinite(v) for v in row):
            raise ProtocolError(f"{where}: source {s} has an infinite score")
        if not 0 <= fails <= n:
            raise ProtocolError(f"{where}: source {s} failed {fails} samples of {n}")
