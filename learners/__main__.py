"""``python -m learners --run-dir DIR``: the learner (rank of an Accelerate job)."""

from verl_async.runtime import load_context, start_role


def main() -> None:
    args = start_role("learner", "verl-async learner")
    from learners.setup import run_learner

    try:
        run_learner(load_context(args.run_dir))
    except KeyboardInterrupt:  # SIGTERM from the launcher: the loop has already cleaned up
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
