"""Tool calls parsed by family (verl_async/tools/parsers.py) on vLLM's real parsers: hermes on
Qwen2.5's template and the shipped ChatML one, llama3_json on Llama 3.1's, qwen3_coder on
Qwen3-Coder's XML form. For each: a single call, two in one turn, a malformed call and an
unknown tool, on text written the way its template teaches (rendered by the template from
structured tool_calls where the template renders them). Also pinned: what vLLM's parsers do
on their own with malformed calls, which the audits make up for.

vLLM is imported once for the module (10 s or more on a slow machine)."""

import json
import subprocess
import sys

import pytest

from tests.unit.chat_tokenizers import llama3_1, qwen2_5, smollm2_tools
from verl_async.config_base import ConfigError
from verl_async.tools.parsers import ToolCall, ToolCallParser

SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
                "required": ["a"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]
ADD = ("add", {"a": 2, "b": 0.5})
SEARCH = ("search", {"query": "green tea"})


@pytest.fixture(scope="module")
def tokenizers():
    return {"qwen2_5": qwen2_5(), "smollm2": smollm2_tools(), "llama3_1": llama3_1()}


@pytest.fixture(scope="module")
def parsers(tokenizers):
    return {
        "hermes": ToolCallParser("hermes", tokenizers["qwen2_5"], SCHEMAS),
        "hermes_smollm2": ToolCallParser("hermes", tokenizers["smollm2"], SCHEMAS),
        "llama3_json": ToolCallParser("llama3_json", tokenizers["llama3_1"], SCHEMAS),
        "qwen3_coder": ToolCallParser("qwen3_coder", tokenizers["qwen2_5"], SCHEMAS),
    }


def taught(tok, calls, header, end):
    """The assistant turn the template renders for structured ``calls``: the text a model
    trained on it writes."""
    messages = [
        {"role": "user", "content": "Add 2 and 0.5."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
            ],
        },
    ]
    text = tok.apply_chat_template(messages, tools=SCHEMAS, tokenize=False)
    return text[text.rindex(header) + len(header) : text.rindex(end)].lstrip("\n")


