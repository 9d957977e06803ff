"""Tool calls parsed out of a model's turn: vLLM's maintained parsers, and a second reading
of the turn for the malformed calls they swallow.

    parser = ToolCallParser("hermes", tokenizer, toolset)  # imports vLLM: 10 s or more
    turn = parser.parse(text, turn=2)
    turn.calls    [ToolCall(id="call_2_0", name="add", arguments_json='{"a": 1}')]
    turn.errors   ["tool call 2: invalid JSON (Expecting ',' delimiter at line 2 column 30)"]
    turn.content  the text that is not a call, as vLLM's OpenAI server would return it

The families (each name is vLLM's ``--tool-call-parser``; the chat template teaches the form):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a block per call:
                 Qwen2.5, Qwen3's JSON calls, Hermes, and templates/chatml_tools.jinja
    llama3_json  the turn is a JSON object {"name": ..., "parameters": {...}}, maybe after
                 <|python_tag|>, several joined by ";": Llama 3.1 to 3.3
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
                 </tool_call>: Qwen3-Coder (vLLM converts each value to its schema's type)

What vLLM 0.32's parsers do with malformed calls (found by running them):

    hermes       one block that is not JSON, or lacks "name" or "arguments", and the turn has
                 no calls at all, logged with a traceback; a block left open at the end of
                 the turn counts if its JSON is whole; text after the first block is dropped
                 from content
    llama3_json  every "{" starts a JSON object: prose with braces ("the set {1, 2}") fails,
                 logged with a traceback, and a JSON object with a "name" inside prose is a
                 call; content is None whenever there is a call
    qwen3_coder  lenient: a block with no <function=...> (JSON written hermes-style, garbage)
                 is dropped silently, content None; a parameter left open at the end of the
                 turn is dropped, so a turn cut mid-call still gives the call, short of that
                 argument
    all three    a name that is not a tool's is a call like any other; ids are random

So vLLM's result is taken (its calls, its converted arguments, its content) and each family's
audit below reads the turn again for the attempts vLLM dropped or cut short. Every problem is
one line of ``errors``: the caller counts them (``multiturn/tool_parse_errors``) and tells
the model. The rules added here:

  - a turn with a malformed call runs none of its calls (vLLM's hermes does so already): a
    half-understood turn is never half executed;
  - a call to a name that is not a tool stays in ``calls`` and is reported in ``errors``; the
    caller answers it with an error tool message, as it answers a call that fails;
  - arguments that are not a JSON object are malformed;
  - ids are ``call_<turn>_<index>``, so an episode replays to the same trajectory;
  - the vLLM parser's logger is set to CRITICAL: a model learning the format writes malformed
    calls by the thousand, and ``errors`` already says what each one got wrong.

A parser is not thread-safe (vLLM's keep state while parsing): one per generator loop.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async.config_base import ConfigError
from verl_async.tools.schemas import ToolSet, json_type

PARSERS = ("hermes", "llama3_json", "qwen3_coder")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    id: str  # call_<turn>_<index>
    name: str
    arguments_json: str  # a JSON object

    def arguments(self) -> dict[str, Any]:
        return json.loads(self.arguments_json)


@dataclass(frozen=True)
class ParsedTurn:
    """What a model's turn holds: text, calls, and what was wrong with the calls."""

    content: str | None  # the text that is not a call (the whole turn when it has no call)
    calls: list[ToolCall]
    errors: list[str]  # one line per malformed call or unknown tool, for the model to read


def check_parser_name(name: str, key: str) -> None:
    """Refuse, naming ``key``, a parser this module does not audit (imports nothing)."""
    if name not in PARSERS:
        raise ConfigError(
            f"bad value for '{key}': {name!r} is not a tool-call parser here; choose one of "
            f"{', '.join(PARSERS)}"
        )


class ToolCallParser:
    """One family's parser for one set of tools (their schemas tell vLLM the argument types
    and the audit the known names)."""

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        tools: ToolSet | Sequence[Mapping[str, Any]],
        key: str = "tool_parser",
    ) -> None:
        check_parser_name(name, key)
        self.name = name
        schemas = tools.schemas() if isinstance(tools, ToolSet) else [dict(s) for s in tools]
        self.tool_names = [s["function"]["name"] for s in schemas]
        self._audit = _AUDITS[name]
        self._parser, self._request = _vllm_parser(name, tokenizer, schemas, key)

    def parse(self, text: str, turn: int = 0) -> ParsedTurn:
        """The calls in ``text``, a whole turn as decoded, numbered for ``turn``. Special
        tokens may be kept or skipped: these families' tags are plain text or added tokens
        that are not special, and llama3_json's <|python_tag|> is optional."""
        attempts, errors = self._audit(text)
        info = self._extract(text, errors)
        found = info.tool_calls if info is not None else []
        if len(found) < attempts and not errors:  # vLLM dropped what the audit let pass
            errors.append(f"{attempts - len(found)} of {attempts} tool calls could not be parsed")
        for tc in found:
            problem = _arguments_problem(tc.function.arguments)
            if problem:
                errors.append(f"tool call to '{tc.function.name}': {problem}")
        if errors:  # malformed: none of the turn's calls runs
            return ParsedTurn(text or None, [], errors)
        calls = [
            ToolCall(f"call_{turn}_{i}", tc.function.name, tc.function.arguments)
            for i, tc in enumerate(found)
        ]
        known = ", ".join(self.tool_names) or "none"
        errors = [
            f"tool call to '{c.name}': no such tool (the tools are {known})"
            for c in calls
            if c.name not in self.tool_names
        ]
        content = info.content if calls else (text or None)
        return ParsedTurn(content, calls, errors)

    def _extract(self, text: str, errors: list[str]) -> Any:
        try:
            return self._parser.extract_tool_calls(text, self._request)
        except Exception as exc:  # a parser's bug ends a turn's calls, never the episode
            errors.append(f"the {self.name} parser failed ({type(exc).__name__}: {exc})")
            return None


