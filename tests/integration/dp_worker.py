"""One rank of the data-parallel check (run by test_data_parallel.py under torchrun).

Every rank builds the same tiny Llama and the same step batch (rows of varied lengths,
cut over the ranks by the buffer's ``shard_samples``). Each case then makes one SGD step
(lr 1, no momentum, no clipping: the weight change is minus the gradient) twice:

- one rank's way: a plain copy of the model on the whole batch, in this process;
- the job's way: the FSDP2-sharded model (learners/setup.py's ``fsdp2``), each rank on its
  own rows with the denominators of learners/plan.py.

Rank 0 writes, per case, the largest difference between the two weight changes (and the
gradient norms) to the JSON file named on the command line. It also checks that
``gather_rows`` gives back what one pass over the whole batch gives.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from buffer.batches import shard_samples
from buffer.ledger import StoredGroup
from learners.batching import collate
from learners.checkpoints.manager import Checkpoints
from learners.checkpoints.state import LearnerState
from learners.distributed import DataParallel
from learners.finite import NonFiniteWeights, require_finite
from learners.logprobs import logits_of
from learners.plan import Minibatch, plan_update
from learners.setup import fsdp2, leave_job
from learners.update import UpdateHooks, policy_update
from learners.whole_step_correction import metric_names
from verl_async import lora
from verl_async import protocol as P
from verl_async.algos import token_logprobs
from verl_async.schema import (
    AlgoConfig,
    CheckpointConfig,
    LearnerConfig,
    LoraConfig,
    RolloutCorrectionConfig,
)

CASES = {
    "token-mean": {},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean"},
    "seq-mean-token-sum-norm": {
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "loss_scale_factor": 6.0,
    },
    "token-sum": {"loss_agg_mode": "token-sum"},  # the ranks' sums times the world size
    "gspo": {"loss_mode": "gspo"},  # a loss mode with its own aggregation
    "micro-batches": {"micro": 48},  # budget of 48 padded tokens: several passes per rank
    "two-minibatches": {"minibatches": 2},
    "lora": {"lora": True, "minibatches": 2},  # adapters on a frozen base, sharded alike
    # Every other case packs each group's rows behind its prompt (learner.share_prefix).
    "unpacked": {"share_prefix": False},
    # learner.cpu_offload: the shards, their gradients and the SGD step in host memory
    "cpu-offload": {"offload": True},
    # verl's rollout correction: token weights normalised over both ranks' tokens, and
    # rejection that recounts each minibatch's tokens over both ranks.
    "rollout-correction": {
        "minibatches": 2,
        "rollout": {
            "rollout_is": "token",
            "rollout_is_batch_normalize": True,
            "rollout_rs": "token_k2",
            "rollout_rs_threshold": 0.3,
        },
    },
}


def step_batch(world: int):
    """Three groups of four samples, prompts of 12..14 tokens, responses 1..6 tokens; rows
    ordered rank by rank."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(3):
        lengths = rng.integers(1, 7, 4)
        groups.append(
            StoredGroup(
                g, g, 0, rng.integers(3, 14, 12 + g, dtype=np.int32),
                [rng.integers(3, 14, n, dtype=np.int32) for n in lengths],
                [rng.uniform(-3, -1, n).astype(np.float32) for n in lengths],
                [np.zeros(n, np.int32) for n in lengths],
                [[float(rng.integers(0, 2))] for _ in lengths], [0], "default",
            )
        )  # fmt: skip
    shards = shard_samples(groups, world)
    samples = [(groups[gi], i) for shard in shards for gi, i in shard]
    frames = P.Frames()
    cat = lambda xs, dt: np.concatenate(xs).astype(dt)  # noqa: E731
    body = P.Batch(
        step=0, group_ids=[g.group_id for g in groups], sample_group=[g.group_id for g, _ in samples],
        sample_index=[i for _, i in samples], shard_sizes=[len(s) for s in shards],
        prompt_lengths=[len(g.prompt_ids) for g, _ in samples],
        response_lengths=[len(g.responses[i]) for g, i in samples],
        prompt_ids=frames.add(cat([g.prompt_ids for g, _ in samples], np.int32)),
        response_ids=frames.add(cat([g.responses[i] for g, i in samples], np.int32)),
        behav_logprobs=frames.add(cat([g.behav_logprobs[i] for g, i in samples], np.float32)),
        token_versions=frames.add(cat([g.token_versions[i] for g, i in samples], np.int32)),
        scores=[g.scores[i] for g, i in samples], failed=[0], data_sources=["default"] * 3,
        dropped_stale=0, buffer_size=0,
    )  # fmt: skip
    return collate(body, [bytes(b) for b in frames.buffers], pad_id=0)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def full_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def sgd_step(model, batch, adv, algo, plan, sharded: bool, share_prefix: bool = True, reduce=None):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def clip():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=clip, reduce=reduce)
    learner = LearnerConfig(share_prefix=share_prefix)
    before = full_params(model)
    stats = policy_update(model, opt, batch, adv, algo, hooks, plan=plan, learner=learner)
    after = full_params(model)
    return {k: after[k] - before[k] for k in before}, stats


