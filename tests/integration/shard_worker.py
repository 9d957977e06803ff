"""One rank of the sharded-checkpoint check (run by test_sharded_checkpoints.py, under
torchrun or alone as a one-rank job).

``save DIR``: a tiny Llama with a tied head, sharded with FSDP2 (learners/setup.py), takes
two AdamW steps; every rank writes its shards into ``DIR/ckpt`` with learners/checkpoints/shards.py,
and rank 0 writes the full weights and optimizer state, gathered, to
``DIR/reference.safetensors`` (with the optimizer's param groups in ``DIR/groups.json``).

``load DIR``: a model built from another seed (other weights) and a fresh optimizer, on
as many ranks as this job has (one: a plain module, no process group), loads the shards;
rank 0 writes the largest difference from the reference to ``DIR/loaded-<world>.json``,
and takes one more step to show the loaded optimizer state trains.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from learners.checkpoints import shards as sharded
from learners.setup import fsdp2
from verl_async.checkpoint import SHARDS


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def train_step(model, optimizer) -> None:
    ids = torch.arange(24).remainder(32).view(2, 12)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer state, full tensors (a collective when the model is sharded)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    for name, entries in optim.get("state", {}).items():
        out |= {f"optim.{name}.{key}": v for key, v in entries.items()}
    return out


def main() -> None:
    what, out = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    model = tiny_llama(seed=0 if what == "save" else 1)
    if world > 1:
        model = fsdp2(model, torch.float32)
    lr = 1e-2 if what == "save" else 5e-3  # loading restores the saved param groups
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    if what == "save":
        train_step(model, optimizer)
        train_step(model, optimizer)
        writer = sharded.ShardWriter(600)
        tensors, groups = sharded.shard_tensors(model, optimizer, sharded.ACTOR)
        writer.save(tensors, out / "ckpt" / SHARDS)
        assert writer.wait(120), "the shards were not written in 120 s"
        writer.close()
        reference = full_state(model, optimizer)
        if rank == 0:
            from safetensors.torch import save_file

            save_file(
                {k: v.contiguous() for k, v in reference.items()}, out / "reference.safetensors"
            )
            (out / "groups.json").write_text(json.dumps(groups))
    else:
        from safetensors.torch import load_file

        groups = json.loads((out / "groups.json").read_text())
        group = dist.new_group(backend="gloo") if world > 1 else None
        sharded.load_shards(out / "ckpt", model, optimizer, groups, sharded.ACTOR, world, group)
        loaded = full_state(model, optimizer)
        if rank == 0:
            reference = load_file(out / "reference.safetensors")
            diff = {
                name: float((loaded[name] - ref).abs().max()) for name, ref in reference.items()
            }
            report = {
                "names": sorted(loaded),
                "max_abs_diff": max(diff.values()),
                "lr": optimizer.param_groups[0]["lr"],
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            }
            (out / f"loaded-{world}.json").write_text(json.dumps(report))
        train_step(model, optimizer)  # the loaded state trains (every rank together)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
