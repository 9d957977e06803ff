"""``python -m generators --run-dir DIR --index I``: one generator process."""

import asyncio
import logging
import signal

import uvloop

from verl_async.lifetime import Stopped
from verl_async.runtime import RunContext, load_context, report_exit, start_role

log = logging.getLogger("verl_async.generator")


async def _run(ctx: RunContext, index: int, asked: list[int]) -> None:
    from generators.main import run_generator

    # SIGTERM (the launcher stopping the run, or the launcher's death through
    # PR_SET_PDEATHSIG) cancels the generator, so its ``finally`` shuts the engine down:
    # vLLM's engine-core and worker processes would otherwise outlive it.
    task = asyncio.current_task()

    def stop() -> None:
        asked.append(signal.SIGTERM)  # a cancellation asked for, not one from inside
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    await run_generator(ctx, index)


def main() -> None:
    args = start_role("generator", "verl-async generator", with_index=True)
    asked: list[int] = []
    with report_exit(log):
        try:
            uvloop.run(_run(load_context(args.run_dir), args.index, asked))
        except asyncio.CancelledError:
            if not asked:
                raise
            raise Stopped(128 + signal.SIGTERM, "SIGTERM") from None


if __name__ == "__main__":
    main()
