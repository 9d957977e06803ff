"""agg_loss, every policy-loss mode and the KL estimators against verl's own functions at
commit 1dda039 (tests/fixtures/verl_1dda039.json, made by tests/reference/verl_1dda039.py;
float64). Each entry's verl config keys are mapped to ours (docs/algorithms.md: verl keys
and ours)."""

import json
from pathlib import Path

import msgspec
import pytest
import torch

from verl_async.algos import GlobalBatch, LossInputs, agg_loss, kl_penalty, policy_loss
from verl_async.schema import AlgoConfig

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "verl_1dda039.json").read_text())
INPUTS = FIXTURE["inputs"]
D = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def tensor(group: str, name: str) -> torch.Tensor:
    return torch.tensor(INPUTS[group][name], dtype=D)


def _id(entry: dict) -> str:
    return entry.get("name") or f"{entry['loss_agg_mode']}/{entry['global_batch_info']}"


# ----------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize(
    "entry", FIXTURE["agg_loss"], ids=[f"{i}-{_id(e)}" for i, e in enumerate(FIXTURE["agg_loss"])]
)
def test_agg_loss_matches_verl(entry):
    group, name = entry["loss_mat"].split(".")
    loss_mat, mask = tensor(group, name), tensor(group, entry["mask"])
    info = entry["global_batch_info"]
    if entry["raises"]:
        assert entry["raises"].startswith("ValueError")
        with pytest.raises(ValueError, match="required when dp_size > 1"):
            agg_loss(loss_mat, mask, entry["loss_agg_mode"], **info)
        return
    out = agg_loss(loss_mat, mask, entry["loss_agg_mode"], **info)
    torch.testing.assert_close(out, torch.tensor(entry["loss"], dtype=D), **TOL)


# ----------------------------------------------------------------------------- policy losses


def algo_of(entry: dict) -> AlgoConfig:
    """Our ``algo`` section for a verl entry's actor config."""
    c, pl = entry["config"], entry["config"]["policy_loss"]
    low = c["clip_ratio"] if c["clip_ratio_low"] is None else c["clip_ratio_low"]
    high = c["clip_ratio"] if c["clip_ratio_high"] is None else c["clip_ratio_high"]
    mode = entry["loss_mode"]
    if mode == "bypass_mode":  # correction none (old = rollout); ppo_clip is vanilla
        mode = {"ppo_clip": "vanilla", "reinforce": "reinforce"}[
            pl["rollout_correction"]["loss_type"]
        ]
    return msgspec.structs.replace(
        AlgoConfig(),
        loss_mode=mode,
        correction="none",
        loss_agg_mode=entry["loss_agg_mode"],
        clip_eps=low,
        clip_eps_high=high,
        clip_ratio_c=c["clip_ratio_c"],
        tau_pos=c["tau_pos"],
        tau_neg=c["tau_neg"],
        clip_cov_ratio=pl["clip_cov_ratio"],
        clip_cov_lb=pl["clip_cov_lb"],
        clip_cov_ub=pl["clip_cov_ub"],
        kl_cov_ratio=pl["kl_cov_ratio"],
        kl_cov_coef=pl["ppo_kl_coef"],
        dro_beta=pl["dro_beta"],
    )


def bypass_weights(entry: dict, logp: torch.Tensor, rlp: torch.Tensor, mask: torch.Tensor):
    """(covered, weights): the IS weights verl's bypass mode computes from pi_theta /
    pi_rollout (token or sequence level, truncated at U, or IcePop's band), written out here
    for these entries only (ppo_clip applies none); not covered: rejection sampling, which is
    the rollout-correction module's."""
    rc = entry["config"]["policy_loss"]["rollout_correction"]
    if rc["rollout_rs"] is not None or rc["rollout_is_batch_normalize"]:
        return False, None
    if rc["loss_type"] == "ppo_clip" or rc["rollout_is"] is None:
        return True, None
    log_ratio = (logp - rlp).detach()
    if rc["rollout_is"] == "sequence":
        log_ratio = (log_ratio * mask).sum(dim=-1, keepdim=True).expand_as(mask)
    raw = torch.exp(log_ratio.clamp(-20, 20)) * mask
    threshold = str(rc["rollout_is_threshold"])
    if "_" in threshold:
        lo, hi = (float(x) for x in threshold.split("_", 1))
        return True, torch.where((raw >= lo) & (raw <= hi), raw, torch.zeros_like(raw))
    return True, raw.clamp(max=float(threshold))


def run_entry(entry: dict):
    group = INPUTS[entry["inputs"]]
    mask = torch.tensor(group[entry["mask"]], dtype=D)
    logp = torch.tensor(group["log_prob"], dtype=D, requires_grad=True)
    olp = torch.tensor(group[entry["old_log_prob_from"]], dtype=D)
    weights = None
    if entry["loss_mode"] == "bypass_mode":
        covered, weights = bypass_weights(entry, logp, olp, mask)
        if not covered:
            pytest.skip("rejection sampling: the rollout-correction module's own tests")
    elif entry["with_rollout_is_weights"]:
        weights = torch.tensor(group["rollout_is_weights"], dtype=D)
    adv = torch.tensor(group["advantages"], dtype=D)
    seed = entry["torch_seed"] or 0
    info = entry["config"]["global_batch_info"]
    inputs = LossInputs(logp, olp, olp, adv, mask, weights, seed)
    out = policy_loss(inputs, algo_of(entry), GlobalBatch(**info))
    out.loss.backward()
    return out, logp.grad


@pytest.mark.parametrize(
    "entry", FIXTURE["policy_loss"], ids=[e["name"] for e in FIXTURE["policy_loss"]]
)
def test_policy_loss_matches_verl(entry):
    out, grad = run_entry(entry)
    torch.testing.assert_close(out.loss, torch.tensor(entry["loss"], dtype=D), **TOL)
    torch.testing.assert_close(grad, torch.tensor(entry["grad_log_prob"], dtype=D), **TOL)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if f"actor/{key}" in entry["metrics"]:
            want = torch.tensor(entry["metrics"][f"actor/{key}"], dtype=D)
            torch.testing.assert_close(getattr(out, key), want, **TOL, msg=key)


def test_every_verl_mode_is_covered():
    modes = {e["loss_mode"] for e in FIXTURE["policy_loss"]}
    assert modes >= {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"}
    assert modes >= {"dro", "cispo", "dppo_tv", "dppo_kl", "bypass_mode"}


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize(
    "entry",
    FIXTURE["kl_penalty"],
    ids=[f"{e['inputs']}-{e.get('mask')}-{e['kl_type']}" for e in FIXTURE["kl_penalty"]],
)
def test_kl_penalty_matches_verl(entry):
    group = entry["inputs"]
    logp = tensor(group, "log_prob").requires_grad_()
    ref = tensor(group, "ref_log_prob")
    if entry.get("raises"):
        with pytest.raises(ValueError):  # verl raises NotImplementedError
            kl_penalty(logp, ref, entry["kl_type"])
        return
    value = kl_penalty(logp, ref, entry["kl_type"])
    (value * tensor(group, entry["mask"])).sum().backward()
    torch.testing.assert_close(value, torch.tensor(entry["value"], dtype=D), **TOL)
    torch.testing.assert_close(logp.grad, torch.tensor(entry["grad_log_prob"], dtype=D), **TOL)
