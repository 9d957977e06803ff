"""On-policy distillation's losses (verl 1dda039's ``distillation.distillation_loss``).

A teacher scores the tokens the student sampled. Per kept token, with s = the student's
log-prob of the sampled token (pi_theta, carrying the gradient), t = the teacher's, and for
``forward_kl_topk`` the teacher's K most likely tokens with log-probs t_k and the student's
log-probs s_k of those same tokens:

  kl / k1            s - t                      (reverse KL's plain estimate; may be < 0)
  abs                |s - t|
  mse / k2           0.5 (s - t)^2
  low_var_kl / k3    x = clamp(t - s, -20, 20); clamp(e^x - x - 1, -10, 10)
  forward_kl_topk    max(0, sum_k e^t_k (t_k - s_k)), after clamping s_k and t_k below at
                     log_prob_min_clamp; computed in float32

These are ``algos/kl.py``'s estimators with the teacher in the reference's place. Then, in
order:

  1. loss_max_clamp c (if set): each token's value clamped to [-c, c].
  2. As a loss (``use_policy_gradient`` false): aggregated like any loss term (``agg_loss``
     with the run's ``loss_agg_mode`` and denominators). The config refuses k1 (and kl)
     there: its gradient does not depend on the teacher.
     As a reward (true; Thinking Machines' recipe): the vanilla PPO-clip loss with
     advantage -value.detach() per token (for k1 that is t - s: the teacher's log-prob
     minus the student's, no discount, no baseline), the clip range
     [1 - clip_ratio_low, 1 + clip_ratio_high], dual clip at 3 (verl's fallback), the same
     ratio denominator and correction weights as the policy loss.
  3. total = task_loss + distillation_loss_coef * distill  with ``use_task_rewards``;
     total = distill                                          without it (the task's policy
     loss, entropy bonus and KL term all dropped, as verl drops its whole ppo_loss).

The masked positions never reach a value or a gradient: everything is aggregated over the
mask. Pure torch; the learner's teacher pass (learners/teacher.py) supplies t, and for
forward_kl_topk the teacher's top k (t_k and the ids); the actor's log-prob pass
(learners/logprobs.py, ``token_stats(at_ids=...)``) gives s_k with their gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from verl_async.algos.kl import BASE_KL_KINDS, kl_penalty
from verl_async.algos.losses import GlobalBatch
from verl_async.algos.policy_losses import LossInputs, LossOutput, policy_loss

ESTIMATOR_MODES = BASE_KL_KINDS  # kl, k1, abs, mse, k2, low_var_kl, k3
DUAL_CLIP = 3.0  # verl reads clip_ratio_c from the distillation settings, which have none


@dataclass
class TopK:
    """The student's top-k terms at each token [N, T]: the forward KL and the probability
    mass each model puts on the teacher's k tokens (below 1; the KL is a lower bound)."""

    loss: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor


def estimator_losses(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mode: str
) -> torch.Tensor:
    """Per-token reverse-KL estimate [N, T] of the student from the teacher on the sampled
    tokens (``mode`` one of ``ESTIMATOR_MODES``)."""
    if mode not in ESTIMATOR_MODES:
        raise ValueError(f"unknown distillation estimator '{mode}' (one of {ESTIMATOR_MODES})")
    return kl_penalty(student_logp, teacher_logp, mode)


def forward_kl_topk(
    student_topk_logp: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    log_prob_min_clamp: float | None = None,
) -> TopK:
    """Forward KL over the teacher's top k: both [N, T, K] log-probs of the teacher's k
    tokens (the student's from its full softmax, so its gradient reaches every logit
    through the normaliser). Returns float32 ``TopK`` values [N, T], the loss clamped at 0
    (the truncated distributions do not sum to 1, so the sum can dip below)."""
    student_mass = student_topk_logp.exp().sum(dim=-1)
    teacher_mass = teacher_topk_logp.exp().sum(dim=-1)
    s, t = student_topk_logp, teacher_topk_logp
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    s, t = s.float(), t.float()
    loss = (t.exp() * (t - s)).sum(dim=-1).clamp_min(0.0)
    return TopK(loss, student_mass, teacher_mass)


