"""Token-exact multi-turn rendering (generators/render.py): observation deltas appended to
sampled ids equal a full render of the conversation.

Templates: SmolLM2's (injects a default system prompt, "\\n" after end-of-turn) and a
Llama-3-like one (no separator after end-of-turn), on a byte-level BPE tokenizer trained
here; SmolLM2's own tokenizer too when VERL_ASYNC_SMOLLM2 names the model directory; and
the plain (no template) mode on a word-level tokenizer.
"""

import os

import pytest

from generators.render import Renderer, TemplateError

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_LIKE_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip


def bpe_tokenizer(template: str, eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "What is 17 * 23? Use the calculator.",
        "<calc>17*23</calc> <result>391</result> The answer is 391.",
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        "Wrong, try again. higher lower guess system user assistant tool error",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
    fast.chat_template = template
    return fast


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def episode(renderer, tok, prompt, turns, observations, eos_id):
    """Incremental ids of an episode whose sampled turns are the encodings of ``turns``."""
    ids = renderer.prompt_ids(prompt)
    for i, text in enumerate(turns):
        ids += encode(tok, text) + [eos_id]
        if i < len(observations):
            ids += renderer.observation_ids(observations[i])
    return ids


PROMPTS = [
    [{"role": "user", "content": "What is 17 * 23? Use the calculator."}],  # no system message
    [
        {"role": "system", "content": "You are a calculator user."},
        {"role": "user", "content": "What is 17 * 23?"},
    ],  # fmt: skip
]
TURNS = ["<calc>17*23</calc>", "The answer is 391."]
OBSERVATIONS = [[{"role": "user", "content": "<result>391</result>"}]]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(
    "template,eos", [(SMOLLM2_TEMPLATE, "<|im_end|>"), (LLAMA3_LIKE_TEMPLATE, "<|eot_id|>")]
)
def test_deltas_equal_the_full_render(template, eos, prompt):
    tok = bpe_tokenizer(template, eos)
    eos_id = tok.convert_tokens_to_ids(eos)
    r = Renderer(tok, True, {eos_id})
    inc = episode(r, tok, prompt, TURNS, OBSERVATIONS, eos_id)
    full = r.full_ids(prompt, TURNS, OBSERVATIONS)
    assert r.matches_full_render(inc, full, ended=True)
    assert full == inc + r.separator
    # And three observations, two messages in one of them, a tool role.
    obs = [
        [{"role": "user", "content": "Wrong, try again."}],
        [{"role": "tool", "content": "<result>1</result>"}, {"role": "user", "content": "go"}],
        [{"role": "user", "content": "higher"}],
    ]
    turns = ["guess 5", "<calc>1</calc>", "guess 7", "guess 8"]
    inc = episode(r, tok, prompt, turns, obs, eos_id)
    assert r.matches_full_render(inc, r.full_ids(prompt, turns, obs), ended=True)


def test_smollm2_delta_keeps_the_separator_and_drops_the_injected_system_prompt():
    tok = bpe_tokenizer(SMOLLM2_TEMPLATE, "<|im_end|>")
    r = Renderer(tok, True, {tok.convert_tokens_to_ids("<|im_end|>")})
    assert tok.decode(r.separator) == "\n"
    delta = tok.decode(r.observation_ids(OBSERVATIONS[0]))
    assert delta == "\n<|im_start|>user\n<result>391</result><|im_end|>\n<|im_start|>assistant\n"
    assert "SmolLM" not in delta  # the default system prompt the template injects


def test_llama3_like_delta_has_no_separator():
    tok = bpe_tokenizer(LLAMA3_LIKE_TEMPLATE, "<|eot_id|>")
    r = Renderer(tok, True, {tok.convert_tokens_to_ids("<|eot_id|>")})
    assert r.separator == []
    assert tok.decode(r.observation_ids(OBSERVATIONS[0])).startswith("<|start_header_id|>user")


def test_a_mismatch_is_reported_not_hidden():
    tok = bpe_tokenizer(SMOLLM2_TEMPLATE, "<|im_end|>")
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    r = Renderer(tok, True, {eos_id})
    prompt = PROMPTS[0]
    inc = episode(r, tok, prompt, TURNS, OBSERVATIONS, eos_id)
    # A sampled sequence the tokenizer would not produce from its text: "391" spelled
    # digit by digit decodes to the same text but re-encodes differently.
    digits = [i for c in "391" for i in encode(tok, c)]
    assert digits != encode(tok, "391")
    split = r.prompt_ids(prompt) + digits + [eos_id]
    assert not r.matches_full_render(split, r.full_ids(prompt, ["391"], []), ended=True)
    # A template that rewrites earlier turns (drops them) is a mismatch too.
    assert not r.matches_full_render(inc, r.full_ids(prompt, TURNS[1:], []), ended=True)


def test_a_turn_cut_by_its_budget_is_a_prefix_of_the_full_render():
    tok = bpe_tokenizer(SMOLLM2_TEMPLATE, "<|im_end|>")
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    r = Renderer(tok, True, {eos_id})
    prompt = PROMPTS[0]
    inc = r.prompt_ids(prompt) + encode(tok, "The answer")
    assert r.matches_full_render(inc, r.full_ids(prompt, ["The answer"], []), ended=False)


def test_templates_without_an_end_of_turn_token_are_refused():
    tok = bpe_tokenizer(SMOLLM2_TEMPLATE, "<|im_end|>")
    with pytest.raises(TemplateError, match="end-of-sequence"):
        Renderer(tok, True, {tok.convert_tokens_to_ids("<|eot_id|>")})


def test_plain_mode_on_the_word_level_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from verl_async.launch.tiny_model import build_tokenizer
    from verl_async.tasks.max_digit import VOCAB

    build_tokenizer(tmp_path, [*VOCAB, "wrong"])
    tok = AutoTokenizer.from_pretrained(tmp_path)
    eos_id = tok.eos_token_id
    r = Renderer(tok, False, {eos_id})
    assert not r.templated
    prompt = "max 3 7 1 ="
    obs = [[{"role": "user", "content": "wrong"}]]  # model.tiny.extra_words: [wrong]
    assert r.observation_ids(obs[0]) == encode(tok, "wrong")
    inc = episode(r, tok, prompt, ["3", "7"], obs, eos_id)
    assert inc == tok(prompt)["input_ids"] + encode(tok, "3") + [eos_id] + encode(tok, "wrong") + (
        encode(tok, "7") + [eos_id]
    )
    assert r.matches_full_render(inc, r.full_ids(prompt, ["3", "7"], obs), ended=True)
    with pytest.raises(TemplateError, match="chat template"):
        r.prompt_ids([{"role": "user", "content": "max 1 ="}])


@pytest.mark.skipif(
    not os.environ.get("VERL_ASYNC_SMOLLM2"),
    reason="opt-in: VERL_ASYNC_SMOLLM2=models/smollm2-135m",
)
def test_smollm2_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.environ["VERL_ASYNC_SMOLLM2"])
    r = Renderer(tok, True, {tok.eos_token_id})
    for prompt in PROMPTS:
        inc = episode(r, tok, prompt, TURNS, OBSERVATIONS, tok.eos_token_id)
        assert r.matches_full_render(inc, r.full_ids(prompt, TURNS, OBSERVATIONS), ended=True)
