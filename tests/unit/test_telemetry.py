"""Generator telemetry stays off the data path: the buffer's clocks reach the learner
through ``Stats``, no checkpoint carries them, and the learner's per-step values survive
the totals starting again from zero (a resumed buffer)."""

from __future__ import annotations

import json
import time

import pytest

from buffer.snapshot import LEDGER_FILE, LedgerState, decode_state, encode_state
from learners.step_metrics import GeneratorTiming
from verl_async import protocol as P

from .test_buffer_validation import Harness, _issue_four

CLOCK_FIELDS = {"gen_tokens_per_s", "gen_blocked_s", "gen_idle_s", "wait_s"}


def _stats(tokens_per_s: float, blocked: float, idle: float, **leases) -> P.Stats:
    return P.Stats(
        issued=0, returned=0, consumed=0, stored_groups=0, target_version=0,
        dropped_stale=0, admission_blocked=0,
        gen_tokens_per_s=tokens_per_s, gen_blocked_s=blocked, gen_idle_s=idle, **leases,
    )  # fmt: skip


def test_per_step_generator_timing_is_the_difference_of_the_totals():
    timing = GeneratorTiming()
    assert timing.row(_stats(100.0, 2.0, 0.5)) == {
        "gen_tokens_per_s": 100.0,
        "gen_blocked_s": 2.0,
        "gen_idle_s": 0.5,
        "leases_expired": 0,
        "leases_renewed": 0,
        "rollouts_dropped": 0,
        "rollouts_refused": 0,
        "groups_ended": 0,
    }
    row = timing.row(_stats(250.123, 5.0, 0.5, leases_expired=3, leases_renewed=40))
    assert row == {
        "gen_tokens_per_s": 250.12,
        "gen_blocked_s": 3.0,
        "gen_idle_s": 0.0,
        "leases_expired": 3,  # running totals, as the buffer counts them
        "leases_renewed": 40,
        "rollouts_dropped": 0,
        "rollouts_refused": 0,
        "groups_ended": 0,
    }


def test_per_step_generator_timing_survives_a_restart_of_the_totals():
    timing = GeneratorTiming()
    for blocked, idle in [(10.0, 4.0), (30.0, 9.0), (45.0, 12.0)]:
        timing.row(_stats(1.0, blocked, idle))
    # The buffer started again (a resume): its totals count from zero. The step counts
    # from the new start: nothing negative, no jump by the old totals.
    row = timing.row(_stats(1.0, 1.5, 0.25))
    assert row["gen_blocked_s"] == 1.5 and row["gen_idle_s"] == 0.25
    row = timing.row(_stats(1.0, 4.0, 0.25))  # and goes on from the new totals
    assert row["gen_blocked_s"] == 2.5 and row["gen_idle_s"] == 0.0
    # Only one total smaller (idle restarted, blocked already past its old value): a restart.
    timing.row(_stats(1.0, 100.0, 50.0))
    row = timing.row(_stats(1.0, 120.0, 3.0))
    assert row["gen_blocked_s"] == 120.0 and row["gen_idle_s"] == 3.0


def test_per_step_generator_timing_takes_rounding_for_no_restart():
    timing = GeneratorTiming()
    timing.row(_stats(1.0, 1000.0, 500.0))
    row = timing.row(_stats(1.0, 1000.0 - 1e-9, 500.0))  # float noise in the buffer's sums
    assert row["gen_blocked_s"] == 0.0 and row["gen_idle_s"] == 0.0


def test_teacher_waits_per_step_are_per_group_means_of_the_new_groups():
    """distill/teacher_wait_s and teacher_busy_s: the totals' growth since the last batch
    over the groups a teacher process scored meanwhile; none when no group was; a buffer
    that started again counts from its new totals."""
    import msgspec

    timing = GeneratorTiming()
    base = _stats(1.0, 0.0, 0.0)
    at = lambda groups, wait, busy: msgspec.structs.replace(  # noqa: E731
        base, teacher_groups=groups, teacher_s=wait, teacher_busy_s=busy
    )
    assert "distill/teacher_wait_s" not in timing.row(base)  # no teacher process
    row = timing.row(at(4, 2.0, 0.4))
    assert (row["distill/teacher_wait_s"], row["distill/teacher_busy_s"]) == (0.5, 0.1)
    row = timing.row(at(6, 5.0, 0.6))
    assert (row["distill/teacher_wait_s"], row["distill/teacher_busy_s"]) == (1.5, 0.1)
    assert "distill/teacher_wait_s" not in timing.row(at(6, 5.0, 0.6))  # no new group
    row = timing.row(at(2, 0.5, 0.25))  # the buffer started again
    assert (row["distill/teacher_wait_s"], row["distill/teacher_busy_s"]) == (0.25, 0.125)


def test_a_batch_carries_no_clocks_and_stats_carry_the_generator_timing():
    assert not CLOCK_FIELDS & set(P.Batch.__struct_fields__)
    assert {"gen_tokens_per_s", "gen_blocked_s", "gen_idle_s"} <= set(P.Stats.__struct_fields__)


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _refused(h: Harness, client: bytes, generator_id: int) -> None:
    req = P.GetPrompts(generator_id=generator_id, loaded_version=0, max_groups=4)
    reply = h.request(client, req)
    assert reply.blocked_by_admission and not reply.groups


def test_stats_report_admission_time_and_a_restored_buffer_counts_from_zero(harness, tmp_path):
    h = harness
    _issue_four(h, version=0)  # admission at eta=1, B=2: nothing more at version 0
    _refused(h, b"A", 0)  # blocked, its four groups still in flight: not idle
    _refused(h, b"B", 1)  # blocked with nothing in flight: idle too
    time.sleep(0.02)
    stats = h.request(b"L", P.GetStats())
    assert stats.gen_blocked_s >= 0.04 and 0.02 <= stats.gen_idle_s < stats.gen_blocked_s
    assert stats.gen_tokens_per_s == 0.0  # nothing returned yet

    assert isinstance(h.request(b"L", P.SnapshotBuffer(step=0, version=0)), P.Ack)
    files, frames = h.server.cuts.files(0)
    wire = [bytes(b) for b in frames.buffers]
    for name, ref in files.files.items():
        (tmp_path / name).write_bytes(P.tensor(ref, wire).tobytes())
    assert not {k for k in json.loads((tmp_path / LEDGER_FILE).read_bytes()) if "gen_" in k}
    fresh = Harness()
    try:
        fresh.server.restore(tmp_path)
        stats = fresh.request(b"L", P.GetStats())
        assert (stats.gen_blocked_s, stats.gen_idle_s) == (0.0, 0.0)
    finally:
        fresh.close()


def test_a_ledger_file_of_an_earlier_version_with_clocks_still_loads():
    state = LedgerState(
        step=3, version=3, next_group=20, reissue=[15], stored_groups=5, num_prompts=40,
        shuffle_seed=1, groups_per_step=4, max_staleness=2, dropped_stale=0,
        admission_blocked=7,
    )  # fmt: skip
    old = json.loads(encode_state(state))
    old.update(gen_blocked_s=1.5, gen_idle_s=0.25)  # what earlier versions wrote
    assert decode_state(json.dumps(old).encode()) == state
