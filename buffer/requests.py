"""Checks of what a buffer client asks for, before any state changes. Pure functions:
every rejection raises ``ProtocolError`` with a message naming what was wrong (the server
answers it as an ``Error`` and logs it through ``verl_async.ratelimit.RateLimitedLog``, so
a flood of rejections costs a few lines); rollouts themselves are checked in
buffer/rollouts.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl_async import protocol as P
from verl_async.auth import GENERATOR, LEARNER

MAX_WAIT_S = 300.0  # the longest long poll (clients poll for 1-30 s; see learners/batching.py)
MAX_WORLD_SIZE = 4096  # learner ranks a GetBatch may name (shards are allocated per rank)


LEARNER_ONLY = (
    P.GetBatch, P.AnnounceWeights, P.SyncStatus, P.SnapshotBuffer, P.FetchSnapshot,
    P.StartEval, P.GetEval, P.Shutdown,
)  # fmt: skip
GENERATOR_ONLY = (
    P.GetPrompts,
    P.PushRollouts,
    P.RenewLeases,
    P.PollVersion,
    P.JoinSync,
    P.PushEval,
)
ROLES = {t: (LEARNER,) for t in LEARNER_ONLY} | {t: (GENERATOR,) for t in GENERATOR_ONLY}
"""Who may send what (``RouterSocket`` answers the rest ``Error("forbidden")``); any
admitted client, a ``guest`` included, may ask ``GetStats`` and ``GetRun``."""


@dataclass(frozen=True)
class Peers:
    """The run's shape, as its config fixes it (None: not known, not checked): requests
    name generators and learner ranks only within it, so no client can make the buffer
    keep state for ids the run does not have, nor cut steps for another world size."""

    generators: int | None = None  # generator groups (placement.generators)
    learner_ranks: int | None = None  # learner ranks (placement.learners)


# ----------------------------------------------------------------------------- validation
# Pure checks of a request against what the buffer knows; each raises ProtocolError with a
# message naming the field, and is called before the request touches any state.


def check_non_negative(body: P.Body, *fields: str) -> None:
    """Counters, steps, versions and ids are never negative."""
    for name in fields:
        value = getattr(body, name)
        if value < 0:
            raise P.ProtocolError(f"{type(body).__name__}.{name} = {value} is negative")


def check_wait(wait_s: float) -> None:
    """A long poll's wait: a deadline that can be reached (NaN and inf never are)."""
    if not 0.0 <= wait_s <= MAX_WAIT_S:  # NaN fails both comparisons
        raise P.ProtocolError(f"wait_s {wait_s!r} is outside 0..{MAX_WAIT_S:g} seconds")


def check_generator_id(generator_id: int, peers: Peers) -> None:
    """A generator id the run has (each one's state lives as long as the buffer)."""
    if peers.generators is not None and generator_id >= peers.generators:
        raise P.ProtocolError(
            f"generator_id {generator_id}: the run has {peers.generators} generator(s)"
        )


def check_loaded(loaded_version: int, target_version: int) -> None:
    """A generator loads only versions the buffer announced (it learns them from here)."""
    if loaded_version > target_version:
        raise P.ProtocolError(
            f"loaded_version {loaded_version} was never announced "
            f"(the newest version is {target_version})"
        )


def check_get_batch(
    req: P.GetBatch, total_steps: int, cut_for: int | None, ranks: int | None = None
) -> None:
    """Step, rank and world size a learner can ask for. ``cut_for``: the number of ranks
    the step was already split over (None: not cut yet); every rank must agree on it.
    ``ranks``: the run's learner ranks (None: not known), the only world size it serves."""
    check_non_negative(req, "step", "learner_version")
    check_wait(req.wait_s)
    if req.step >= total_steps:
        raise P.ProtocolError(f"step {req.step} is past the run's last step {total_steps - 1}")
    if not 1 <= req.world_size <= MAX_WORLD_SIZE:
        raise P.ProtocolError(f"world_size {req.world_size} is outside 1..{MAX_WORLD_SIZE}")
    if ranks is not None and req.world_size != ranks:
        raise P.ProtocolError(f"world_size {req.world_size}: the run has {ranks} learner rank(s)")
    if not 0 <= req.rank < req.world_size:
        raise P.ProtocolError(f"rank {req.rank} is outside 0..{req.world_size - 1}")
    if req.learner_version > req.step:
        raise P.ProtocolError(
            f"learner_version {req.learner_version} at step {req.step}: "
            "the learner trains step s with version s"
        )
    if cut_for is not None and cut_for != req.world_size:
        raise P.ProtocolError(
            f"step {req.step} was cut for {cut_for} ranks, this request says {req.world_size}"
        )


