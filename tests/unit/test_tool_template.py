"""Chat templates with tools: the shipped ChatML tool template (verl_async/tools/templates/
chatml_tools.jinja) beside SmolLM2's own, schemas in the prompt for it, Qwen2.5's and Llama
3.1's templates, and tool results rendered as observation deltas (generators/render.py) that
equal a render of the whole conversation; the template found by name and packaged.

``Renderer`` renders without ``tools=``; ``ToolRenderer`` below is the change it needs: the
tool schemas passed to every ``apply_chat_template`` call (prompt, anchor, observations, full
render), so the prompt lists them and the full render is of the same conversation."""

import pytest

from generators.render import Renderer
from tests.unit.chat_tokenizers import llama3_1, qwen2_5, smollm2_tools
from tests.unit.test_render import SMOLLM2_TEMPLATE, bpe_tokenizer, encode, episode
from verl_async.config_base import ConfigError
from verl_async.tools.chat_templates import chat_template, shipped_templates
from verl_async.tools.schemas import load_tool

TOOLS = [
    load_tool("tests.unit.tool_fns:add", key="tools[0]"),
    load_tool("tests.unit.tool_fns:search", key="tools[1]"),
]
SCHEMAS = [tool.schema for tool in TOOLS]  # what the chat template's tools= takes
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 0.5}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "search", "arguments": {"query": "tea"}}\n</tool_call>'
RESULTS = [
    {"role": "tool", "content": "2.5", "tool_call_id": "call_0_0", "name": "add"},
    {"role": "tool", "content": '["note about tea"]', "tool_call_id": "call_0_1", "name": "search"},
]


def ToolRenderer(tokenizer, eos_ids, tools):  # noqa: N802 (reads as the class it builds)
    """``Renderer`` with the tools' schemas passed to the chat template."""
    return Renderer(tokenizer, True, eos_ids, tools=tools)


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 * 23?"}],
    [
        {"role": "system", "content": "You are a calculator user."},
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "391"},
        {"role": "user", "content": "Sure?"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_without_tools_the_shipped_template_is_smollm2s(messages, generation_prompt):
    ours = smollm2_tools()
    theirs = bpe_tokenizer(SMOLLM2_TEMPLATE, "<|im_end|>")
    kwargs = {"add_generation_prompt": generation_prompt}
    assert render(ours, messages, **kwargs) == render(theirs, messages, **kwargs)


@pytest.mark.parametrize("factory", [smollm2_tools, qwen2_5, llama3_1])
def test_the_prompt_lists_every_tools_name_and_description(factory):
    tok = factory()
    text = render(tok, CONVERSATIONS[0], tools=SCHEMAS, add_generation_prompt=True)
    for tool in TOOLS:
        assert f'"name": "{tool.name}"' in text
        assert tool.schema["function"]["description"] in text
    assert '"query"' in text and "What is 17 * 23?" in text


def test_the_shipped_template_follows_qwen25s_layout_with_smollm2s_system_prompt():
    messages = [
        CONVERSATIONS[0][0],
        {"role": "assistant", "content": TWO_CALLS},
        *RESULTS,
        {"role": "user", "content": "And now?"},
    ]
    ours = render(smollm2_tools(), messages, tools=SCHEMAS, add_generation_prompt=True)
    qwen = render(qwen2_5(), messages, tools=SCHEMAS, add_generation_prompt=True)
    qwen_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert ours.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}\n\n# Tools\n")
    assert ours == qwen.replace(qwen_system, SMOLLM2_SYSTEM)
    # Consecutive tool messages are one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n2.5\n</tool_response>\n"
        '<tool_response>\n["note about tea"]\n</tool_response><|im_end|>\n'
        "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
    ) in ours
    # A given system message replaces the default one, tools still listed after it.
    system = [{"role": "system", "content": "Be brief."}, CONVERSATIONS[0][0]]
    assert render(smollm2_tools(), system, tools=SCHEMAS).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools\n"
    )


