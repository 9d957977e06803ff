"""Fault injection: a learner slowed down on purpose.

- ``--write-delay-s S``: checkpoint writes sleep S seconds after the learner's files,
  before the buffer's files and the manifest, so that a kill or a Ctrl-C lands in the
  middle of a write (``SlowCheckpointer``, also used directly by unit tests);
- ``--update-delay-s S``: every optimizer update takes S seconds longer, so the learner is
  the slower stage whatever the machine and the generator stays ahead of it (buffer
  snapshots then hold finished rollouts, not only groups in flight).

In a real run the learner role is started as this module (``benchmarks/custom_learner.py``)::

    python -m benchmarks.custom_learner tests.slow_learner --write-delay-s 4 -- train ...
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

from learners import checkpointing


class SlowCheckpointer(checkpointing.Checkpointer):
    """A ``Checkpointer`` whose writes sleep ``delay_s`` after the learner's files, before
    the buffer's files and the manifest."""

    def __init__(self, *args, delay_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    def write(self, snap: checkpointing.Snapshot) -> None:
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


def main() -> None:
    from benchmarks.custom_learner import run_learner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-delay-s", type=float, default=0.0)
    parser.add_argument("--update-delay-s", type=float, default=0.0)
    args, rest = parser.parse_known_args()
    if args.write_delay_s:
        # The learner builds its writer as ``checkpointing.Checkpointer(...)``.
        checkpointing.Checkpointer = functools.partial(SlowCheckpointer, delay_s=args.write_delay_s)
    if args.update_delay_s:
        slow_updates(args.update_delay_s)
    run_learner(rest)


if __name__ == "__main__":
    main()
