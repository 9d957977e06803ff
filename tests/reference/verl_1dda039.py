"""Reference values computed by verl's own functions at commit 1dda039 (verl-project/verl).

verl-async's losses, loss aggregation, KL estimators, rollout correction, GRPO/GDPO advantages and
DAPO overlong shaping are pinned to these numbers by tests that read the JSON this script writes
(tests/fixtures/verl_1dda039.json). The script itself never runs in CI and pytest never collects
it (the file name does not match test_*.py).

Recipe (CPU only, about two minutes of installs):

    git -C <verl git dir> archive 1dda039b9c6311889a9c9a26040677e1254814f9 | tar -x -C /tmp/verl1dda039
    python3.11 -m venv /tmp/verlref-venv
    /tmp/verlref-venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/verlref-venv/bin/pip install numpy omegaconf tensordict packaging ray transformers \
        codetiming orjson
    /tmp/verlref-venv/bin/python tests/reference/verl_1dda039.py \
        --verl /tmp/verl1dda039 --out tests/fixtures/verl_1dda039.json

Versions used for the committed JSON: torch 2.13.0+cpu, numpy 2.4.6, omegaconf 2.4.0,
tensordict 0.15.3, ray 2.60.0, transformers 5.10.4, codetiming 1.4.0, orjson 3.13.0.

How verl is made importable: the checkout goes first on sys.path and the real `verl` package is
imported unmodified (its __init__ pulls ray, transformers and tensordict, hence the installs
above); VERL_USE_EXTERNAL_PLUGINS=none keeps entry-point plugins out. Losses receive a real
`verl.workers.config.ActorConfig` (strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
the clip fields, a `PolicyLossConfig` and `global_batch_info`), because gspo, sapo and cispo
assert `isinstance(config, ActorConfig)`. GDPO gets a real `AlgoConfig`. The DAPO overlong
penalty comes from the legacy `verl.workers.reward_manager.dapo.DAPORewardManager`, called on a
DataProto with a stub tokenizer and a compute_score that returns each sample's given score.

torch's default dtype is set to float64 for the whole run and every input is float64, so the
values are float64 except where verl itself forces float32 (noted per entry under "dtype_note").
Masks are float64 0/1 tensors; every policy loss is also run with the same mask as bool (what the
engine passes) and the script asserts identical results. Masked positions hold ordinary finite
values (not zeros), so a consumer that lets them leak will disagree with these numbers. Every
policy loss accepted the mask with an empty row (inputs.main.response_mask), so all policy-loss
entries use it; response_mask_nonempty is used by kl_penalty and by a second copy of every
agg_loss and rollout_correction case.

JSON schema (all tensors are nested lists of floats, [B, T] row-major):

  meta: {verl_commit, torch_version, python_version, packages, made_utc, default_dtype, notes}
  inputs:
    main: B=5, T=7 {log_prob, old_log_prob, rollout_log_prob, ref_log_prob, advantages (rows
          +1.3, -0.8, 0, -1.1, +0.6), response_mask (lengths 7, 5, 3, 0, 6), response_mask_nonempty
          (lengths 7, 5, 3, 2, 6), rollout_is_weights}
    cov:  B=4, T=6 {log_prob, old_log_prob, advantages, response_mask}  (clip_cov / kl_cov set)
    kl_large: B=2, T=4 {log_prob, ref_log_prob, response_mask}  (|log_prob - ref| > 20 somewhere)
  agg_loss: [{loss_mat, mask, loss_agg_mode, global_batch_info, loss, raises}]
    loss_mat names the input tensor ("main.ref_log_prob"); global_batch_info holds the keyword
    arguments passed ({} = verl's defaults); raises is null or "ValueError: <message>".
  policy_loss: [{name, loss_mode, inputs, mask, loss_agg_mode, with_rollout_is_weights, config,
    torch_seed, old_log_prob_from, loss, grad_log_prob, metrics}]
    config: {clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, tau_pos, tau_neg,
             policy_loss: {every PolicyLossConfig field as used, defaults included,
                           rollout_correction as a dict; loss_mode left out},
             global_batch_info}
    name: "<mode>/<agg>/w=<bool>" (MAIN_CLIP, MAIN_POLICY_LOSS, no global info);
          "<mode>/<agg>/global/lsf=<None|12.0>" (GLOBAL_INFO, with weights);
          "<mode>/token-mean/defaults" (ActorConfig and PolicyLossConfig defaults);
          "<mode>/<agg>/w=<bool>/tight" (TIGHT_CLIP); "sapo/token-mean/w=<bool>/tau";
          "clip_cov|kl_cov/cov/..." (inputs.cov); "bypass_mode/<loss_type>/<setting>/<agg>/w=..".
    grad_log_prob is d loss / d log_prob. gspo, sapo and geo_mean ignore loss_agg_mode (two modes
    recorded to show it). bypass_mode entries take old_log_prob = inputs.main.rollout_log_prob
    (as the trainer sets it) and ignore the rollout_is_weights argument (w=True equals w=False).
    clip_cov: torch.manual_seed(torch_seed) is called right before the loss; verl then draws
    torch.randperm(n_candidates) from the global generator, which equals
    torch.randperm(n, generator=torch.Generator().manual_seed(torch_seed)) (asserted here for
    n < 64). Candidates are in torch.nonzero (row-major) order.
  kl_penalty: [{inputs, mask, kl_type, value, grad_log_prob}]: grad of sum(value * mask);
    value is unmasked. Entries with "raises" record the names verl rejects.
  rollout_correction:
    cases: [{name, mask, args: {rollout_is, rollout_is_threshold, rollout_is_batch_normalize,
             rollout_rs, rollout_rs_threshold}, weights (null if none), modified_mask, metrics}]
      old_log_prob = inputs.main.old_log_prob, rollout_log_prob = inputs.main.rollout_log_prob.
      Every RS case keeps some and rejects some valid tokens of the main mask (asserted).
    presets: {classmethod name: {field: value}}  (each called with its default arguments)
  advantages:
    grpo: [{name, token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo, epsilon,
            advantages, returns}]
    gdpo: [{name, reward_keys, reward_weights, scores: {key: [per sample]}, index, response_mask,
            advantages, dtype_note}]  (scores sit at each row's last valid token)
  overlong: [{max_resp_len, overlong_buffer_len, penalty_factor, valid_response_length, score,
              reward, overlong_reward, overlong}]
    reward is read from the manager's float32 reward tensor; overlong_reward from its
    reward_extra_info (float64 here).

With --part distillation the script writes tests/fixtures/verl_1dda039_distillation.json
instead (the same recipe; verl.trainer.distillation's own functions):

  inputs: {main (as above), topk: B=3, T=4, V=12 {student_logits, teacher_topk_log_probs and
          teacher_topk_ids (the teacher's top K=5, ids as floats), log_prob, old_log_prob,
          response_mask (lengths 4, 2, 3)}}
  distillation:
    estimators: [{loss_mode, use_policy_gradient, loss_max_clamp, loss_agg_mode, loss,
                  grad_log_prob, raises}]: distillation_loss(ActorConfig, DistillationConfig,
                  {"log_probs": main.log_prob}, data) with main.ref_log_prob as the teacher,
                  main.old_log_prob as old_log_probs, main.rollout_is_weights, GLOBAL_INFO and
                  clip_ratio_low 0.15 / clip_ratio_high 0.25; raises: "ValueError: ..." where
                  verl's config refuses the combination (k1 without use_policy_gradient).
    topk: [{log_prob_min_clamp, loss_max_clamp, use_policy_gradient, loss_agg_mode,
            per_token_loss, student_mass, teacher_mass, loss, grad_student_logits,
            grad_log_prob}]: the FSDP logits processor compute_forward_kl_topk on the student
            logits (per_token_loss is its output, before the registered loss clamps it at 0),
            then distillation_loss as above.
  Tensors go through verl's padding-free layout with a one-token prompt per row; gradients
  are read back at the response positions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

VERL_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
# One global-batch setting used across sections: two DP ranks, 40 tokens and 8 sequences in the
# whole mini-batch (deliberately not the local counts, so a consumer that uses local counts fails).
GLOBAL_INFO = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 8}
MAIN_CLIP = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
MAIN_POLICY_LOSS = {
    "clip_cov_ratio": 0.2,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.2,
    "ppo_kl_coef": 0.1,
    "dro_beta": 0.5,
}
CLIP_COV_SEED = 1234
PACKAGES = ("numpy", "omegaconf", "tensordict", "ray", "transformers", "codetiming", "orjson")


def load_verl(path: str) -> dict:
    """Import the verl modules this script needs from the checkout at `path`."""
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    sys.path.insert(0, str(Path(path).resolve()))
    import verl.trainer.ppo.core_algos as core_algos
    import verl.trainer.ppo.rollout_corr_helper as rch
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import DistillationConfig, DistillationLossConfig
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
    from verl.workers.reward_manager.dapo import DAPORewardManager

    assert Path(core_algos.__file__).resolve().is_relative_to(Path(path).resolve())
    return {
        "core_algos": core_algos,
        "rch": rch,
        "DataProto": DataProto,
        "AlgoConfig": AlgoConfig,
        "RolloutCorrectionConfig": RolloutCorrectionConfig,
        "ActorConfig": ActorConfig,
        "PolicyLossConfig": PolicyLossConfig,
        "DAPORewardManager": DAPORewardManager,
        "DistillationConfig": DistillationConfig,
        "DistillationLossConfig": DistillationLossConfig,
        "distillation_losses": importlib.import_module("verl.trainer.distillation.losses"),
        "distillation_fsdp": importlib.import_module("verl.trainer.distillation.fsdp.losses"),
    }


def as_json(x):
    """Tensors, numpy values and nested containers as plain JSON values."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).tolist() if x.dim() else float(x.detach())
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {str(k): as_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [as_json(v) for v in x]
    return x


def prefix_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)


