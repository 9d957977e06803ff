"""Evaluation rounds in the buffer: hand-out share, versions, completion, bad input."""

import pytest

from buffer.evaluation import EvalRounds
from buffer.ledger import LedgerError
from verl_async import protocol as P
from verl_async.data import PromptRecord


def _result(i):
    return P.EvalResult(
        group_id=i,
        data_source="default",
        scores=[[1.0]],
        failed=[0],
        response_lengths=[3],
        versions=[0],
        example="7",
    )


def _rounds(n=5):
    return EvalRounds([PromptRecord(f"p{i}", str(i), prompt_ids=(1, i)) for i in range(n)])


def test_a_round_takes_half_the_room_and_reports_when_complete():
    ev = _rounds()
    assert ev.take(8, 4) == (-1, []) and ev.pending_version() == -1  # nothing started
    ev.start(P.StartEval(round=0, step=4, version=4))
    assert ev.wanted(8, 4) == 4 and ev.wanted(1, 4) == 1 and ev.pending_version() == 4
    r, groups = ev.take(8, 4)
    assert r == 0 and [g.group_id for g in groups] == [0, 1, 2, 3]
    assert groups[2].prompt_ids == [1, 2] and groups[2].ground_truth == "2"
    _, rest = ev.take(8, 5)
    assert [g.group_id for g in rest] == [4] and ev.wanted(8, 4) == 0
    assert ev.pending_version() == -1  # all handed out (not all returned)
    ev.record(P.PushEval(round=0, results=[_result(i) for i in range(4)]))
    assert ev.report(0) == P.NotReady(step=0, missing_groups=1)
    ev.record(P.PushEval(round=0, results=[_result(4)]))
    report = ev.report(0)
    assert isinstance(report, P.EvalReport)
    assert (report.step, report.version, len(report.results)) == (4, 4, 5)
    with pytest.raises(LedgerError, match="not running"):
        ev.report(0)  # reported once


def test_the_oldest_round_is_served_first():
    ev = _rounds(2)
    ev.start(P.StartEval(round=1, step=2, version=2))
    ev.start(P.StartEval(round=0, step=0, version=0))
    assert [ev.take(2, 2)[0] for _ in range(4)] == [0, 0, 1, 1]


def test_a_round_goes_only_to_generators_that_loaded_its_version():
    ev = _rounds(2)
    ev.start(P.StartEval(round=0, step=3, version=3))
    assert ev.wanted(4, 2) == 0 and ev.take(4, 2) == (-1, [])  # still on version 2
    assert ev.pending_version() == 3
    r, groups = ev.take(4, 3)
    assert r == 0 and len(groups) == 2 and ev.pending_version() == -1


def test_unknown_and_repeated_results_are_rejected_whole():
    ev = _rounds(3)
    ev.start(P.StartEval(round=0, step=0, version=0))
    assert len(ev.take(8, 0, b"A")[1]) == 3
    with pytest.raises(LedgerError, match="not running"):
        ev.record(P.PushEval(round=9, results=[_result(0)]), b"A")
    with pytest.raises(LedgerError, match="unknown or repeated"):
        ev.record(P.PushEval(round=0, results=[_result(0), _result(7)]), b"A")
    # Results come only from the connection the prompt was handed to: another client
    # cannot fabricate them (nor fill the round before the real ones arrive).
    with pytest.raises(LedgerError, match="prompt 1 of round 0 was not handed to this connection"):
        ev.record(P.PushEval(round=0, results=[_result(1)]), b"B")
    assert ev.report(0).missing_groups == 3  # nothing of the bad messages was kept
    with pytest.raises(LedgerError, match="already started"):
        ev.start(P.StartEval(round=0, step=0, version=0))
    with pytest.raises(LedgerError, match="no validation prompts"):
        EvalRounds([]).start(P.StartEval(round=0, step=0, version=0))
