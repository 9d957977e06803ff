"""Tools as OpenAI function schemas (verl_async/tools/schemas.py): derived by transformers'
get_json_schema from typed, docstringed functions (plain, async, a callable object, an
environment class's public methods), written explicitly as in YAML, refused with the key
named; a call's arguments checked against the schema and its result made the tool message's
text, as generators/tool_calls.py runs a call."""

import asyncio
import re

import pytest

from tests.unit import tool_fns
from verl_async.config_base import ConfigError
from verl_async.tools.schemas import (
    ToolCallError,
    check_arguments,
    check_schema,
    load_tool,
    method_tools,
    result_text,
)

KEY = "multiturn.tools[2]"
ADD_SCHEMA = {
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "number", "description": "The second number."},
        },
        "required": ["a"],
    },
}


def run(tool, arguments, instance=None):
    """A call as the generator makes one: the arguments checked, the function called (an
    environment's method on ``instance``, by name), awaited when the tool is async, and its
    result as text."""
    kwargs = check_arguments(tool, arguments)
    fn = tool.fn if instance is None else getattr(instance, tool.name)
    result = fn(**kwargs)
    if tool.is_async:
        result = asyncio.run(result)
    return result_text(tool, result)


def test_a_plain_function_gets_transformers_schema():
    tool = load_tool("tests.unit.tool_fns:add", key=KEY)
    assert tool.name == "add" and not tool.is_async and tool.fn is tool_fns.add
    assert tool.schema == {
        "type": "function",
        "function": {**ADD_SCHEMA, "return": {"type": "number"}},
    }
    assert run(tool, {"a": 2, "b": 0.5}) == "2.5"  # not a str: JSON


def test_an_async_function_is_awaited_and_its_result_is_json():
    tool = load_tool("tests.unit.tool_fns:search", key=KEY, max_concurrent=4, timeout_s=2.5)
    assert tool.is_async and (tool.max_concurrent, tool.timeout_s) == (4, 2.5)
    params = tool.parameters
    assert params["required"] == ["query"]
    # `int | None` is transformers' nullable integer, and None passes the argument check.
    assert params["properties"]["limit"] == {
        "type": "integer",
        "nullable": True,
        "description": "At most this many results.",
    }
    assert run(tool, {"query": "tea", "limit": None}) == '["note about tea"]'


def test_a_callable_object_is_named_after_its_attribute():
    tool = load_tool("tests.unit.tool_fns:count", key=KEY)
    assert tool.name == "count"
    assert tool.schema["function"]["description"] == "Count up."
    assert run(tool, {"step": 2}) == "count=2"  # a str result stays as it is
    assert tool_fns.count.calls == 2


def test_an_environment_class_exposes_its_public_methods_called_on_an_instance():
    tools = {t.name: t for t in method_tools(tool_fns.Inventory)}
    # reset/step/close, _helper and the property are not tools (the property would raise).
    assert list(tools) == ["look", "put"]
    assert tools["put"].parameters["required"] == ["item"]  # no "self"
    assert tools["look"].is_async and tools["look"].parameters["properties"] == {}
    env, other = tool_fns.Inventory(), tool_fns.Inventory()
    assert run(tools["put"], {"item": "key", "n": 2}, env) == "key: 2"
    assert run(tools["look"], {}, env) == '{"key": 2}'
    assert env.items == {"key": 2} and other.items == {}  # the call changed that instance


def test_an_explicit_schema_is_taken_whole_or_as_its_function_part():
    short = load_tool("tests.unit.tool_fns:add", key=KEY, schema=ADD_SCHEMA)
    full = load_tool(
        "tests.unit.tool_fns:add", key=KEY, schema={"type": "function", "function": ADD_SCHEMA}
    )
    assert short.schema == full.schema == {"type": "function", "function": ADD_SCHEMA}
    # Missing parameters and description: no arguments, empty description.
    bare = check_schema({"name": "ping"}, KEY)
    assert bare["function"] == {
        "name": "ping",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    }


