"""A ReAct-style agent written against the plain ``openai`` client, nothing else.

verl-async trains it as it is: a config names it (``multiturn.agents``), each episode
gets a client whose base URL is the generator's chat endpoint, and every call it makes is
sampled by the policy being trained and recorded token for token::

    multiturn:
      agents:
        - agent: examples.react_agent:agent
          args: {tools: [calculator]}
          max_calls: 4

The loop: ask the model with the tools' schemas; run each call it makes and send the
results back as ``role: tool`` messages; stop at the first reply without a call (the
final answer, which the run's reward sources score) or after ``max_steps`` replies. It
returns None: the reward is the run's. Nothing here knows about verl-async; pointed at
any OpenAI-compatible server it runs the same way.
"""

from __future__ import annotations

import json

from verl_async.envs.safe_math import CalcError, evaluate

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 17 * 23"}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the secret of this episode.",
        "parameters": {"type": "object", "properties": {}},
    },
}
SCHEMAS = {"calculator": CALCULATOR, "lookup": LOOKUP}


def run_tool(name: str, arguments: str, row) -> str:
    """One call: its result, or an error text the model reads next."""
    try:
        args = json.loads(arguments or "{}")
        if name == "calculator":
            return str(evaluate(str(args["expression"])))
        if name == "lookup":
            return str(row.ground_truth)  # the tiny task's secret (configs/tiny_agent.yaml)
    except (CalcError, KeyError, TypeError, ValueError) as exc:
        return f"error: {exc}"
    return f"error: no tool named {name!r}"


async def agent(
    client,
    row,
    tools=("calculator",),
    max_steps: int = 3,
    call_reward: float = 0.0,
    model: str = "policy",
):
    """One episode of ``row``'s prompt (a string or chat messages). Returns
    ``call_reward`` if it ran a tool (a hint while a small policy learns the format; 0:
    none), else None."""
    prompt = row.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    schemas = [SCHEMAS[name] for name in tools]
    called = False
    for _ in range(max_steps):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=schemas)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break  # the final answer
        for call in message.tool_calls:
            called = True
            result = run_tool(call.function.name, call.function.arguments, row)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return call_reward if called and call_reward else None
