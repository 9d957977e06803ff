"""A secret only a tool can tell: the tiny model's tool-calling task.

    multiturn:
      environments:
        - env: verl_async.envs.secret:SecretEnv
          methods_as_tools: true        # lookup() is the tool

Every row's prompt is the same ("secret =") and its answer a digit drawn at random
(``python -m verl_async.tasks.secret``), so nothing in the prompt tells it: a policy that
answers at once is right one time in ten; one that calls ``lookup`` in the standard form
(``<tool_call>{"name":"lookup","arguments":{}}</tool_call>``, parsed by the run's
``multiturn.tool_parser``) reads the digit in the tool's answer and can copy it. The
environment's method is the tool, bound to the episode's row (TRL's
``environment_factory`` shape); a turn without a call is the final answer, scored by the
run's reward sources.
"""

from __future__ import annotations

from verl_async.envs.base import EnvRow, Step


class SecretEnv:
    """``call_reward``: the environment's reward, at the final turn, for an episode that
    called ``lookup`` (a hint towards the tool while the policy cannot copy yet; the
    run's reward sources still score only the answer)."""

    def __init__(self, call_reward: float = 0.0) -> None:
        self.call_reward = call_reward
        self.secret = ""
        self.called = False

    def reset(self, row: EnvRow) -> None:
        self.secret = row.ground_truth
        return None

    def lookup(self) -> str:
        """Look up the secret of this episode."""
        self.called = True
        return self.secret

    def step(self, text: str) -> Step:
        return Step([], reward=self.call_reward if self.called else 0.0, done=True)
