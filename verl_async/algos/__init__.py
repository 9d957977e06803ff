"""The PPO family's pure tensor functions: advantage estimators, KL penalties and
controllers, losses, off-policy corrections, and per-token log-probs and entropies (see
docs/algorithms.md).

The names below are loaded on first use (PEP 562): importing this package, or its torch-free
``correction.settings`` (which the config schema reads), does not import torch. The
built-in loss modes register themselves when ``policy_losses`` is imported.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "advantages": (
        "gae_advantages",
        "gdpo_advantages",
        "group_ids",
        "grpo_advantages",
        "grpo_outcome_advantages",
        "reinforce_plus_plus_advantages",
        "reinforce_plus_plus_baseline_advantages",
        "remax_advantages",
        "rloo_advantages",
    ),
    "correction.off_policy": ("Correction", "off_policy_correction"),
    "episodes": ("Episodes",),
    "kl": (
        "KL_KINDS",
        "AdaptiveKLController",
        "FixedKLController",
        "apply_kl_penalty",
        "kl_k3",
        "kl_penalty",
        "make_kl_controller",
    ),
    "losses": (
        "AGG_MODES",
        "GlobalBatch",
        "agg_loss",
        "entropy_loss",
        "explained_variance",
        "value_loss",
    ),
    "masked": ("masked_center", "masked_mean", "masked_sum", "masked_var", "masked_whiten"),
    "policy_losses": (
        "LossInputs",
        "LossOutput",
        "actor_inputs",
        "get_policy_loss",
        "policy_loss",
        "policy_loss_names",
        "register_policy_loss",
    ),
    "tokens": ("entropy_from_logits", "token_entropy", "token_logprobs"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
