"""LoRA adapters (``model.lora``): the same adapter on the learner and in every generator.

The learner wraps its model with peft's LoRA before any sharding and trains only the
adapter; the base stays frozen. A weight update then carries the adapter alone, by the
names of peft's saved format (``adapter_model.safetensors``: no adapter name inside, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so a generator can
copy it into its own peft model or write it as an adapter directory for vLLM.

``lora_B`` starts at zero, so every process's model at version 0 is the base model,
whatever ``lora_A``'s random start: generators need no initial adapter.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch

ADAPTER = "default"  # peft's name for the one adapter


def enabled(cfg) -> bool:
    """Whether the run trains LoRA adapters (``model.lora.rank`` > 0)."""
    return cfg.model.lora.rank > 0


def peft_config(lora):
    """peft's ``LoraConfig`` of a ``model.lora`` section."""
    from peft import LoraConfig

    modules = lora.target_modules
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if modules == ["all-linear"] else list(modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply(model, lora):
    """``model`` with LoRA adapters (peft ``PeftModel``), only their weights trainable.

    An unknown module name fails here, naming the key."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_config(lora))
    except ValueError as exc:
        raise ValueError(f"model.lora.target_modules {lora.target_modules}: {exc}") from exc


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def saved_name(name: str) -> str:
    """A peft model's state-dict name -> the name peft saves it under (adapter name out)."""
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(
        f".lora_B.{ADAPTER}.", ".lora_B."
    )


def model_name(name: str) -> str:
    """The inverse of ``saved_name``: the name in a peft model's state dict."""
    return name.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(
        ".lora_B.", f".lora_B.{ADAPTER}."
    )


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a peft model's state dict, by their saved names."""
    return {saved_name(n): t for n, t in state.items() if is_adapter(n)}


def load_adapter(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (saved names) into a peft model's own, in place; a name the
    model lacks, or a missing one, is an error (a partial adapter would mix versions)."""
    own = dict(model.named_parameters())
    names = {model_name(n) for n in tensors}
    missing = sorted(n for n in own if is_adapter(n) and n not in names)
    unknown = sorted(n for n in names if n not in own)
    if missing or unknown:
        raise ValueError(
            f"adapter does not match the model: missing {missing[:3]}, unknown {unknown[:3]}"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = own[model_name(name)]
            param.copy_(tensor.to(param.dtype))


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user may enter (0700 whatever the umask), made
    if missing. In a directory anyone may write (``/dev/shm``, ``/tmp``) another user could
    make the name first and then swap the files a reader loads: a ``PermissionError``
    when it exists and is not a directory of this user's closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"'{path}' exists and is not a private directory of this user "
            f"(mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}): refusing to write there"
        )
    return path


def write_adapter_dir(path: Path, tensors: dict[str, torch.Tensor], lora, base_path: str) -> Path:
    """A peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
    that peft and vLLM load."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora).to_dict()
    config["base_model_name_or_path"] = base_path
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1, default=str))
    save_file(
        {n: t.detach().contiguous().cpu() for n, t in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
    return path
