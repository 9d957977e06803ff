"""``python -m generators --run-dir DIR --index I``: one generator process."""

import uvloop

from verl_async.runtime import load_context, start_role


def main() -> None:
    # Unpinned until its engine is up: the engine's processes each import vLLM, and on a
    # small machine that start-up goes faster on every core (generators/main.py pins then).
    args = start_role("generator", "verl-async generator", with_index=True, pin=False)
    from generators.main import run_generator

    uvloop.run(run_generator(load_context(args.run_dir), args.index))


if __name__ == "__main__":
    main()
