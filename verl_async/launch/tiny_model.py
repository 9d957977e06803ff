"""Build the tiny default model locally: a random Llama and a word-level tokenizer.

Nothing is downloaded: the config is initialised at random with a fixed seed and written
with ``save_pretrained`` next to a ``tokenizers`` WordLevel tokenizer, so transformers and
vLLM load the directory like any Hugging Face checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from verl_async.config_base import ConfigError
from verl_async.schema import TinyModelConfig
from verl_async.tasks.max_digit import VOCAB

_MARKER = "verl_async_tiny.json"
_CACHE_FORMAT = 1  # bump when a build of the same config would differ


def vocabulary(cfg: TinyModelConfig) -> list[str]:
    """``VOCAB`` and then ``cfg.extra_words`` not already in it, in order; a word that
    holds whitespace (the tokenizer splits words at whitespace) raises ConfigError."""
    words = list(VOCAB)
    for word in cfg.extra_words:
        if not word or any(c.isspace() for c in word):
            raise ConfigError(
                f"bad value for 'model.tiny.extra_words': {word!r} is not one word "
                "(empty, or holds whitespace)"
            )
        if word not in words:
            words.append(word)
    return words


def tiny_tokenizer(words: list[str] = VOCAB):
    """The word-level ``tokenizers.Tokenizer`` over ``words`` (ids in list order) that
    ``build_tokenizer`` saves: without transformers, so the launcher counts a prompt's
    tokens in milliseconds (``prompt_fit``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return tok


def tiny_fast_tokenizer(words: list[str] = VOCAB):
    """``tiny_tokenizer`` as transformers' tokenizer, what ``build_tokenizer`` saves."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(words),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
    )


def build_tokenizer(out_dir: Path, words: list[str] = VOCAB) -> None:
    """A word-level tokenizer over ``words`` (ids in list order; the tiny model's default
    vocabulary if not given) into ``out_dir``."""
    tiny_fast_tokenizer(words).save_pretrained(out_dir)


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig) -> Path:
    """Write the tiny model to ``out_dir`` unless the same one is already there; a copy
    of an identical build in the cache (``cache_dir``) saves importing torch."""
    out_dir = Path(out_dir)
    words = vocabulary(cfg)
    # The extra words are part of "vocab": without them the marker (and the cache key) is
    # the one builds had before the option existed, so their copies are used as they are.
    shape = {k: v for k, v in _as_dict(cfg).items() if k != "extra_words"}
    wanted = json.dumps({"vocab": words, **shape}, sort_keys=True)
    marker = out_dir / _MARKER
    if marker.is_file() and marker.read_text() == wanted:
        return out_dir
    cached = cache_dir(wanted)
    if cached is not None and (cached / _MARKER).is_file():
        _copy(cached, out_dir)
        return out_dir
    _build(out_dir, cfg, words, wanted)
    if cached is not None:
        _store(out_dir, cached)
    return out_dir


def cache_dir(wanted: str) -> Path | None:
    """Where a build of ``wanted`` is kept: ``$VERL_ASYNC_CACHE`` (default
    ~/.cache/verl-async) / tiny / a hash of the config and the torch and transformers
    versions that built it; None when VERL_ASYNC_CACHE=off."""
    from importlib.metadata import version

    base = os.environ.get("VERL_ASYNC_CACHE", str(Path.home() / ".cache" / "verl-async"))
    if base == "off":
        return None
    key = f"{_CACHE_FORMAT}|{wanted}|{version('torch')}|{version('transformers')}"
    return Path(base) / "tiny" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _copy(src: Path, out_dir: Path) -> None:
    """The cached files, the marker last (an interrupted copy is built again next time)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir(), key=lambda f: f.name == _MARKER):
        shutil.copy2(f, out_dir / f.name)


def _store(built: Path, cached: Path) -> None:
    """Keep a copy of ``built`` as ``cached``: written aside, then renamed into place."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".build-"))
    except OSError:
        return  # a cache that cannot be written is skipped
    try:
        _copy(built, tmp)
        os.replace(tmp, cached)
    except OSError:  # another run stored it meanwhile, or the disk is full
        shutil.rmtree(tmp, ignore_errors=True)


def _build(out_dir: Path, cfg: TinyModelConfig, words: list[str], wanted: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = out_dir / _MARKER
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=VOCAB.index("<bos>"),
        eos_token_id=VOCAB.index("<eos>"),
        pad_token_id=VOCAB.index("<pad>"),
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir, words)
    marker.write_text(wanted)


def _as_dict(cfg: TinyModelConfig) -> dict:
    import msgspec

    return msgspec.to_builtins(cfg)
