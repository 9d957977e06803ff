"""Fault injection: a learner slowed down on purpose.

- ``--write-delay-s S``: checkpoint writes sleep S seconds after the learner's files,
  before the buffer's files and the manifest, so that a kill or a Ctrl-C lands in the
  middle of a write (``SlowCheckpointer``, also used directly by unit tests);
- ``--update-delay-s S``: every optimizer update takes S seconds longer, so the learner is
  the slower stage whatever the machine and the generator stays ahead of it (buffer
  snapshots then hold finished rollouts, not only groups in flight);
- ``--gate FILE``: update n (counted from 1) waits until FILE holds an integer >= n, so a
  test paces the run by what it has done itself (a fuzzer's messages, say) instead of by
  the machine's speed;
- ``--ahead``: the update of step s waits until the buffer has received a group of a step
  after s, so the cut at the barrier after it holds a finished rollout on any machine (a
  delay only makes that likely: a loaded machine can slow the generator more than the
  learner).

In a real run the learner role is started as this module (``benchmarks/custom_learner.py``)::

    python -m benchmarks.custom_learner tests.slow_learner --write-delay-s 4 -- train ...
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

from learners.checkpoints import writer


class SlowCheckpointer(writer.Checkpointer):
    """A ``Checkpointer`` whose writes sleep ``delay_s`` after the learner's files, before
    the buffer's files and the manifest."""

    def __init__(self, *args, delay_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    def write(self, snap: writer.Snapshot) -> None:
        fetch = snap.deferred  # called right after the learner's files are written

        def late() -> dict[str, list]:
            time.sleep(self.delay_s)
            return fetch() if fetch is not None else {}

        super().write(dataclasses.replace(snap, deferred=late))


def slow_updates(delay_s: float) -> None:
    """Make every ``Learner.update`` sleep ``delay_s`` before it runs."""
    from learners.trainer import Learner

    update = Learner.update

    @functools.wraps(update)
    def slowed(self, *args, **kwargs):
        time.sleep(delay_s)
        return update(self, *args, **kwargs)

    Learner.update = slowed


GATE_TIMEOUT_S = 600.0  # a test that never opens the gate fails the run, it does not hang it


def gated_updates(path: str, timeout_s: float = GATE_TIMEOUT_S) -> None:
    """Make ``Learner.update`` number n wait until the file ``path`` holds an integer
    >= n (written by the test; a missing or half-written file counts as 0)."""
    from learners.trainer import Learner

    update = Learner.update
    done = [0]

    def allowed() -> int:
        try:
            return int(open(path).read().strip() or 0)
        except (OSError, ValueError):
            return 0

    @functools.wraps(update)
    def gated(self, *args, **kwargs):
        deadline = time.monotonic() + timeout_s
        while allowed() <= done[0]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gate {path} stayed at {allowed()} for {timeout_s:.0f}s")
            time.sleep(0.01)
        done[0] += 1
        return update(self, *args, **kwargs)

    Learner.update = gated


def ahead_updates(poll_s: float = 0.02, timeout_s: float = GATE_TIMEOUT_S) -> None:
    """Make the update of step s wait until the buffer has received a group of a step
    after s (the last step: all of its own). Groups have consecutive ids and step s trains
    ids sB .. sB + B - 1 (buffer/ledger.py, no dynamic sampling), and the buffer's
    ``consumed`` is the first id not yet handed to a step while ``returned`` counts the
    groups it holds, all at or past that id: so ``consumed + returned`` groups have come
    back, and more than (s + 1) B of them means one of a step after s has. Such a group is
    in the cut taken at step s + 1 (stored, or handed out for a later step and put back)."""
    from learners.trainer import Learner
    from verl_async import protocol as P

    update = Learner.update

    @functools.wraps(update)
    def ahead(self, *args, **kwargs):
        b, total = self.cfg.learner.groups_per_step, self.cfg.trainer.total_steps
        want = min((self.steps_done + 1) * b + 1, total * b)
        deadline = time.monotonic() + timeout_s
        while True:
            stats, _ = self.client.request(P.GetStats())
            if (got := stats.consumed + stats.returned) >= want:
                return update(self, *args, **kwargs)
            if time.monotonic() > deadline:
                raise RuntimeError(f"--ahead: the buffer stayed at {got}/{want} groups back")
            time.sleep(poll_s)

    Learner.update = ahead


def main() -> None:
    from benchmarks.custom_learner import run_learner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-delay-s", type=float, default=0.0)
    parser.add_argument("--update-delay-s", type=float, default=0.0)
    parser.add_argument("--gate", default="")
    parser.add_argument("--ahead", action="store_true")
    args, rest = parser.parse_known_args()
    if args.write_delay_s:
        # The learner's ``Checkpoints`` builds its writer as ``writer.Checkpointer(...)``.
        writer.Checkpointer = functools.partial(SlowCheckpointer, delay_s=args.write_delay_s)
    if args.update_delay_s:
        slow_updates(args.update_delay_s)
    if args.gate:
        gated_updates(args.gate)
    if args.ahead:
        ahead_updates()
    run_learner(rest)


if __name__ == "__main__":
    main()
