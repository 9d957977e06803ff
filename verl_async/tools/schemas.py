"""Tools as OpenAI function schemas: where a tool comes from, what its schema says, how a
call's arguments are checked and its result written.

A tool is a Python callable plus its schema, ``{"type": "function", "function": {"name",
"description", "parameters"}}``: the form ``apply_chat_template(messages, tools=...)``, vLLM's
tool parsers and TRL's ``tools=`` all take. Three ways to get one, each ending in a ``Tool``:

    load_tool("pkg.mod:fn", key=...)             a function (plain or ``async def``) or a
                                                 callable object; its schema derived by
                                                 transformers' ``get_json_schema`` from the
                                                 type hints and the docstring's ``Args:``
                                                 section, as TRL derives it from ``tools=[fn]``
    load_tool("pkg.mod:fn", key=..., schema={})  the schema written in the config (YAML),
                                                 whole or just its ``function`` part, checked
    build_tool("pkg.mod:factory", args, key=...) the callable a factory builds from the
                                                 config's ``args`` (the sandbox's ``python``)
    method_tools(EnvClass)                       an environment's public methods, as TRL's
                                                 ``environment_factory`` exposes them: each
                                                 ``Tool.fn`` is the unbound method, called on
                                                 the episode's instance by name

A call is the caller's to run (generators/tool_calls.py): ``check_arguments(tool, arguments)``
checks them against the schema (an unknown or missing argument, a value of the wrong JSON
type: ``ToolCallError``), the caller calls ``tool.fn`` with them as keyword arguments
(awaiting it when ``Tool.is_async``) on a thread or loop of its choosing, within the
timeout and concurrency limit the config asked for (``Tool.timeout_s``,
``Tool.max_concurrent``), catching what the tool raises; ``result_text(tool, result)`` makes
its result the text of the tool message: a string as it is, anything else as JSON.

Config errors (a function that cannot be imported, a schema that cannot be derived or is
malformed) raise ``ConfigError`` naming the key, as
``multiturn.tools[2].schema.function.name``; the caller refuses two tools of one name.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from verl_async.config_base import ConfigError, import_named

NAME = re.compile(r"^[A-Za-z_][\w-]*$")
SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# An environment's methods that run the episode rather than serve as tools (``get_reward``
# is TRL's hook for an environment that owns its reward).
NOT_TOOLS = frozenset({"reset", "step", "close", "get_reward"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


class ToolCallError(ValueError):
    """A call's arguments do not fit its tool's schema; the message says how, for the model."""


@dataclass(frozen=True)
class Tool:
    """One callable tool and its OpenAI function schema."""

    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}
    fn: Callable[..., Any]
    is_async: bool  # fn returns a coroutine, for the caller to await
    max_concurrent: int | None = None  # calls of this tool running at once; None: no limit
    timeout_s: float | None = None  # a call's deadline; None: the caller's default

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (an object schema)."""
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


# ---- where a tool comes from ---------------------------------------------------------------


def load_tool(
    function: str,
    *,
    key: str,
    schema: Mapping[str, Any] | None = None,
    max_concurrent: int | None = None,
    timeout_s: float | None = None,
) -> Tool:
    """The tool ``function`` names (``package.module:attr``): its schema is ``schema`` when
    given (checked), else derived from the callable. Errors name ``<key>.function``,
    ``<key>.schema...``, ``<key>.max_concurrent`` or ``<key>.timeout_s``."""
    fn = import_callable(function, f"{key}.function")
    _check_limits(key, max_concurrent, timeout_s)
    if schema is None:
        # A callable object's schema comes from its __call__, named after the attribute.
        name = function.partition(":")[2] if not _is_function(fn) else None
        full = derive_schema(fn, f"{key}.function", name=name)
    else:
        full = check_schema(schema, f"{key}.schema")
        _check_signature(fn, full, f"{key}.schema")
    return _make_tool(fn, full, max_concurrent, timeout_s)


def build_tool(
    factory: str,
    args: Mapping[str, Any],
    *,
    key: str,
    max_concurrent: int | None = None,
) -> Tool:
    """The tool ``factory(**args)`` returns (``package.module:factory``: a class or a
    function that builds a callable object), its schema derived from the object's
    ``__call__``, named as that function is. A factory that refuses ``args`` raises
    ConfigError naming ``<key>.args``."""
    make = import_callable(factory, f"{key}.function")
    _check_limits(key, max_concurrent, None)
    try:
        fn = make(**args)
    except ConfigError as exc:
        raise ConfigError(f"bad value for '{key}.args': {exc}") from None
    except Exception as exc:  # a factory's own refusal, whatever its type
        raise ConfigError(
            f"bad value for '{key}.args': {factory} refused them ({type(exc).__name__}: {exc})"
        ) from None
    if not callable(fn):
        raise ConfigError(
            f"bad value for '{key}.function': {factory}(**args) gave a {type(fn).__name__}, "
            "which cannot be called"
        )
    return _make_tool(fn, derive_schema(fn, f"{key}.function"), max_concurrent, None)


