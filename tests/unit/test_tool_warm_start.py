"""examples/tool_warm_start.py: its demonstrations are the template's own render, and the
loss mask keeps exactly the assistant's messages."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.unit.chat_tokenizers import smollm2_tools
from verl_async.tools.chat_templates import chat_template
from verl_async.tools.schemas import derive_schema

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "tool_warm_start", ROOT / "examples/tool_warm_start.py"
)
warm = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = warm
spec.loader.exec_module(warm)

ROW = {
    "prompt": [{"role": "user", "content": "What is 31 + 9? Answer with just the number."}],
    "reward_model": {"ground_truth": "40"},
    "extra_info": {"a": 31, "b": 9, "op": "+"},
}


def test_demonstration_is_a_right_call_the_tool_answer_and_the_number():
    messages = warm.conversation(ROW)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    call = messages[1]["tool_calls"][0]["function"]
    assert call == {"name": "calculator", "arguments": {"expression": "31 + 9"}}
    assert messages[2]["content"] == "40" and messages[3]["content"] == "40"


def test_tokens_equal_the_whole_render_and_the_mask_keeps_the_assistant_turns():
    tok = smollm2_tools()
    template = chat_template("chatml_tools")
    tools = [derive_schema(warm.calculator, warm.TOOL)]
    messages = warm.conversation(ROW)
    ids, mask = warm.tokenize(tok, template, tools, messages)
    whole = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    kept = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    call = json.dumps({"name": "calculator", "arguments": {"expression": "31 + 9"}})
    assert kept == f"<tool_call>\n{call}\n</tool_call><|im_end|>\n40<|im_end|>\n"
    # The prompt, the tool's schema and the tool's answer are never trained on.
    dropped = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "What is 31 + 9?" in dropped and "<tool_response>\n40\n</tool_response>" in dropped
    assert '"calculator"' in dropped  # the schema in the system turn