def main_inputs() -> dict[str, torch.Tensor]:
    """B=5, T=7 inputs; row 3 is empty in response_mask; advantages +, -, 0, -, +."""
    g = torch.Generator().manual_seed(20260822)
    b, t = 5, 7
    old = -(0.3 + 2.7 * torch.rand(b, t, generator=g))
    delta = 0.45 * torch.randn(b, t, generator=g)
    # Ratios far from 1: row 1 has A < 0 and a ratio near e^1.4 > clip_ratio_c (dual clip binds).
    delta[1, 1], delta[0, 3], delta[4, 0], delta[2, 1], delta[4, 4] = 1.4, -0.9, 0.8, -1.2, 0.5
    # Row 4 (A > 0) gets a mean log-ratio near 0.18: GSPO clips it under TIGHT_CLIP only.
    delta[4, 3] = 0.3
    log_prob = torch.clamp(old + delta, max=-0.02)
    ref = torch.clamp(old + 0.6 * torch.randn(b, t, generator=g), max=-0.01)
    rollout = old + 0.35 * torch.randn(b, t, generator=g)
    # Token IS weights exp(old - rollout) well above 2 and well below 0.5 at a few places.
    rollout[0, 1], rollout[4, 0], rollout[1, 0] = old[0, 1] - 1.1, old[4, 0] + 1.3, old[1, 0] - 0.9
    # Row log-ratio sums beyond log 2 (row 2) and below log 0.5 (row 4): sequence TIS and
    # sequence IcePop bind on whole rows.
    rollout[2, 0], rollout[4, 5] = old[2, 0] - 0.9, old[4, 5] + 0.5
    rollout = torch.clamp(rollout, max=-0.01)
    adv_rows = torch.tensor([1.3, -0.8, 0.0, -1.1, 0.6])
    return {
        "log_prob": log_prob,
        "old_log_prob": old,
        "rollout_log_prob": rollout,
        "ref_log_prob": ref,
        "advantages": adv_rows[:, None].expand(b, t).clone(),
        "response_mask": prefix_mask([7, 5, 3, 0, 6], t),
        "response_mask_nonempty": prefix_mask([7, 5, 3, 2, 6], t),
        "rollout_is_weights": 0.3 + 2.2 * torch.rand(b, t, generator=g),
    }


