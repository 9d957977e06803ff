"""The buffer's checkpoint: Arrow round trip, and exactly-once across snapshot + restore."""

import io

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from buffer.ledger import LedgerError, PromptLedger, StoredGroup
from buffer.snapshot import (
    LedgerState,
    SnapshotError,
    decode_state,
    encode_state,
    rollouts_from_arrow,
    rollouts_to_arrow,
)
from verl_async.data import PromptRecord
from verl_async.protocol import EpisodeStats
from verl_async.staleness import Admission


def _group(k, version, rng):
    lengths = rng.integers(0, 5, size=3)  # an empty response is legal
    return StoredGroup(
        k,
        k % 7,
        k % 2,
        rng.integers(0, 50, size=1 + k % 3).astype(np.int32),
        [rng.integers(0, 50, size=n).astype(np.int32) for n in lengths],
        [rng.normal(size=n).astype(np.float32) for n in lengths],
        [np.full(n, version + (i % 2), np.int32) for i, n in enumerate(lengths)],
        [[float(i % 2), float("nan")] for i in range(len(lengths))],  # [N][S], NaN: not routed
        [k % 3, 0],
        f"source{k % 2}",
    )


def _multiturn(g: StoredGroup, masks: bool = True, rewards: bool = True) -> StoredGroup:
    """``g`` made multi-turn: each sample's middle tokens an observation, a turn reward at
    its first token, and its episode stats."""
    if masks:
        g.loss_masks = [np.zeros(len(r), np.uint8) for r in g.responses]
        for m in g.loss_masks:
            m[:1] = m[-1:] = 1
    if rewards:
        g.turn_rewards = [np.zeros(len(r), np.float32) for r in g.responses]
        for i, t in enumerate(g.turn_rewards):
            t[:1] = 0.25 * (i + 1)
    g.episodes = [
        EpisodeStats(i + 1, i, 0, 1, 0.5 * i, len(r), "turns" if i else "", i, bool(i), -0.5)
        for i, r in enumerate(g.responses)
    ]
    return g


def _same(a: StoredGroup, b: StoredGroup) -> bool:
    arrays = ("responses", "behav_logprobs", "token_versions")
    optional = ("loss_masks", "turn_rewards", "teacher_logprobs")
    return (
        (a.group_id, a.prompt_id, a.generator_id, a.failed, a.data_source, a.episodes)
        == (b.group_id, b.prompt_id, b.generator_id, b.failed, b.data_source, b.episodes)
        and all((getattr(a, n) is None) == (getattr(b, n) is None) for n in optional)
        and np.array_equal(np.array(a.scores), np.array(b.scores), equal_nan=True)
        and np.array_equal(a.prompt_ids, b.prompt_ids)
        and all(
            len(getattr(a, n)) == len(getattr(b, n))
            and all(
                x.dtype == y.dtype and np.array_equal(x, y)
                for x, y in zip(getattr(a, n), getattr(b, n), strict=True)
            )
            for n in arrays + tuple(n for n in optional if getattr(a, n) is not None)
        )
    )


