"""Small local tokenizers carrying real chat templates, for the tool tests: SmolLM2's
vocabulary form with the shipped ChatML tool template, Qwen2.5's and Llama 3.1's templates
(tests/fixtures/chat_templates, as in the models' tokenizer_config.json) with the tokens
their tool calls use. The byte-level BPE is the one tests/unit/test_render.py trains."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_render import bpe_tokenizer
from verl_async.tools.chat_templates import chat_template

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


def smollm2_tools():
    return bpe_tokenizer(chat_template("chatml_tools"), "<|im_end|>")


def qwen2_5():
    tok = bpe_tokenizer((FIXTURES / "qwen2_5.jinja").read_text(), "<|im_end|>")
    # Qwen2.5's vocabulary has these as added (not special) tokens.
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


def llama3_1():
    tok = bpe_tokenizer((FIXTURES / "llama3_1.jinja").read_text(), "<|eot_id|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eom_id|>"]})
    tok.bos_token = "<|begin_of_text|>"
    return tok
