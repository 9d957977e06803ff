"""``python -m reward_model --run-dir DIR --name SOURCE``: one reward-model process."""

from __future__ import annotations

import logging
import signal

from verl_async.config import ConfigError
from verl_async.reward_config import ModelReward
from verl_async.runtime import RunContext, load_context, report_exit, start_role
from verl_async.schema import RunConfig
from verl_async.transport.server import ServerOptions

log = logging.getLogger("verl_async.reward_model")


def find_source(cfg: RunConfig, name: str) -> ModelReward:
    models = [s for s in cfg.rewards.sources if isinstance(s, ModelReward)]
    for source in models:
        if source.name == name:
            return source
    raise ConfigError(
        f"--name '{name}' is not a model reward source of this run "
        f"(model sources: {[s.name for s in models]})"
    )


def endpoint_of(ctx: RunContext, name: str) -> str:
    try:
        return ctx.endpoints.reward_models[name]
    except KeyError:
        raise ConfigError(
            f"endpoints.json of {ctx.run_dir} has no reward_models endpoint for '{name}'"
        ) from None


def main() -> None:
    args = start_role("reward_model", "verl-async reward-model process", with_name=True)
    with report_exit(log):
        serve(args.run_dir, args.name)


def serve(run_dir: str, name: str) -> None:
    """Load the model of reward source ``name`` and answer scoring requests until SIGTERM."""
    import torch

    from reward_model.scoring import load_reward_model
    from reward_model.server import RewardModelServer

    ctx = load_context(run_dir)
    source = find_source(ctx.cfg, name)
    endpoint = endpoint_of(ctx, name)
    # float32 on CPU (half precision there is slow and imprecise); the run's dtype on CUDA.
    device, dtype = (
        ("cuda", ctx.cfg.model.dtype) if torch.cuda.is_available() else ("cpu", "float32")
    )
    model, tokenizer = load_reward_model(source.path, device, dtype)
    log.info("loaded %s on %s (%s)", source.path, device, dtype)
    server = RewardModelServer(
        model,
        tokenizer,
        endpoint,
        source.batch_size,
        source.max_length,
        source.share_prefix,
        options=ServerOptions.for_run(ctx.cfg, run_dir),
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "terminated", True))
    server.serve()


if __name__ == "__main__":
    main()