def test_rollouts_survive_the_arrow_round_trip_bit_for_bit():
    rng = np.random.default_rng(0)
    groups = [_group(k, k // 4, rng) for k in range(9)]
    back = rollouts_from_arrow(rollouts_to_arrow(groups))
    assert len(back) == len(groups)
    assert all(_same(a, b) for a, b in zip(groups, back, strict=True))
    assert rollouts_from_arrow(rollouts_to_arrow([])) == []


def test_teacher_logprobs_survive_the_arrow_round_trip_bit_for_bit():
    """A checkpoint keeps the stored groups' teacher log-probs (distillation by teacher
    processes): a resumed run trains them as scored, without asking a teacher again."""
    rng = np.random.default_rng(2)
    groups = [_group(k, 1, rng) for k in range(4)]
    for g in groups[1:]:
        g.teacher_logprobs = [-rng.random(len(r)).astype(np.float32) for r in g.responses]
    _multiturn(groups[3])
    back = rollouts_from_arrow(rollouts_to_arrow(groups))
    assert all(_same(a, b) for a, b in zip(groups, back, strict=True))
    assert [g.teacher_logprobs is None for g in back] == [True, False, False, False]


def test_multiturn_rollouts_survive_the_arrow_round_trip_bit_for_bit():
    rng = np.random.default_rng(1)
    groups = [_group(k, 2, rng) for k in range(6)]
    _multiturn(groups[0])
    _multiturn(groups[2], rewards=False)
    _multiturn(groups[3], masks=False)
    _multiturn(groups[5])
    back = rollouts_from_arrow(rollouts_to_arrow(groups))
    assert all(_same(a, b) for a, b in zip(groups, back, strict=True))
    assert [g.loss_masks is None for g in back] == [False, True, False, True, True, False]
    assert [g.turn_rewards is None for g in back] == [False, True, True, False, True, False]
    assert [bool(g.episodes) for g in back] == [True, False, True, True, False, True]
    assert back[0].loss_masks[0].dtype == np.uint8
    assert back[0].turn_rewards[0].dtype == np.float32


def test_a_snapshot_written_before_multiturn_rollouts_loads_as_single_turn():
    rng = np.random.default_rng(2)
    groups = [_group(k, 1, rng) for k in range(3)]
    new = pa.ipc.open_file(pa.py_buffer(rollouts_to_arrow(groups))).read_all()
    # The columns the buffer wrote before multi-turn rollouts, and nothing else.
    old = new.select(
        [
            "group_id",
            "prompt_id",
            "generator_id",
            "prompt_ids",
            "response_ids",
            "behav_logprobs",
            "token_versions",
            "scores",
            "failed",
            "data_source",
        ]
    )
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, old.schema) as writer:
        writer.write_table(old)
    back = rollouts_from_arrow(sink.getvalue())
    assert all(_same(a, b) for a, b in zip(groups, back, strict=True))
    assert all((g.loss_masks, g.turn_rewards, g.episodes) == (None, None, []) for g in back)


def test_ledger_state_round_trips_and_rejects_other_formats():
    state = LedgerState(
        step=3,
        version=3,
        next_group=20,
        reissue=[15, 17],
        stored_groups=5,
        num_prompts=40,
        shuffle_seed=1,
        groups_per_step=4,
        max_staleness=2,
        dropped_stale=0,
        admission_blocked=7,
    )
    assert decode_state(encode_state(state)) == state
    with pytest.raises(SnapshotError, match="format 99"):
        decode_state(encode_state(msgspec.structs.replace(state, format=99)))
    with pytest.raises(SnapshotError, match="unreadable"):
        decode_state(b"{not json")


def _ledger(b, eta, steps, n):
    prompts = [PromptRecord(f"p{i}", str(i)) for i in range(n)]
    return PromptLedger(prompts, Admission(b, eta), steps, seed=3)


class Sim:
    """Drives a ledger like the buffer does: generators issue and return, steps consume."""

    def __init__(self, ledger, rng):
        self.ledger = ledger
        self.rng = rng
        self.handed_out: dict[int, list[StoredGroup]] = {}
        self.trained: list[tuple[int, int, int]] = []  # (step, group id, prompt id)

    def generate(self, version, max_groups):
        groups, _ = self.ledger.issue(0, version, max_groups)
        return [g.group_id for g in groups]

    def give_back(self, ids, version):
        for k in ids:
            _, idx = self.ledger.prompt_of(k)
            g = _group(k, version, self.rng)
            g.prompt_id = idx
            self.ledger.record_return(g)

    def consume(self, step):
        groups = self.ledger.consume(step)
        self.handed_out[step] = groups
        return groups

    def train(self, step, groups):
        self.trained += [(step, g.group_id, g.prompt_id) for g in groups]


def test_snapshot_then_restore_trains_every_group_of_the_epoch_exactly_once():
    b, eta, steps, n = 4, 2, 10, 40  # one epoch: 40 prompts = 10 steps x 4 groups
    rng = np.random.default_rng(1)
    before = Sim(_ledger(b, eta, steps, n), rng)
    # Steps 0..3 train; the prefetcher has already taken steps 4 and 5; some groups in flight.
    version = 0
    for step in range(4):
        before.give_back(before.generate(version, 100), version)
        before.train(step, before.consume(step))
        version += 1
    pending = before.generate(version, 100)  # issued at version 4: groups up to (4+2+1)*4 - 1
    before.give_back(pending[: len(pending) // 2], version)
    before.consume(4)
    before.consume(5)
    stored, reissue = before.ledger.snapshot(4, before.handed_out)
    assert reissue == sorted(pending[len(pending) // 2 :])
    assert {g.group_id for g in stored} | set(reissue) == set(range(16, before.ledger.next_group))

    # Restore into a fresh ledger (as a new buffer process would) through the files.
    after = Sim(_ledger(b, eta, steps, n), rng)
    after.ledger.restore(
        4, 4, before.ledger.next_group, rollouts_from_arrow(rollouts_to_arrow(stored)), reissue
    )
    assert after.ledger.issue(0, loaded_version=3, max_groups=5) == ([], True)  # old weights wait
    first = after.generate(4, 2)
    assert first == reissue[:2]  # re-issued groups go first
    after.give_back(first, 4)
    after.trained = [t for t in before.trained]
    version = 4
    for step in range(4, steps):
        after.give_back(after.generate(version, 100), version)
        after.train(step, after.consume(step))
        version += 1
    assert after.ledger.exhausted and not after.ledger.in_flight and not after.ledger.returned
    groups = [k for _, k, _ in after.trained]
    assert sorted(groups) == list(range(steps * b))  # every group once, none twice
    assert sorted(p for _, _, p in after.trained) == list(range(n))  # every prompt once
    assert [s for s, _, _ in after.trained] == [s for s in range(steps) for _ in range(b)]


def test_snapshot_refuses_a_cut_it_cannot_make_and_restore_refuses_gaps():
    sim = Sim(_ledger(2, 1, 4, 8), np.random.default_rng(2))
    sim.give_back(sim.generate(0, 100), 0)
    sim.consume(0)
    with pytest.raises(LedgerError, match="only 1 steps were consumed"):
        sim.ledger.snapshot(2, sim.handed_out)
    with pytest.raises(LedgerError, match="the groups of step 0 are gone"):
        sim.ledger.snapshot(0, {})
    stored, reissue = sim.ledger.snapshot(1, sim.handed_out)
    fresh = _ledger(2, 1, 4, 8)
    with pytest.raises(LedgerError, match="exactly once"):
        fresh.restore(1, 1, sim.ledger.next_group, stored[1:], reissue)
    with pytest.raises(LedgerError, match="exactly once"):
        fresh.restore(1, 1, sim.ledger.next_group, stored, [*reissue, stored[0].group_id])
