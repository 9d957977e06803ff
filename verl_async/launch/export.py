"""``verl-async export``: a checkpoint as a Hugging Face model directory.

The checkpoint holds the full weights by Hugging Face name (``learner/model.safetensors``,
or a learner of several ranks' shards, read here without a process group);
the model's config, generation config and tokenizer come from the run's initial model
(the manifest's ``model_path``, or ``<run_dir>/model`` when that directory moved with the
run). The result is a ``save_pretrained`` directory that transformers and vLLM load. A
LoRA run's checkpoint holds the peft model (frozen base and adapter): the export merges
the adapter into the weights, and with ``--adapter DIR`` also writes it as a peft adapter
directory that peft and vLLM (``LoRARequest``) load on top of the base model.

The checkpoint is verified against its manifest before any of its files is read, and
held while it is read (``checkpoint.reading``): a run still writing checkpoints beside
the export prunes nothing meanwhile, so the files read are the files verified.

An existing non-empty output directory is refused (files of another model would stay
beside the new ones) unless ``force``; then the model is written to a temporary directory
beside it and swapped in, so the output directory never holds a mix of the two.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from verl_async import lora
from verl_async.checkpoint import (
    CheckpointError,
    Manifest,
    checkpoints_root,
    is_sharded,
    newest_valid,
    read_sharded_model,
    reading,
    require_valid,
    step_dir,
)
from verl_async.config import load_config


def export(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    force: bool = False,
    adapter_dir: str | Path | None = None,
) -> tuple[Path, Path]:
    """Write checkpoint ``step`` (default: the newest that verifies) to ``out_dir``. A LoRA
    run's adapter is merged into the base weights there; ``adapter_dir`` also gets it as a
    peft adapter directory (adapter_config.json + adapter_model.safetensors)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    check_out_dir(out_dir, force)
    if adapter_dir is not None:
        check_out_dir(Path(adapter_dir), force)
    if not checkpoints_root(run_dir).is_dir():
        raise CheckpointError(f"'{run_dir}' holds no checkpoints (no checkpoints/ directory)")
    with reading(run_dir):  # a live run's writer leaves the checkpoint where it is
        ckpt, manifest = _chosen(run_dir, step)
        base = _base_model(run_dir, manifest)
        tmp = _beside(out_dir, "export")
        tmp.mkdir(parents=True)
        try:
            _write_model(ckpt, base, tmp, run_dir, adapter_dir)
            swap_in(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already unless the write failed
    return ckpt, out_dir


def _chosen(run_dir: Path, step: int | None) -> tuple[Path, Manifest]:
    """Checkpoint ``step`` of the run (default: the newest that verifies), verified."""
    if step is None:
        found = newest_valid(run_dir)
        if found is None:
            raise CheckpointError(f"no checkpoint in {run_dir / 'checkpoints'} verifies")
        return found
    ckpt = step_dir(run_dir, step)
    return ckpt, require_valid(ckpt)


def _base_model(run_dir: Path, manifest: Manifest) -> Path:
    """The run's initial model (config and tokenizer): where the manifest says, or
    ``<run_dir>/model`` when that directory moved with the run."""
    base = Path(str(manifest.meta.get("model_path", "")))
    if not (base / "config.json").is_file():
        base = run_dir / "model"
    if not (base / "config.json").is_file():
        raise CheckpointError(
            f"the run's initial model (for config and tokenizer) is gone: {manifest.meta.get('model_path')}"
        )
    return base


def check_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse an output path that holds anything, unless ``force``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"'{out_dir}' exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise CheckpointError(
            f"'{out_dir}' exists and is not empty; choose another directory, or pass --force "
            "to replace it"
        )


def swap_in(new: Path, out_dir: Path) -> None:
    """Put directory ``new`` in the place of ``out_dir`` (both on one file system). An old
    ``out_dir`` is renamed aside first and deleted last: at every instant ``out_dir`` is
    the old directory, absent, or the complete new one, never a mix."""
    old = _beside(out_dir, "old") if out_dir.exists() else None
    if old is not None:
        os.rename(out_dir, old)
    try:
        os.rename(new, out_dir)
    except OSError:
        if old is not None:
            os.rename(old, out_dir)  # put the old one back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _beside(out_dir: Path, what: str) -> Path:
    """A fresh hidden path next to ``out_dir`` (same file system, so renames are atomic)."""
    path = out_dir.parent / f".{out_dir.name}.{what}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)  # left by a crashed export with the same pid
    return path


def _load(model, state: dict) -> None:
    """A strict load; shards hold a tied tensor once (an output head sharing the input
    embedding), so its other names get it back first."""
    from verl_async.weight_sync import with_tied

    model.load_state_dict(with_tied(model, state), strict=True)


def _write_model(
    ckpt: Path, base: Path, out_dir: Path, run_dir: Path, adapter_dir: str | Path | None
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if is_sharded(ckpt):  # written by several learner ranks
        state = read_sharded_model(ckpt)
    else:
        state = load_file(ckpt / "learner" / "model.safetensors")
    config = AutoConfig.from_pretrained(base)
    dtype = next(iter(state.values())).dtype if state else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = lora.adapter_state(state)
    if adapter:  # a LoRA run: its peft model's state, merged into plain weights
        lora_cfg = load_config(run_dir / "config.yaml").model.lora
        model = lora.apply(model, lora_cfg)
        _load(model, state)
        if adapter_dir is not None:
            tmp = _beside(Path(adapter_dir), "export")
            lora.write_adapter_dir(tmp, adapter, lora_cfg, str(base))
            swap_in(tmp, Path(adapter_dir))
        model = model.merge_and_unload()
    elif adapter_dir is not None:
        raise CheckpointError(f"{ckpt.name} holds no LoRA adapter (the run trained every weight)")
    else:
        _load(model, state)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base).save_pretrained(out_dir)
    with contextlib.suppress(OSError):  # the initial model may have no generation config
        GenerationConfig.from_pretrained(base).save_pretrained(out_dir)