def method_tools(cls: type, key: str = "environment") -> list[Tool]:
    """The tools an environment class exposes: its public methods (listed on the class, so
    properties are not evaluated; ``reset``, ``step``, ``close`` and ``get_reward`` left out),
    schemas derived from their hints and docstrings, known before an instance is built (the
    schemas a prompt needs). Each ``Tool.fn`` is the unbound method, which the caller calls
    on the episode's instance by name."""
    names = [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    ]
    where = f"{key} ({cls.__module__}.{cls.__qualname__})"
    tools = []
    for name in names:
        method = getattr(cls, name)
        # Bound to a stand-in, the signature has no ``self`` (what get_json_schema reads).
        schema = derive_schema(types.MethodType(method, object()), f"{where}.{name}")
        tools.append(_make_tool(method, schema, None, None))
    return tools


def import_callable(spec: str, key: str) -> Callable[..., Any]:
    """The callable ``spec`` names (``package.module:attr``); errors name ``key``."""
    where = f"bad value for '{key}'"
    if not isinstance(spec, str) or not SPEC.match(spec):
        raise ConfigError(f"{where}: {spec!r} is not of the form package.module:function")
    fn = import_named(spec, key)
    if not callable(fn):
        raise ConfigError(f"{where}: '{spec}' is not callable (it is a {type(fn).__name__})")
    return fn


def derive_schema(fn: Callable[..., Any], key: str, name: str | None = None) -> dict[str, Any]:
    """``fn``'s schema by ``transformers.utils.get_json_schema`` (type hints, and a Google
    style docstring with a description and an ``Args:`` line per argument); ``name``
    replaces the derived name. A function it cannot describe raises ConfigError naming
    ``key`` and saying what is missing."""
    from transformers.utils import get_json_schema

    target = fn if _is_function(fn) else fn.__call__
    try:
        schema = get_json_schema(target)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException, ...
        raise ConfigError(
            f"bad value for '{key}': no schema can be derived from {_describe(fn)} ({exc}); "
            "give it type hints and a docstring with an Args: section, or write its schema"
        ) from None
    if name is not None:
        schema["function"]["name"] = name
    return check_schema(schema, key, extra_keys=frozenset({"return"}))


def check_schema(raw: Any, key: str, extra_keys: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``raw`` as a full function schema ``{"type": "function", "function": {...}}``; it may
    be given whole or as just the ``function`` part. Refuses, naming the key: a name not
    matching ``^[A-Za-z_][\\w-]*$``, a description that is not a string, parameters that are
    not an object schema, unknown keys. Missing parameters mean no arguments."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"bad value for '{key}': a schema is a mapping, got {type(raw).__name__}")
    if "function" in raw:
        unknown = sorted(set(raw) - {"type", "function"})
        if unknown or raw.get("type", "function") != "function":
            raise ConfigError(
                f"bad value for '{key}': a full schema is {{type: function, function: {{...}}}}"
                + (f"; unknown key '{unknown[0]}'" if unknown else f", not type {raw['type']!r}")
            )
        raw, key = raw["function"], f"{key}.function"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"bad value for '{key}': expected a mapping")
    unknown = sorted(set(raw) - _FUNCTION_KEYS - extra_keys)
    if unknown:
        raise ConfigError(
            f"bad value for '{key}.{unknown[0]}': unknown key (a function schema has "
            f"{', '.join(sorted(_FUNCTION_KEYS))})"
        )
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(
            f"bad value for '{key}.name': {name!r} is not a tool name (letters, digits, _ "
            "and -, not starting with a digit or -)"
        )
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"bad value for '{key}.description': expected a string")
    function = copy.deepcopy(dict(raw))  # the caller's mapping is never shared or changed
    function["description"] = description
    function.setdefault("parameters", {"type": "object", "properties": {}})
    _check_parameters(function["parameters"], f"{key}.parameters")
    return {"type": "function", "function": function}


