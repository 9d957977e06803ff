"""Fault injection: a checkpoint writer slowed down on purpose, so that a kill or a Ctrl-C
lands in the middle of a write (learner files written, buffer files and manifest not).

``SlowCheckpointer`` is used directly by unit tests. In a real run the learner role is
started as this module (``benchmarks/custom_learner.py``)::

    python -m benchmarks.custom_learner tests.slow_checkpoint --write-delay-s 4 -- train ...
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


def main() -> None:
    from benchmarks.custom_learner import run_learner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-delay-s", type=float, required=True)
    args, rest = parser.parse_known_args()
    # The learner builds its writer as ``checkpointing.Checkpointer(...)``.
    checkpointing.Checkpointer = functools.partial(SlowCheckpointer, delay_s=args.write_delay_s)
    run_learner(rest)


if __name__ == "__main__":
    main()
