"""The full layout: what a one-rank learner checkpoints, every tensor whole.

Files of ``checkpoints/step_NNNNNNNN/learner/`` in this form (safetensors, no pickle)::

    model.safetensors          full weights by Hugging Face name
    state.safetensors          optimizer state tensors ("optim.<param>.<key>"), RNG states
    critic.safetensors         the critic's weights (algo.adv_estimator: gae only)
    critic_state.safetensors   its optimizer state tensors

and in ``trainer_state.json`` the optimizer's param groups and scalars ("optimizer",
"critic_optimizer"). The optimizer's state is its ``state_dict()`` as one rank's AdamW
writes it (parameters numbered in ``parameters()`` order). Every rank of an FSDP2 job
loads its own shards out of it, so a run checkpointed on one rank resumes on any number
(a run on several ranks writes shards instead: shards.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from learners.checkpoints.state import LearnerState, Staged
from learners.checkpoints.writer import Checkpointer, Stager


class FullFiles:
    """One rank: stage every tensor into the writer's slots; rank 0 writes the files."""

    critic_key = "critic_optimizer"  # in trainer_state.json when the run has a critic

    def __init__(self, writer: Checkpointer) -> None:
        self.writer = writer
        self.stager: Stager | None = None

    def ready(self, step: int) -> None:
        """Wait for a staging slot no write still reads (only both being busy waits)."""
        self.stager = self.writer.stager()

    def stage(self, step: int, state: LearnerState) -> Staged:
        tensors, optim = split_optimizer(state.optimizer.state_dict())
        files = {
            "learner/model.safetensors": self.stager.stage(
                "model", model_state(state.model), {"format": "pt"}
            ),
            "learner/state.safetensors": self.stager.stage("state", tensors | rng_tensors()),
        }
        staged = Staged({"optimizer": optim}, files)
        if state.critic is not None:
            critic, critic_optimizer = state.critic
            critic_tensors, staged.json[self.critic_key] = split_optimizer(
                critic_optimizer.state_dict()
            )
            files["learner/critic.safetensors"] = self.stager.stage(
                "critic", model_state(critic), {"format": "pt"}
            )
            files["learner/critic_state.safetensors"] = self.stager.stage(
                "critic_state", critic_tensors
            )
        return staged

    def wait(self, timeout_s: float) -> bool:
        return True  # nothing is written behind the step but rank 0's files

    def close(self) -> None:
        pass


def load(ckpt: Path, saved: dict, state: LearnerState, world: int) -> dict:
    """Restore the full files of ``ckpt`` (verified) into ``state``; every rank of an
    FSDP2 job keeps its own shards. Returns the torch RNG states."""
    from safetensors.torch import load_file

    learner = ckpt / "learner"
    load_model_state(state.model, load_file(learner / "model.safetensors"), world)
    tensors = load_file(learner / "state.safetensors")
    optimizer_state = join_optimizer(tensors, saved["optimizer"])
    load_optimizer_state(state.model, state.optimizer, optimizer_state, world)
    if state.critic is not None:
        critic, critic_optimizer = state.critic
        load_model_state(critic, load_file(learner / "critic.safetensors"), world)
        critic_tensors = load_file(learner / "critic_state.safetensors")
        critic_state = join_optimizer(critic_tensors, saved["critic_optimizer"])
        load_optimizer_state(critic, critic_optimizer, critic_state, world)
    cuda = [
        (int(name[len("rng.cuda.") :]), t)
        for name, t in tensors.items()
        if name.startswith("rng.cuda.")
    ]
    rng = {"torch": tensors["rng.torch"]}
    if cuda:
        rng["cuda"] = [t for _, t in sorted(cuda, key=lambda c: c[0])]
    return rng


def rng_tensors() -> dict[str, torch.Tensor]:
    """Torch's RNG states as tensors of ``state.safetensors`` (Python's go in the JSON)."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, cuda in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = cuda
    return tensors


def split_optimizer(optimizer: dict, prefix: str = "optim") -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state_dict -> (tensors named "<prefix>.<param>.<key>", JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for param, entries in optimizer["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{param}.{key}"] = whole(value)
            else:
                scalars.setdefault(str(param), {})[key] = value
    return tensors, {"param_groups": optimizer["param_groups"], "scalars": scalars}


def join_optimizer(tensors: dict[str, torch.Tensor], rest: dict, prefix: str = "optim") -> dict:
    """Inverse of ``split_optimizer`` (tensors of other prefixes are ignored)."""
    state: dict[int, dict] = {}
    for param, entries in rest["scalars"].items():
        state.setdefault(int(param), {}).update(entries)
    for name, tensor in tensors.items():
        kind, _, tail = name.partition(".")
        if kind == prefix:
            param, _, key = tail.partition(".")
            state.setdefault(int(param), {})[key] = tensor
    return {"state": state, "param_groups": rest["param_groups"]}


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _names(model: torch.nn.Module) -> list[str]:
    """The optimizer's parameters by name, in its order: the trainable ones (all of them,
    or a LoRA run's adapter)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A one-rank model's tensors by name (several ranks write shards: shards.py)."""
    return {name: whole(t).detach() for name, t in model.state_dict().items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor as a plain one: a one-rank FSDP2 model's DTensors (learner.cpu_offload)
    hold every element in their one shard."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``model`` (on one rank too, with learner.cpu_offload)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def load_model_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], world: int) -> None:
    """Load full tensors into a plain or FSDP2-sharded model (every rank passes them)."""
    if world == 1 and not sharded(model):
        model.load_state_dict(tensors)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, tensors, options=_options())


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict, world: int) -> None:
    """Load a one-rank-form optimizer state (every rank passes it)."""
    if world == 1 and not sharded(model):
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
