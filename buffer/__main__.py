"""``python -m buffer --run-dir DIR``: the rollout buffer process."""

import asyncio
import logging
import signal
import sys
from pathlib import Path

import uvloop

from buffer.evaluation import EvalRounds
from buffer.filtering import FilterRule
from buffer.leases import Leases
from buffer.ledger import PromptLedger
from buffer.requests import Peers
from buffer.rollouts import RolloutLimits, max_response_tokens, max_samples_per_episode
from buffer.server import BufferServer
from verl_async import placement
from verl_async import protocol as P
from verl_async.checkpoint import in_run, require_valid
from verl_async.config import prompt_limit
from verl_async.data import PromptRecord, load_prompts, render_prompts
from verl_async.runtime import load_context, mark, mark_cpu, report_exit, start_role
from verl_async.schema import RunConfig
from verl_async.staleness import Admission
from verl_async.transport.server import ServerOptions

log = logging.getLogger("verl_async.buffer")


def load_rendered(cfg: RunConfig, model_path: str) -> tuple[list, list, int]:
    """(training prompts, validation prompts, prompts skipped), rendered to token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    limit = prompt_limit(cfg)

    def render(records: list[PromptRecord], key: str) -> tuple[list[PromptRecord], int]:
        chat = cfg.data.chat_template
        kept, skipped = render_prompts(records, tokenizer, chat, limit.tokens)
        if skipped:
            log.warning(
                "%s: skipped %d of %d prompts longer than %d tokens (%s)",
                key,
                skipped,
                len(records),
                limit.tokens,
                limit.key,
            )
        if not kept:  # the launcher's check (launch/prompt_fit.py) let an estimate pass
            every, _ = render_prompts(records, tokenizer, chat, sys.maxsize)
            raise limit.too_low(key, min(len(r.prompt_ids) for r in every))
        return kept, skipped

    train, skipped = render(load_prompts(cfg.data.path), "data.path")
    val = []
    if cfg.data.val_path:
        val, _ = render(load_prompts(cfg.data.val_path, "data.val_path"), "data.val_path")
        if cfg.eval.max_prompts:
            val = val[: cfg.eval.max_prompts]
    log.info("%d training prompts, %d validation prompts", len(train), len(val))
    return train, val, skipped


def rollout_limits(cfg: RunConfig, model_path: str) -> RolloutLimits:
    """What a returned group must look like in this run (the buffer rejects the rest)."""
    from transformers import AutoConfig

    return RolloutLimits(
        num_sources=len(cfg.rewards.sources),
        group_size=cfg.generators.group_size,
        vocab_size=AutoConfig.from_pretrained(model_path).vocab_size,
        max_response_tokens=max_response_tokens(cfg),
        max_samples_per_episode=max_samples_per_episode(cfg),
        teacher_logprobs=bool(cfg.distillation.processes),
    )


def run_info(run_dir: str) -> P.RunInfo:
    """The run as roles started on their own fetch it (``GetRun``)."""
    path = Path(run_dir).resolve()
    return P.RunInfo(
        config_yaml=(path / "config.yaml").read_text(),
        endpoints_json=(path / "endpoints.json").read_text(),
        run_dir=str(path),
    )


async def serve(run_dir: str, exit_after_stop_s: float | None = None) -> None:
    ctx = load_context(run_dir)
    cfg = ctx.cfg
    train, val, skipped = load_rendered(cfg, ctx.endpoints.model_path)
    admission = Admission(cfg.learner.groups_per_step, cfg.staleness.max)
    # A generator holds at most max_inflight_groups being sampled and as many waiting for
    # their scores (generators/main.py): more on one connection is not a generator's doing.
    b = cfg.buffer
    leases = Leases(b.lease_timeout_s, 2 * cfg.generators.max_inflight_groups, max_s=b.lease_max_s)
    ledger = PromptLedger(
        train, admission, cfg.trainer.total_steps, cfg.data.shuffle_seed, leases=leases
    )
    server = BufferServer(
        ledger,
        cfg.staleness.max,
        ctx.endpoints.buffer,
        num_sources=len(cfg.rewards.sources),
        evals=EvalRounds(val),
        prompts_skipped=skipped,
        limits=rollout_limits(cfg, ctx.endpoints.model_path),
        run_info=run_info(run_dir),
        exit_after_stop_s=exit_after_stop_s,
        options=ServerOptions.for_run(cfg, run_dir),
        peers=Peers(
            generators=len(placement.generator_groups(cfg)),
            learner_ranks=len(placement.learner_devices(cfg)),
        ),
        filter_rule=FilterRule.from_config(cfg),
    )
    if ctx.endpoints.resume_from:
        ckpt = in_run(run_dir, ctx.endpoints.resume_from)
        require_valid(ckpt, "buffer")  # before a byte of it is read
        server.restore(ckpt / "buffer")
    mark(run_dir, "buffer", "serving")

    # SIGTERM (the launcher stopping the run) and SIGINT (Ctrl-C on `verl-async buffer`)
    # end the serving loop; its return is a clean end.
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(
            sig, lambda: setattr(server, "terminated", True)
        )
    try:
        await server.serve()
    finally:
        mark_cpu(run_dir, "buffer")


def exit_option(parser) -> None:
    parser.add_argument(
        "--exit-after-stop-s",
        type=float,
        default=None,
        help="leave this long after the learner's Shutdown (default: run until SIGTERM)",
    )


def main() -> None:
    args = start_role("buffer", "verl-async rollout buffer", more=exit_option)
    with report_exit(log):
        uvloop.run(serve(args.run_dir, args.exit_after_stop_s))


if __name__ == "__main__":
    main()
