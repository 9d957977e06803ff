"""Retry after feedback: a wrong answer is told so and the model answers again.

    multiturn:
      environments:
        - env: verl_async.envs.retry:RetryEnv
          args: {max_attempts: 3, extract: first_word, feedback: "wrong again"}

A worked episode on the max-digit prompt "max 3 7 1 =" (ground truth 7) with the args
above::

    assistant  3
    user       wrong again                  reward 0.0, not done
    assistant  7                            reward 1.0, done

Had the third answer been wrong too, the episode would end there with ``wrong_reward``.
The answer is read from the turn as ``extract`` says: ``first_word`` or ``last_word``
(compared with the ground truth as text, like an ``exact`` reward source), or
``last_number`` (compared as numbers, like a ``math`` source's fallback).
"""

from __future__ import annotations

from verl_async.envs.base import EnvRow, Step
from verl_async.rewards.rules import extract_exact, last_number, numbers_equal

EXTRACT_MODES = ("first_word", "last_word", "last_number")


class RetryEnv:
    """Right: ``right_reward`` and done. Wrong with attempts left: ``wrong_reward`` and the
    ``feedback`` message (role ``role``). Wrong at the last attempt: ``wrong_reward``, done."""

    def __init__(
        self,
        max_attempts: int = 3,
        feedback: str = "Wrong, try again.",
        extract: str = "first_word",
        right_reward: float = 1.0,
        wrong_reward: float = 0.0,
        role: str = "user",
    ) -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if extract not in EXTRACT_MODES:
            raise ValueError(f"extract must be one of {', '.join(EXTRACT_MODES)}, got {extract!r}")
        self.max_attempts = max_attempts
        self.feedback = feedback
        self.extract = extract
        self.right_reward = float(right_reward)
        self.wrong_reward = float(wrong_reward)
        self.role = role
        self.ground_truth = ""
        self.attempts = 0

    def reset(self, row: EnvRow) -> None:
        """Remembers the answer; the prompt stays as it is."""
        self.ground_truth = row.ground_truth.strip()
        self.attempts = 0

    def step(self, text: str) -> Step:
        """Judges one answer."""
        self.attempts += 1
        if self.is_right(text):
            return Step([], self.right_reward, done=True)
        if self.attempts >= self.max_attempts:
            return Step([], self.wrong_reward, done=True)
        return Step([{"role": self.role, "content": self.feedback}], self.wrong_reward)

    def is_right(self, text: str) -> bool:
        """Whether the answer read from ``text`` is the ground truth."""
        if self.extract == "last_number":
            return numbers_equal(last_number(text), last_number(self.ground_truth))
        return extract_exact(text, self.extract) == self.ground_truth
