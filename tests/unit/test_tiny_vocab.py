"""The tiny model's vocabulary: extra words for multi-turn feedback, the default unchanged."""

import pytest

from verl_async.config_base import ConfigError
from verl_async.launch.tiny_model import _MARKER, build_tiny_model, vocabulary
from verl_async.schema import TinyModelConfig
from verl_async.tasks.max_digit import VOCAB

WORDS = ["wrong", "higher", "lower", "guess", "again"]


def test_extra_words_get_ids_after_the_default_vocabulary(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("VERL_ASYNC_CACHE", "off")
    cfg = TinyModelConfig(extra_words=[*WORDS, "wrong", "max"])  # repeats are dropped
    model = build_tiny_model(tmp_path / "m", cfg)
    tok = AutoTokenizer.from_pretrained(model)
    wrong, three = len(VOCAB), VOCAB.index("3")
    assert tok.encode("wrong 3", add_special_tokens=False) == [wrong, three]
    assert tok.decode([wrong, three]) == "wrong 3"
    assert tok.decode(tok.encode("guess = 4 higher 7 lower 5", add_special_tokens=False)) == (
        "guess = 4 higher 7 lower 5"
    )
    assert AutoConfig.from_pretrained(model).vocab_size == len(VOCAB) + len(WORDS) == len(tok)


def test_a_word_with_whitespace_names_the_key():
    for bad in ("try again", "", "tab\there"):
        with pytest.raises(ConfigError, match=r"'model\.tiny\.extra_words'"):
            vocabulary(TinyModelConfig(extra_words=["wrong", bad]))


# The marker of the default build as it was written before ``extra_words`` existed.
OLD_DEFAULT_MARKER = (
    '{"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2, '
    '"num_layers": 2, "seed": 0, "vocab": ["<pad>", "<bos>", "<eos>", "max", "=", "0", "1", '
    '"2", "3", "4", "5", "6", "7", "8", "9"]}'
)


def test_a_default_build_made_before_extra_words_existed_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_ASYNC_CACHE", "off")
    out = tmp_path / "m"
    out.mkdir()
    (out / _MARKER).write_text(OLD_DEFAULT_MARKER)
    assert build_tiny_model(out, TinyModelConfig()) == out
    assert [p.name for p in out.iterdir()] == [_MARKER]  # taken as it is: nothing built