def qwen3_coder_call(name, arguments):
    """A call as Qwen3-Coder's template writes one."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def calls_of(turn):
    return [(c.name, c.arguments()) for c in turn.calls]


# ---- the format each template teaches, parsed back --------------------------------------------


@pytest.mark.parametrize("template", ["qwen2_5", "smollm2"])
def test_hermes_reads_back_what_the_template_renders(tokenizers, parsers, template):
    tok = tokenizers[template]
    parser = parsers["hermes" if template == "qwen2_5" else "hermes_smollm2"]
    one = taught(tok, [ADD], "<|im_start|>assistant", "<|im_end|>")
    assert one == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 0.5}}\n</tool_call>'
    turn = parser.parse(one, turn=3)
    assert turn.calls == [ToolCall("call_3_0", "add", '{"a": 2, "b": 0.5}')]
    assert turn.errors == [] and turn.content is None
    two = parser.parse(taught(tok, [ADD, SEARCH], "<|im_start|>assistant", "<|im_end|>"), turn=4)
    assert calls_of(two) == [ADD, SEARCH] and two.errors == []
    assert [c.id for c in two.calls] == ["call_4_0", "call_4_1"]


def test_llama3_json_reads_back_what_the_template_renders(tokenizers, parsers):
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    one = taught(tokenizers["llama3_1"], [ADD], header, "<|eot_id|>")
    assert one == '{"name": "add", "parameters": {"a": 2, "b": 0.5}}'
    parser = parsers["llama3_json"]
    assert calls_of(parser.parse(one)) == [ADD]
    assert calls_of(parser.parse("<|python_tag|>" + one)) == [ADD]  # Llama 3.2's habit
    # Llama 3.1's template renders one call a turn; vLLM reads several joined by ";".
    two = parser.parse(one + '; {"name": "search", "parameters": {"query": "green tea"}}', turn=1)
    assert calls_of(two) == [ADD, SEARCH] and two.errors == []
    assert [c.id for c in two.calls] == ["call_1_0", "call_1_1"]


def test_qwen3_coder_reads_the_xml_form_with_values_of_the_schemas_types(parsers):
    parser = parsers["qwen3_coder"]
    turn = parser.parse("I will add them.\n" + qwen3_coder_call(*ADD), turn=2)
    assert turn.calls == [ToolCall("call_2_0", "add", '{"a": 2, "b": 0.5}')]  # not "2", "0.5"
    assert turn.content == "I will add them." and turn.errors == []
    two = parser.parse(qwen3_coder_call(*ADD) + "\n" + qwen3_coder_call(*SEARCH))
    assert calls_of(two) == [ADD, SEARCH] and two.errors == []


# ---- malformed calls and unknown tools ---------------------------------------------------------

GOOD_HERMES = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 0.5}}\n</tool_call>'
MALFORMED = [
    # (parser, turn, the error's words)
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>',
     "tool call 1: invalid JSON (Expecting property name enclosed in double quotes"),
    ("hermes", GOOD_HERMES + '\n<tool_call>\n{"name": "search", "arguments": {query}}\n</tool_call>',
     "tool call 2: invalid JSON"),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2', "tool call 1: invalid JSON"),
    ("hermes", '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>', 'tool call 1: no "name"'),
    ("hermes", '<tool_call>\n{"name": "add"}\n</tool_call>', 'tool call 1: no "arguments"'),
    ("hermes", '<tool_call>\n["add", 2]\n</tool_call>', "expected a JSON object"),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "a=2"}\n</tool_call>',
     "tool call to 'add': the arguments must be a JSON object, got string"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 2,}}', "tool call 1: invalid JSON"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 2}}; {"name": "search"}',
     'tool call 2: no "parameters"'),
    ("llama3_json", "<|python_tag|>brave_search.call(query='tea')", "tool call 1: invalid JSON"),
    ("qwen3_coder", '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>',
     "tool call 1: no <function=NAME>"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n",
     "tool call 1: not closed: the turn ended inside the call"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n</function>\n</tool_call>",
     "tool call 1: parameter 'a' is not closed"),
    ("qwen3_coder", qwen3_coder_call(*ADD) + "\n<tool_call>\ngarbage\n</tool_call>",
     "tool call 2: no <function=NAME>"),
]  # fmt: skip


@pytest.mark.parametrize("name,text,words", MALFORMED)
def test_a_malformed_call_is_reported_and_none_of_the_turns_calls_runs(parsers, name, text, words):
    turn = parsers[name].parse(text, turn=5)
    assert turn.calls == []
    assert len(turn.errors) == 1 and words in turn.errors[0], turn.errors
    assert turn.content == text  # the turn is text, as sampled


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", '<tool_call>\n{"name": "nope", "arguments": {"a": 2}}\n</tool_call>'),
        ("llama3_json", '{"name": "nope", "parameters": {"a": 2}}'),
        ("qwen3_coder", qwen3_coder_call("nope", {"a": 2})),
    ],
)
def test_an_unknown_tool_is_reported_and_kept_for_an_error_reply(parsers, name, text):
    turn = parsers[name].parse(text, turn=1)
    assert [(c.id, c.name) for c in turn.calls] == [("call_1_0", "nope")]
    assert turn.errors == ["tool call to 'nope': no such tool (the tools are add, search)"]


def test_text_without_a_call_is_content_and_no_error(parsers):
    for name in ("hermes", "llama3_json", "qwen3_coder"):
        turn = parsers[name].parse("The answer is 2.5.")
        assert (turn.calls, turn.errors, turn.content) == ([], [], "The answer is 2.5.")
    # Braces in prose are not a malformed Llama call (vLLM tries them as JSON and fails).
    prose = parsers["llama3_json"].parse("The set {1, 2} has two elements.")
    assert prose.calls == [] and prose.errors == []


def test_content_is_what_vllm_returns_beside_the_calls(parsers):
    turn = parsers["hermes"].parse("Let me add.\n" + GOOD_HERMES + "\nDone.")
    assert calls_of(turn) == [ADD]
    assert turn.content == "Let me add.\n"  # vLLM's hermes drops the text after a call
    # A block left open at the end of the turn counts when its JSON is whole (as in vLLM).
    assert calls_of(parsers["hermes"].parse(GOOD_HERMES.removesuffix("\n</tool_call>"))) == [ADD]


def test_ids_depend_only_on_the_turn_and_the_order(parsers):
    text = GOOD_HERMES + "\n" + GOOD_HERMES.replace('"b": 0.5', '"b": 1.5')
    first, again = parsers["hermes"].parse(text, turn=7), parsers["hermes"].parse(text, turn=7)
    assert first == again and [c.id for c in first.calls] == ["call_7_0", "call_7_1"]
    assert [c.id for c in parsers["hermes"].parse(text, turn=8).calls] == ["call_8_0", "call_8_1"]


# ---- refusals ----------------------------------------------------------------------------------


def test_an_unknown_parser_is_refused_naming_the_key_without_importing_vllm(repo_root):
    code = (
        "import sys\n"
        "from verl_async.tools.parsers import ToolCallParser\n"
        "try:\n"
        "    ToolCallParser('hermes2', None, [], key='multiturn.tool_parser')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "print('vllm' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0].startswith("ConfigError bad value for 'multiturn.tool_parser': 'hermes2'")
    assert "hermes, llama3_json, qwen3_coder" in out[0]
    assert out[1] == "False"


def test_llama3_json_needs_the_python_tag_token(tokenizers, parsers):
    with pytest.raises(ConfigError, match="'multiturn.tool_parser'.*llama3_json.*python_tag"):
        ToolCallParser("llama3_json", tokenizers["qwen2_5"], SCHEMAS, key="multiturn.tool_parser")


# ---- vLLM's own behaviour, which the audits make up for ---------------------------------------


def test_vllm_parsers_swallow_what_the_audits_report(tokenizers, parsers):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers import ToolParserManager

    tools = [ChatCompletionToolsParam.model_validate(s) for s in SCHEMAS]
    request = ChatCompletionRequest(messages=[], tools=tools, tool_choice="auto")

    def vllm(name, tok, text):
        info = ToolParserManager.get_tool_parser(name)(tok, tools).extract_tool_calls(text, request)
        return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]

    qwen, llama = tokenizers["qwen2_5"], tokenizers["llama3_1"]
    # hermes: one bad block and the good one is lost too, with no word of why.
    bad_second = GOOD_HERMES + '\n<tool_call>\n{"name": "search", "arguments": {q}}\n</tool_call>'
    assert vllm("hermes", qwen, bad_second) == []
    # qwen3_coder: a turn cut inside a parameter still calls, the argument silently missing.
    assert vllm("qwen3_coder", qwen, "<tool_call>\n<function=add>\n<parameter=a>\n2\n") == [
        ("add", {})
    ]
    # llama3_json: a call in the middle of prose is a call.
    assert vllm("llama3_json", llama, 'Sure: {"name": "add", "parameters": {"a": 2}} ok') == [
        ("add", {"a": 2})
    ]
    # All three: an unknown name is a call like any other.
    assert vllm("hermes", qwen, GOOD_HERMES.replace('"add"', '"nope"'))[0][0] == "nope"


# ---- degenerate text: one error line in bounded time, never an exception --------------------
# A repetition collapse writes the same few tokens until the turn's end: brackets thousands
# deep, a tag thousands of times. Each parse below takes milliseconds; the timeout (the test's
# call only, not vLLM's import) is what a quadratic reading or a recursion would miss by far.

DEEP, MANY, MB = 10_000, 10_000, 1_000_000
OPENS = {  # where each family's call has begun, and the turn goes on inside it
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": ',
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": ',
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n",
}
SHORT_CALLS = {  # the shortest whole call each family reads, for turns of MANY of them
    "hermes": '<tool_call>{"name":"add","arguments":{}}</tool_call>',
    "llama3_json": '{"name":"add","parameters":{}};',
    "qwen3_coder": "<function=add></function>",
}


def call_with(family, value):
    """A whole call to add whose argument ``a`` is ``value``: JSON text for the JSON
    families, the parameter's text for qwen3_coder."""
    if family == "qwen3_coder":
        return qwen3_coder_call("add", {"a": value})
    if family == "hermes":
        return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {value}}}}}\n</tool_call>'
    return f'{{"name": "add", "parameters": {{"a": {value}}}}}'


