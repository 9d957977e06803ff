"""Fault injection: a learner whose first update calls ``sys.exit(2)`` from deep inside
its loop, as a user's loss function or a library might. The role must end saying so in
its log's last line (``verl_async.runtime.report_exit``).

    python -m benchmarks.custom_learner tests.exiting_learner -- train ...
"""

from __future__ import annotations

import functools
import sys


def exit_in_update() -> None:
    """Make ``Learner.update`` exit with code 2 before it computes anything."""
    from learners.trainer import Learner

    update = Learner.update

    @functools.wraps(update)
    def exiting(self, *args, **kwargs):
        give_up()

    Learner.update = exiting


def give_up() -> None:
    sys.exit(2)


def main() -> None:
    from benchmarks.custom_learner import run_learner

    exit_in_update()
    run_learner(sys.argv[1:])


if __name__ == "__main__":
    main()
