"""The policy-loss registry: ``algo.loss_mode`` names a loss, registered here or given as
``package.module:function``; every loss takes the same three arguments.

A loss mode is a function

    def my_loss(inputs: LossInputs, algo: AlgoConfig, batch: GlobalBatch)
        -> tuple[torch.Tensor, dict[str, torch.Tensor]]

returning the scalar loss of one micro-batch and its metrics. ``inputs`` holds the
per-token tensors (``LossInputs``), ``algo`` the ``algo`` config section (its settings:
clip_eps, clip_ratio_c, loss_agg_mode, ...), ``batch`` the minibatch's denominators, so
``batch.agg(loss_mat, inputs.mask, algo.loss_agg_mode)`` aggregates the way the run asks
(across micro-batches and ranks). Multiply the per-token loss by ``inputs.is_weights``
when it is not None (the off-policy correction's weights). The metric keys the learner
reads are ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl``, or verl's names for them
(``actor/pg_clipfrac``, ...); a missing one reads 0, other keys are ignored. The entropy bonus and the KL loss term are added outside.

``register_policy_loss(name)`` registers one under a name (a name taken twice raises);
``get_policy_loss(name)`` finds it, or imports ``module:function``. The built-in modes
live in ``loss_modes.py``, registered when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_async.algos.correction.off_policy import Correction, off_policy_correction
from verl_async.algos.losses import GlobalBatch
from verl_async.config_base import IMPORT_SPEC, ConfigError, import_named

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
LOSS_MODE_KEY = "algo.loss_mode"
# Filled by ``register_policy_loss`` as modules defining losses are imported, never after.
_REGISTRY: dict[str, PolicyLossFn] = {}


@dataclass
class LossInputs:
    """The per-token inputs of a policy loss, each [N, T] (``advantages`` may be [N, 1]).
    Masked positions may hold anything; the dispatcher zeroes them before a loss runs."""

    logp: torch.Tensor  # pi_theta, carries the gradient
    logp_old: torch.Tensor  # the ratio's denominator: pi_prox, or pi_behav (correction none)
    logp_behav: torch.Tensor  # the generator's sampling log-probs
    advantages: torch.Tensor
    mask: torch.Tensor  # 0/1, in logp's dtype
    is_weights: torch.Tensor | None = None  # detached per-token weights of the correction
    seed: int = 0  # seeds a loss's random choices (clip_cov): same seed, same choice


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    pg_clipfrac: torch.Tensor  # scalar, each mode's clip fraction (verl's definition)
    pg_clipfrac_lower: torch.Tensor  # scalar, vanilla: share where the dual clip binds
    ppo_kl: torch.Tensor  # scalar, mostly the mean of log(pi_old / pi_theta)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register the loss under ``name`` (``algo.loss_mode: name``). A name
    registered twice raises ValueError (verl overwrites silently)."""

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss '{name}' is registered already")
        _REGISTRY[name] = fn
        return fn

    return add


def policy_loss_names() -> list[str]:
    """The registered loss modes, sorted."""
    return sorted(_REGISTRY)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss ``name`` names: a registered mode, or ``package.module:function`` imported.
    Anything else raises ConfigError naming ``algo.loss_mode`` and the known modes."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if IMPORT_SPEC.match(name):
        fn = import_named(name, LOSS_MODE_KEY)
        if not callable(fn):
            raise ConfigError(f"bad value for '{LOSS_MODE_KEY}': '{name}' is not a function")
        return fn
    raise ConfigError(
        f"bad value for '{LOSS_MODE_KEY}': unknown loss mode '{name}' (one of "
        f"{', '.join(policy_loss_names())}, or package.module:function)"
    )


def _kept(x: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor | None:
    """``x`` with masked positions set to 0 (no gradient reaches them)."""
    if x is None:
        return None
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_loss(inputs: LossInputs, algo, batch: GlobalBatch | None = None) -> LossOutput:
    """The loss of ``algo.loss_mode`` on ``inputs``, aggregated with ``batch``'s
    denominators (default: this batch's own and ``algo.loss_scale_factor``). Masked positions are zeroed first, so no
    value a loss computes there (an exp of junk) reaches the loss or its gradient."""
    fn = get_policy_loss(algo.loss_mode)
    keep = inputs.mask > 0
    clean = LossInputs(
        logp=_kept(inputs.logp, keep),
        logp_old=_kept(inputs.logp_old, keep),
        logp_behav=_kept(inputs.logp_behav, keep),
        advantages=_kept(inputs.advantages, keep),
        mask=inputs.mask,
        is_weights=_kept(inputs.is_weights, keep),
        seed=inputs.seed,
    )
    batch = batch or GlobalBatch(loss_scale_factor=algo.loss_scale_factor)
    loss, metrics = fn(clean, algo, batch)
    zero = torch.zeros((), dtype=inputs.logp.dtype, device=inputs.logp.device)

    def get(key: str) -> torch.Tensor:  # our key, or verl's "actor/<key>"
        return torch.as_tensor(metrics.get(key, metrics.get(f"actor/{key}", zero))).detach()

    return LossOutput(loss, get("pg_clipfrac"), get("pg_clipfrac_lower"), get("ppo_kl"))


def actor_inputs(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo,
    seed: int = 0,
    given: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> tuple[LossInputs, Correction]:
    """A loss's inputs from the three policies' log-probs [N, T]: ``algo.correction``
    chooses the ratio's denominator, the weights and the mask (``correction/off_policy.py``;
    ``given``: the rollout correction's weights and mask for these rows, computed over
    the whole step)."""
    corr = off_policy_correction(logp_prox, logp_behav, mask, algo, logp=logp, given=given)
    inputs = LossInputs(
        logp=logp,
        logp_old=corr.logp_old,
        logp_behav=logp_behav,
        advantages=advantages,
        mask=corr.mask.to(logp.dtype),
        is_weights=corr.weights,
        seed=seed,
    )
    return inputs, corr


# Registers the built-in loss modes (after the registry and LossInputs exist).
from verl_async.algos import loss_modes  # noqa: E402, F401  isort: skip