def _check_parameters(parameters: Any, key: str) -> None:
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ConfigError(
            f"bad value for '{key}': the parameters must be an object schema "
            "({type: object, properties: {...}, required: [...]})"
        )
    properties = parameters.get("properties", {})
    if not isinstance(properties, Mapping) or not all(
        isinstance(p, Mapping) for p in properties.values()
    ):
        raise ConfigError(
            f"bad value for '{key}.properties': expected a mapping of argument names to schemas"
        )
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConfigError(f"bad value for '{key}.required': expected a list of argument names")
    missing = [r for r in required if r not in properties]
    if missing:
        raise ConfigError(
            f"bad value for '{key}.required': '{missing[0]}' is not one of the properties"
        )


def _check_signature(fn: Callable[..., Any], schema: dict[str, Any], key: str) -> None:
    """A written schema must fit the function: every property a parameter it takes, every
    parameter without a default required."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none; nothing to compare
        return
    params = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    parameters = schema["function"]["parameters"]
    for prop in parameters.get("properties", {}):
        if prop not in params:
            raise ConfigError(
                f"bad value for '{key}': argument '{prop}' is not a parameter of "
                f"{_describe(fn)} (it takes {', '.join(params) or 'none'})"
            )
    required = set(parameters.get("required", []))
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for name, p in params.items():
        if p.default is p.empty and p.kind in plain and name not in required:
            raise ConfigError(
                f"bad value for '{key}': {_describe(fn)} has no default for '{name}', so "
                "the schema must list it in required"
            )


def _check_limits(key: str, max_concurrent: int | None, timeout_s: float | None) -> None:
    if max_concurrent is not None and (type(max_concurrent) is not int or max_concurrent < 1):
        raise ConfigError(
            f"bad value for '{key}.max_concurrent': {max_concurrent!r} is not a positive "
            "integer (or null for no limit)"
        )
    if timeout_s is not None and not (
        isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0
    ):
        raise ConfigError(
            f"bad value for '{key}.timeout_s': {timeout_s!r} is not a positive number of seconds"
        )


def _make_tool(
    fn: Callable[..., Any],
    schema: dict[str, Any],
    max_concurrent: int | None,
    timeout_s: float | None,
) -> Tool:
    name = schema["function"]["name"]
    return Tool(name, schema, fn, _is_async(fn), max_concurrent, timeout_s)


def _is_function(fn: Any) -> bool:
    return inspect.isfunction(fn) or inspect.ismethod(fn)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (a callable object's __call__)
    )


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


# ---- a call's arguments and its result -----------------------------------------------------


def check_arguments(tool: Tool, arguments: Any) -> dict[str, Any]:
    """``arguments`` if they fit the tool's schema: a JSON object, no argument the schema
    does not name (unless it allows ``additionalProperties``), every required one present,
    each of its declared JSON type. Otherwise ToolCallError saying every problem found."""
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f"{tool.name}: arguments must be a JSON object, got {json_type(arguments)}"
        )
    parameters = tool.parameters
    properties = parameters.get("properties", {})
    problems = []
    if parameters.get("additionalProperties") is not True:
        unknown = [a for a in arguments if a not in properties]
        if unknown:
            takes = ", ".join(properties) or "no arguments"
            problems.append(f"unknown argument(s) {_names(unknown)} (it takes {takes})")
    missing = [r for r in parameters.get("required", []) if r not in arguments]
    if missing:
        problems.append(f"missing required argument(s) {_names(missing)}")
    for arg, value in arguments.items():
        expected = _declared_types(properties.get(arg, {}))
        if expected and not any(_is_json_type(value, t) for t in expected):
            problems.append(
                f"argument '{arg}' must be {' or '.join(expected)}, got {json_type(value)}"
            )
    if problems:
        raise ToolCallError(f"{tool.name}: " + "; ".join(problems))
    return arguments


def result_text(tool: Tool, result: Any) -> str:
    """A tool's result as text: a string as it is, anything else as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"tool '{tool.name}' returned a {type(result).__name__}, which is not JSON "
            f"({exc}); return a string or JSON data (dict, list, number, bool, None)"
        ) from None


def _declared_types(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types a property's schema declares (its ``type``, and ``null`` when it is
    ``nullable`` as transformers writes ``X | None``); empty: anything goes."""
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    if types and schema.get("nullable"):
        types.append("null")
    return [t for t in types if isinstance(t, str)]


def _is_json_type(value: Any, name: str) -> bool:
    if name not in _JSON_TYPES:
        return True  # a type this minimal check does not know is not refused
    if isinstance(value, bool) and name in ("integer", "number"):
        return False  # JSON's true is not a number, though Python's bool is an int
    return isinstance(value, _JSON_TYPES[name])


def json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_json_type(value, name):
            return name
    return type(value).__name__


def _names(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)