def _vllm_parser(
    name: str, tokenizer: Any, schemas: list[dict[str, Any]], key: str
) -> tuple[Any, Any]:
    """vLLM's parser of ``name`` and the request it reads the tools from."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers import ToolParserManager

    cls = ToolParserManager.get_tool_parser(name)
    logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)  # see the module docstring
    tools = [ChatCompletionToolsParam.model_validate(s) for s in schemas]
    try:
        parser = cls(tokenizer, tools)
    except Exception as exc:  # llama3_json needs <|python_tag|> in the vocabulary
        raise ConfigError(
            f"bad value for '{key}': vLLM's {name} parser refuses this tokenizer ({exc})"
        ) from None
    # tool_choice "auto": with "none" the qwen3_coder parser suppresses every call.
    request = ChatCompletionRequest(messages=[], tools=tools or None, tool_choice="auto")
    return parser, request


def _arguments_problem(arguments_json: str) -> str | None:
    try:
        arguments = json.loads(arguments_json)
    except json.JSONDecodeError:
        return "the arguments are not JSON"
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, got {json_type(arguments)}"
    return None


# ---- audits: (attempted calls, problems) read from the turn itself --------------------------


Audit = Callable[[str], tuple[int, list[str]]]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_QWEN3_BLOCK = re.compile(
    r"<tool_call>(?P<body>.*?)(?P<end></tool_call>|\Z)"
    r"|(?P<bare><function=.*?)(?P<bare_end></function>|\Z)",  # vLLM's fallback: no <tool_call>
    re.DOTALL,
)
_QWEN3_FUNCTION = re.compile(r"<function=([^>]*)>")
_QWEN3_PARAMETER = re.compile(r"<parameter=([^>]*)>")


def _hermes_audit(text: str) -> tuple[int, list[str]]:
    """Each <tool_call> block (closed, or open to the end as vLLM reads it) must be JSON with
    a "name" and "arguments"."""
    bodies = _HERMES_BLOCK.findall(text)
    return len(bodies), _numbered(_json_call_problem(b, "arguments") for b in bodies)


def _llama_audit(text: str) -> tuple[int, list[str]]:
    """A turn starting with "{" or <|python_tag|> is a call: each JSON object in it must have
    a "name" and "parameters" (or "arguments"). A turn of prose is not read: vLLM may find a
    call inside it, which stands, but braces in prose are not a malformed call."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    elif not body.startswith("{"):
        return 0, []
    objects = _json_objects(body)
    return len(objects), _numbered(
        _json_call_problem(o, "parameters", "arguments") for o in objects
    )


def _qwen3_audit(text: str) -> tuple[int, list[str]]:
    """Each <tool_call> block (or bare <function=...>, which vLLM also takes) must name its
    function, be closed, and close its last parameter (vLLM drops one left open)."""
    blocks = []
    for m in _QWEN3_BLOCK.finditer(text):
        if m["bare"] is None:
            blocks.append((m["body"], bool(m["end"])))
        else:
            blocks.append((m["bare"] + m["bare_end"], bool(m["bare_end"])))
    return len(blocks), _numbered(_qwen3_problem(body, closed) for body, closed in blocks)


_AUDITS: dict[str, Audit] = {
    "hermes": _hermes_audit,
    "llama3_json": _llama_audit,
    "qwen3_coder": _qwen3_audit,
}


def _json_call_problem(body: str, *argument_keys: str) -> str | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    form = f'{{"name": ..., "{argument_keys[0]}": {{...}}}}'
    if not isinstance(call, dict):
        return f"expected a JSON object {form}, got {json_type(call)}"
    if not isinstance(call.get("name"), str):
        return f'no "name" string (a call is {form})'
    if not any(k in call for k in argument_keys):
        return f'no "{argument_keys[0]}" (a call is {form})'
    return None


def _json_objects(body: str) -> list[str]:
    """The JSON objects vLLM's llama3_json parser reads from ``body``: from each "{" past the
    last object read; one that does not decode runs to the end (and ends the reading)."""
    decoder = json.JSONDecoder()
    objects: list[str] = []
    pos = 0
    while (start := body.find("{", pos)) != -1:
        try:
            _, pos = decoder.raw_decode(body, start)
        except json.JSONDecodeError:
            objects.append(body[start:])
            break
        objects.append(body[start:pos])
    return objects or [body]  # <|python_tag|> and no JSON at all: one malformed call


def _qwen3_problem(body: str, closed: bool) -> str | None:
    function = _QWEN3_FUNCTION.search(body)
    if function is None:
        return "no <function=NAME> (a call is <function=NAME><parameter=KEY>VALUE</parameter></function>)"
    if not function.group(1).strip():
        return "<function=> has no name"
    if not closed and "</function>" not in body:
        return "not closed: the turn ended inside the call"
    parameters = list(_QWEN3_PARAMETER.finditer(body))
    if parameters and "</parameter>" not in body[parameters[-1].end() :]:
        return f"parameter '{parameters[-1].group(1)}' is not closed with </parameter>"
    return None


def _numbered(problems: Any) -> list[str]:
    return [f"tool call {i}: {p}" for i, p in enumerate(problems, 1) if p]
