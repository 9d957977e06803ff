"""``python -m generators --run-dir DIR --index I``: one generator process."""

import uvloop

from verl_async.runtime import load_context, start_role


def main() -> None:
    args = start_role("generator", "verl-async generator", with_index=True)
    from generators.main import run_generator

    uvloop.run(run_generator(load_context(args.run_dir), args.index))


if __name__ == "__main__":
    main()
