"""The learner's algorithm functions; they live in ``verl_async.algos`` and are re-exported
here so ``from verl_async.algorithms import ...`` keeps working.

  grpo_advantages                 group-relative advantages (verl_async.algos.advantages)
  policy_loss, LossOutput         PPO-clip with none|tis|decoupled corrections, clip-higher
                                  and dual-clip (verl_async.algos.losses)
  token_logprobs, token_entropy   per-token quantities from logits (verl_async.algos.tokens)
  kl_k3                           the learner's k3 KL metric (verl_async.algos.kl)

Everything else in ``verl_async.algos`` is importable from here as well.
"""

from verl_async.algos import (
    AGG_MODES,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    LossOutput,
    agg_loss,
    apply_kl_penalty,
    entropy_from_logits,
    entropy_loss,
    explained_variance,
    gae_advantages,
    group_ids,
    grpo_advantages,
    grpo_outcome_advantages,
    kl_k3,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_entropy,
    token_logprobs,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "LossOutput",
    "agg_loss",
    "apply_kl_penalty",
    "entropy_from_logits",
    "entropy_loss",
    "explained_variance",
    "gae_advantages",
    "group_ids",
    "grpo_advantages",
    "grpo_outcome_advantages",
    "kl_k3",
    "kl_penalty",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
