"""KL estimators, the KL reward penalty and its coefficient controllers (verl semantics).

Per token, with d = logp - ref_logp (log-probs of the sampled token under the policy and
under the reference):

  "kl" / "k1"           d
  "abs"                 |d|
  "mse" / "k2"          0.5 * d^2
  "low_var_kl" / "k3"   x = clamp(-d, -20, 20); clamp(e^x - x - 1, -10, 10)
  "full"                unsupported (needs whole-vocabulary distributions): ValueError
  "<kind>+"             <kind>'s value with the gradient of k2 (0.5 * d^2, i.e. d per unit
                        of logp): g - sg(g) + sg(f), f the estimate, g = 0.5 d^2
                        (straight-through; verl 1dda039). "k2+" and "mse+" are plain k2.

``kl_k3(logp, logp_ref)`` is the learner's unclamped metric e^d - 1 - d: the k3 estimator
with the roles swapped (it equals "k3" with the arguments exchanged, before the clamps).

apply_kl_penalty: rewards = scores - beta * kl_t on kept tokens (scores unchanged on masked
ones); the reported KL is the batch mean of each sequence's masked token mean.

Controllers (Ziegler et al. 2019, as verl): the fixed one keeps beta; the adaptive one does
  e = clip(current_kl / target_kl - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)
"""

from __future__ import annotations

import torch

from verl_async.algos.masked import masked_mean
from verl_async.algos.tokens import entropy_from_logits

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "entropy_from_logits",
    "kl_k3",
    "kl_penalty",
    "make_kl_controller",
]

BASE_KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = BASE_KL_KINDS + tuple(f"{k}+" for k in BASE_KL_KINDS)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [N, T] of the policy from the reference, by ``kind`` (see the
    module docstring). Raises ValueError for "full" and unknown kinds."""
    if kind.endswith("+"):
        value = _kl_estimate(logp, ref_logp, kind[:-1])
        if kind in ("k2+", "mse+"):
            return value
        k2 = 0.5 * (logp - ref_logp).square()
        return k2 - k2.detach() + value.detach()
    return _kl_estimate(logp, ref_logp, kind)


def _kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    if kind == "full":
        raise ValueError(
            "kl kind 'full' needs whole-vocabulary distributions and is not supported; "
            f"use one of {', '.join(KL_KINDS)}"
        )
    raise ValueError(f"unknown kl kind '{kind}' (one of {', '.join(KL_KINDS)})")


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(ref || theta) from samples of ref: e^x - 1 - x, x = logp - logp_ref."""
    x = logp - logp_ref
    return torch.exp(x) - 1 - x


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL-penalised token rewards, as verl's ``apply_kl_penalty``.

    token_level_scores, logp (the sampling policy's), ref_logp, mask: [N, T].
    Returns (token_level_rewards [N, T], batch_kl): rewards = scores - kl_coef * kl on kept
    tokens and the scores themselves on masked ones; batch_kl is the mean over the N
    sequences of each one's masked mean KL (an all-masked sequence counts as 0). Pass
    batch_kl and N to the controller's ``update``.
    """
    kld = kl_penalty(logp, ref_logp, kind)
    kld = torch.where(mask.bool(), kld, torch.zeros_like(kld)) * mask
    rewards = token_level_scores - kl_coef * kld
    per_seq = masked_mean(kld, mask, dim=-1)
    return rewards, float(per_seq.mean())


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards ``target_kl``.

    update: e = clip(current_kl / target_kl - 1, -0.2, 0.2);
            value <- value * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """ "fixed" or "adaptive" controller (the adaptive one needs horizon > 0)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller '{kind}' (fixed, adaptive)")
