"""Guess the number: each wrong guess is answered "higher" or "lower".

    multiturn:
      max_turns: 4
      environments:
        - env: verl_async.envs.guess:GuessNumberEnv
          data_sources: [guess]
          args: {no_number: "guess again"}

The secret is the row's ground truth (an integer); the range ``lo..hi`` comes from the
row's ``extra_info`` (keys ``lo`` and ``hi``), else from the args. A worked episode on the
tiny task's prompt "guess =" with secret 6 in 0..9 (``python -m
verl_async.tasks.guess_number`` writes those prompts)::

    assistant  4
    user       higher                       reward 0.0 (wrong_reward), not done
    assistant  7
    user       lower                        reward 0.0, not done
    assistant  6                            reward 1.0 (right_reward), done

The guess is the last integer of the turn; a turn without one is answered ``no_number``.
Episodes end at the generator's ``multiturn.max_turns`` unless ``max_guesses`` (every turn
counts, a turn without a number too) ends them first. Binary search finds any of ten
digits within four guesses.
"""

from __future__ import annotations

from typing import Any

from verl_async.envs.base import EnvRow, Step
from verl_async.rewards.rules import last_number


class GuessNumberEnv:
    """Higher/lower feedback on a secret integer.

    args: ``lo``, ``hi`` (the range when the row has none), ``right_reward``,
    ``wrong_reward``, the feedback texts ``higher``, ``lower`` and ``no_number`` (``{lo}``
    and ``{hi}`` in it are filled in), ``role`` of the feedback message, ``max_guesses``
    (None: no limit of its own).
    """

    def __init__(
        self,
        lo: int = 1,
        hi: int = 100,
        right_reward: float = 1.0,
        wrong_reward: float = 0.0,
        higher: str = "higher",
        lower: str = "lower",
        no_number: str = "Guess an integer from {lo} to {hi}.",
        role: str = "user",
        max_guesses: int | None = None,
    ) -> None:
        if max_guesses is not None and (not isinstance(max_guesses, int) or max_guesses < 1):
            raise ValueError(f"max_guesses must be an integer >= 1 or None, got {max_guesses!r}")
        self.lo, self.hi = _range(lo, hi, "args")
        self.right_reward = float(right_reward)
        self.wrong_reward = float(wrong_reward)
        self.higher = higher
        self.lower = lower
        self.no_number = no_number
        self.role = role
        self.max_guesses = max_guesses
        self.secret = 0
        self.guesses = 0

    def reset(self, row: EnvRow) -> None:
        """Takes the secret and range from the row; the prompt stays as it is."""
        try:
            self.secret = int(row.ground_truth)
        except ValueError:
            raise ValueError(f"ground truth {row.ground_truth!r:.50} is not an integer") from None
        if "lo" in row.extra_info or "hi" in row.extra_info:
            self.lo, self.hi = _range(
                row.extra_info.get("lo"), row.extra_info.get("hi"), "extra_info"
            )
        self.guesses = 0

    def step(self, text: str) -> Step:
        """Judges one guess."""
        self.guesses += 1
        guess = last_number(text)
        if guess == self.secret:
            return Step([], self.right_reward, done=True)
        if self.max_guesses is not None and self.guesses >= self.max_guesses:
            return Step([], self.wrong_reward, done=True)
        if guess is None or not guess.is_integer():
            feedback = self.no_number.format(lo=self.lo, hi=self.hi)
        else:
            feedback = self.higher if guess < self.secret else self.lower
        return Step([{"role": self.role, "content": feedback}], self.wrong_reward)


def _range(lo: Any, hi: Any, where: str) -> tuple[int, int]:
    if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi):
        raise ValueError(f"{where} lo and hi must be integers with lo <= hi, got {lo!r}, {hi!r}")
    return lo, hi
