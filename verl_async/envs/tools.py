"""Tool-calling episodes without an environment of their own, and the shipped tools.

``ToolAgent`` is verl's tool agent loop as an environment: the model sees the tools'
schemas in its prompt, each turn's calls are run and answered as ``role: tool`` messages
(the generator does that, generators/tool_calls.py), and the first turn without a call is
the final answer, scored by the run's reward sources::

    multiturn:
      environments:
        - env: verl_async.envs.tools:ToolAgent
          data_sources: [arith]
          tools:
            - function: verl_async.envs.tools:calculator

An environment of your own gets tools the same way (``tools:`` in its entry), or exposes
its public methods as tools (``methods_as_tools: true``); its ``step`` then sees only the
turns without a call.
"""

from __future__ import annotations

from verl_async.envs.base import EnvRow, Message, Step
from verl_async.envs.safe_math import CalcError, evaluate


class ToolAgent:
    """The plain tool-calling loop: the row's prompt, and a turn without a tool call ends the
    episode. ``system_prompt``: put first in a prompt that has no system message (chat
    templates that take tools add their own instructions to it)."""

    def __init__(self, system_prompt: str = "") -> None:
        self.system_prompt = system_prompt

    def reset(self, row: EnvRow) -> list[Message] | None:
        if not self.system_prompt:
            return None
        prompt = row.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if any(m["role"] == "system" for m in messages):
            return None
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def step(self, text: str) -> Step:
        return Step([], done=True)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers and the operators + - * / // % ** with parentheses, e.g. "17 * 23".
    """
    try:
        return str(evaluate(expression))
    except CalcError as exc:
        raise ValueError(str(exc)) from None