TOO_DEEP = {"hermes": "nested deeper than 32 levels", "llama3_json": "nested deeper than 32 levels"}
OPEN_IN_QWEN3 = {**TOO_DEEP, "qwen3_coder": "not closed: the turn ended inside the call"}
TOO_MANY = "tool calls in one turn; at most 64 are read"
UNCLOSED = {  # a call opened and never closed, over and over (llama3_json: JSON objects)
    "hermes": "<tool_call>",
    "llama3_json": '{"name": "add", "parameters": ',
    "qwen3_coder": "<tool_call>\n<function=add>\n",
}
HOSTILE = {
    # name: (the turn for a family, words of its one error, or of each family's)
    "brackets_deep_in_an_open_call": (lambda f: OPENS[f] + "[" * DEEP, OPEN_IN_QWEN3),
    "braces_deep_in_an_open_call": (lambda f: OPENS[f] + '{"a": ' * DEEP, OPEN_IN_QWEN3),
    "a_closed_call_nested_deep": (lambda f: call_with(f, "[" * DEEP + "]" * DEEP), TOO_DEEP),
    "a_megabyte_of_text": (lambda f: "x" * MB, "characters long"),
    "a_megabyte_in_an_open_call": (lambda f: OPENS[f] + "x" * MB, "characters long"),
    "a_megabyte_in_one_call": (lambda f: call_with(f, '"' + "x" * MB + '"'), "characters long"),
    "ten_thousand_calls": (lambda f: SHORT_CALLS[f] * MANY, TOO_MANY),
    "ten_thousand_unclosed_openings": (
        lambda f: UNCLOSED[f] * MANY,
        {"hermes": TOO_MANY, "llama3_json": "nested deeper", "qwen3_coder": TOO_MANY},
    ),
    "nul_in_an_argument": (
        lambda f: call_with(f, "x\x00y" if f == "qwen3_coder" else '"x\\u0000y"'),
        "holds NUL or an unpaired surrogate",
    ),
    "an_escaped_lone_surrogate": (
        lambda f: call_with(f, '"\\ud800"'),
        "holds NUL or an unpaired surrogate",
    ),
    "a_raw_lone_surrogate": (lambda f: call_with(f, '"\ud800x"'), "not valid Unicode"),
}