@pytest.mark.parametrize(
    "schema,key,words",
    [
        ({**ADD_SCHEMA, "name": "2add"}, f"{KEY}.schema.name", "not a tool name"),
        ({**ADD_SCHEMA, "name": "add me"}, f"{KEY}.schema.name", "not a tool name"),
        ({**ADD_SCHEMA, "name": None}, f"{KEY}.schema.name", "not a tool name"),
        ({**ADD_SCHEMA, "description": 3}, f"{KEY}.schema.description", "string"),
        ({**ADD_SCHEMA, "parameters": {"type": "array"}}, f"{KEY}.schema.parameters", "object"),
        ({**ADD_SCHEMA, "parameters": []}, f"{KEY}.schema.parameters", "object"),
        (
            {**ADD_SCHEMA, "parameters": {"type": "object", "properties": {"a": 1}}},
            f"{KEY}.schema.parameters.properties",
            "mapping",
        ),
        (
            {**ADD_SCHEMA, "parameters": {"type": "object", "required": ["c"]}},
            f"{KEY}.schema.parameters.required",
            "'c'",
        ),
        ({**ADD_SCHEMA, "returns": {}}, f"{KEY}.schema.returns", "unknown key"),
        (
            {"type": "function", "function": {**ADD_SCHEMA, "name": "-x"}},
            f"{KEY}.schema.function.name",
            "not a tool name",
        ),
        ({"type": "tool", "function": ADD_SCHEMA}, f"{KEY}.schema", "type: function"),
        ("add", f"{KEY}.schema", "mapping"),
        # The schema must fit the function it describes.
        (
            {**ADD_SCHEMA, "parameters": {"type": "object", "properties": {"c": {}}}},
            f"{KEY}.schema",
            "'c' is not a parameter",
        ),
        ({**ADD_SCHEMA, "parameters": {"type": "object"}}, f"{KEY}.schema", "'a'"),
    ],
)
def test_a_bad_explicit_schema_is_refused_naming_its_key(schema, key, words):
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")) as err:
        load_tool("tests.unit.tool_fns:add", key=KEY, schema=schema)
    assert words in str(err.value)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("tests.unit.tool_fns.add", "package.module:function"),
        ("tests.unit.no_such_module:add", "cannot be imported"),
        ("tests.unit.tool_fns:nope", "has no 'nope'"),
        ("tests.unit.tool_fns:NOT_CALLABLE", "not callable"),
        ("tests.unit.tool_fns:undocumented", "no docstring"),
        ("tests.unit.tool_fns:untyped", "type hint"),
    ],
)
def test_a_tool_that_cannot_be_loaded_or_described_is_refused(spec, words):
    with pytest.raises(ConfigError, match=re.escape(f"'{KEY}.function'")) as err:
        load_tool(spec, key=KEY)
    assert words in str(err.value)


def test_a_schema_covers_a_function_taking_any_keywords():
    tool = load_tool("tests.unit.tool_fns:takes_any", key=KEY, schema=ADD_SCHEMA)
    assert run(tool, {"a": 1}) == '{"a": 1}'


@pytest.mark.parametrize(
    "field,value", [("max_concurrent", 0), ("max_concurrent", 1.5), ("timeout_s", -1.0)]
)
def test_bad_limits_are_refused_naming_their_key(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"'{KEY}.{field}'")):
        load_tool("tests.unit.tool_fns:add", key=KEY, **{field: value})


def test_an_environment_method_without_a_schema_is_refused_naming_it():
    class Env:
        def reset(self, row):
            pass

        def step(self, text):
            pass

        def poke(self, x):  # no hints, no docstring
            return x

    with pytest.raises(ConfigError, match=r"Env\.poke") as err:
        method_tools(Env, key="multiturn.environments[0]")
    assert "multiturn.environments[0]" in str(err.value)


@pytest.mark.parametrize(
    "arguments,words",
    [
        ({"b": 1.0}, "missing required argument(s) 'a'"),
        ({"a": 1, "c": 2, "d": 3}, "unknown argument(s) 'c', 'd' (it takes a, b)"),
        ({"a": "1"}, "argument 'a' must be integer, got string"),
        ({"a": 1.5}, "argument 'a' must be integer, got number"),
        ({"a": True}, "argument 'a' must be integer, got boolean"),  # a bool is no number
        ({"a": 1, "b": None}, "argument 'b' must be number, got null"),
        ([1, 2], "arguments must be a JSON object, got array"),
    ],
)
def test_arguments_that_do_not_fit_the_schema_are_a_tool_call_error(arguments, words):
    tool = load_tool("tests.unit.tool_fns:add", key=KEY)
    with pytest.raises(ToolCallError) as err:
        check_arguments(tool, arguments)
    assert str(err.value).startswith("add: ") and words in str(err.value)


def test_every_problem_of_a_call_is_named_at_once():
    tool = load_tool("tests.unit.tool_fns:add", key=KEY)
    with pytest.raises(ToolCallError, match="unknown argument.*; missing required argument"):
        check_arguments(tool, {"c": 1})


def test_untyped_properties_take_any_value_and_what_the_tool_raises_is_the_callers():
    tool = load_tool("tests.unit.tool_fns:add", key=KEY, schema={"name": "add_any", "parameters": {
        "type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"]}})  # fmt: skip
    assert check_arguments(tool, {"a": "x", "b": 1}) == {"a": "x", "b": 1}
    with pytest.raises(TypeError, match="can only concatenate"):
        run(tool, {"a": "x", "b": 1})


def test_a_result_that_is_not_json_is_refused_with_the_tools_name():
    tool = load_tool("tests.unit.tool_fns:returns_a_set", key=KEY)
    with pytest.raises(TypeError, match="tool 'returns_a_set' returned a set"):
        run(tool, {})
    assert result_text(tool, {"a": [1, None]}) == '{"a": [1, null]}'
    assert result_text(tool, "ünïcode") == "ünïcode"  # a string as it is, not JSON-quoted