def student_topk_logp(logits: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """The student's log-probs [N, T, K] of the teacher's top-k ids [N, T, K] from its
    logits [N, T, V]: log_softmax gathered (for unit tests and small vocabularies)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, teacher_ids)


def clamp_losses(losses: torch.Tensor, loss_max_clamp: float | None) -> torch.Tensor:
    """Each token's value clamped to [-c, c] (c = loss_max_clamp; None: unchanged)."""
    if loss_max_clamp is None:
        return losses
    return losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)


@dataclass
class DistillLoss:
    loss: torch.Tensor  # scalar: the distillation term before its coefficient
    pg: LossOutput | None  # the vanilla loss's metrics when used as a reward


def distillation_loss(
    losses: torch.Tensor, inputs: LossInputs, settings, algo, batch: GlobalBatch
) -> DistillLoss:
    """The distillation term from per-token values ``losses`` [N, T] (``estimator_losses``
    or ``forward_kl_topk``'s loss): clamped, then aggregated as a loss or used as the
    advantage of a vanilla PPO-clip loss (module docstring, steps 1-2). ``inputs`` are the
    policy loss's (student log-probs, ratio denominator, mask, correction weights),
    ``settings`` the ``distillation`` config section, ``algo`` the ``algo`` section (its
    ``loss_agg_mode`` and ``loss_scale_factor``), ``batch`` the denominators."""
    losses = clamp_losses(losses, settings.loss_max_clamp)
    if not settings.use_policy_gradient:
        return DistillLoss(batch.agg(losses, inputs.mask, algo.loss_agg_mode), None)
    as_reward = msgspec.structs.replace(
        algo,
        loss_mode="vanilla",
        clip_eps=settings.clip_ratio_low,
        clip_eps_high=settings.clip_ratio_high,
        clip_ratio_c=DUAL_CLIP,
    )
    reward_inputs = LossInputs(
        logp=inputs.logp,
        logp_old=inputs.logp_old,
        logp_behav=inputs.logp_behav,
        advantages=-losses.detach(),
        mask=inputs.mask,
        is_weights=inputs.is_weights,
        seed=inputs.seed,
    )
    pg = policy_loss(reward_inputs, as_reward, batch)
    return DistillLoss(pg.loss, pg)


def combine(task_loss: torch.Tensor, distill: torch.Tensor, settings) -> torch.Tensor:
    """The actor's loss (module docstring, step 3): the task's loss plus the weighted
    distillation term with ``use_task_rewards``, the distillation term alone without."""
    if settings.use_task_rewards:
        return task_loss + settings.distillation_loss_coef * distill
    return distill


def distillation_term(
    inputs: LossInputs, teacher_logp: torch.Tensor, settings, algo, batch: GlobalBatch
) -> DistillLoss:
    """The distillation term of a reverse-KL estimator ``settings.loss_mode``: the
    student's log-probs ``inputs.logp`` against ``teacher_logp`` [N, T], through
    ``distillation_loss``."""
    losses = estimator_losses(inputs.logp, teacher_logp, settings.loss_mode)
    return distillation_loss(losses, inputs, settings, algo, batch)


def topk_term(
    inputs: LossInputs,
    student_topk: torch.Tensor,
    teacher_topk: torch.Tensor,
    settings,
    algo,
    batch: GlobalBatch,
) -> DistillLoss:
    """The distillation term of forward_kl_topk: the student's log-probs ``student_topk``
    [N, T, K] (with their gradient) of the teacher's top-k tokens, whose log-probs are
    ``teacher_topk`` [N, T, K], clamped below at ``settings.log_prob_min_clamp``, through
    ``distillation_loss`` (as a loss, or as a reward on ``inputs.logp``)."""
    top = forward_kl_topk(student_topk, teacher_topk, settings.log_prob_min_clamp)
    return distillation_loss(top.loss, inputs, settings, algo, batch)
