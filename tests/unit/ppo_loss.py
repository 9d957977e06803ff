"""The PPO loss with its settings as plain arguments, for tests written before the loss
registry: builds the ``algo`` section and the inputs and runs ``policy_loss``."""

from types import SimpleNamespace

import msgspec

from verl_async.algos import GlobalBatch, actor_inputs, policy_loss
from verl_async.schema import AlgoConfig


def ppo_loss(
    logp,
    logp_prox,
    logp_behav,
    advantages,
    mask,
    correction,
    clip_eps,
    is_cap,
    clip_eps_high=None,
    *,
    clip_ratio_c=None,
    loss_agg_mode="token-mean",
    loss_mode="vanilla",
    batch: GlobalBatch | None = None,
    **settings,
):
    """The policy loss and every metric (the correction's too) as attributes."""
    algo = msgspec.structs.replace(
        AlgoConfig(),
        correction=correction,
        clip_eps=clip_eps,
        is_cap=is_cap,
        clip_eps_high=clip_eps_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        loss_mode=loss_mode,
        **settings,
    )
    inputs, corr = actor_inputs(logp, logp_prox, logp_behav, advantages, mask, algo)
    out = policy_loss(inputs, algo, batch)
    return SimpleNamespace(
        **vars(out),
        clip_fraction=out.pg_clipfrac,
        is_weight_mean=corr.is_weight_mean,
        is_weight_max=corr.is_weight_max,
        is_clipped_fraction=corr.is_clipped_fraction,
    )
