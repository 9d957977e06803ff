"""``python -m learners --run-dir DIR``: the learner (rank of an Accelerate job)."""

from verl_async.runtime import (
    apply_cpu_pinning,
    die_with_parent,
    load_context,
    role_args,
    setup_logging,
)


def main() -> None:
    args = role_args("verl-async learner")
    die_with_parent()
    setup_logging("learner")
    apply_cpu_pinning()
    from learners.trainer import run_learner

    run_learner(load_context(args.run_dir))


if __name__ == "__main__":
    main()
