"""``python -m learners --run-dir DIR``: the learner (rank of an Accelerate job)."""

from verl_async.runtime import load_context, start_role


def main() -> None:
    args = start_role("learner", "verl-async learner")
    from learners.setup import run_learner
    from verl_async.config_base import ConfigError

    try:
        run_learner(load_context(args.run_dir))
    except ConfigError as exc:  # a loss mode no module has, found at start (it needs torch)
        raise SystemExit(f"learner: {exc}") from None
    except KeyboardInterrupt:  # SIGTERM from the launcher: the loop has already cleaned up
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
