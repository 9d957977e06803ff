"""The launcher's check that some prompt fits the run's limit (verl_async/launch/
prompt_fit.py): its quick count (``tokenizers`` and jinja2, no transformers) against the
buffer's own render (transformers' chat template), on real chat templates; and where the
exact count takes over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.chat_tokenizers import FIXTURES
from tests.unit.test_render import bpe_tokenizer
from verl_async.config import ConfigError, load_config
from verl_async.data import PromptRecord
from verl_async.launch import prompt_fit
from verl_async.tools.chat_templates import chat_template

PROMPTS = [
    PromptRecord(prompt="What is 17 * 23? Use the calculator.", ground_truth="391"),
    PromptRecord(
        prompt=[
            {"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "Wrong, try again. higher or lower?"},
        ],
        ground_truth="x",
    ),
]
TEMPLATES = {
    "chatml": lambda: chat_template("chatml_tools"),
    "qwen2_5": lambda: (FIXTURES / "qwen2_5.jinja").read_text(),
    "llama3_1": lambda: (FIXTURES / "llama3_1.jinja").read_text(),
}


def model_dir(tmp_path: Path, template: str) -> Path:
    """A model directory as far as tokenizing goes: a small byte-level BPE with ``template``."""
    out = tmp_path / "model"
    eos = "<|eot_id|>" if "eot_id" in template else "<|im_end|>"
    bpe_tokenizer(template, eos).save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return out


def run_config(model: Path, *overrides: str):
    root = Path(__file__).resolve().parents[2]
    extra = [f"model.path={model}", "generators.max_model_len=4096", "data.chat_template=true"]
    extra += overrides
    return load_config(root / "configs/tiny.yaml", extra)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("templated", [True, False])
def test_the_quick_count_is_the_buffers_count_on_real_chat_templates(tmp_path, name, templated):
    cfg = run_config(model_dir(tmp_path, TEMPLATES[name]()), f"data.chat_template={templated}")
    model = Path(cfg.model.path)
    quick = prompt_fit._tokenizers_count(cfg, model)
    exact = prompt_fit._transformers_count(cfg, model)
    assert quick is not None
    for record in PROMPTS:
        if templated or isinstance(record.prompt, str):
            assert quick(record) == exact(record), record.prompt
        else:  # messages without a template: render_prompts' error, from the exact count
            assert quick(record) is None
            with pytest.raises(ConfigError, match="data.chat_template"):
                exact(record)


def test_a_model_directory_is_refused_exactly_below_its_shortest_prompt(tmp_path, monkeypatch):
    """Below the shortest prompt the estimate cannot say a prompt fits: the exact count
    decides and names the shortest; with MARGIN to spare, transformers is never loaded."""
    model = model_dir(tmp_path, TEMPLATES["qwen2_5"]())
    exact = prompt_fit._transformers_count(run_config(model), model)
    shortest = min(exact(r) for r in PROMPTS)
    prompts = {"data.path (prompts.jsonl)": PROMPTS}

    with pytest.raises(ConfigError) as refused:
        prompt_fit.check_prompt_fit(
            run_config(model, f"data.max_prompt_length={shortest - 1}"), prompts
        )
    assert str(refused.value).startswith("bad value for 'data.max_prompt_length': ")
    assert f"every prompt of data.path (prompts.jsonl) is longer than its {shortest - 1}" in str(
        refused.value
    )
    assert f"(the shortest has {shortest})" in str(refused.value)
    prompt_fit.check_prompt_fit(run_config(model, f"data.max_prompt_length={shortest}"), prompts)

    def no_transformers(*args):
        raise AssertionError("the exact count was needed")

    monkeypatch.setattr(prompt_fit, "_transformers_count", no_transformers)
    spare = run_config(model, f"data.max_prompt_length={shortest + prompt_fit.MARGIN}")
    prompt_fit.check_prompt_fit(spare, prompts)


def test_a_model_path_that_is_no_model_directory_is_left_to_prepare(tmp_path):
    cfg = run_config(tmp_path / "nothing-here", "data.max_prompt_length=1")
    prompt_fit.check_prompt_fit(cfg, {"data.path (x)": PROMPTS})  # prepare says what is wrong
