"""``verl-async export``: a checkpoint as a Hugging Face model directory.

The checkpoint holds the full weights by Hugging Face name (``learner/model.safetensors``);
the model's config, generation config and tokenizer come from the run's initial model
(the manifest's ``model_path``, or ``<run_dir>/model`` when that directory moved with the
run). The result is a ``save_pretrained`` directory that transformers and vLLM load.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from verl_async.checkpoint import CheckpointError, newest_valid, read_manifest, step_dir, verify


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if step is None:
        found = newest_valid(run_dir)
        if found is None:
            raise CheckpointError(f"no checkpoint in {run_dir / 'checkpoints'} verifies")
        ckpt = found[0]
    else:
        ckpt = step_dir(run_dir, step)
        problems = verify(ckpt)
        if problems:
            raise CheckpointError(f"{ckpt.name} fails verification: {'; '.join(problems)}")
    manifest = read_manifest(ckpt)
    base = Path(str(manifest.meta.get("model_path", "")))
    if not (base / "config.json").is_file():
        base = run_dir / "model"
    if not (base / "config.json").is_file():
        raise CheckpointError(
            f"the run's initial model (for config and tokenizer) is gone: {manifest.meta.get('model_path')}"
        )
    state = load_file(ckpt / "learner" / "model.safetensors")
    config = AutoConfig.from_pretrained(base)
    dtype = next(iter(state.values())).dtype if state else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    with contextlib.suppress(OSError):  # the initial model may have no generation config
        GenerationConfig.from_pretrained(base).save_pretrained(out_dir)
    return ckpt, out_dir
