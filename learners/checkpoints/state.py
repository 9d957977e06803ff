"""What a checkpoint holds of the learner, whichever layout writes it.

``LearnerState`` names the live objects (unwrapped models, optimizers, scheduler) once;
``Checkpoints`` (manager.py) checks them, a layout (full.py, shards.py) stages them and
loads them back. Tensors are named as in the files: the model's by ``model.<name>``, its
optimizer's by ``model_optim.<name>.<key>``, the critic's alike (``critic.``,
``critic_optim.``), which is how a refusal to write names what is not finite.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class LearnerState:
    """The learner's objects a checkpoint saves and restores."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any = None
    critic: tuple[torch.nn.Module, Any] | None = None  # (critic, its optimizer): gae only

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a checkpoint holds of the models and their optimizers (a
        DTensor as it is: each rank sees its own shards)."""
        parts = [("model", self.model, self.optimizer)]
        if self.critic is not None:
            parts.append(("critic", *self.critic))
        for prefix, model, optimizer in parts:
            yield from ((f"{prefix}.{n}", t) for n, t in model.state_dict().items())
            for name, param in model.named_parameters():
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        yield f"{prefix}_optim.{name}.{key}", value


@dataclass
class Staged:
    """A layout's part of one checkpoint, staged in host memory."""

    json: dict  # its part of trainer_state.json
    files: dict[str, list] = field(default_factory=dict)  # rank 0's files: name -> chunks
    shards: Future | None = None  # the DCP save of every rank's shards (shards.py)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
