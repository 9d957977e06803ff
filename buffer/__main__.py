"""``python -m buffer --run-dir DIR``: the rollout buffer process."""

import asyncio
import signal
from pathlib import Path

import uvloop

from buffer.ledger import PromptLedger
from buffer.server import BufferServer
from verl_async.data import load_prompts
from verl_async.runtime import load_context, start_role
from verl_async.staleness import Admission


async def serve(run_dir: str) -> None:
    ctx = load_context(run_dir)
    cfg = ctx.cfg
    admission = Admission(cfg.learner.groups_per_step, cfg.staleness.max)
    ledger = PromptLedger(
        load_prompts(cfg.data.path), admission, cfg.trainer.total_steps, cfg.data.shuffle_seed
    )
    server = BufferServer(ledger, cfg.staleness.max, ctx.endpoints.buffer)
    if ctx.endpoints.resume_from:
        server.restore(Path(ctx.endpoints.resume_from) / "buffer")

    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: setattr(server, "terminated", True)
    )
    await server.serve()


def main() -> None:
    args = start_role("buffer", "verl-async rollout buffer")
    uvloop.run(serve(args.run_dir))


if __name__ == "__main__":
    main()
