"""The chat-completions endpoint's pure parts (generators/chat_api.py): what a request
may ask, how messages reach the template, and the reply built from a completion's text
with a hermes-style tool-call parser (``<tool_call>{json}</tool_call>``).

Tool calls are tested here on given text: the tiny model cannot be made to write a
well-formed call on purpose. tests/integration/test_endpoint.py serves a parsed call
through HTTP and the openai client with the model's own text."""

import json
import re

import pytest

from generators.chat_api import (
    OpenAIError,
    assistant_reply,
    completion_body,
    normalise_messages,
    parse_request,
)
from generators.endpoint import BoundedCache
from verl_async.tools.parsers import ParsedTurn, ToolCall

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}},
]
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def hermes(text: str, tools: list[dict]):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, Hermes' format."""
    names = {t["function"]["name"] for t in tools}
    calls, errors = [], []
    for block in CALL.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            errors.append(f"not JSON: {block.strip()!r}")
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            errors.append(f"not a call to a known tool: {block.strip()!r}")
            continue
        calls.append(ToolCall("", obj["name"], json.dumps(obj.get("arguments", {}))))
    return ParsedTurn(CALL.sub("", text).strip() or None, calls if not errors else [], errors)


def bad(body) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse_request({"model": "m", **body} if isinstance(body, dict) else body)
    assert err.value.status == 400
    return err.value


def test_a_plain_request_and_its_defaults():
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert (req.tools, req.tool_choice, req.max_tokens, req.stop) == (None, "auto", None, ())
    req = parse_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
         "max_completion_tokens": 5, "stop": "x", "seed": 3, "temperature": 0.2, "future": 1}
    )  # fmt: skip
    assert (req.max_tokens, req.stop, req.temperature, req.ignored) == (5, ("x",), 0.2, ("future",))
    assert bad([1, 2]).message == "the request body must be a JSON object"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 2}, "n", "not supported"),
        ({"stream": True}, "stream", "not supported"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"logit_bias": {"5": 100}}, "logit_bias", "not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"max_tokens": 0}, "max_tokens", "positive integer"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens", "positive integer"),
        ({"stop": ["ok", ""]}, "stop", "non-empty strings"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]", "function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "div"}}},
         "tool_choice", "naming one of the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "auto"),
        ({"tools": TOOLS, "tool_choice": {"function": "add"}}, "tool_choice", "naming one"),
        ({"tools": TOOLS, "tool_choice": ["add"]}, "tool_choice", "naming one"),
        ({"model": 7}, "model", "string"),
    ],
)  # fmt: skip
def test_what_is_refused_names_its_field(body, param, words):
    err = bad({"messages": [{"role": "user", "content": "hi"}], **body})
    assert err.param == param and words in err.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ([{"role": "robot", "content": "hi"}], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": None}],
         "messages[1].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         "messages[0].content"),
        ([{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": "{oops"}}]}],
         "messages[0].tool_calls[0]"),
    ],
)  # fmt: skip
def test_bad_messages_name_the_message(messages, param):
    assert bad({"messages": messages}).param == param


def test_messages_are_normalised_for_chat_templates():
    sent = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]  # fmt: skip
    out = normalise_messages(sent)
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[1]["content"] == "2+3"
    assert out[2]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    ]
    assert out[3] == sent[3]
    assert sent[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 3}'  # not mutated


def test_a_hermes_call_in_the_text_becomes_openai_tool_calls():
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    message, parsed = assistant_reply(text, TOOLS, "auto", hermes, "call_3")
    assert parsed.errors == [] and message["content"] == "Let me add."
    [c] = message["tool_calls"]
    assert c["type"] == "function" and c["id"] == "call_3_0"
    assert c["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    body = completion_body("policy", message, "tool_calls", 7, 4)
    assert body["object"] == "chat.completion" and body["model"] == "policy"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_malformed_calls_are_errors_and_the_text_stays():
    text = '<tool_call>{"name": "add", "arg</tool_call><tool_call>{"name": "div"}</tool_call>'
    message, parsed = assistant_reply(text, TOOLS, "required", hermes)
    assert "tool_calls" not in message and len(parsed.errors) == 2
    assert "not JSON" in parsed.errors[0] and "known tool" in parsed.errors[1]


def test_calls_are_not_parsed_without_tools_a_parser_or_with_tool_choice_none():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for tools, choice, parser in [(TOOLS, "none", hermes), (None, "auto", hermes),
                                  (TOOLS, "auto", None)]:  # fmt: skip
        message, parsed = assistant_reply(text, tools, choice, parser)
        assert message == {"role": "assistant", "content": text} and parsed.calls == []


def test_a_parser_that_raises_is_an_error_of_the_reply():
    def broken(text, tools):
        raise ValueError("boom")

    message, parsed = assistant_reply("hi", TOOLS, "auto", broken)
    assert message == {"role": "assistant", "content": "hi"} and "boom" in parsed.errors[0]


def nested(depth: int, leaf=0):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def test_json_nested_too_deep_is_a_400_wherever_it_hides():
    """Arguments 10,000 deep (a JSON string, so the body itself decodes) and a body nested
    past the limit are refused before anything renders them (they used to be a 500)."""
    args = '{"a": ' + "[" * 10_000 + "]" * 10_000 + "}"
    call = {"type": "function", "function": {"name": "add", "arguments": args}}
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert bad({"messages": msgs}).param == "messages[0].tool_calls[0]"
    args = json.dumps({"a": nested(100)})  # decodes, but deeper than MAX_DEPTH
    msgs[0]["tool_calls"][0]["function"]["arguments"] = args
    assert "nests deeper" in bad({"messages": msgs}).message
    deep_body = {"messages": [{"role": "user", "content": "hi", "x": nested(40)}]}
    assert "deeper than 32" in bad(deep_body).message
    # Decoded JSON of any depth is walked without recursion.
    assert bad({"messages": [{"role": "user", "content": "x", "y": nested(100_000)}]})


def test_the_render_cache_keeps_to_its_bytes_dropping_the_least_recent():
    cache = BoundedCache(100)
    cache.put("a", 1, 40)
    cache.put("b", 2, 40)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3, 40)  # over 100: b, the least recent, goes
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    assert cache.bytes <= 100
    cache.put("huge", 4, 1000)  # larger than the whole cache: not kept
    assert cache.get("huge") is None and cache.get("a") == 1
