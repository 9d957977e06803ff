"""The critic (value model) of PPO with GAE, and the frozen reference policy.

Both live in the learner process; generators never hold them.

Critic. A token-classification model with one output: the policy's backbone (or
``critic.path``) with a fresh scalar head, trained by its own AdamW (``critic.lr``) on the
clipped value loss. ``critic_values`` gives V at every position t of the targets' layout
([N, T-1]): the value of the state after token t, i.e. before the response token t+1 is
generated, which is where GAE needs it (as verl takes ``values[:, -R-1:-1]``). Its weights
and optimizer state are part of every checkpoint.

Reference. The initial policy (or ``algo.kl.ref_path``), frozen: no optimizer and no
gradient, so it costs one more copy of the weights in memory (in ``model.dtype`` on CUDA,
float32 on CPU) and one forward pass per batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from learners.batching import TrainBatch
from learners.finite import guarded_step
from learners.logprobs import PassOptions, token_stats
from learners.plan import Minibatch, micro_rows, plan_update
from learners.update import UpdateHooks
from verl_async.algos.losses import explained_variance, value_loss
from verl_async.algos.masked import masked_mean
from verl_async.schema import AlgoConfig


@dataclass
class CriticStats:
    vf_loss: float
    vf_clipfrac: float
    vf_explained_var: float
    grad_norm: float
    values_mean: float
    # The step's values before the critic trained on it against its returns: the mean
    # squared error, and the returns' variance (what a constant guess at their mean
    # would err). Summed over several steps, 1 - sum(mse) / sum(var) is the explained
    # variance of those steps pooled, which a step whose returns are all alike (the
    # policy sure of every answer) cannot swing the way it swings vf_explained_var.
    values_mse: float = 0.0
    returns_var: float = 0.0
    # Optimizer steps skipped for a value loss or a gradient norm that was not finite, or
    # for a minibatch without a token to learn from (learners/finite.py).
    skipped_nonfinite_loss: int = 0
    skipped_nonfinite_grad: int = 0
    skipped_empty: int = 0


def value_fit(
    stats: CriticStats, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> CriticStats:
    """``stats`` with how well the step's ``values`` [N, T-1] (computed before the critic
    trained on the step) predict its ``returns``, over the kept tokens of ``mask``."""
    keep = mask.bool()
    v, r = values[keep], returns[keep]
    return dataclasses.replace(
        stats,
        vf_explained_var=float(explained_variance(values, returns, mask)),
        values_mean=float(v.mean()) if len(v) else 0.0,
        values_mse=float(((v - r) ** 2).mean()) if len(v) else 0.0,
        returns_var=float(r.var(unbiased=False)) if len(r) else 0.0,
    )


def load_critic(path: str, dtype: torch.dtype = torch.float32):
    """A one-output token classifier from ``path`` (a fresh head when ``path`` is a causal LM)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    # No dropout before the head: the values of the no-grad pass and of the training pass
    # must come from the same function (verl sets the same).
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)


def load_reference(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.requires_grad_(False)
    return model.to(device).eval()


def reference_logprobs(
    ref, batch: TrainBatch, temperature: float, options: PassOptions | None = None
) -> torch.Tensor:
    """The reference policy's log-probs of the batch's targets [N, T-1] at the loss mask's
    positions (0 elsewhere), at the sampling temperature (the same distribution the
    actor's log-probs describe), the pass run as ``options`` say (None: the defaults)."""
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.loss_mask
    with torch.no_grad():
        return token_stats(ref, ids, attn, mask, temperature, options=options).logp


def critic_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """V at each target position [N, T-1] (float32) of ids [N, T]."""
    out = critic(input_ids=input_ids, attention_mask=attention_mask).logits
    return out[:, :-1, 0].float()


def critic_update(
    critic,
    optimizer,
    batch: TrainBatch,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    algo: AlgoConfig,
    hooks: UpdateHooks,
    *,
    cliprange_value: float,
    plan: list[Minibatch] | None = None,
) -> CriticStats:
    """One AdamW step per minibatch of ``plan`` (learners/plan.py; by default
    ``algo.minibatches`` chunks of this batch) on the clipped value loss (verl's
    semantics: 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), aggregated by
    ``loss_agg_mode``). ``old_values`` and ``returns`` are this batch's rows; ``hooks``
    backpropagate, clip and agree over ranks as for the actor (``policy_update``; its
    ``reduce`` is not used). A minibatch whose loss or gradient norm is not finite, or
    without a token to learn from, takes no step (``guarded_step``)."""
    mask = batch.loss_mask
    if plan is None:
        plan = plan_update(mask, batch.attention_mask, [len(mask)], 0, algo.minibatches)
    losses, clips, grads, skips = [], [], [], []
    for mb in plan:
        agg = mb.global_batch(algo.loss_scale_factor)
        mb_loss = 0.0
        for idx in mb.micro:
            rows = micro_rows(idx, batch.attention_mask)
            rows_mask = rows.mask(mask)
            values = critic_values(critic, *rows.inputs(batch.input_ids, batch.attention_mask))
            old, ret = rows.take(old_values), rows.take(returns)
            loss, clipfrac = value_loss(
                values, old, ret, rows_mask, cliprange_value, algo.loss_agg_mode, agg
            )
            hooks.backward(loss)
            if not rows.placeholder:
                mb_loss += float(loss.detach())
                clips.append((float(clipfrac), float(rows_mask.sum())))
        empty = mb.tokens == 0  # the minibatch's, over every rank
        grad, skip = guarded_step(optimizer, hooks.clip_grad, mb_loss, hooks.any_rank, empty)
        grads.append(grad)
        skips.append(skip)
        losses.append(mb_loss)
    weight = sum(w for _, w in clips) or 1.0
    return CriticStats(
        vf_loss=sum(losses) / len(losses),
        vf_clipfrac=sum(c * w for c, w in clips) / weight,
        vf_explained_var=float(explained_variance(old_values, returns, mask)),
        grad_norm=sum(grads) / len(grads),
        values_mean=float(masked_mean(old_values, mask)),
        skipped_nonfinite_loss=skips.count("nonfinite_loss"),
        skipped_nonfinite_grad=skips.count("nonfinite_grad"),
        skipped_empty=skips.count("empty"),
    )
