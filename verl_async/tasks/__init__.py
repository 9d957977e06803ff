"""Tasks: how a prompt record is shown to the model and how a response is scored."""

from __future__ import annotations

from collections.abc import Callable

from verl_async.tasks import max_digit

# name -> reward(answer, response_text) -> float in [0, 1]
REWARDS: dict[str, Callable[[str, str], float]] = {"max_digit": max_digit.reward}


def reward_fn(task: str) -> Callable[[str, str], float]:
    return REWARDS[task]
