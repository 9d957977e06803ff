"""A policy loss of a user's, selected by ``algo.loss_mode: tests.unit.custom_losses:halved``."""

import torch


def halved(inputs, algo, batch):
    """Half the plain policy gradient -A lp, with one metric."""
    loss_mat = -0.5 * inputs.advantages * inputs.logp
    if inputs.is_weights is not None:
        loss_mat = loss_mat * inputs.is_weights
    loss = batch.agg(loss_mat, inputs.mask, algo.loss_agg_mode)
    return loss, {"ppo_kl": torch.tensor(0.25), "actor/pg_clipfrac": 0.125}  # ours, verl's name


NOT_A_FUNCTION = 3
