"""``python -m learners --run-dir DIR``: the learner (rank of an Accelerate job)."""

import logging

from verl_async.lifetime import Interrupted, Stopped
from verl_async.runtime import load_context, report_exit, start_role

log = logging.getLogger("verl_async.learner")


def main() -> None:
    args = start_role("learner", "verl-async learner")
    with report_exit(log):  # a loss mode no module has ends it as a ConfigError, in one line
        from learners.setup import run_learner

        try:
            run_learner(load_context(args.run_dir))
        except Interrupted as exc:  # SIGTERM from the launcher: the loop has cleaned up
            raise Stopped(130, str(exc)) from None


if __name__ == "__main__":
    main()
