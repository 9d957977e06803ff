"""The buffer's part of a checkpoint: two files, made at the checkpoint barrier.

    ledger.json      where the prompt ledger stands (next group, groups to re-issue, the
                     step consumption resumes at), the admission counters and the version
    rollouts.arrow   every stored rollout group with its per-token versions (Arrow IPC,
                     one row per group); multi-turn groups add their loss masks, turn
                     rewards and episode stats, columns that are null for single-turn
                     groups and absent from snapshots older than multi-turn rollouts

The snapshot is taken *as of step s*: groups that the learner's prefetcher already took
for steps >= s go back into it, because a learner restored at step s has not trained on
them. Groups issued but not returned go into ``reissue``; after a restore they are issued
again (first, in id order) and generated from scratch. Together this is the exactly-once
rule: every group of steps >= s is either stored here or will be issued. With dynamic
sampling (buffer/filtering.py) a group may also be dropped: ``filtered`` lists those from
step s's first group on, which are done and never issued again. Leases are not
saved: every group in flight at the cut is issued again anyway, whatever its lease.

``Cuts`` takes the cut at the barrier (``SnapshotBuffer``) and encodes its files when the
learner's writer asks (``FetchSnapshot``); ``restore_ledger`` reads them back.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa

from buffer.ledger import FilterMarks, LedgerError, PromptLedger, StoredGroup
from verl_async import protocol as P
from verl_async.protocol import EpisodeStats

FORMAT = 2
LEDGER_FILE = "ledger.json"
ROLLOUTS_FILE = "rollouts.arrow"


class LedgerState(msgspec.Struct, kw_only=True):
    """ledger.json. Counts only, no clocks (the generator timing of buffer/telemetry.py
    starts from zero in a resumed buffer). Unknown keys are ignored, so a snapshot that
    still holds the ``gen_blocked_s`` / ``gen_idle_s`` of earlier versions loads."""

    format: int = FORMAT
    step: int  # consumption resumes at this step
    version: int  # weights version published when the snapshot was taken
    next_group: int  # first group never issued
    reissue: list[int]  # issued before the snapshot, not returned: issue again
    stored_groups: int  # rows of rollouts.arrow
    num_prompts: int  # the dataset the ledger's epoch orders were drawn for
    shuffle_seed: int
    groups_per_step: int
    max_staleness: int
    dropped_stale: int
    admission_blocked: int
    leases_expired: int = 0  # groups whose lease ran out before the snapshot
    # Dynamic sampling; the defaults are a snapshot of a run without it.
    step_start: int | None = None  # step's first group (None: step * groups_per_step)
    filtered: list[int] = []  # groups dropped, from step_start on: done, never issued again
    past_bound: list[int] = []  # stored groups kept past filter_groups.max_in_a_row
    past_bound_before: int = 0  # groups kept past the bound before step_start
    filter_in_a_row: int = 0  # groups dropped in a row when the snapshot was taken


class SnapshotError(ValueError):
    """A snapshot that cannot be restored into this run (with the reason)."""


def _nested(
    values: np.ndarray,
    inner_lengths: list[int],
    outer_counts: list[int],
    nulls: list[bool] | None = None,
) -> pa.Array:
    """list<list<T>>: rows of ``outer_counts`` samples, samples of ``inner_lengths`` items;
    rows where ``nulls`` is true are null (and hold no samples)."""
    inner = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(inner_lengths)]).astype(np.int32)), values
    )
    return pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(outer_counts)]).astype(np.int32)),
        inner,
        mask=None if nulls is None else pa.array(nulls, pa.bool_()),
    )


def _optional_nested(groups: list[StoredGroup], attr: str, dtype) -> pa.Array:
    """Per-sample arrays ``attr`` (None for a single-turn group, stored as null)."""
    per_group = [getattr(g, attr) for g in groups]
    arrays = [a for samples in per_group if samples is not None for a in samples]
    return _nested(
        np.concatenate(arrays, dtype=dtype) if arrays else np.zeros(0, dtype),
        [len(a) for a in arrays],
        [0 if samples is None else len(samples) for samples in per_group],
        [samples is None for samples in per_group],
    )


def rollouts_to_arrow(groups: list[StoredGroup]) -> bytes:
    lengths = [len(r) for g in groups for r in g.responses]
    counts = [len(g.responses) for g in groups]

    def flat(attr: str, dtype) -> np.ndarray:
        arrays = [a for g in groups for a in getattr(g, attr)]
        return np.concatenate(arrays, dtype=dtype) if arrays else np.zeros(0, dtype)

    prompt_lengths = [len(g.prompt_ids) for g in groups]
    prompts = [g.prompt_ids for g in groups]
    table = pa.table(
        {
            "group_id": pa.array([g.group_id for g in groups], pa.int64()),
            "prompt_id": pa.array([g.prompt_id for g in groups], pa.int64()),
            "generator_id": pa.array([g.generator_id for g in groups], pa.int32()),
            "prompt_ids": pa.ListArray.from_arrays(
                pa.array(np.concatenate([[0], np.cumsum(prompt_lengths)]).astype(np.int32)),
                np.concatenate(prompts, dtype=np.int32) if prompts else np.zeros(0, np.int32),
            ),
            "response_ids": _nested(flat("responses", np.int32), lengths, counts),
            "behav_logprobs": _nested(flat("behav_logprobs", np.float32), lengths, counts),
            "token_versions": _nested(flat("token_versions", np.int32), lengths, counts),
            "scores": pa.array([g.scores for g in groups], pa.list_(pa.list_(pa.float64()))),
            "failed": pa.array([g.failed for g in groups], pa.list_(pa.int64())),
            "data_source": pa.array([g.data_source for g in groups], pa.string()),
            "loss_masks": _optional_nested(groups, "loss_masks", np.uint8),
            "turn_rewards": _optional_nested(groups, "turn_rewards", np.float32),
            "teacher_logprobs": _optional_nested(groups, "teacher_logprobs", np.float32),
            "episodes": pa.array(
                [msgspec.msgpack.encode(g.episodes) if g.episodes else None for g in groups],
                pa.binary(),
            ),
        }
    )
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def rollouts_from_arrow(data: bytes) -> list[StoredGroup]:
    table = pa.ipc.open_file(pa.py_buffer(data)).read_all().combine_chunks()

    def split(name: str) -> list[list[np.ndarray]]:
        """Per row, the list of per-sample arrays of column ``name``."""
        outer = table.column(name).chunk(0) if table.num_rows else None
        if outer is None:
            return []
        inner = outer.flatten()
        values = inner.flatten().to_numpy(zero_copy_only=False)
        inner_off = inner.offsets.to_numpy()
        outer_off = outer.offsets.to_numpy()
        samples = [values[inner_off[i] : inner_off[i + 1]] for i in range(len(inner))]
        return [samples[outer_off[r] : outer_off[r + 1]] for r in range(len(outer))]

    def optional(name: str, dtype) -> list[list[np.ndarray] | None]:
        """``split`` of a nullable column, None for its null rows and for every row of a
        snapshot written before the column existed (all single-turn, no teacher)."""
        if name not in table.column_names:
            return [None] * table.num_rows
        valid = table.column(name).is_valid().to_pylist()
        return [
            [a.astype(dtype) for a in samples] if ok else None
            for samples, ok in zip(split(name), valid, strict=True)
        ]

    def episodes() -> list[list[EpisodeStats]]:
        if "episodes" not in table.column_names:
            return [[] for _ in range(table.num_rows)]
        return [
            [] if raw is None else msgspec.msgpack.decode(raw, type=list[EpisodeStats])
            for raw in rows("episodes")
        ]

    def rows(name: str) -> list:
        return table.column(name).to_pylist()

    prompts = table.column("prompt_ids").chunk(0) if table.num_rows else None
    prompt_values = prompts.flatten().to_numpy(zero_copy_only=False) if prompts else None
    prompt_off = prompts.offsets.to_numpy() if prompts else None
    responses, logprobs, versions = (
        split("response_ids"),
        split("behav_logprobs"),
        split("token_versions"),
    )
    masks = optional("loss_masks", np.uint8)
    turn_rewards = optional("turn_rewards", np.float32)
    teacher_logprobs = optional("teacher_logprobs", np.float32)
    stats = episodes()
    return [
        StoredGroup(
            group_id=gid,
            prompt_id=pid,
            generator_id=gen,
            prompt_ids=prompt_values[prompt_off[i] : prompt_off[i + 1]].astype(np.int32),
            responses=[a.astype(np.int32) for a in responses[i]],
            behav_logprobs=[a.astype(np.float32) for a in logprobs[i]],
            token_versions=[a.astype(np.int32) for a in versions[i]],
            scores=scores,
            failed=failed,
            data_source=source,
            loss_masks=masks[i],
            turn_rewards=turn_rewards[i],
            episodes=stats[i],
            teacher_logprobs=teacher_logprobs[i],
        )
        for i, (gid, pid, gen, scores, failed, source) in enumerate(
            zip(
                rows("group_id"),
                rows("prompt_id"),
                rows("generator_id"),
                rows("scores"),
                rows("failed"),
                rows("data_source"),
                strict=True,
            )
        )
    ]


def encode_state(state: LedgerState) -> bytes:
    return msgspec.json.format(msgspec.json.encode(state))


def decode_state(data: bytes) -> LedgerState:
    try:
        state = msgspec.json.decode(data, type=LedgerState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"{LEDGER_FILE} is unreadable: {exc}") from None
    if state.format != FORMAT:
        raise SnapshotError(f"{LEDGER_FILE} has format {state.format}, this version reads {FORMAT}")
    return state


# ----------------------------------------------------------------------------- cut and restore

log = logging.getLogger("verl_async.buffer")


class Cuts:
    """The cuts taken at checkpoint barriers, each held until its files are fetched."""

    # Cuts kept for FetchSnapshot; the learner has at most two writes in flight, more
    # means a learner died between the two requests, and the oldest cut is dropped.
    MAX_CUTS = 4

    def __init__(self, ledger: PromptLedger) -> None:
        self.ledger = ledger
        self.cuts: dict[int, tuple[LedgerState, list[StoredGroup]]] = {}  # step -> cut

    def take(self, step: int, handed_out: dict[int, list[StoredGroup]], **counters: float) -> None:
        """The state as of ``step``; ``counters`` are the server's fields of LedgerState.

        Taken in the event loop between two messages, so it is one consistent cut. It only
        collects references (stored groups are never modified), so it costs the learner a
        round trip; encoding waits for ``files``.
        """
        lg = self.ledger
        stored, reissue = lg.snapshot(step, handed_out)
        marks = lg.filter_marks(step)
        state = LedgerState(
            step=step,
            step_start=marks.start,
            filtered=marks.dropped,
            past_bound=marks.past_bound,
            past_bound_before=marks.past_bound_before,
            next_group=lg.next_group,
            reissue=reissue,
            stored_groups=len(stored),
            num_prompts=len(lg.prompts),
            shuffle_seed=lg.seed,
            groups_per_step=lg.admission.groups_per_step,
            leases_expired=lg.leases.expired_total,
            **counters,
        )
        self.cuts[step] = (state, stored)
        while len(self.cuts) > self.MAX_CUTS:
            dropped = min(self.cuts)
            del self.cuts[dropped]
            log.warning("snapshot of step %d was never fetched; dropped", dropped)
        log.info(
            "snapshot at step %d: %d groups stored, %d to re-issue, next group %d",
            step,
            len(stored),
            len(reissue),
            lg.next_group,
        )

    def files(self, step: int) -> tuple[P.BufferState, P.Frames]:
        """The files of the cut taken at ``step`` (asked for by the learner's writer)."""
        if step not in self.cuts:
            raise LedgerError(f"no snapshot was taken at step {step}")
        state, stored = self.cuts.pop(step)
        frames = P.Frames()
        as_bytes = lambda data: np.frombuffer(data, np.uint8)  # noqa: E731
        files = {
            LEDGER_FILE: frames.add(as_bytes(encode_state(state))),
            ROLLOUTS_FILE: frames.add(as_bytes(rollouts_to_arrow(stored))),
        }
        return P.BufferState(step=step, files=files), frames


def restore_ledger(lg: PromptLedger, ckpt_dir: Path) -> LedgerState:
    """Continue ``lg`` from the buffer files of a checkpoint; returns their state (the
    server takes its counters from it)."""
    state = decode_state((ckpt_dir / LEDGER_FILE).read_bytes())
    for key, theirs, ours in (
        ("data.path (number of prompts)", state.num_prompts, len(lg.prompts)),
        ("data.shuffle_seed", state.shuffle_seed, lg.seed),
        ("learner.groups_per_step", state.groups_per_step, lg.admission.groups_per_step),
    ):
        if theirs != ours:
            raise SnapshotError(
                f"cannot resume: the checkpoint was taken with {key} = {theirs}, "
                f"this run has {ours}"
            )
    stored = rollouts_from_arrow((ckpt_dir / ROLLOUTS_FILE).read_bytes())
    if len(stored) != state.stored_groups:
        raise SnapshotError(
            f"{ROLLOUTS_FILE} holds {len(stored)} groups, {LEDGER_FILE} says {state.stored_groups}"
        )
    start = state.step * lg.admission.groups_per_step
    marks = FilterMarks(
        start if state.step_start is None else state.step_start,
        state.filtered,
        state.past_bound,
        state.past_bound_before,
    )
    lg.restore(state.step, state.version, state.next_group, stored, state.reissue, marks)
    lg.leases.expired_total = state.leases_expired
    log.info(
        "restored step %d, version %d: %d groups stored, %d to re-issue, %d dropped, next group %d",
        state.step,
        state.version,
        len(stored),
        len(state.reissue),
        len(state.filtered),
        state.next_group,
    )
    return state
