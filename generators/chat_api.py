"""The OpenAI chat-completions API as the generator's endpoint speaks it: what a request
may ask, checked before anything is rendered, and the reply built from a completion.

Pure functions, no server (generators/endpoint.py serves them):

    parse_request(body)      a decoded JSON body -> ChatRequest, or OpenAIError (400)
                             naming the first field that is wrong or not supported
    assistant_reply(...)     the assistant message for a completion's text, its tool calls
                             parsed by the run's parser (one ``ToolCall`` type, from
                             verl_async/tools/parsers.py, whatever the family)
    completion_body(...)     OpenAI's ChatCompletion JSON for one choice
    same_message(a, b)       whether a message sent back is the one the episode had

Errors are OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
request that is wrong (a field of the wrong type or shape, JSON nested deeper than
``MAX_DEPTH``), 404 for an unknown episode key or model. A bad request never reaches the
chat template or the engine.

Sampling. The behaviour policy must be known to train on its samples, so a request's
``temperature`` and ``top_p`` are ignored (the server logs that once); ``n`` other than 1,
``stream``, ``logprobs``, penalties, logit bias and structured ``response_format`` are
refused as not supported (each would change or hide what was sampled). Unknown fields
are ignored. ``tool_choice`` "required" and a named function are not enforced on decoding
(the policy samples freely: constraining it would change what is trained on), they only
decide that calls are parsed.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from verl_async.tools.parsers import ParsedTurn, ToolCall

# (text, tools) -> the turn's calls and malformed ones, as the run's parser reads them
ParseCalls = Callable[[str, list[dict]], ParsedTurn]

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_DEPTH = 32  # JSON nesting a request may use (messages, tools, arguments)
# Fields that would change or hide what is sampled: refused unless at their default.
REFUSED_UNLESS = {
    "n": (None, 1),
    "stream": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
}
USED = {"messages", "model", "tools", "tool_choice", "max_tokens", "max_completion_tokens"}
USED |= {"stop", "temperature", "top_p", "response_format"}
IGNORED = {"seed", "user", "metadata", "store", "parallel_tool_calls", "stream_options"}
IGNORED |= {"service_tier", "modalities", "reasoning_effort", "functions", "function_call"}


class OpenAIError(Exception):
    """A request answered with an error in OpenAI's format."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        kind = kind if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


@dataclass(frozen=True)
class ChatRequest:
    """What a chat-completions body asks for, checked and normalised."""

    model: str
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str | dict  # "auto" | "none" | "required" | {"type": "function", ...}
    max_tokens: int | None
    stop: tuple[str, ...]
    temperature: float | None  # asked for, not used (see the module docstring)
    top_p: float | None
    ignored: tuple[str, ...]  # fields not known to this endpoint


def parse_request(body: object) -> ChatRequest:
    """``body`` (decoded JSON) as a ``ChatRequest``; raises ``OpenAIError`` (400) naming
    the first field that is wrong or not supported."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if too_deep(body, MAX_DEPTH):
        raise bad(f"the request nests JSON deeper than {MAX_DEPTH} levels")
    for name, allowed in REFUSED_UNLESS.items():
        if name in body and body[name] not in allowed:
            raise bad(
                f"{name}={json.dumps(body[name])[:80]} is not supported by this endpoint", name
            )
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format other than text is not supported", "response_format")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model must be a string: the name GET /models lists", "model")
    tools = _tools(body.get("tools"))
    return ChatRequest(
        model=model,
        messages=normalise_messages(body.get("messages")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        ignored=tuple(sorted(set(body) - USED - IGNORED - set(REFUSED_UNLESS)))[:16],
    )


def too_deep(value: object, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests lists and objects more than ``limit`` deep
    (walked without recursion, so any depth is answered)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def normalise_messages(messages: object) -> list[dict]:
    """Messages as chat templates expect them: content as a string (text parts joined),
    "developer" as "system", tool-call arguments as dicts (JSON strings decoded)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"{where} must be an object with a role in {sorted(ROLES)}", where)
        m = dict(m)
        m["role"] = "system" if m["role"] == "developer" else m["role"]
        m["content"] = _content(m.get("content"), f"{where}.content", m["role"] == "assistant")
        if m.get("tool_calls") is not None and m["role"] == "assistant":
            m["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in
                               enumerate(_list(m["tool_calls"], f"{where}.tool_calls"))]  # fmt: skip
        out.append(m)
    return out


