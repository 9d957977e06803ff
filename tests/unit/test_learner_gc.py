"""Python's garbage collector stays out of the learner's steps (learners/trainer.py):
what exists before the loop is frozen, automatic collection is off during the steps,
and the young generations are collected between them."""

from __future__ import annotations

import gc
import weakref

from learners.trainer import Learner, collector_between_steps


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # only the collector frees it


def test_steps_run_without_automatic_collection_and_collect_between():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with collector_between_steps() as between_steps:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > before  # what was alive at the start is frozen
        garbage = weakref.ref(_Cycle())  # a step's garbage cycle
        for _ in range(3):  # allocations that would trigger an automatic collection
            [object() for _ in range(10 * gc.get_threshold()[0])]
        assert garbage() is not None  # not collected inside the step
        between_steps()
        assert garbage() is None
    assert gc.isenabled()
    assert gc.get_freeze_count() == before


class _Loop:
    """What ``Learner.train`` calls around its steps, recording the collector's state at
    each step (a stand-in for the learner's collaborators)."""

    def __init__(self, steps: int) -> None:
        self.steps_done, self.sync, self.seen = 0, None, []
        self.cfg = type("Cfg", (), {"trainer": type("T", (), {"total_steps": steps})})

    def restore(self) -> bool:
        return False

    def open_prefetcher(self, steps):
        return type("Batches", (), {"close": lambda self: None})()

    def maybe_evaluate(self) -> None:
        pass

    def step(self, step: int, first: int, batches) -> None:
        self.seen.append((step, gc.isenabled(), gc.get_freeze_count()))

    def finish(self) -> None:
        self.finished = gc.isenabled()


def test_the_learner_loop_runs_its_steps_with_the_collector_held_off():
    loop, before = _Loop(steps=3), gc.get_freeze_count()
    Learner.train(loop)
    assert [s for s, *_ in loop.seen] == [0, 1, 2]
    assert all(not enabled and frozen > 0 for _, enabled, frozen in loop.seen)
    assert loop.finished and gc.get_freeze_count() == before