def cov_inputs() -> dict[str, torch.Tensor]:
    """B=4, T=6 inputs where clip_cov's window (1, 5) holds candidates and kl_cov has K > 1.

    Ratios stay within the clip range at most tokens (so few tokens are excluded as clipped),
    advantages are +-2 so that (A - mean A) * (lp - mean lp) reaches values between 1 and 5.
    """
    g = torch.Generator().manual_seed(7)
    b, t = 4, 6
    log_prob = -(0.05 + 4.0 * torch.rand(b, t, generator=g))
    old = torch.clamp(log_prob - 0.08 * torch.randn(b, t, generator=g), max=-0.01)
    adv_rows = torch.tensor([2.0, -2.0, 1.5, -1.5])
    return {
        "log_prob": log_prob,
        "old_log_prob": old,
        "advantages": adv_rows[:, None].expand(b, t).clone(),
        "response_mask": prefix_mask([6, 5, 6, 4], t),
    }


def kl_large_inputs() -> dict[str, torch.Tensor]:
    """log_prob - ref_log_prob spans -25..+25, so the +-20 input clamp and the 10 output clamp bind."""
    ref = torch.tensor([[-2.0, -27.0, -1.0, -0.5], [-30.0, -3.0, -0.2, -4.0]])
    diff = torch.tensor([[-0.3, 25.0, -21.0, 0.4], [22.0, -24.5, -3.0, 1.5]])
    return {"log_prob": ref + diff, "ref_log_prob": ref, "response_mask": prefix_mask([4, 3], 4)}


def agg_loss_section(v: dict, inp: dict) -> list[dict]:
    """core_algos.agg_loss on inputs.main.ref_log_prob for every mode, mask and global setting."""
    agg_loss = v["core_algos"].agg_loss
    infos = [
        {},
        {**GLOBAL_INFO, "loss_scale_factor": None},
        {**GLOBAL_INFO, "loss_scale_factor": 12.0},
        {
            "dp_size": 1,
            "batch_num_tokens": None,
            "global_batch_size": None,
            "loss_scale_factor": 4.0,
        },
        {"dp_size": 2},  # no global counts with dp > 1: verl raises for every mode but token-sum
    ]
    out = []
    for mask_name in ("response_mask", "response_mask_nonempty"):
        for mode in AGG_MODES:
            for info in infos:
                entry = {
                    "loss_mat": "main.ref_log_prob",
                    "mask": mask_name,
                    "loss_agg_mode": mode,
                    "global_batch_info": info,
                }
                try:
                    loss = agg_loss(inp["ref_log_prob"], inp[mask_name], mode, **info)
                    entry.update(loss=float(loss), raises=None)
                except ValueError as err:
                    entry.update(loss=None, raises=f"ValueError: {err}")
                out.append(entry)
    return out


def actor_config(v: dict, clip: dict, policy_loss: dict, global_info: dict, **extra):
    """A real ActorConfig: the smallest set of fields its __post_init__ accepts, plus ours."""
    return v["ActorConfig"](
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=v["PolicyLossConfig"](**policy_loss),
        global_batch_info=dict(global_info),
        **clip,
        **extra,
    )


def public_fields(cfg) -> dict:
    """A verl config dataclass as a dict, nested configs included, without `_target_`."""
    return {k: x for k, x in dataclasses.asdict(cfg).items() if not k.startswith("_")}


def config_record(cfg) -> dict:
    """The values the losses read: the ActorConfig clip/tau fields and the effective
    PolicyLossConfig (defaults included; loss_mode left out since the loss is called directly)."""
    keys = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")
    rec = {k: getattr(cfg, k) for k in keys}
    policy_loss = public_fields(cfg.policy_loss)
    policy_loss.pop("loss_mode")
    policy_loss["rollout_correction"] = public_fields(cfg.policy_loss.rollout_correction)
    rec["policy_loss"] = policy_loss
    rec["global_batch_info"] = dict(cfg.global_batch_info)
    return rec


def call_loss(v: dict, case: dict, mask: torch.Tensor):
    """One call of the registered loss; returns (config, loss, d loss / d log_prob, metrics)."""
    inp = case["inputs"]
    cfg = actor_config(v, case["clip"], case["policy_loss"], case["global_info"])
    log_prob = inp["log_prob"].clone().requires_grad_(True)
    fn = v["core_algos"].get_policy_loss_fn(case["loss_mode"])
    if case.get("seed") is not None:
        torch.manual_seed(case["seed"])
    loss, metrics = fn(
        old_log_prob=inp[case["old_from"]],
        log_prob=log_prob,
        advantages=inp["advantages"],
        response_mask=mask,
        loss_agg_mode=case["agg"],
        config=cfg,
        rollout_is_weights=inp["rollout_is_weights"] if case["with_w"] else None,
    )
    loss.backward()
    grad = log_prob.grad if log_prob.grad is not None else torch.zeros_like(log_prob)
    return cfg, loss.detach(), grad, metrics