def _content(content: object, where: str, may_be_empty: bool) -> str | None:
    if isinstance(content, str) or (content is None and may_be_empty):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad(f"{where} must be a string or a list of text parts (only text is supported)", where)


def _tool_call(call: object, where: str) -> dict:
    """A message's tool call with its arguments as a dict (what templates write)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be an object with function.name", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except (json.JSONDecodeError, RecursionError):
            raise bad(f"{where}.function.arguments is not valid JSON", where) from None
        if too_deep(args, MAX_DEPTH):
            raise bad(f"{where}.function.arguments nests deeper than {MAX_DEPTH} levels", where)
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments must be a JSON object", where)
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise bad(f"{where} must be a list", where)
    return value


def _tools(tools: object) -> list[dict] | None:
    if tools is None:
        return None
    for i, t in enumerate(_list(tools, "tools")):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}] must be a function tool with function.name", f"tools[{i}]")
    return tools or None


def _tool_choice(choice: object, tools: list[dict] | None) -> str | dict:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    names = {t["function"]["name"] for t in tools or []}
    if not isinstance(name, str) or name not in names:
        raise bad(
            'tool_choice must be "auto", "none", "required" or {"type": "function", '
            '"function": {"name": ...}} naming one of the tools',
            "tool_choice",
        )
    return choice


def _max_tokens(body: dict) -> int | None:
    newer = body.get("max_completion_tokens") is not None  # the name that replaced max_tokens
    name = "max_completion_tokens" if newer else "max_tokens"
    value = body.get(name)
    if value is not None and (type(value) is not int or value < 1):
        raise bad(f"{name} must be a positive integer", name)
    return value


def _stop(stop: object) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a string or a list of non-empty strings", "stop")
    return tuple(stops)


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise bad(f"{name} must be a number", name)
    return value


def assistant_reply(
    text: str,
    tools: list[dict] | None,
    tool_choice: str | dict,
    parse_calls: ParseCalls | None,
    ids: str | None = None,
) -> tuple[dict, ParsedTurn]:
    """The assistant message answering ``text`` (decoded completion), and what the parser
    read: calls are parsed only with a parser, tools, and ``tool_choice`` not "none".
    Call ``i`` gets the id ``<ids>_<i>`` (``ids`` names the episode's call, so an episode
    replays to the same ids), or a random one."""
    if parse_calls is None or not tools or tool_choice == "none":
        return {"role": "assistant", "content": text}, ParsedTurn(text, [], [])
    try:
        parsed = parse_calls(text, tools)
    except Exception as exc:  # noqa: BLE001 (model text is a boundary: the reply's, not ours)
        parsed = ParsedTurn(text, [], [f"the tool-call parser failed: {type(exc).__name__}: {exc}"])
    message: dict = {"role": "assistant", "content": parsed.content if parsed.calls else text}
    if parsed.calls:
        message["tool_calls"] = [
            _openai_call(c, f"{ids}_{i}" if ids else f"call_{secrets.token_hex(12)}")
            for i, c in enumerate(parsed.calls)
        ]
    return message, parsed


def _openai_call(call: ToolCall, call_id: str) -> dict:
    """A ``ToolCall`` as an assistant message's ``tool_calls`` entry (arguments as JSON
    text, as OpenAI sends them)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    }


def completion_body(model: str, message: dict, finish_reason: str, prompt: int, sampled: int):
    """OpenAI's ChatCompletion JSON for one choice."""
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": sampled,
            "total_tokens": prompt + sampled,
        },
    }


def same_message(sent: dict, got: dict) -> bool:
    """Whether a message the agent sent back is the one the episode had: role, text, and
    tool calls by name and parsed arguments (ids and JSON spacing may differ)."""
    if sent.get("role") != got.get("role") or (sent.get("content") or "") != (
        got.get("content") or ""
    ):
        return False
    return _calls(sent) == _calls(got)


def _calls(message: dict) -> list[tuple]:
    out = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", c)
        args = f.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError, RecursionError):
                args = json.loads(args)
        out.append((f.get("name"), json.dumps(args, sort_keys=True)))
    return out