def one_rank_plan(batch, algo, spec) -> list:
    """The same global minibatches on one rank: minibatch k is every rank's chunk k."""
    world = len(batch.shard_sizes)
    plans = [
        plan_update(batch.loss_mask, batch.attention_mask, batch.shard_sizes, r, algo.minibatches)
        for r in range(world)
    ]
    merged = []
    for k in range(algo.minibatches):
        rows = [
            DataParallel(r, world).bounds(batch)[0] + torch.cat(plans[r][k].micro)
            for r in range(world)
        ]
        mb = plans[0][k]
        merged.append(Minibatch([torch.cat(rows)], mb.tokens, mb.seqs, 1))
    return merged


def run_case(name: str, spec: dict, base, batch, dp: DataParallel) -> dict:
    algo = msgspec.structs.replace(
        AlgoConfig(), minibatches=spec.get("minibatches", 1),
        loss_agg_mode=spec.get("loss_agg_mode", "token-mean"),
        loss_scale_factor=spec.get("loss_scale_factor"), loss_mode=spec.get("loss_mode", "vanilla"),
    )  # fmt: skip
    if "rollout" in spec:
        section = RolloutCorrectionConfig(**spec["rollout"])
        algo = msgspec.structs.replace(algo, correction="rollout", rollout_correction=section)
    rewards = torch.tensor([s[0] for s in batch.scores])
    adv = (rewards - rewards.mean())[:, None] * batch.loss_mask  # per token, step-wide
    if spec.get("lora"):  # peft before sharding, as the learner does
        torch.manual_seed(1)
        base = lora.apply(copy.deepcopy(base), LoraConfig(rank=4, alpha=8.0))
    one = copy.deepcopy(base)
    share = spec.get("share_prefix", True)
    delta_one, stats_one = sgd_step(
        one, batch, adv, algo, one_rank_plan(batch, algo, spec), sharded=False, share_prefix=share
    )

    sharded = fsdp2(copy.deepcopy(base), torch.float32, offload=spec.get("offload", False))
    local = dp.local(batch)
    plan = plan_update(
        batch.loss_mask, batch.attention_mask, batch.shard_sizes, dp.rank, algo.minibatches,
        spec.get("micro", 0),
    )  # fmt: skip
    delta_dp, stats_dp = sgd_step(
        sharded, local, dp.local_part(adv, batch, local), algo, plan, sharded=True,
        share_prefix=share, reduce=dp.all_sum,
    )  # fmt: skip
    diff = max(float((delta_dp[k] - delta_one[k]).abs().max()) for k in delta_one)
    scale = max(float(d.abs().max()) for d in delta_one.values())
    trained = [k for k in delta_one if float(delta_one[k].abs().max()) > 0]
    return {
        "max_abs_diff": diff,
        "max_abs_delta": scale,
        "trained_all_adapter": all(lora.is_adapter(k) for k in trained),
        "grad_norm_one": stats_one.grad_norm,
        "grad_norm_dp": stats_dp.grad_norm,
        "rollout_corr": [stats_one.rollout_corr, stats_dp.rollout_corr],
        "rollout_corr_ranks": rollout_over_ranks(algo, stats_dp, local, dp),
        "micro_passes": [len(mb.micro) for mb in plan],
        "shared_prefix_fraction": [
            stats_one.shared_prefix_fraction,
            stats_dp.shared_prefix_fraction,
        ],
    }


def rollout_over_ranks(algo, stats, local, dp: DataParallel) -> dict | None:
    """The ranks' rollout_corr/* combined as the learner combines them (a collective)."""
    if algo.correction != "rollout":
        return None
    names = metric_names(algo.rollout_correction.settings())
    return dp.mean_metrics(stats.rollout_corr, float(local.loss_mask.sum()), names)