def run_policy_loss(v: dict, case: dict) -> dict:
    """The loss with the float64 0/1 mask, checked against the engine's bool mask."""
    mask = case["inputs"][case["mask"]]
    cfg, loss, grad, metrics = call_loss(v, case, mask)
    _, loss_b, grad_b, metrics_b = call_loss(v, case, mask.bool())
    assert torch.allclose(loss, loss_b, rtol=1e-12, atol=1e-12), case["name"]
    assert torch.allclose(grad, grad_b, rtol=1e-12, atol=1e-12), case["name"]
    assert as_json(metrics) == as_json(metrics_b), case["name"]
    rec = {
        "name": case["name"],
        "loss_mode": case["loss_mode"],
        "inputs": case["inputs_name"],
        "mask": case["mask"],
        "loss_agg_mode": case["agg"],
        "with_rollout_is_weights": case["with_w"],
        "config": config_record(cfg),
        "torch_seed": case.get("seed"),
        "old_log_prob_from": case["old_from"],
        "loss": float(loss),
        "grad_log_prob": as_json(grad),
        "metrics": as_json(metrics),
    }
    check_finite(rec, case["name"])
    return rec


def check_finite(rec: dict, where: str) -> None:
    bad = [k for k, x in rec.items() if re.search(r"\bNaN\b|Infinity", json.dumps(x))]
    if isinstance(rec.get("metrics"), dict):
        bad += [k for k, x in rec["metrics"].items() if not math.isfinite(x)]
    assert not bad, f"non-finite values in {where}: {bad}"


FORCED_AGG = {"gspo", "sapo", "geo_mean"}  # these ignore loss_agg_mode: two modes show it
PLAIN_MODES = [
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg",
    "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
]  # fmt: skip


def policy_cases(v: dict, main: dict, cov: dict) -> list[dict]:
    """Every registered loss over the main inputs, global-info variants, other configs, cov set
    and bypass_mode."""
    base = {
        "inputs": main,
        "inputs_name": "main",
        "mask": "response_mask",
        "old_from": "old_log_prob",
        "clip": MAIN_CLIP,
        "policy_loss": MAIN_POLICY_LOSS,
        "global_info": {},
        "seed": None,
    }
    cases = []
    for mode in PLAIN_MODES:
        seed = CLIP_COV_SEED if mode == "clip_cov" else None
        aggs = ["token-mean", "seq-mean-token-sum"] if mode in FORCED_AGG else AGG_MODES
        for agg in aggs:
            for with_w in (False, True):
                cases.append(
                    {
                        **base,
                        "name": f"{mode}/{agg}/w={with_w}",
                        "loss_mode": mode,
                        "agg": agg,
                        "with_w": with_w,
                        "seed": seed,
                    }
                )
        global_aggs = AGG_MODES if mode == "vanilla" else ["token-mean", "seq-mean-token-sum-norm"]
        for agg in global_aggs:
            for lsf in (None, 12.0) if agg == "seq-mean-token-sum-norm" else (None,):
                info = {**GLOBAL_INFO, "loss_scale_factor": lsf}
                cases.append(
                    {
                        **base,
                        "name": f"{mode}/{agg}/global/lsf={lsf}",
                        "loss_mode": mode,
                        "agg": agg,
                        "with_w": True,
                        "global_info": info,
                        "seed": seed,
                    }
                )
    return cases + variant_cases(base) + cov_cases(cov) + bypass_cases(v, base)


# Tighter bounds than MAIN_CLIP, so more tokens (and GSPO's sequence ratios) hit them; DPPO reads
# the two clip fields as divergence thresholds and clip_ratio_c as its IS-weight cap.
TIGHT_CLIP = {
    "clip_ratio": 0.05,
    "clip_ratio_low": 0.05,
    "clip_ratio_high": 0.08,
    "clip_ratio_c": 1.5,
}


def variant_cases(base: dict) -> list[dict]:
    """ActorConfig defaults, TIGHT_CLIP, and SAPO with non-default temperatures."""
    cases = []
    for mode in ("vanilla", "dppo_tv", "dppo_kl", "cispo", "geo_mean", "gspo", "sapo"):
        cases.append(
            {
                **base,
                "name": f"{mode}/token-mean/defaults",
                "loss_mode": mode,
                "agg": "token-mean",
                "with_w": False,
                "clip": {},
                "policy_loss": {},
            }
        )
    for mode in ("vanilla", "dppo_tv", "dppo_kl", "cispo", "geo_mean", "gspo"):
        for agg in ("token-mean", "seq-mean-token-sum"):
            for with_w in (False, True):
                cases.append(
                    {
                        **base,
                        "name": f"{mode}/{agg}/w={with_w}/tight",
                        "loss_mode": mode,
                        "agg": agg,
                        "with_w": with_w,
                        "clip": TIGHT_CLIP,
                    }
                )
    for with_w in (False, True):
        cases.append(
            {
                **base,
                "name": f"sapo/token-mean/w={with_w}/tau",
                "loss_mode": "sapo",
                "agg": "token-mean",
                "with_w": with_w,
                "clip": {**MAIN_CLIP, "tau_pos": 2.0, "tau_neg": 3.0},
            }
        )
    return cases


