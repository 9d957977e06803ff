"""The buffer's part of a checkpoint: two files, made at the checkpoint barrier.

    ledger.json      where the prompt ledger stands (next group, groups to re-issue, the
                     step consumption resumes at), the admission counters and the version
    rollouts.arrow   every stored rollout group with its per-token versions (Arrow IPC,
                     one row per group)

The snapshot is taken *as of step s*: groups that the learner's prefetcher already took
for steps >= s go back into it, because a learner restored at step s has not trained on
them. Groups issued but not returned go into ``reissue``; after a restore they are issued
again (first, in id order) and generated from scratch. Together this is the exactly-once
rule: every group of steps >= s is either stored here or will be issued.
"""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pyarrow as pa

from buffer.ledger import StoredGroup

FORMAT = 2
LEDGER_FILE = "ledger.json"
ROLLOUTS_FILE = "rollouts.arrow"


class LedgerState(msgspec.Struct, kw_only=True):
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
    gen_blocked_s: float
    gen_idle_s: float


class SnapshotError(ValueError):
    """A snapshot that cannot be restored into this run (with the reason)."""


def _nested(values: np.ndarray, inner_lengths: list[int], outer_counts: list[int]) -> pa.Array:
    """list<list<T>>: rows of ``outer_counts`` samples, samples of ``inner_lengths`` items."""
    inner = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(inner_lengths)]).astype(np.int32)), values
    )
    return pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(outer_counts)]).astype(np.int32)), inner
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
