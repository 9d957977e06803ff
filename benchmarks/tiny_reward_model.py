"""Build a tiny reward model locally: a random ``LlamaForSequenceClassification`` (one
output) with the tiny policy's word-level tokenizer and a chat template.

Nothing is downloaded. The tokenizer only knows ``VOCAB`` of the max-digit task (digits,
"max", "=", special tokens); an unknown word becomes ``<pad>`` (the tokenizer's unk), so
the chat template joins message contents only, never role names. A second call with the
same arguments reuses the directory (marker file, as in ``tiny_model.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_async.launch.tiny_model import build_tokenizer
from verl_async.tasks.max_digit import VOCAB

_MARKER = "verl_async_tiny_rm.json"
# Message contents joined by spaces after <bos>: every word of it is in VOCAB.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "mlp": 128}


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny reward model to ``out_dir`` unless the same one is already there."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out_dir = Path(out_dir)
    wanted = json.dumps(
        {"vocab": VOCAB, "template": CHAT_TEMPLATE, "seed": seed, **_SHAPE}, sort_keys=True
    )
    marker = out_dir / _MARKER
    if marker.is_file() and marker.read_text() == wanted:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=_SHAPE["hidden_size"],
        intermediate_size=_SHAPE["mlp"],
        num_hidden_layers=_SHAPE["num_layers"],
        num_attention_heads=_SHAPE["num_heads"],
        num_key_value_heads=_SHAPE["num_kv_heads"],
        head_dim=_SHAPE["hidden_size"] // _SHAPE["num_heads"],
        max_position_embeddings=256,
        num_labels=1,
        bos_token_id=VOCAB.index("<bos>"),
        eos_token_id=VOCAB.index("<eos>"),
        # Set so that the classification head pools the last non-pad token of padded rows.
        pad_token_id=VOCAB.index("<pad>"),
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config).to(torch.float32)
    with torch.no_grad():
        # The default init (std 0.02) gives scores of ~1e-2 that all look alike; std
        # 1/sqrt(hidden) over unit-scale normed states gives scores of order 1, so tests
        # comparing scores of different conversations compare something.
        model.score.weight.normal_(0.0, config.hidden_size**-0.5)
    model.save_pretrained(out_dir)
    _write_tokenizer(out_dir)
    marker.write_text(wanted)
    return out_dir


def _write_tokenizer(out_dir: Path) -> None:
    from transformers import AutoTokenizer

    build_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
