"""A calculator tool: the model writes ``<calc>EXPRESSION</calc>`` and reads the result.

    multiturn:
      environments:
        - env: verl_async.envs.calculator:CalculatorEnv
          data_sources: [arith]

A worked episode on "What is 17 * 23?" (a chat prompt, so the tool's instructions come
first as a system message)::

    system     You have a calculator. To use it, write <calc>EXPRESSION</calc> ...
    user       What is 17 * 23?
    assistant  <calc>17 * 23</calc>
    user       <result>391</result>                  tool_call, not done
    assistant  <answer>391</answer>                  no <calc>: the final answer, done

The environment gives no reward of its own: the run's ``rewards.sources`` score the final
turn (a ``math`` source reads the last number). Expressions are evaluated by
``safe_math.evaluate`` (numbers and + - * / // % ** only, bounded); one it refuses answers
``<result>error: REASON</result>`` and the model may try again.
"""

from __future__ import annotations

import re

from verl_async.envs.base import EnvRow, Message, Step
from verl_async.envs.safe_math import CalcError, evaluate

SYSTEM_PROMPT = (
    "You have a calculator. To use it, write <calc>EXPRESSION</calc> and stop; the result "
    "comes back as <result>VALUE</result>. Give your final answer as <answer>N</answer>."
)
# The closing tag may be missing: a generator that stops at "</calc>" cuts it off.
_CALL = re.compile(r"<calc>(.*?)(?:</calc>|\Z)", re.DOTALL)


class CalculatorEnv:
    """Evaluates the first ``<calc>...</calc>`` of a turn; a turn without one is final.

    args: ``role`` of the result message ("user" or "tool"), ``system_prompt`` put first in
    chat prompts that have no system message of their own (plain string prompts are left
    as they are: they are written for a model without a chat template).
    """

    def __init__(self, role: str = "user", system_prompt: str = SYSTEM_PROMPT) -> None:
        if role not in ("user", "tool"):
            raise ValueError(f"role must be 'user' or 'tool', got {role!r}")
        self.role = role
        self.system_prompt = system_prompt

    def reset(self, row: EnvRow) -> list[Message] | None:
        """The chat prompt with the tool's instructions first; None (the prompt as it is)
        for a plain string or a chat prompt that has a system message already."""
        if isinstance(row.prompt, str) or any(m["role"] == "system" for m in row.prompt):
            return None
        return [{"role": "system", "content": self.system_prompt}, *row.prompt]

    def step(self, text: str) -> Step:
        """The result of the turn's first expression, or the end of the episode."""
        call = _CALL.search(text)
        if call is None:
            return Step([], done=True)
        try:
            result = evaluate(call.group(1))
        except CalcError as exc:
            result = f"error: {exc}"
        return Step([{"role": self.role, "content": f"<result>{result}</result>"}], tool_call=True)
