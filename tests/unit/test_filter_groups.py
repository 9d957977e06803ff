"""DAPO's dynamic sampling at the buffer (buffer/filtering.py, buffer/ledger.py): which
groups are dropped, how steps are refilled, and that staleness and exactly-once hold."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.filtering import FilterRule, GroupFilter, Verdict, uniform
from buffer.ledger import FilterMarks, LedgerError, PromptLedger, StoredGroup
from buffer.snapshot import Cuts, LedgerState, decode_state, encode_state, restore_ledger
from learners.batching import Filtered
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.data import PromptRecord
from verl_async.protocol import EpisodeStats
from verl_async.staleness import Admission, check_sample

NAN = math.nan


def _group(k: int, scores: list[list[float]], version: int = 0, turn=None, episodes=()):
    """Group ``k`` with one sample per row of ``scores`` ([N][S])."""
    n = len(scores)
    z = np.zeros(2, np.int32)
    return StoredGroup(
        k,
        0,
        0,
        z,
        [z] * n,
        [z.astype(np.float32)] * n,
        [np.full(2, version, np.int32)] * n,
        scores,
        [0] * len(scores[0]),
        "",
        turn_rewards=None if turn is None else [np.asarray(t, np.float32) for t in turn],
        episodes=list(episodes),
    )


def _episode(index: int) -> EpisodeStats:
    return EpisodeStats(1, 0, 0, 0, 0.0, 0, "", 0, False, 0.0, episode=index)


# ----------------------------------------------------------------------------- the decision


def test_groups_whose_members_all_score_alike_are_uniform():
    assert uniform(_group(0, [[1.0], [1.0], [1.0]]), None)
    assert uniform(_group(0, [[0.0], [0.0]]), 0)
    assert not uniform(_group(0, [[1.0], [0.0], [1.0]]), None)
    assert not uniform(_group(0, [[1.0]]), None)  # a singleton is never filtered
    # reward: every source must agree; a source name looks at that source alone.
    two = _group(0, [[1.0, 0.5], [1.0, 0.25]])
    assert not uniform(two, None) and uniform(two, 0) and not uniform(two, 1)
    # A source not routed to the group (NaN) compares equal to itself under "reward" ...
    routed = _group(0, [[1.0, NAN], [1.0, NAN]])
    assert uniform(routed, None)
    # ... and a group its metric source does not score is never dropped.
    assert not uniform(routed, 1)


def test_multiturn_groups_compare_their_episode_rewards():
    same_outcome = [[1.0], [1.0]]
    differ = _group(0, same_outcome, turn=[[0.0, 0.5], [0.0, 0.0]])
    assert not uniform(differ, None)  # the turn rewards differ: 1.5 vs 1.0
    assert uniform(differ, 0)  # the source alone does not see them
    # Different turns, same sum: the episode rewards are equal.
    assert uniform(_group(0, same_outcome, turn=[[0.25, 0.25], [0.0, 0.5]]), None)
    # An agent's one episode of two samples is a singleton group.
    one_episode = [_episode(0), _episode(0)]
    assert not uniform(_group(0, same_outcome, episodes=one_episode), None)
    two_episodes = [_episode(0), _episode(1)]
    assert uniform(_group(0, same_outcome, episodes=two_episodes), None)


def test_drops_in_a_row_are_bounded_and_the_count_restarts():
    f = GroupFilter(FilterRule(source=None, max_in_a_row=2))
    alike, mixed = _group(0, [[0.0], [0.0]]), _group(0, [[0.0], [1.0]])
    seq = [f.decide(g) for g in (alike, alike, alike, alike, mixed, alike, alike, alike)]
    assert seq == [
        Verdict.DROP,
        Verdict.DROP,
        Verdict.PAST_BOUND,  # a third in a row is kept
        Verdict.DROP,  # the count started again
        Verdict.KEEP,  # a kept group restarts it too
        Verdict.DROP,
        Verdict.DROP,
        Verdict.PAST_BOUND,
    ]
    assert f.in_a_row == 0


def test_filtered_metrics_name_the_step_and_the_run_counts():
    assert Filtered([[3, 7], [5, 1]], 9, 1, 4).metrics() == {
        "filter_groups/dropped": 2,
        "filter_groups/dropped_total": 9,
        "filter_groups/admitted_past_bound": 1,
        "filter_groups/admitted_past_bound_total": 4,
    }


# ----------------------------------------------------------------------------- the ledger


def _ledger(b: int, eta: int, steps: int, n: int = 50) -> PromptLedger:
    prompts = [PromptRecord(f"p{i}", str(i)) for i in range(n)]
    return PromptLedger(prompts, Admission(b, eta), steps, seed=0)


def _issue(lg: PromptLedger, version: int, most: int = 100) -> list[int]:
    return [g.group_id for g in lg.issue(0, version, most)[0]]


def test_a_step_takes_the_next_kept_groups_and_dropped_ones_make_room():
    lg = _ledger(b=2, eta=0, steps=3)
    assert _issue(lg, 0) == [0, 1]  # eta 0: step 0's two places
    lg.record_return(_group(0, [[1.0]]), "drop")
    assert lg.missing_for(0) == 2  # group 1 and the one after it
    assert _issue(lg, 0) == [2]  # the drop made room at version 0
    lg.record_return(_group(2, [[1.0]]), "past_bound")
    assert lg.missing_for(0) == 1 and _issue(lg, 0) == []
    lg.record_return(_group(1, [[1.0]]), "drop")
    assert _issue(lg, 0) == [3]
    lg.record_return(_group(3, [[1.0]]))
    groups, filtered, past_bound = lg.consume_step(0)
    assert [g.group_id for g in groups] == [2, 3]
    assert filtered == [0, 1] and past_bound == 1
    assert lg.start == 4 and lg.past_bound_total == 1
    assert lg.position(4) == 2  # step 1's first place
    assert _issue(lg, 0) == [] and _issue(lg, 1) == [4, 5]
    with pytest.raises(LedgerError, match="still waits for 2 groups"):
        lg.consume_step(1)


def test_without_drops_positions_are_ids_and_steps_are_fixed():
    lg = _ledger(b=3, eta=1, steps=2)
    assert _issue(lg, 0) == [0, 1, 2, 3, 4, 5]
    assert [lg.position(k) for k in range(6)] == list(range(6))
    for k in range(6):
        lg.record_return(_group(k, [[float(k)]]))
    assert [g.group_id for g in lg.consume(0)] == [0, 1, 2]
    assert [g.group_id for g in lg.consume(1)] == [3, 4, 5]
    assert lg.exhausted


def test_exhaustion_reopens_when_a_group_in_flight_is_dropped():
    lg = _ledger(b=2, eta=1, steps=1)
    assert _issue(lg, 0) == [0, 1] and lg.exhausted
    lg.record_return(_group(1, [[0.0]]), "drop")
    assert not lg.exhausted and _issue(lg, 0) == [2]


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 3),
    eta=st.integers(0, 3),
    steps=st.integers(1, 5),
    choices=st.lists(st.integers(0, 1_000_000), min_size=50, max_size=300),
)
def test_random_interleavings_with_drops_stay_fresh_and_account_for_every_group(
    b, eta, steps, choices
):
    """Two generators, random issue / return (a third dropped) / step / load, then run to
    the end: every group before the last step's end trained or dropped once, none stale."""
    lg = _ledger(b, eta, steps, n=7)
    version, loaded = 0, [0, 0]
    held: list[tuple[int, int]] = []
    trained: list[int] = []

    def give_back(i: int, c: int) -> None:
        k, v = held.pop(i)
        lg.record_return(_group(k, [[0.0]], version=v), "drop" if c % 3 == 0 else "keep")

    def step() -> None:
        nonlocal version
        for grp in lg.consume(version):
            assert check_sample(version, int(grp.token_versions[0].min()), eta)
            trained.append(grp.group_id)
        version += 1

    for c in choices:
        op, g = c % 4, (c // 4) % 2
        if op == 0:
            held += [(k, loaded[g]) for k in _issue(lg, loaded[g], 1 + c % 3)]
        elif op == 1 and held:
            give_back((c // 8) % len(held), c // 16)
        elif op == 2 and version < steps and lg.missing_for(version) == 0:
            step()
        elif op == 3:
            loaded[g] = min(version, loaded[g] + 1)
    # Finish: generators follow the learner, nothing is dropped any more (no stall).
    while version < steps:
        held += [(k, version) for k in _issue(lg, version)]
        while held:
            give_back(0, 1)
        if lg.missing_for(version) == 0:
            step()
    assert len(trained) == steps * b == len(set(trained))
    dropped = {k for k in range(lg.start) if k not in trained}
    assert set(trained) | dropped == set(range(lg.start))
    assert lg.start - steps * b == len(dropped)  # the ledger's own count of drops


def test_a_snapshot_keeps_dropped_groups_done_across_a_restore():
    b, steps = 2, 4
    before = _ledger(b, 1, steps)
    handed_out, trained = {}, []
    ids = _issue(before, 0)  # 0..3
    for k in ids:
        before.record_return(_group(k, [[0.0]]), "drop" if k in (0, 2) else "keep")
    ids = _issue(before, 0)  # 4, 5: the drops made room
    before.record_return(_group(4, [[0.0]]), "past_bound")
    handed_out[0], _, _ = before.consume_step(0)  # groups 1 and 3
    trained += [g.group_id for g in handed_out[0]]
    marks = before.filter_marks(1)
    assert (marks.start, marks.dropped, marks.past_bound, marks.past_bound_before) == (
        4,
        [],
        [4],
        0,
    )
    marks0 = before.filter_marks(0)
    assert (marks0.start, marks0.dropped) == (0, [0, 2])
    stored, reissue = before.snapshot(1, handed_out)
    assert [g.group_id for g in stored] == [4] and reissue == [5]
    state = LedgerState(
        step=1, version=1, next_group=before.next_group, reissue=reissue, stored_groups=1,
        num_prompts=50, shuffle_seed=0, groups_per_step=b, max_staleness=1, dropped_stale=0,
        admission_blocked=0, step_start=marks.start, filtered=marks.dropped,
        past_bound=marks.past_bound, past_bound_before=marks.past_bound_before,
    )  # fmt: skip
    assert decode_state(encode_state(state)) == state
    # An older snapshot (no filtering fields) means step * B and nothing dropped.
    assert LedgerState(**{**_fields(state), "step_start": None}).step_start is None

    after = _ledger(b, 1, steps)
    after.restore(1, 1, before.next_group, stored, reissue, FilterMarks(4, [], [4], 0))
    assert _issue(after, 1, 1) == [5]  # in flight at the cut: issued again
    version = 1
    while version < steps:
        for k in [5, *_issue(after, version)] if version == 1 else _issue(after, version):
            after.record_return(_group(k, [[0.0]], version=version), "drop" if k % 3 else "keep")
        while after.missing_for(version) == 0 and version < steps:
            trained += [g.group_id for g in after.consume(version)]
            version += 1
    assert len(trained) == len(set(trained)) == steps * b
    assert 0 not in trained and 2 not in trained  # dropped before the cut: never again
    assert after.past_bound_total == 1  # group 4, counted once


def _fields(state: LedgerState) -> dict:
    return {f: getattr(state, f) for f in state.__struct_fields__}


def test_restore_refuses_a_dropped_group_that_is_also_stored():
    lg = _ledger(2, 1, 4)
    stored = [_group(2, [[0.0]]), _group(3, [[1.0]])]
    with pytest.raises(LedgerError, match="exactly once"):
        lg.restore(1, 1, 4, stored, [], FilterMarks(2, [2], [], 0))
    lg.restore(1, 1, 5, stored, [], FilterMarks(2, [4], [], 0))
    assert lg.position(5) == 4  # after four places (step 0's two, groups 2 and 3); 4 dropped


# ----------------------------------------------------------------------------- config


def test_filter_groups_config_and_its_errors_name_the_key():
    cfg = load_config("configs/tiny.yaml", ["algo.filter_groups.enable=true"])
    rule = FilterRule.from_config(cfg)
    assert rule == FilterRule(source=None, max_in_a_row=32)
    cfg = load_config(
        "configs/tiny.yaml",
        ["algo.filter_groups.enable=true", "algo.filter_groups.metric=correct"],
    )
    assert FilterRule.from_config(cfg).source == 0
    assert FilterRule.from_config(load_config("configs/tiny.yaml")) is None
    with pytest.raises(ConfigError, match="'algo.filter_groups.metric': 'acc' is neither"):
        load_config("configs/tiny.yaml", ["algo.filter_groups.metric=acc"])
    with pytest.raises(ConfigError, match="algo.filter_groups.max_in_a_row"):
        load_config("configs/tiny.yaml", ["algo.filter_groups.max_in_a_row=0"])
    with pytest.raises(ConfigError, match="algo.filter_groups.typo"):
        load_config("configs/tiny.yaml", ["algo.filter_groups.typo=1"])


def test_checkpoint_files_carry_the_drops_and_the_count_in_a_row(tmp_path):
    """Through the buffer's cut and its files (buffer/snapshot.py), as a resume reads them."""
    lg = _ledger(2, 1, 4)
    for k in _issue(lg, 0):  # 0..3
        lg.record_return(_group(k, [[0.0]]), {0: "drop", 1: "keep", 2: "past_bound"}.get(k, "drop"))
    handed_out = {0: lg.consume_step(0)[0]}  # groups 1 and 2; 0 dropped before them
    assert lg.missing_for(1) == 2 and _issue(lg, 1, 2) == [4, 5]  # 3 was dropped
    cuts = Cuts(lg)
    cuts.take(0, handed_out, version=0, max_staleness=1, dropped_stale=0, admission_blocked=0,
              filter_in_a_row=1)  # fmt: skip
    files, frames = cuts.files(0)
    wire = [bytes(b) for b in frames.buffers]
    for name, ref in files.files.items():
        (tmp_path / name).write_bytes(P.tensor(ref, wire).tobytes())

    fresh = _ledger(2, 1, 4)
    state = restore_ledger(fresh, tmp_path)
    assert (state.step_start, state.filtered, state.past_bound) == (0, [0, 3], [2])
    assert state.filter_in_a_row == 1
    assert sorted(fresh.returned) == [1, 2] and list(fresh.reissue) == [4, 5]
    assert fresh.dropped == {0, 3} and fresh.past_bound == {2}
    assert [g.group_id for g in fresh.consume(0)] == [1, 2]  # step 0 again, the same groups
    assert fresh.past_bound_total == 1 and fresh.start == 3
    assert _issue(fresh, 1, 3) == [4, 5, 6]  # never 0 or 3 again
