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

from dataclasses import dataclass

import torch

from learners.batching import TrainBatch
from learners.update import logits_of
from verl_async.algos import token_logprobs
from verl_async.algos.losses import explained_variance, value_loss
from verl_async.algos.masked import masked_mean


@dataclass
class CriticStats:
    vf_loss: float
    vf_clipfrac: float
    vf_explained_var: float
    grad_norm: float
    values_mean: float


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


def reference_logprobs(ref, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """The reference policy's log-probs of the batch's targets [N, T-1], at the sampling
    temperature (the same distribution the actor's log-probs describe)."""
    with torch.no_grad():
        logits = logits_of(ref, batch.input_ids, batch.attention_mask, temperature)
        return token_logprobs(logits, batch.input_ids[:, 1:])


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
    algo,
    cliprange_value: float,
    backward,
    clip_grad,
) -> CriticStats:
    """``algo.minibatches`` AdamW steps on the clipped value loss (verl's semantics:
    0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), aggregated by ``loss_agg_mode``)."""
    mask = batch.loss_mask
    chunks = torch.arange(len(mask), device=mask.device).chunk(algo.minibatches)
    totals = dict(loss=0.0, clip=0.0, grad=0.0)
    for idx in chunks:
        values = critic_values(critic, batch.input_ids[idx], batch.attention_mask[idx])
        loss, clipfrac = value_loss(
            values,
            old_values[idx],
            returns[idx],
            mask[idx],
            cliprange_value,
            algo.loss_agg_mode,
            algo.loss_scale_factor,
        )
        backward(loss)
        grad = clip_grad()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        k = 1.0 / len(chunks)
        totals["loss"] += float(loss.detach()) * k
        totals["clip"] += float(clipfrac) * k
        totals["grad"] += float(grad) * k
    return CriticStats(
        vf_loss=totals["loss"],
        vf_clipfrac=totals["clip"],
        vf_explained_var=float(explained_variance(old_values, returns, mask)),
        grad_norm=totals["grad"],
        values_mean=float(masked_mean(old_values, mask)),
    )