@pytest.mark.timeout(10, func_only=True)
@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("family", ["hermes", "llama3_json", "qwen3_coder"])
def test_degenerate_text_is_one_parse_error_in_bounded_time(parsers, family, case):
    make, words = HOSTILE[case]
    text, words = make(family), words.get(family, "") if isinstance(words, dict) else words
    turn = parsers[family].parse(text, turn=1)
    assert turn.calls == [] and turn.content == text
    assert len(turn.errors) == 1 and words in turn.errors[0], turn.errors


@pytest.mark.timeout(10, func_only=True)
@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_json_that_python_refuses_to_decode_is_one_parse_error(parsers, family):
    # json raises ValueError (not JSONDecodeError) for an integer of more than 4300 digits;
    # qwen3_coder's values are text, so there it is a string the argument check refuses.
    text = call_with(family, "1" * 5000)
    turn = parsers[family].parse(text)
    assert turn.calls == [] and turn.errors == [
        "tool call 1: invalid JSON (Exceeds the limit (4300 digits) for integer string "
        "conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)"
    ]


@pytest.mark.timeout(10, func_only=True)
@pytest.mark.parametrize("family", ["hermes", "qwen3_coder"])
def test_deep_brackets_outside_the_call_tags_are_text_and_the_call_still_runs(parsers, family):
    prose = "[" * DEEP + "{" * DEEP + "\n"
    call = GOOD_HERMES if family == "hermes" else qwen3_coder_call(*ADD)
    turn = parsers[family].parse(prose + call)
    assert calls_of(turn) == [ADD] and turn.errors == []


@pytest.mark.timeout(10, func_only=True)
def test_llama_prose_nested_deep_is_text(parsers):
    for text in ("so " + "[" * DEEP, "so " + "{" * DEEP, "so " + '{"a": ' * DEEP):
        turn = parsers["llama3_json"].parse(text)
        assert (turn.calls, turn.errors, turn.content) == ([], [], text)


@pytest.mark.timeout(10, func_only=True)
def test_llama_prose_with_more_calls_than_are_read_is_one_error(parsers):
    text = "Here: " + " ".join(['{"name": "add", "parameters": {"a": 1}}'] * MANY)
    turn = parsers["llama3_json"].parse(text)
    assert turn.calls == []
    assert turn.errors == ["more than 64 tool calls in one turn; at most 64 are read, so none "
                           "of them runs"]  # fmt: skip


# ---- the bounds, at their edges ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "qwen3_coder"])
def test_max_calls_are_read_and_one_more_is_an_error(parsers, family):
    from verl_async.tools.parsers import MAX_CALLS

    call = {
        "hermes": GOOD_HERMES,
        "llama3_json": '{"name": "add", "parameters": {"a": 2, "b": 0.5}};',
        "qwen3_coder": qwen3_coder_call(*ADD),
    }[family]
    turn = parsers[family].parse("\n".join([call] * MAX_CALLS))
    assert calls_of(turn) == [ADD] * MAX_CALLS and turn.errors == []
    over = parsers[family].parse("\n".join([call] * (MAX_CALLS + 1)))
    assert over.calls == [] and len(over.errors) == 1
    assert "tool calls in one turn; at most 64 are read" in over.errors[0]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "qwen3_coder"])