def test_structured_tool_calls_render_as_the_text_a_model_writes():
    tok = smollm2_tools()
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 0.5}}}
    # OpenAI-style messages carry the arguments as a JSON string: written as they are.
    as_string = {"id": "call_0_0", "type": "function",
                 "function": {"name": "search", "arguments": '{"query": "tea"}'}}  # fmt: skip
    structured = [
        CONVERSATIONS[0][0],
        {"role": "assistant", "content": "", "tool_calls": [call, as_string]},
    ]
    plain = [CONVERSATIONS[0][0], {"role": "assistant", "content": TWO_CALLS}]
    assert render(tok, structured, tools=SCHEMAS) == render(tok, plain, tools=SCHEMAS)


@pytest.mark.parametrize(
    "factory,eos,call",
    [
        (smollm2_tools, "<|im_end|>", TWO_CALLS),
        (qwen2_5, "<|im_end|>", TWO_CALLS),
        (llama3_1, "<|eot_id|>", '{"name": "add", "parameters": {"a": 2, "b": 0.5}}'),
    ],
)
@pytest.mark.parametrize("prompt", CONVERSATIONS[:1] + [CONVERSATIONS[1][:2]])
def test_tool_results_as_deltas_equal_the_full_render(factory, eos, call, prompt):
    tok = factory()
    eos_id = tok.convert_tokens_to_ids(eos)
    r = ToolRenderer(tok, {eos_id}, SCHEMAS)
    assert "Search the notes." in tok.decode(r.prompt_ids(prompt))  # the schemas are there
    turns = [call, "2.5, and one note about tea.", "Done."]
    observations = [RESULTS, [{"role": "user", "content": "Anything else?"}]]
    inc = episode(r, tok, prompt, turns, observations, eos_id)
    full = r.full_ids(prompt, turns, observations)
    assert r.matches_full_render(inc, full, ended=True)
    assert full == inc + r.separator


def test_the_smollm2_tool_delta_is_one_user_turn_of_responses():
    tok = smollm2_tools()
    r = ToolRenderer(tok, {tok.convert_tokens_to_ids("<|im_end|>")}, SCHEMAS)
    assert tok.decode(r.observation_ids(RESULTS)) == (
        "\n<|im_start|>user\n<tool_response>\n2.5\n</tool_response>\n"
        '<tool_response>\n["note about tea"]\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_without_tools_in_the_render_the_full_render_is_another_conversation():
    """Why Renderer needs ``tools=``: prompt ids rendered with the schemas (as the buffer
    would) do not match a full render without them."""
    tok = smollm2_tools()
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    with_tools = ToolRenderer(tok, {eos_id}, SCHEMAS)
    plain = Renderer(tok, True, {eos_id})
    prompt = CONVERSATIONS[0]
    inc = with_tools.prompt_ids(prompt) + encode(tok, CALL) + [eos_id]
    inc += with_tools.observation_ids(RESULTS[:1])
    # The episode stops after the observation: its full render ends with the same
    # generation prompt.
    assert inc == with_tools.full_ids(prompt, [CALL], [RESULTS[:1]])
    assert inc != plain.full_ids(prompt, [CALL], [RESULTS[:1]])
    # The observation delta itself does not depend on the tools (it follows the anchor).
    assert plain.observation_ids(RESULTS) == with_tools.observation_ids(RESULTS)


def test_the_shipped_template_is_found_by_name_or_path(tmp_path):
    assert "chatml_tools" in shipped_templates()
    text = chat_template("chatml_tools")
    assert "<tool_call>" in text and "<tool_response>" in text
    own = tmp_path / "mine.jinja"
    own.write_text("{{ messages[0]['content'] }}")
    assert chat_template(str(own)) == "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match="'multiturn.tool_template'.*chatml_tools"):
        chat_template("chatml_tool", key="multiturn.tool_template")


def test_packaging_ships_the_templates(repo_root):
    import tomllib

    pyproject = tomllib.loads((repo_root / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["verl_async"]
    package = repo_root / "verl_async"
    shipped = {p for g in globs for p in package.glob(g)}
    assert set((package / "tools" / "templates").glob("*.jinja")) <= shipped