def check_announce(update: P.WeightUpdate, target_version: int) -> None:
    """A new version is the next one (or the current one again, after a restore)."""
    if update.version not in (target_version, target_version + 1):
        raise P.ProtocolError(
            f"version {update.version} announced while the newest is {target_version}: "
            "versions go up one at a time"
        )
    if update.bucket_bytes <= 0:
        raise P.ProtocolError(f"bucket_bytes {update.bucket_bytes} is not positive")
    for spec in update.params:
        if any(d < 0 for d in spec.shape):
            raise P.ProtocolError(f"parameter {spec.name[:64]!r} has a negative dimension")
    if update.memory is not None:
        check_memory_offer(update.memory)


def check_memory_offer(offer: P.MemoryOffer) -> None:
    """A memory file of the announcing process: ``/proc/<pid>/fd/<n>`` with its own pid and
    a token of 16 to 64 hex digits (members check the file itself; this keeps junk off the
    generators); or a device buffer's offer (``check_cuda_offer``)."""
    if offer.cuda is not None:
        check_cuda_offer(offer)
        return
    fd = offer.path.removeprefix(f"/proc/{offer.pid}/fd/")
    if offer.pid <= 0 or not (fd.isascii() and fd.isdigit()) or len(fd) > 10:
        raise P.ProtocolError(
            f"memory offer path {offer.path[:64]!r} is not /proc/{offer.pid}/fd/<n>"
        )
    _check_token(offer.token)


def check_cuda_offer(offer: P.MemoryOffer) -> None:
    """A device buffer's offer: no path, a CUDA IPC handle of sane sizes (CUDA's handles
    are 64 bytes), a token as a memory file's."""
    ipc = offer.cuda
    handles = (ipc.handle, ipc.ref_counter_handle, ipc.event_handle)
    if offer.path or offer.pid <= 0 or min(ipc.device, ipc.size, ipc.offset) < 0:
        raise P.ProtocolError("device memory offer with a path, or a negative number")
    if not ipc.handle or any(len(h) > 256 for h in handles) or ipc.size == 0:
        raise P.ProtocolError("device memory offer with an empty or oversized handle")
    _check_token(offer.token)


def _check_token(token: str) -> None:
    if not 16 <= len(token) <= 64 or any(c not in "0123456789abcdef" for c in token):
        raise P.ProtocolError("memory offer token is not 16 to 64 lowercase hex digits")


def check_eval_results(body: P.PushEval, num_sources: int, target_version: int) -> None:
    """Every evaluation result has one row of scores per source, one entry per sample."""
    check_non_negative(body, "round")
    for res in body.results:
        where = f"evaluation prompt {res.group_id}"
        n = len(res.response_lengths)
        if len(res.scores) != num_sources or len(res.failed) != num_sources:
            raise P.ProtocolError(
                f"{where}: scores of {len(res.scores)} sources and failed counts of "
                f"{len(res.failed)}, the run has {num_sources} reward sources"
            )
        if any(len(row) != n for row in res.scores) or len(res.versions) != n:
            raise P.ProtocolError(f"{where}: scores or versions do not match {n} samples")
        if any(not 0 <= v <= target_version for v in res.versions):
            raise P.ProtocolError(f"{where}: a version outside 0..{target_version}")
        if any(x < 0 for x in res.response_lengths) or any(not 0 <= f <= n for f in res.failed):
            raise P.ProtocolError(f"{where}: a negative length or an impossible failed count")
        if any(math.isinf(v) for row in res.scores for v in row):
            raise P.ProtocolError(f"{where}: an infinite score")
