"""Full (unsharded) model and optimizer state, whatever the number of learner ranks.

A checkpoint holds one format: the model's full tensors by name and the optimizer's
``state_dict()`` as one rank's AdamW writes it (parameters numbered in ``parameters()``
order). Under FSDP2 the ranks gather that format for rank 0 to write, and every rank
loads its shards back out of it, so a run checkpointed on L ranks resumes on any number.
"""

from __future__ import annotations

import torch


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _names(model: torch.nn.Module) -> list[str]:
    """The optimizer's parameters by name, in its order: the trainable ones (all of them,
    or a LoRA run's adapter)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def model_state(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    """The model's full tensors by name (a collective when ``world`` > 1: gathered into
    rank 0's host memory, the other ranks get an empty dict)."""
    if world == 1:
        return {name: t.detach() for name, t in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def optimizer_state(model: torch.nn.Module, optimizer, world: int) -> dict:
    """The optimizer's full state in one-rank form (a collective when ``world`` > 1; ranks
    other than 0 get an empty dict)."""
    if world == 1:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(_names(model))}
    return {
        "state": {index[name]: entry for name, entry in by_name["state"].items()},
        "param_groups": [
            {**g, "params": [index[name] for name in g["params"]]} for g in by_name["param_groups"]
        ],
    }


def load_model_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], world: int) -> None:
    """Load full tensors into a plain or FSDP2-sharded model (every rank passes them)."""
    if world == 1:
        model.load_state_dict(tensors)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, tensors, options=_options())


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict, world: int) -> None:
    """Load a one-rank-form optimizer state (every rank passes it)."""
    if world == 1:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _names(model)
    by_name = {
        "state": {names[int(i)]: entry for i, entry in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=_options())
