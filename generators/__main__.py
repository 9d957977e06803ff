"""``python -m generators --run-dir DIR --index I``: one generator process."""

import asyncio
import signal

import uvloop

from verl_async.runtime import RunContext, load_context, start_role


async def _run(ctx: RunContext, index: int) -> None:
    from generators.main import run_generator

    # SIGTERM (the launcher stopping the run, or the launcher's death through
    # PR_SET_PDEATHSIG) cancels the generator, so its ``finally`` shuts the engine down:
    # vLLM's engine-core and worker processes would otherwise outlive it.
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    await run_generator(ctx, index)


def main() -> None:
    args = start_role("generator", "verl-async generator", with_index=True)
    try:
        uvloop.run(_run(load_context(args.run_dir), args.index))
    except asyncio.CancelledError:
        raise SystemExit(128 + signal.SIGTERM) from None


if __name__ == "__main__":
    main()
