"""Tool calls parsed out of a model's turn: vLLM's maintained parsers, and a second reading
of the turn for the malformed calls they swallow.

    parser = ToolCallParser("hermes", tokenizer, schemas)  # imports vLLM: 10 s or more
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
    half-understood turn is never half executed, and vLLM is not asked to read it;
  - a call to a name that is not a tool stays in ``calls`` and is reported in ``errors``; the
    caller answers it with an error tool message, as it answers a call that fails;
  - arguments that are not a JSON object are malformed, and so are arguments no tool should be
    handed: nested deeper than MAX_JSON_DEPTH, a string (or key) holding NUL or an unpaired
    surrogate, a number that is not finite (NaN, Infinity, 1e999);
  - ids are ``call_<turn>_<index>``, so an episode replays to the same trajectory;
  - the vLLM parser's logger is set to CRITICAL: a model learning the format writes malformed
    calls by the thousand, and ``errors`` already says what each one got wrong.

Degenerate text (a repetition collapse: brackets a thousand deep, a tag repeated to the end
of the turn) costs the turn's calls and nothing else. What such text did before the bounds
below (measured): json's C decoder recurses once per level and raised RecursionError out of
the audit at about a thousand levels; json raises ValueError for an integer of more than
4300 digits; vLLM's qwen3_coder converts a call's arguments again at each parameter (a call
of 256 parameters in 33k characters: 6 s) and takes seconds for a thousand <function=...>
tags. So, before anything is read:

  - MAX_TURN_CHARS: a longer turn is one error, not read at all;
  - a turn that is not valid Unicode (an unpaired surrogate; decoded ids never give one) is
    one error;
  - MAX_CALLS: a turn with more call openings (``<tool_call>``, ``<function=``, JSON objects)
    is one error, as is a qwen3_coder turn past MAX_QWEN3_WORK;
  - JSON is decoded once per call from where it starts (linear in the turn), and nesting
    past MAX_JSON_DEPTH is an error whatever depth the decoder would have reached;

and whatever the audit or vLLM raises, ``BaseException`` included (RecursionError,
MemoryError, SystemExit), is one error line of that turn. KeyboardInterrupt is the one
exception passed on: it is the operator stopping the process, not something the text did,
and a parser that swallowed it would make a run ignore Ctrl-C while it parses.

A parser is not thread-safe (vLLM's keep state while parsing): one per generator loop.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_async.config_base import ConfigError
from verl_async.tools.schemas import json_type

PARSERS = ("hermes", "llama3_json", "qwen3_coder")
# A turn of 128k tokens at about 4 characters a token; vLLM's qwen3_coder reads this much in
# about a second. Longer is a runaway generation, whatever it holds.
MAX_TURN_CHARS = 2**19
# Far more calls than a turn needs (multiturn.max_parallel_calls of them run); more is a
# repetition collapse, and qwen3_coder's time grows with the square of the number.
MAX_CALLS = 64
# vLLM's qwen3_coder converts a call's arguments again at each <parameter=...> tag, about a
# microsecond a character each time: a turn whose calls sum more parameters x characters (the
# call's) than this, about a second of its time, is one error. Four parameters in a call of
# 64k characters fit, as does one parameter in a turn of MAX_TURN_CHARS.
MAX_QWEN3_WORK = 2**20
# Levels of nesting in a call's arguments (tools take flat or shallow objects). json's decoder
# recurses once per level up to the interpreter's recursion limit (1000), so a bound far
# below it gives every call the same verdict however deep the caller's stack is.
MAX_JSON_DEPTH = 32
_BAD_CHARS = re.compile(r"[\x00\ud800-\udfff]")  # NUL, and surrogates (unpaired in a str)
_SURROGATE = re.compile(r"[\ud800-\udfff]")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    id: str  # call_<turn>_<index>
    name: str
    arguments_json: str  # a JSON object at most MAX_JSON_DEPTH deep: json.loads never recurses out

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
        tools: Sequence[Mapping[str, Any]],
        key: str = "tool_parser",
    ) -> None:
        check_parser_name(name, key)
        self.name = name
        schemas = [dict(s) for s in tools]
        self.tool_names = [s["function"]["name"] for s in schemas]
        self._audit = _AUDITS[name]
        self._parser, self._request = _vllm_parser(name, tokenizer, schemas, key)

    def parse(self, text: str, turn: int = 0) -> ParsedTurn:
        """The calls in ``text``, a whole turn as decoded, numbered for ``turn``. Special
        tokens may be kept or skipped: these families' tags are plain text or added tokens
        that are not special, and llama3_json's <|python_tag|> is optional. Never raises
        (but KeyboardInterrupt): whatever goes wrong is an error line (module docstring)."""
        try:
            return self._parse(text, turn)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 (model text costs its turn, never the loop)
            return ParsedTurn(text or None, [], [f"the turn could not be read ({_brief(exc)})"])

    def _parse(self, text: str, turn: int) -> ParsedTurn:
        problem = _turn_problem(text)
        attempts, errors = (0, [problem]) if problem else self._audit(text)
        if errors:  # malformed: none of the turn's calls runs, and vLLM need not read it
            return ParsedTurn(text or None, [], errors)
        info = self._extract(text, errors)
        found = info.tool_calls if info is not None else []
        if len(found) < attempts and not errors:  # vLLM dropped what the audit let pass
            errors.append(f"{attempts - len(found)} of {attempts} tool calls could not be parsed")
        for tc in found:
            problem = _arguments_problem(tc.function.arguments)
            if problem:
                errors.append(f"tool call to {_shown(tc.function.name)}: {problem}")
        if errors:
            return ParsedTurn(text or None, [], errors)
        calls = [
            ToolCall(f"call_{turn}_{i}", tc.function.name, tc.function.arguments)
            for i, tc in enumerate(found)
        ]
        known = ", ".join(self.tool_names) or "none"
        errors = [
            f"tool call to {_shown(c.name)}: no such tool (the tools are {known})"
            for c in calls
            if c.name not in self.tool_names
        ]
        content = info.content if calls else (text or None)
        return ParsedTurn(content, calls, errors)

    def _extract(self, text: str, errors: list[str]) -> Any:
        try:
            return self._parser.extract_tool_calls(text, self._request)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 (a parser's bug ends a turn's calls only)
            errors.append(f"the {self.name} parser failed ({_brief(exc)})")
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


def _turn_problem(text: str) -> str | None:
    """Why the turn is not read at all (see MAX_TURN_CHARS), or None."""
    if len(text) > MAX_TURN_CHARS:
        return (
            f"the turn is {len(text)} characters long; tool calls are read from turns of at "
            f"most {MAX_TURN_CHARS}"
        )
    surrogate = _SURROGATE.search(text)
    if surrogate:
        at = surrogate.start()
        return f"the turn is not valid Unicode (an unpaired surrogate at character {at})"
    return None


def _arguments_problem(arguments_json: str) -> str | None:
    arguments, problem = _decode(arguments_json)
    if problem:
        return f"the arguments are not JSON ({problem})"
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, got {json_type(arguments)}"
    return _value_problem(arguments)


def _decode(body: str) -> tuple[Any, str | None]:
    """``body`` as JSON, or why not (json raises ValueError for an integer of more than 4300
    digits, RecursionError for nesting near the recursion limit)."""
    try:
        return json.loads(body), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except ValueError as exc:
        return None, _cut(str(exc))
    except RecursionError:
        return None, f"nested deeper than {MAX_JSON_DEPTH} levels"


def _value_problem(value: Any) -> str | None:
    """What makes decoded arguments unfit to hand a tool (module docstring), or None."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                return f"the arguments are nested deeper than {MAX_JSON_DEPTH} levels"
            children = [*item, *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, str) and _BAD_CHARS.search(item):
            return "a string in the arguments holds NUL or an unpaired surrogate, which is not text"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"a number in the arguments is {item}, which is not JSON"
    return None