def test_arguments_nested_max_json_depth_levels_pass_and_one_more_is_an_error(parsers, family):
    from verl_async.tools.parsers import MAX_JSON_DEPTH

    def nested(levels):  # the value of "a" that makes the arguments ``levels`` deep
        return "[" * (levels - 1) + "]" * (levels - 1)

    fits = parsers[family].parse(call_with(family, nested(MAX_JSON_DEPTH)))
    assert [c.name for c in fits.calls] == ["add"] and fits.errors == []
    assert fits.calls[0].arguments()["a"] == json.loads(nested(MAX_JSON_DEPTH))
    deep = parsers[family].parse(call_with(family, nested(MAX_JSON_DEPTH + 1)))
    assert deep.calls == [] and len(deep.errors) == 1
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in deep.errors[0]


def test_a_turn_of_max_turn_chars_is_read_and_one_more_is_an_error(parsers):
    from verl_async.tools.parsers import MAX_TURN_CHARS

    text = "x" * (MAX_TURN_CHARS - len(GOOD_HERMES)) + GOOD_HERMES
    assert calls_of(parsers["hermes"].parse(text)) == [ADD]
    turn = parsers["hermes"].parse(text + "x")
    assert turn.calls == [] and turn.errors == [
        f"the turn is {MAX_TURN_CHARS + 1} characters long; tool calls are read from turns "
        f"of at most {MAX_TURN_CHARS}"
    ]


@pytest.mark.timeout(10, func_only=True)
def test_qwen3_coder_calls_too_large_for_its_parser_are_one_error(parsers):
    from verl_async.tools.parsers import MAX_QWEN3_WORK

    # 256 parameters of 100 characters: vLLM alone takes seconds over it (the docstring's
    # measurements); the same parameters short, or few long ones, are read.
    many = qwen3_coder_call("search", {f"p{i}": "x" * 100 for i in range(256)})
    assert many.count("<parameter=") * len(many) > MAX_QWEN3_WORK
    turn = parsers["qwen3_coder"].parse(many)
    assert turn.calls == [] and len(turn.errors) == 1
    assert turn.errors[0].startswith("the calls are too large to read")
    few = qwen3_coder_call("search", {"query": "x" * 100_000})
    assert parsers["qwen3_coder"].parse(few).errors == []


@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-1e999"])
def test_a_number_that_is_not_finite_is_malformed(parsers, family, number):
    turn = parsers[family].parse(call_with(family, number))
    assert turn.calls == [] and len(turn.errors) == 1 and "which is not JSON" in turn.errors[0]


# ---- whatever a parser raises costs the turn's calls, not the caller ---------------------------


class Raising:
    """vLLM's parser, or an audit, that raises ``exc`` (a stand-in: real text cannot be
    counted on to reach each of these)."""

    def __init__(self, exc):
        self.exc = exc

    def __call__(self, *args):
        raise self.exc

    extract_tool_calls = __call__


@pytest.mark.parametrize(
    "exc",
    [RecursionError("deep"), MemoryError(), SystemExit(3), ValueError("odd"), GeneratorExit()],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize("where", ["_audit", "_parser"])
def test_what_a_parser_or_an_audit_raises_is_an_error_line(parsers, monkeypatch, where, exc):
    parser = parsers["hermes"]
    monkeypatch.setattr(parser, where, Raising(exc))
    turn = parser.parse(GOOD_HERMES)
    assert turn.calls == [] and turn.content == GOOD_HERMES and len(turn.errors) == 1
    assert type(exc).__name__ in turn.errors[0]


@pytest.mark.parametrize("where", ["_audit", "_parser"])
def test_keyboard_interrupt_is_passed_on(parsers, monkeypatch, where):
    # The operator's Ctrl-C, not the text's doing: a parser that swallowed it would leave a
    # run that ignores it while it parses.
    parser = parsers["hermes"]
    monkeypatch.setattr(parser, where, Raising(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        parser.parse(GOOD_HERMES)


def test_the_config_bounds_parallel_calls_by_what_a_parser_reads():
    from verl_async.schema import MAX_TURN_CALLS
    from verl_async.tools.parsers import MAX_CALLS

    assert MAX_TURN_CALLS == MAX_CALLS