def cov_cases(cov: dict) -> list[dict]:
    """clip_cov (two seeds) and kl_cov on inputs.cov, with MAIN_POLICY_LOSS and with defaults."""
    base = {
        "inputs": cov,
        "inputs_name": "cov",
        "mask": "response_mask",
        "old_from": "old_log_prob",
        "with_w": False,
        "clip": MAIN_CLIP,
        "policy_loss": MAIN_POLICY_LOSS,
        "global_info": {},
        "seed": None,
    }
    defaults = {"clip": {}, "policy_loss": {}}
    specs = []
    for agg in ("token-mean", "seq-mean-token-sum"):
        for seed in (CLIP_COV_SEED, 99):
            specs.append((f"clip_cov/cov/{agg}/seed={seed}", "clip_cov", agg, {"seed": seed}))
        specs.append((f"kl_cov/cov/{agg}", "kl_cov", agg, {}))
    specs.append(
        (
            "clip_cov/cov/token-mean/defaults",
            "clip_cov",
            "token-mean",
            {**defaults, "seed": CLIP_COV_SEED},
        )
    )
    specs.append(("kl_cov/cov/token-mean/defaults", "kl_cov", "token-mean", defaults))
    return [{**base, "name": n, "loss_mode": m, "agg": a, **extra} for n, m, a, extra in specs]


BYPASS_SETTINGS = {
    "ppo_clip/token_is_2.0": {"loss_type": "ppo_clip", "rollout_is": "token"},
    "reinforce/token_is_2.0": {"loss_type": "reinforce", "rollout_is": "token"},
    "reinforce/seq_is_2.0": {"loss_type": "reinforce", "rollout_is": "sequence"},
    "reinforce/token_icepop": {"loss_type": "reinforce", "rollout_is": "token",
                               "rollout_is_threshold": "0.5_5.0"},
    "reinforce/seq_mean_k3_rs": {"loss_type": "reinforce", "rollout_is": None,
                                 "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.25},
    "ppo_clip/token_k1_rs": {"loss_type": "ppo_clip", "rollout_is": "token",
                             "rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.5"},
}  # fmt: skip


def bypass_cases(v: dict, base: dict) -> list[dict]:
    """bypass_mode: old_log_prob is the rollout log-prob, as the trainer sets it."""
    cases = []
    for label, setting in BYPASS_SETTINGS.items():
        rc = v["RolloutCorrectionConfig"](bypass_mode=True, **setting)
        for agg in ("token-mean", "seq-mean-token-sum"):
            for with_w in (False, True):
                cases.append(
                    {
                        **base,
                        "name": f"bypass_mode/{label}/{agg}/w={with_w}",
                        "loss_mode": "bypass_mode",
                        "agg": agg,
                        "with_w": with_w,
                        "clip": MAIN_CLIP,
                        "policy_loss": {"rollout_correction": rc},
                        "global_info": {},
                        "old_from": "rollout_log_prob",
                    }
                )
    return cases


def check_randperm_matches(seed: int) -> None:
    """torch.manual_seed(S); randperm(n) equals randperm(n) on a fresh generator seeded S."""
    for n in range(1, 64):
        torch.manual_seed(seed)
        a = torch.randperm(n)
        b = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(a, b), f"randperm differs for n={n}, seed={seed}"


KL_TYPES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
            "k1+", "kl+", "k2+", "mse+", "k3+", "low_var_kl+", "abs+"]  # fmt: skip


def kl_penalty_section(v: dict, main: dict, large: dict) -> list[dict]:
    out = []
    for name, inp, mask in (
        ("main", main, "response_mask_nonempty"),
        ("kl_large", large, "response_mask"),
    ):
        for kl_type in KL_TYPES:
            log_prob = inp["log_prob"].clone().requires_grad_(True)
            value = v["core_algos"].kl_penalty(log_prob, inp["ref_log_prob"], kl_type)
            (value * inp[mask]).sum().backward()
            out.append(
                {
                    "inputs": name,
                    "mask": mask,
                    "kl_type": kl_type,
                    "value": as_json(value),
                    "grad_log_prob": as_json(log_prob.grad),
                }
            )
    for kl_type in ("full", "full+", "bogus"):
        try:
            v["core_algos"].kl_penalty(main["log_prob"], main["ref_log_prob"], kl_type)
            raised = None
        except NotImplementedError:
            raised = "NotImplementedError"
        out.append({"inputs": "main", "kl_type": kl_type, "raises": raised})
    return out


# (name, rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold)
RC_CASES = [
    ("metrics_only", None, 2.0, False, None, None),
    ("token_tis", "token", 2.0, False, None, None),
    ("token_tis_str", "token", "2.0", False, None, None),
    ("token_tis_norm", "token", 2.0, True, None, None),
    ("seq_tis", "sequence", 2.0, False, None, None),
    ("seq_tis_norm", "sequence", 2.0, True, None, None),
    ("token_icepop", "token", "0.5_5.0", False, None, None),
    ("token_icepop_norm", "token", "0.5_5.0", True, None, None),
    ("seq_icepop", "sequence", "0.5_5.0", False, None, None),
    ("rs_token_k1", None, 2.0, False, "token_k1", 1.5),
    ("rs_token_k2", None, 2.0, False, "token_k2", 0.05),
    ("rs_token_k3", None, 2.0, False, "token_k3", 0.05),
    ("rs_seq_sum_k1", None, 2.0, False, "seq_sum_k1", 2.0),
    ("rs_seq_sum_k2", None, 2.0, False, "seq_sum_k2", 1.0),
    ("rs_seq_sum_k3", None, 2.0, False, "seq_sum_k3", 1.0),
    ("rs_seq_mean_k1", None, 2.0, False, "seq_mean_k1", 1.1),
    ("rs_seq_mean_k2", None, 2.0, False, "seq_mean_k2", 0.2),
    ("rs_seq_mean_k3", None, 2.0, False, "seq_mean_k3", 0.2),
    ("rs_seq_max_k2", None, 2.0, False, "seq_max_k2", 0.6),
    ("rs_seq_max_k3", None, 2.0, False, "seq_max_k3", 0.7),
    ("rs_token_k1_asym", None, 2.0, False, "token_k1", "0.7_1.8"),
    ("rs_conjunction", "token", 2.0, False, "seq_mean_k1,token_k3,seq_max_k2", "1.2,0.3,0.85"),
    ("rs_conjunction_shared", "sequence", 2.0, True, "token_k2, seq_mean_k3", 0.22),
]