def _brief(exc: BaseException) -> str:
    return _cut(f"{type(exc).__name__}: {exc}")


def _cut(message: str, limit: int = 200) -> str:
    """An error line stays short whatever the text held (a name, an exception's message)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _shown(name: Any) -> str:
    return _cut(repr(name), 80)


# ---- audits: (attempted calls, problems) read from the turn itself --------------------------


Audit = Callable[[str], tuple[int, list[str]]]

_TOOL_CALL = "<tool_call>"
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
    opened = text.count(_TOOL_CALL)
    if opened > MAX_CALLS:
        return opened, [_too_many(opened)]
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
        return _llama_prose(text)
    objects = _json_objects(body, MAX_CALLS + 1)
    if len(objects) > MAX_CALLS:
        return len(objects), [_too_many(f"more than {MAX_CALLS}")]
    return len(objects), _numbered(
        _json_call_problem(o, "parameters", "arguments") for o in objects
    )


def _llama_prose(text: str) -> tuple[int, list[str]]:
    """vLLM reads calls out of prose too, from its first "{" to the first object that is not
    a call; only their number is checked here (each read copies the rest of the turn)."""
    read = 0
    for source in _json_objects(text, MAX_CALLS + 1):
        call, problem = _decode(source)
        is_call = isinstance(call, dict) and "name" in call
        if problem or not (is_call and ("parameters" in call or "arguments" in call)):
            break
        read += 1
    return (read, [_too_many(f"more than {MAX_CALLS}")]) if read > MAX_CALLS else (0, [])


def _qwen3_audit(text: str) -> tuple[int, list[str]]:
    """Each <tool_call> block (or bare <function=...>, which vLLM also takes) must name its
    function, be closed, and close its last parameter (vLLM drops one left open)."""
    opened = max(text.count(_TOOL_CALL), text.count("<function="))
    if opened > MAX_CALLS:
        return opened, [_too_many(opened)]
    blocks = []
    for m in _QWEN3_BLOCK.finditer(text):
        if m["bare"] is None:
            blocks.append((m["body"], bool(m["end"])))
        else:
            blocks.append((m["bare"] + m["bare_end"], bool(m["bare_end"])))
    work = sum(body.count("<parameter=") * len(body) for body, _ in blocks)
    if work > MAX_QWEN3_WORK:
        return len(blocks), [
            f"the calls are too large to read: their parameters times their characters sum "
            f"to {work}, more than {MAX_QWEN3_WORK}"
        ]
    return len(blocks), _numbered(_qwen3_problem(body, closed) for body, closed in blocks)


_AUDITS: dict[str, Audit] = {
    "hermes": _hermes_audit,
    "llama3_json": _llama_audit,
    "qwen3_coder": _qwen3_audit,
}


def _too_many(count: int | str) -> str:
    return f"{count} tool calls in one turn; at most {MAX_CALLS} are read, so none of them runs"


def _json_call_problem(body: str, *argument_keys: str) -> str | None:
    call, problem = _decode(body)
    if problem:
        return f"invalid JSON ({problem})"
    form = f'{{"name": ..., "{argument_keys[0]}": {{...}}}}'
    if not isinstance(call, dict):
        return f"expected a JSON object {form}, got {json_type(call)}"
    if not isinstance(call.get("name"), str):
        return f'no "name" string (a call is {form})'
    key = next((k for k in argument_keys if k in call), None)
    if key is None:
        return f'no "{argument_keys[0]}" (a call is {form})'
    return _value_problem(call[key])


def _json_objects(body: str, limit: int) -> list[str]:
    """The JSON objects vLLM's llama3_json parser reads from ``body``, ``limit`` at most:
    from each "{" past the last object read; one that does not decode runs to the end (and
    ends the reading). Each object is decoded once from where it starts: linear in ``body``."""
    decoder = json.JSONDecoder()
    objects: list[str] = []
    pos = 0
    while len(objects) < limit and (start := body.find("{", pos)) != -1:
        try:
            _, pos = decoder.raw_decode(body, start)
        except (ValueError, RecursionError):  # bad JSON, a huge integer, deep nesting
            objects.append(body[start:])
            break
        objects.append(body[start:pos])
    return objects or [body]  # <|python_tag|> and no JSON at all: one malformed call


def _qwen3_problem(body: str, closed: bool) -> str | None:
    function = _QWEN3_FUNCTION.search(body)
    if function is None:
        form = "<function=NAME><parameter=KEY>VALUE</parameter></function>"
        return f"no <function=NAME> (a call is {form})"
    if not function.group(1).strip():
        return "<function=> has no name"
    if not closed and "</function>" not in body:
        return "not closed: the turn ended inside the call"
    parameters = list(_QWEN3_PARAMETER.finditer(body))
    if parameters and "</parameter>" not in body[parameters[-1].end() :]:
        return f"parameter {_shown(parameters[-1].group(1))} is not closed with </parameter>"
    return None


def _numbered(problems: Any) -> list[str]:
    return [f"tool call {i}: {p}" for i, p in enumerate(problems, 1) if p]
