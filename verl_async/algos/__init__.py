"""The PPO family's pure tensor functions: advantage estimators, KL penalties and
controllers, losses, and per-token log-probs and entropies (see docs/algorithms.md)."""

from verl_async.algos.advantages import (
    gae_advantages,
    gdpo_advantages,
    group_ids,
    grpo_advantages,
    grpo_outcome_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from verl_async.algos.corrections import Correction, off_policy_correction
from verl_async.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_k3,
    kl_penalty,
    make_kl_controller,
)
from verl_async.algos.losses import (
    AGG_MODES,
    GlobalBatch,
    agg_loss,
    entropy_loss,
    explained_variance,
    value_loss,
)
from verl_async.algos.masked import (
    masked_center,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from verl_async.algos.policy_losses import (
    LossInputs,
    LossOutput,
    actor_inputs,
    get_policy_loss,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from verl_async.algos.tokens import entropy_from_logits, token_entropy, token_logprobs

# Registers the built-in loss modes (after the registry exists).
from verl_async.algos import loss_modes  # noqa: E402, F401  isort: skip

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "Correction",
    "FixedKLController",
    "GlobalBatch",
    "LossInputs",
    "LossOutput",
    "actor_inputs",
    "agg_loss",
    "apply_kl_penalty",
    "entropy_from_logits",
    "entropy_loss",
    "explained_variance",
    "gae_advantages",
    "gdpo_advantages",
    "get_policy_loss",
    "group_ids",
    "grpo_advantages",
    "grpo_outcome_advantages",
    "kl_k3",
    "kl_penalty",
    "make_kl_controller",
    "masked_center",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "off_policy_correction",
    "policy_loss",
    "policy_loss_names",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
