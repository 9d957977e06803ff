"""``python -m generators --run-dir DIR --index I``: one generator process."""

from verl_async.runtime import (
    apply_cpu_pinning,
    die_with_parent,
    load_context,
    role_args,
    setup_logging,
)


def main() -> None:
    args = role_args("verl-async generator", with_index=True)
    die_with_parent()
    setup_logging(f"generator{args.index}")
    apply_cpu_pinning()
    import uvloop

    from generators.main import run_generator

    uvloop.run(run_generator(load_context(args.run_dir), args.index))


if __name__ == "__main__":
    main()