def rollout_correction_section(v: dict, main: dict) -> dict:
    """compute_rollout_correction_and_rejection_mask(old, rollout, mask, ...) per RC_CASES."""
    fn = v["rch"].compute_rollout_correction_and_rejection_mask
    cases = []
    for mask_name in ("response_mask", "response_mask_nonempty"):
        for name, is_level, is_thr, norm, rs, rs_thr in RC_CASES:
            args = {
                "rollout_is": is_level,
                "rollout_is_threshold": is_thr,
                "rollout_is_batch_normalize": norm,
                "rollout_rs": rs,
                "rollout_rs_threshold": rs_thr,
            }
            proto, mask, metrics = fn(
                main["old_log_prob"], main["rollout_log_prob"], main[mask_name], **args
            )
            weights = proto.batch["rollout_is_weights"] if proto is not None else None
            rec = {
                "name": name,
                "mask": mask_name,
                "args": args,
                "weights": as_json(weights),
                "modified_mask": as_json(mask),
                "metrics": as_json(metrics),
            }
            check_finite(rec, f"rollout_correction/{name}")
            if rs is not None and mask_name == "response_mask":
                kept, valid = float(mask.sum()), float(main[mask_name].sum())
                assert 0 < kept < valid, (
                    f"{name}: RS keeps {kept} of {valid}; pick another threshold"
                )
            cases.append(rec)
    return {"cases": cases, "presets": presets(v)}


def presets(v: dict) -> dict:
    cls = v["RolloutCorrectionConfig"]
    names = [n for n, m in vars(cls).items() if isinstance(m, classmethod)]
    out = {}
    for name in sorted(names):
        cfg = getattr(cls, name)()
        out[name] = public_fields(cfg)
    return out


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> torch.Tensor:
    """Each score at the last valid token of its row, zeros elsewhere ([B, T])."""
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = s
    return rewards


GRPO_BATCHES = {
    # groups of 4, 4 and 1 (the singleton uses mean 0, std 1)
    "groups_4_4_1": (["a"] * 4 + ["b"] * 4 + ["c"], [1.0, 0.0, 0.5, 1.0, 0.2, -0.4, 0.9, 0.1, 0.7]),
    # a group whose scores are all equal (std 0: divided by epsilon only) beside a singleton
    "equal_scores": (["a"] * 3 + ["c"], [0.5, 0.5, 0.5, -0.3]),
}
GRPO_LENGTHS = {"groups_4_4_1": [5, 3, 5, 1, 4, 5, 2, 5, 3], "equal_scores": [2, 5, 4, 3]}


def advantages_section(v: dict) -> dict:
    ca = v["core_algos"]
    grpo = []
    for name, (index, scores) in GRPO_BATCHES.items():
        lengths, width = GRPO_LENGTHS[name], 5
        rewards, mask = outcome_rewards(scores, lengths, width), prefix_mask(lengths, width)
        for norm in (True, False):
            adv, ret = ca.compute_grpo_outcome_advantage(
                token_level_rewards=rewards,
                response_mask=mask,
                index=np.array(index, dtype=object),
                epsilon=1e-6,
                norm_adv_by_std_in_grpo=norm,
            )
            grpo.append(
                {
                    "name": name,
                    "token_level_rewards": as_json(rewards),
                    "response_mask": as_json(mask),
                    "index": index,
                    "norm_adv_by_std_in_grpo": norm,
                    "epsilon": 1e-6,
                    "advantages": as_json(adv),
                    "returns": as_json(ret),
                }
            )
    return {"grpo": grpo, "gdpo": gdpo_entries(v)}


def gdpo_entries(v: dict) -> list[dict]:
    """compute_gdpo_outcome_advantage through its config path (AlgoConfig + batch + scores)."""
    index = ["a"] * 4 + ["b"] * 4 + ["c"]
    lengths, width, prompt_len = [5, 3, 5, 1, 4, 5, 2, 5, 3], 5, 3
    scores = {
        "format_reward": [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        "accuracy_reward": [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0],
    }
    mask = prefix_mask(lengths, width)
    batch = {
        "prompts": torch.zeros(len(index), prompt_len, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(len(index), prompt_len), mask], dim=1).long(),
    }
    out = []
    for weights in ([1.0, 0.5], None):
        cfg = v["AlgoConfig"](gdpo_reward_keys=list(scores), gdpo_reward_weights=weights)
        adv, _ = v["core_algos"].compute_gdpo_outcome_advantage(
            token_level_rewards=torch.zeros(len(index), width),
            response_mask=mask,
            index=np.array(index, dtype=object),
            config=cfg,
            non_tensor_batch={k: np.array(s) for k, s in scores.items()},
            batch=batch,
        )
        out.append(
            {
                "name": f"gdpo/weights={weights}",
                "reward_keys": list(scores),
                "reward_weights": weights,
                "scores": scores,
                "index": index,
                "response_mask": as_json(mask),
                "advantages": as_json(adv),
                "dtype_note": "verl builds the per-component score tensors and the weights "
                "in float32; compare with a float32-level tolerance (~1e-6)",
            }
        )
    return out


# (max_resp_len, overlong_buffer_len, penalty_factor, [(valid_response_length, score), ...])
OVERLONG_CASES = [
    (20, 8, 1.0, [(5, 1.0), (12, 0.0), (13, 1.0), (16, 0.5), (19, -1.0), (20, 1.0)]),
    (16, 16, 0.5, [(1, 1.0), (8, 0.0), (16, 1.0)]),
    (10, 4, 2.0, [(6, 0.25), (7, 0.25), (10, 0.0)]),
]


