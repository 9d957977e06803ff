"""What a run needs on disk before its roles start: paths made absolute and checked, the
prompt files read once, the tiny model built when no ``model.path`` is given, and the
resolved ``config.yaml`` and ``endpoints.json`` written into the run directory (every role
reads both, so no config field is filled in after validation).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from verl_async import placement
from verl_async.config import ConfigError, to_yaml
from verl_async.launch.run_dir import RoleFailed, resolve_data_paths
from verl_async.reward_config import ModelReward
from verl_async.runtime import Endpoints, free_port, write_endpoints
from verl_async.schema import RunConfig


def model_dir(key: str, value: str) -> str:
    """``value`` (the config key ``key``) as an absolute path to a Hugging Face model
    directory; a ``ConfigError`` naming the key if it holds no config.json."""
    path = Path(value).resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"bad value for '{key}': '{path}' is not a Hugging Face model directory "
            "(no config.json)"
        )
    return str(path)


def resolve_reward_models(cfg: RunConfig) -> RunConfig:
    """Reward-model directories made absolute, each checked to be a model directory."""
    sources = []
    for i, src in enumerate(cfg.rewards.sources):
        if isinstance(src, ModelReward):
            src = msgspec.structs.replace(
                src, path=model_dir(f"rewards.sources.{i}.path", src.path)
            )
        sources.append(src)
    return msgspec.structs.replace(
        cfg, rewards=msgspec.structs.replace(cfg.rewards, sources=sources)
    )


def resolve_learner_models(cfg: RunConfig) -> RunConfig:
    """``critic.path`` and ``algo.kl.ref_path`` made absolute, each checked (when set and
    used) to be a model directory."""
    resolve = lambda key, value: model_dir(key, value) if value else value  # noqa: E731
    algo, critic = cfg.algo, cfg.critic
    if algo.adv_estimator == "gae":
        critic = msgspec.structs.replace(critic, path=resolve("critic.path", critic.path))
    if algo.uses_reference:
        kl = msgspec.structs.replace(
            algo.kl, ref_path=resolve("algo.kl.ref_path", algo.kl.ref_path)
        )
        algo = msgspec.structs.replace(algo, kl=kl)
    return msgspec.structs.replace(cfg, algo=algo, critic=critic)


def resolve_teachers(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """Each distillation teacher's ``path`` made absolute and checked, or (empty) the tiny
    teacher built into ``<run_dir>/teachers/<name>`` and its path filled in."""
    if not cfg.distillation.enabled:
        return cfg
    from verl_async.launch.tiny_model import build_tiny_model

    teachers = []
    for i, teacher in enumerate(cfg.distillation.teachers):
        if teacher.path:
            path = model_dir(f"distillation.teachers[{i}].path", teacher.path)
        else:
            path = str(build_tiny_model(run_dir / "teachers" / teacher.name, teacher.tiny))
        teachers.append(msgspec.structs.replace(teacher, path=path))
    distillation = msgspec.structs.replace(cfg.distillation, teachers=teachers)
    return msgspec.structs.replace(cfg, distillation=distillation)


def check_data(cfg: RunConfig) -> None:
    """Read the prompt files: a missing, empty or malformed file (or a missing column) is a
    ``ConfigError`` naming the key, the file and the line; so is a file none of whose
    prompts fits the run's prompt length limit, naming the key that set the limit
    (``prompt_fit``)."""
    from verl_async.data import load_prompts
    from verl_async.launch.prompt_fit import check_prompt_fit

    data = resolve_data_paths(cfg.data)
    prompts = {f"data.path ({data.path})": load_prompts(data.path)}
    if data.val_path:
        prompts[f"data.val_path ({data.val_path})"] = load_prompts(data.val_path, "data.val_path")
    check_prompt_fit(cfg, prompts)
    if cfg.distillation.enabled:  # every trained prompt's source has its teacher
        for source in sorted({p.data_source for p in prompts[f"data.path ({data.path})"]}):
            cfg.distillation.teacher_of(source)


def check_loss_mode(cfg: RunConfig) -> None:
    """``algo.loss_mode`` names a loss: a registered mode, or a function that imports; else a
    ``ConfigError`` naming the key, before any role starts. The losses need torch, so this
    runs after the config is parsed (the default mode needs no check)."""
    if cfg.algo.loss_mode != "vanilla":
        from verl_async.algos import get_policy_loss

        get_policy_loss(cfg.algo.loss_mode)


def prepare(
    cfg: RunConfig, run_dir: Path, resume_from: Path | None = None, data_checked: bool = False
) -> Endpoints:
    """Resolve paths, check the data (unless ``data_checked``), build the tiny model if
    asked, write config.yaml and endpoints.json."""
    cfg = msgspec.structs.replace(cfg, data=resolve_data_paths(cfg.data))
    cfg = resolve_reward_models(cfg)
    cfg = resolve_learner_models(cfg)
    cfg = resolve_teachers(cfg, run_dir)
    cfg = placement.resolve_count(cfg)
    if not data_checked:
        check_data(cfg)
    if cfg.model.path:
        model_path = Path(cfg.model.path).resolve()
        if not (model_path / "config.json").is_file():
            raise RoleFailed(
                f"model.path '{model_path}' is not a Hugging Face model directory (no config.json)"
            )
    else:
        from verl_async.launch.tiny_model import build_tiny_model

        model_path = build_tiny_model(run_dir / "model", cfg.model.tiny)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    host = cfg.buffer.host
    endpoints = Endpoints(
        buffer=f"tcp://{host}:{cfg.buffer.port or free_port(host)}",
        weights_host=cfg.weights.host or host,
        weights_port=cfg.weights.port or free_port(cfg.weights.host or host),
        model_path=str(model_path),
        resume_from=str(resume_from or ""),
        reward_models={
            src.name: f"tcp://{host}:{free_port(host)}"
            for src in cfg.rewards.sources
            if isinstance(src, ModelReward)
        },
        teachers={t.name: f"tcp://{host}:{free_port(host)}" for t in cfg.distillation.processes},
    )
    write_endpoints(run_dir, endpoints)
    return endpoints