def check_gather(base, batch, dp: DataParallel) -> float:
    """gather_rows of each rank's log-probs == one pass over the whole step."""
    with torch.no_grad():
        whole = token_logprobs(
            logits_of(base, batch.input_ids, batch.attention_mask), batch.input_ids[:, 1:]
        )
        local = dp.local(batch)
        mine = token_logprobs(
            logits_of(base, local.input_ids, local.attention_mask), local.input_ids[:, 1:]
        )
    gathered = dp.gather_rows(mine, batch)
    return float(((gathered - whole) * batch.loss_mask).abs().max())


ONE_MINIBATCH = msgspec.structs.replace(AlgoConfig(), minibatches=1)


def local_state(model, opt) -> list[torch.Tensor]:
    """This rank's shards of every weight and optimizer state tensor, copied."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
    for state in opt.state.values():
        tensors += [t.to_local() if hasattr(t, "to_local") else t for t in state.values()]
    return [t.detach().clone() for t in tensors]


def check_nonfinite(base, batch, dp: DataParallel, run_dir: Path) -> list[list[float]]:
    """Rank 1's advantages are NaN (rank 0's are not): every rank must skip the step, for
    the loss (the collective makes rank 1's NaN loss rank 0's verdict too), and keep its
    shards of weights and AdamW state; then a NaN planted in rank 1's shard of a weight
    must stop the publish and the sharded checkpoint on every rank. Per rank: [skipped for
    the loss, skipped for the gradient, state unchanged, publish refused, refused naming a
    tensor of its own, checkpoint refused, a checkpoint directory written]."""
    model = fsdp2(copy.deepcopy(base), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = dp.local(batch)
    adv = dp.local_part(torch.ones_like(batch.loss_mask), batch, local)

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()

    hooks = UpdateHooks(lambda loss: loss.backward(), clip, any_rank=dp.any_rank)

    def update(adv):
        return policy_update(model, opt, local, adv, ONE_MINIBATCH, hooks)

    update(adv)  # a good step first: AdamW has moments to keep
    before = local_state(model, opt)
    stats = update(adv * math.nan if dp.rank == 1 else adv)
    after = local_state(model, opt)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    if dp.rank == 1:
        with torch.no_grad():
            next(model.parameters()).to_local().view(-1)[0] = math.nan
    try:
        require_finite("publish", model.state_dict().items(), dp.any_rank)
        refused = own = False
    except NonFiniteWeights as exc:
        refused, own = True, "another rank" not in str(exc)
    ckpt_refused = refuses_checkpoint(model, opt, dp, run_dir)
    written = (run_dir / "checkpoints").exists()
    row = torch.tensor(
        [stats.skipped_nonfinite_loss, stats.skipped_nonfinite_grad, unchanged, refused, own,
         ckpt_refused, written],
        dtype=torch.float64,
    )  # fmt: skip
    rows = [torch.empty_like(row) for _ in range(dp.world)]
    dist.all_gather(rows, row)
    return [r.tolist() for r in rows]


def refuses_checkpoint(model, opt, dp: DataParallel, run_dir: Path) -> bool:
    """Whether ``Checkpoints.save`` (the sharded layout: two ranks) refuses the state."""
    cfg = CheckpointConfig(every_steps=1, write_timeout_s=60.0)
    state = LearnerState(model, opt)
    checkpoints = Checkpoints(
        run_dir, cfg, state, dp, dp.rank == 0, buffer=None, fetch=dict, meta={}
    )  # no buffer: a refused save never reaches it
    try:
        checkpoints.save(1, 1, dict)
        return False
    except NonFiniteWeights:
        return True
    finally:
        checkpoints.close()


def main() -> None:
    dist.init_process_group("gloo")
    dp = DataParallel.from_environment()
    batch = step_batch(dp.world)
    base = tiny_llama()
    report = {
        "world": dp.world,
        "shard_sizes": batch.shard_sizes,
        "shard_tokens": [
            int(batch.attention_mask[a:b].sum())
            for a, b in (dp.__class__(r, dp.world).bounds(batch) for r in range(dp.world))
        ],
        "longest_row": int(batch.attention_mask.sum(dim=1).max()),
        "gather_max_abs_diff": check_gather(base, batch, dp),
        "cases": {name: run_case(name, spec, base, batch, dp) for name, spec in CASES.items()},
        "nonfinite": check_nonfinite(base, batch, dp, Path(sys.argv[1]).parent / "run"),
    }
    if dp.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    leave_job()  # as a learner rank ends (gloo's teardown can abort a finished rank)


if __name__ == "__main__":
    main()