class _StubTokenizer:
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        return ""


def overlong_section(v: dict) -> list[dict]:
    """DAPORewardManager (legacy class) with overlong shaping; score passed as ground_truth."""
    from omegaconf import OmegaConf

    out = []
    for max_len, buf_len, factor, samples in OVERLONG_CASES:
        cfg = OmegaConf.create(
            {"enable": True, "len": buf_len, "penalty_factor": factor, "log": True}
        )
        manager = v["DAPORewardManager"](
            tokenizer=_StubTokenizer(),
            num_examine=0,
            max_resp_len=max_len,
            overlong_buffer_cfg=cfg,
            compute_score=lambda data_source, solution_str, ground_truth, extra_info: ground_truth,
        )
        n, prompt_len = len(samples), 2
        lengths = [length for length, _ in samples]
        data = v["DataProto"].from_dict(
            tensors={
                "prompts": torch.ones(n, prompt_len, dtype=torch.long),
                "responses": torch.ones(n, max_len, dtype=torch.long),
                "attention_mask": torch.cat(
                    [torch.ones(n, prompt_len), prefix_mask(lengths, max_len)], dim=1
                ).long(),
            },
            non_tensors={
                "reward_model": np.array([{"ground_truth": s} for _, s in samples]),
                "data_source": np.array(["ref"] * n, dtype=object),
            },
        )
        res = manager(data, return_dict=True)
        extra = res["reward_extra_info"]
        for i, (length, score) in enumerate(samples):
            out.append(
                {
                    "max_resp_len": max_len,
                    "overlong_buffer_len": buf_len,
                    "penalty_factor": factor,
                    "valid_response_length": length,
                    "score": score,
                    "reward": float(res["reward_tensor"][i, length - 1]),
                    "overlong_reward": float(extra["overlong_reward"][i]),
                    "overlong": bool(extra["overlong"][i]),
                }
            )
    return out


# ----------------------------------------------------------------------------- distillation

DISTILL_ESTIMATORS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
DISTILL_AGG = ["token-mean", "seq-mean-token-mean"]
DISTILL_CLIP = {"clip_ratio": 0.2, "clip_ratio_low": 0.15, "clip_ratio_high": 0.25}


def topk_inputs() -> dict[str, torch.Tensor]:
    """B=3, T=4, V=12 student and teacher logits; the teacher's top K=5 per token."""
    g = torch.Generator().manual_seed(314)
    b, t, vocab, k = 3, 4, 12, 5
    student = 2.0 * torch.randn(b, t, vocab, generator=g)
    teacher = 2.5 * torch.randn(b, t, vocab, generator=g)
    # Token (0, 1): the teacher is very sure, so some of its top-k log-probs sit below -3
    # (the log_prob_min_clamp cases bind there).
    teacher[0, 1, 3] = 12.0
    top = torch.topk(torch.log_softmax(teacher, dim=-1), k, dim=-1)
    log_prob = -(0.2 + 2.0 * torch.rand(b, t, generator=g))
    return {
        "student_logits": student,
        "teacher_topk_log_probs": top.values,
        "teacher_topk_ids": top.indices.to(torch.float64),  # float in the JSON; cast back
        "log_prob": log_prob,
        "old_log_prob": log_prob - 0.3 * torch.randn(b, t, generator=g),
        "response_mask": prefix_mask([4, 2, 3], t),
    }


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> verl's padding-free layout for a one-token prompt: each row's T values
    then one position of the next row's prompt, flattened ([B * (T + 1), ...])."""
    pad = torch.zeros_like(x[:, :1])
    return torch.cat([x, pad], dim=1).reshape(-1, *x.shape[2:])


def _distill_data(inp: dict, mask: torch.Tensor, teacher: torch.Tensor | None):
    """The TensorDict verl's distillation_loss reads (a one-token prompt per row)."""
    from tensordict import TensorDict

    b, t = mask.shape
    fields = {
        "prompts": torch.ones(b, 1, dtype=torch.long),
        "responses": torch.ones(b, t, dtype=torch.long),
        "attention_mask": torch.ones(b, t + 1, dtype=torch.long),
        "response_mask": mask,
        "old_log_probs": inp["old_log_prob"],
        "dp_size": torch.tensor(GLOBAL_INFO["dp_size"]),
        "batch_num_tokens": torch.tensor(float(GLOBAL_INFO["batch_num_tokens"])),
        "global_batch_size": torch.tensor(float(GLOBAL_INFO["global_batch_size"])),
    }
    if "rollout_is_weights" in inp:
        fields["rollout_is_weights"] = inp["rollout_is_weights"]
    if teacher is not None:
        fields["teacher_logprobs"] = _flat(teacher[..., None])
    return TensorDict(fields, batch_size=[])


def _distill_configs(v: dict, agg: str, loss: dict):
    actor = actor_config(v, MAIN_CLIP, {}, {}, loss_agg_mode=agg)
    dcfg = v["DistillationConfig"](
        enabled=False, distillation_loss=v["DistillationLossConfig"](**DISTILL_CLIP, **loss)
    )
    return actor, dcfg


