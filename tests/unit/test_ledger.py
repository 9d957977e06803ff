import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.batches import filter_stale, shard_samples
from buffer.ledger import LedgerError, PromptLedger, StoredGroup
from buffer.telemetry import AdmissionClock, TokenRate
from verl_async.data import PromptRecord
from verl_async.protocol import EpisodeStats
from verl_async.staleness import Admission


def _stored(k, versions, n_tokens=3):
    z = np.zeros(n_tokens, np.int32)
    return StoredGroup(
        k,
        0,
        0,
        np.zeros(2, np.int32),
        [z] * len(versions),
        [z.astype(np.float32)] * len(versions),
        [np.full(n_tokens, v, np.int32) for v in versions],
        [[1.0]] * len(versions),
        [0],
        "default",
    )


def _ledger(b=2, eta=1, steps=3, n=4):
    return PromptLedger(
        [PromptRecord(f"p{i}", str(i)) for i in range(n)], Admission(b, eta), steps, seed=0
    )


def test_issue_respects_admission_and_reports_blocking():
    ledger = _ledger(b=2, eta=1)
    groups, blocked = ledger.issue(0, loaded_version=0, max_groups=10)
    assert [g.group_id for g in groups] == [0, 1, 2, 3]  # (0 + 1 + 1) * 2
    assert blocked
    more, _ = ledger.issue(0, loaded_version=1, max_groups=10)
    assert [g.group_id for g in more] == [4, 5]
    assert ledger.exhausted


def test_every_prompt_once_per_epoch_then_reshuffled():
    ledger = _ledger(b=4, eta=10, steps=2, n=4)
    groups, _ = ledger.issue(0, 0, 8)
    first, second = [g.prompt_id for g in groups[:4]], [g.prompt_id for g in groups[4:]]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3]
    assert [g.epoch for g in groups] == [0] * 4 + [1] * 4


def test_returns_and_consumption_are_exactly_once():
    ledger = _ledger()
    ledger.issue(0, 0, 2)
    ledger.record_return(_stored(0, [0]))
    with pytest.raises(LedgerError, match="already returned"):
        ledger.record_return(_stored(0, [0]))
    with pytest.raises(LedgerError, match="never issued"):
        ledger.record_return(_stored(5, [0]))
    assert ledger.missing_for(0) == 1
    ledger.record_return(_stored(1, [0]))
    assert [g.group_id for g in ledger.consume(0)] == [0, 1]
    with pytest.raises(LedgerError):
        ledger.consume(0)


def test_filter_stale_drops_and_counts():
    kept, dropped = filter_stale([_stored(0, [3, 1, 2])], learner_version=4, max_staleness=2)
    assert dropped == 1
    assert [int(v.min()) for v in kept[0].token_versions] == [3, 2]


def test_filter_stale_keeps_multiturn_fields_aligned_and_reads_only_sampled_versions():
    g = _stored(0, [3, 1, 2])
    # Sample 2's observation placeholders carry version 0: stale if anything read them.
    g.token_versions[2] = np.array([2, 0, 2], np.int32)
    g.loss_masks = [np.array(m, np.uint8) for m in ([1, 1, 1], [1, 0, 1], [1, 0, 1])]
    g.turn_rewards = [np.array([i, 0, 0], np.float32) for i in range(3)]
    g.episodes = [EpisodeStats(i, 0, 0, 0, 0.0, 1, "", 0, False, 0.0) for i in range(3)]
    g.scores = [[0.0], [1.0], [2.0]]
    [kept], dropped = filter_stale([g], learner_version=4, max_staleness=2)
    assert dropped == 1
    assert [r[0] for r in kept.turn_rewards] == [0, 2] and kept.scores == [[0.0], [2.0]]
    assert [e.turns for e in kept.episodes] == [0, 2]
    assert [m.tolist() for m in kept.loss_masks] == [[1, 1, 1], [1, 0, 1]]
    assert [v.tolist() for v in kept.token_versions] == [[3, 3, 3], [2, 0, 2]]
    # Without a mask every token is sampled: the same versions make sample 2 stale.
    g.loss_masks = None
    [kept], dropped = filter_stale([g], learner_version=4, max_staleness=2)
    assert dropped == 2 and kept.turn_rewards[0][0] == 0 and kept.loss_masks is None


def _group_of_lengths(k, lengths):
    g = _stored(k, [0] * len(lengths))
    g.responses = [np.zeros(n, np.int32) for n in lengths]
    return g


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=8), min_size=1, max_size=12),
    st.integers(1, 4),
)
def test_shards_cover_every_sample_once_and_differ_by_at_most_one_sample(lengths, world):
    groups = [_group_of_lengths(k, ls) for k, ls in enumerate(lengths)]
    shards = shard_samples(groups, world)
    assert len(shards) == world
    every = sorted(key for shard in shards for key in shard)
    assert every == [(gi, i) for gi, ls in enumerate(lengths) for i in range(len(ls))]
    size = lambda gi, i: len(groups[gi].prompt_ids) + lengths[gi][i]  # noqa: E731
    loads = [sum(size(*key) for key in shard) for shard in shards]
    longest = max(size(*key) for key in every)
    assert max(loads) - min(loads) <= longest
    if len(every) >= world:  # nobody idles while another rank has two samples
        assert all(shard for shard in shards)


def test_shards_split_a_group_when_that_balances_tokens():
    groups = [_group_of_lengths(0, [10, 10]), _group_of_lengths(1, [1, 1])]
    shards = shard_samples(groups, 2)
    # Whole groups would give loads 24 and 6; samples give 15 each.
    assert shards == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]


def test_token_rate_window():
    rate = TokenRate(window_s=10)
    rate.add(100, now=0.0)
    rate.add(100, now=1.0)
    assert rate.rate(now=2.0) == pytest.approx(100.0)
    assert rate.rate(now=20.0) == 0.0
    # A burst after a quiet spell is averaged over the window, not over the burst.
    rate.add(100, now=30.0)
    rate.add(100, now=30.001)
    assert rate.rate(now=30.002) == pytest.approx(20.0)


def test_admission_clock_counts_refusals_until_work_and_idle_only_with_nothing_in_flight():
    clock = AdmissionClock()
    clock.observe(0, refused=True, in_flight=2, now=10.0)  # blocked, still busy
    clock.observe(0, refused=True, in_flight=0, now=11.0)  # its last group returned: idle
    clock.observe(1, refused=True, in_flight=0, now=11.5)  # a second generator, idle at once
    assert clock.totals(now=12.0) == pytest.approx((2.0 + 0.5, 1.0 + 0.5))  # running intervals
    clock.observe(0, refused=False, in_flight=0, now=13.0)  # got work: both intervals close
    clock.observe(0, refused=True, in_flight=0, now=13.0)  # refused again later: new interval
    clock.observe(1, refused=False, in_flight=0, now=14.0)
    assert clock.totals(now=14.0) == pytest.approx((3.0 + 1.0 + 2.5, 2.0 + 1.0 + 2.5))
    assert clock.blocked_since == {0: 13.0}
