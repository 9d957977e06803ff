"""Full (unsharded) model and optimizer state: what a one-rank learner checkpoints.

That form is the model's full tensors by name and the optimizer's ``state_dict()`` as one
rank's AdamW writes it (parameters numbered in ``parameters()`` order). Every rank of an
FSDP2 job loads its own shards out of it, so a run checkpointed on one rank resumes on
any number (a run on several ranks writes shards instead: learners/sharded.py).
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


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A one-rank model's tensors by name (several ranks write shards: learners/sharded.py)."""
    return {name: t.detach() for name, t in model.state_dict().items()}


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