def distillation_section(v: dict, main: dict, topk: dict) -> dict:
    """verl's distillation_loss per estimator, as a loss and as a reward, with and without
    loss_max_clamp; and forward_kl_topk from the student's logits (its FSDP logits processor
    then distillation_loss), with and without each clamp."""
    losses = v["distillation_losses"]
    out = {"estimators": [], "topk": []}
    mask = main["response_mask"]
    for mode in DISTILL_ESTIMATORS:
        for pg in (False, True):
            for clamp in (None, 0.5):
                for agg in DISTILL_AGG:
                    loss_cfg = {"loss_mode": mode, "use_policy_gradient": pg,
                                "loss_max_clamp": clamp, "log_prob_min_clamp": None}  # fmt: skip
                    rec = {"loss_mode": mode, "use_policy_gradient": pg,
                           "loss_max_clamp": clamp, "loss_agg_mode": agg}  # fmt: skip
                    try:
                        actor, dcfg = _distill_configs(v, agg, loss_cfg)
                    except ValueError as exc:
                        out["estimators"].append({**rec, "raises": f"ValueError: {exc}"})
                        continue
                    log_prob = _flat(main["log_prob"]).requires_grad_(True)
                    data = _distill_data(main, mask, main["ref_log_prob"])
                    value, _ = losses.distillation_loss(actor, dcfg, {"log_probs": log_prob}, data)
                    value.backward()
                    grad = log_prob.grad.reshape(mask.shape[0], -1)[:, :-1]
                    rec.update(loss=float(value.detach()), grad_log_prob=as_json(grad), raises=None)
                    check_finite(rec, f"distillation/{mode}")
                    out["estimators"].append(rec)
    processor = v["distillation_fsdp"].compute_forward_kl_topk
    b, t = topk["response_mask"].shape
    ids = topk["teacher_topk_ids"].long()
    for min_clamp in (None, -3.0):
        for max_clamp in (None, 0.3):
            for pg in (False, True):
                loss_cfg = {"loss_mode": "forward_kl_topk", "topk": ids.shape[-1],
                            "use_policy_gradient": pg, "loss_max_clamp": max_clamp,
                            "log_prob_min_clamp": min_clamp}  # fmt: skip
                actor, dcfg = _distill_configs(v, "token-mean", loss_cfg)
                logits = topk["student_logits"].clone().requires_grad_(True)
                nested = lambda x: torch.nested.as_nested_tensor(list(x), layout=torch.jagged)  # noqa: E731
                per_token = processor(
                    student_logits=logits.reshape(1, b * t, -1),
                    teacher_topk_log_probs=nested(topk["teacher_topk_log_probs"]),
                    teacher_topk_ids=nested(ids),
                    config=dcfg,
                    data_format="thd",
                )
                shaped = {k: _flat(x.reshape(b, t)) for k, x in per_token.items()}
                shaped["log_probs"] = _flat(topk["log_prob"]).requires_grad_(True)
                data = _distill_data(topk, topk["response_mask"], None)
                value, _ = losses.distillation_loss(actor, dcfg, shaped, data)
                value.backward()
                grad_logits = torch.zeros_like(logits) if logits.grad is None else logits.grad
                grad_log_prob = shaped["log_probs"].grad
                if grad_log_prob is None:
                    grad_log_prob = torch.zeros_like(shaped["log_probs"])
                out["topk"].append(
                    {
                        "log_prob_min_clamp": min_clamp,
                        "loss_max_clamp": max_clamp,
                        "use_policy_gradient": pg,
                        "loss_agg_mode": "token-mean",
                        "per_token_loss": as_json(per_token["distillation_losses"].reshape(b, t)),
                        "student_mass": as_json(per_token["student_mass"].reshape(b, t)),
                        "teacher_mass": as_json(per_token["teacher_mass"].reshape(b, t)),
                        "loss": float(value.detach()),
                        "grad_student_logits": as_json(grad_logits),
                        "grad_log_prob": as_json(grad_log_prob.reshape(b, -1)[:, :-1]),
                    }
                )
    return out


def meta(verl_path: str) -> dict:
    commit = VERL_COMMIT
    if (Path(verl_path) / ".git").exists():
        commit = subprocess.check_output(["git", "-C", verl_path, "rev-parse", "HEAD"], text=True)
        assert commit.strip() == VERL_COMMIT, f"checkout is at {commit.strip()}, not {VERL_COMMIT}"
    return {
        "verl_commit": VERL_COMMIT,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "made_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "packages": {p: importlib.metadata.version(p) for p in PACKAGES},
        "default_dtype": "float64",
        "notes": "Values from verl's own functions; see tests/reference/verl_1dda039.py.",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", required=True, help="checkout of verl at 1dda039")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--part",
        choices=("main", "distillation"),
        default="main",
        help="main: every section but distillation; distillation: that one alone, with its inputs",
    )
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    v = load_verl(args.verl)
    if args.part == "distillation":
        main_in, topk_in = main_inputs(), topk_inputs()
        doc = {
            "meta": meta(args.verl),
            "inputs": {"main": as_json(main_in), "topk": as_json(topk_in)},
            "distillation": distillation_section(v, main_in, topk_in),
        }
        Path(args.out).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.out}: the distillation section")
        return
    check_randperm_matches(CLIP_COV_SEED)
    check_randperm_matches(99)
    main_in, cov_in, large_in = main_inputs(), cov_inputs(), kl_large_inputs()
    policy = [run_policy_loss(v, case) for case in policy_cases(v, main_in, cov_in)]
    doc = {
        "meta": meta(args.verl),
        "inputs": {"main": as_json(main_in), "cov": as_json(cov_in), "kl_large": as_json(large_in)},
        "agg_loss": agg_loss_section(v, main_in),
        "policy_loss": policy,
        "kl_penalty": kl_penalty_section(v, main_in, large_in),
        "rollout_correction": rollout_correction_section(v, main_in),
        "advantages": advantages_section(v),
        "overlong": overlong_section(v),
    }
    text = json.dumps(doc, indent=1, allow_nan=False)
    # One line per innermost list of numbers keeps the file short and its diffs readable.
    text = re.sub(
        r"\[\s+([-0-9.eE+,\s]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m[1]) + "]", text
    )
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out}: {len(policy)} policy-loss entries")


if __name__ == "__main__":
    main()
