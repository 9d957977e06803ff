"""Placement: which devices each process gets, and what follows from that.

The one place that interprets ``placement.*`` (``config.PlacementConfig``):

- ``placement.generators``: one entry per generator engine. A string is a one-device group;
  a list of k devices is one engine over k devices. On CUDA that engine runs tensor
  parallel over the k GPUs (k vLLM workers); on CPU ('cpu:N' cores) it is one engine
  (tensor parallel size 1) whose OpenMP threads are bound to those k cores.
- ``placement.learners``: one learner rank per device (``torch.distributed.run`` starts
  them when there is more than one).
- ``placement.reward_models``: the device of each ``model`` reward source's process,
  reused round-robin.
- ``placement.teachers``: the device of each distillation teacher's process, likewise.

Every vLLM worker is a member of the weight-sync group (it receives the broadcast into
its own shard), so the group has 1 (learner rank 0) + the sum of the generators'
tensor-parallel sizes members, and generator ``index``'s workers take the ranks after
those of the generators before it.

``validate`` only looks at the config (it runs whenever a config is loaded, on any
machine); ``check_devices_exist`` looks at the machine and runs in the launcher before
anything starts. No torch import here at module level: loading a config stays instant.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import msgspec

from verl_async.config_base import ConfigError
from verl_async.schema import RunConfig

DEVICE_RE = re.compile(r"cpu(:\d+)?|cuda:\d+")


def is_cuda(device: str) -> bool:
    return device.startswith("cuda:")


def device_index(device: str) -> int | None:
    """N of 'cpu:N' or 'cuda:N'; None for unpinned 'cpu'."""
    _, sep, index = device.partition(":")
    return int(index) if sep else None


def generator_groups(cfg: RunConfig) -> list[list[str]]:
    """The device group of each generator engine (a lone device is a group of one)."""
    return [[g] if isinstance(g, str) else list(g) for g in cfg.placement.generators]


def generator_count(cfg: RunConfig) -> int:
    """Generator processes, one per group (``generators.count`` must agree, or be empty)."""
    return len(cfg.placement.generators)


def resolve_count(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``generators.count`` filled in (the launcher's resolved config.yaml
    states it, so a role reading the count gets the number, never an empty value)."""
    generators = msgspec.structs.replace(cfg.generators, count=generator_count(cfg))
    return msgspec.structs.replace(cfg, generators=generators)


def tensor_parallel_size(group: list[str]) -> int:
    """vLLM workers of the engine on ``group``: one per GPU on CUDA; on CPU the cores are
    threads of one worker, so 1."""
    return len(group) if is_cuda(group[0]) else 1


def sync_world_size(cfg: RunConfig) -> int:
    """Members of the weight-sync group: learner rank 0 plus every vLLM worker."""
    return 1 + sum(tensor_parallel_size(g) for g in generator_groups(cfg))


def sync_rank_offset(cfg: RunConfig, index: int) -> int:
    """Weight-sync rank of generator ``index``'s first worker (its worker r is offset + r)."""
    return 1 + sum(tensor_parallel_size(g) for g in generator_groups(cfg)[:index])


def shares_cores_with_learner(cfg: RunConfig, index: int) -> bool:
    """Whether generator ``index`` runs on a CPU core that a learner rank may also use
    ('cpu' is every core; 'cpu:N' is core N)."""

    def cores(device: str) -> set[int] | None:  # None: every core
        return None if device_index(device) is None else {device_index(device)}

    mine = [d for d in generator_groups(cfg)[index] if not is_cuda(d)]
    theirs = [d for d in learner_devices(cfg) if not is_cuda(d)]
    for a in mine:
        for b in theirs:
            ca, cb = cores(a), cores(b)
            if ca is None or cb is None or ca & cb:
                return True
    return False


def learner_devices(cfg: RunConfig) -> list[str]:
    """The device of each learner rank, rank order."""
    return list(cfg.placement.learners)


def reward_model_device(cfg: RunConfig, index: int) -> str:
    """Device of the ``index``-th ``model`` reward source's process (round-robin)."""
    devices = cfg.placement.reward_models
    return devices[index % len(devices)]


def teacher_device(cfg: RunConfig, index: int) -> str:
    """Device of the ``index``-th distillation teacher's process (round-robin)."""
    devices = cfg.placement.teachers
    return devices[index % len(devices)]


# --------------------------------------------------------------------- validation


def _generator_entries(cfg: RunConfig) -> Iterator[tuple[str, str]]:
    """(exact config key, device) of every generator device."""
    for i, entry in enumerate(cfg.placement.generators):
        if isinstance(entry, str):
            yield f"placement.generators.{i}", entry
        else:
            for j, device in enumerate(entry):
                yield f"placement.generators.{i}.{j}", device


def _entries(cfg: RunConfig, with_model_servers: bool = True) -> Iterator[tuple[str, str]]:
    """(exact config key, device) of every device named, generators then learners."""
    yield from _generator_entries(cfg)
    for i, device in enumerate(cfg.placement.learners):
        yield f"placement.learners.{i}", device
    if with_model_servers:
        for name in ("reward_models", "teachers"):
            for i, device in enumerate(getattr(cfg.placement, name)):
                yield f"placement.{name}.{i}", device


def validate(cfg: RunConfig) -> None:
    """Config-only placement rules (``config.check_consistency`` calls this); the first
    broken one raises a ConfigError naming its exact key."""
    p = cfg.placement
    for name in ("generators", "learners", "reward_models", "teachers"):
        if not getattr(p, name):
            raise ConfigError(f"bad value for 'placement.{name}': must not be empty")
    for key, device in _entries(cfg):
        if not DEVICE_RE.fullmatch(device):
            raise ConfigError(
                f"bad value for '{key}': '{device}' is not 'cpu', 'cpu:N' or 'cuda:N'"
            )
    for i, group in enumerate(generator_groups(cfg)):
        _check_group(f"placement.generators.{i}", group)
        if cfg.generators.engine == "hf" and tensor_parallel_size(group) > 1:
            raise ConfigError(
                f"bad value for 'placement.generators.{i}': generators.engine 'hf' runs on "
                f"one GPU, not {len(group)}; use generators.engine 'vllm' for tensor parallelism"
            )
    if len({is_cuda(d) for d in p.learners}) > 1:
        raise ConfigError(
            "bad value for 'placement.learners': learner ranks must be all CPU or all CUDA "
            f"(got {', '.join(p.learners)})"
        )
    _check_no_sharing(cfg)
    if cfg.learner.liger and not is_cuda(p.learners[0]):
        raise ConfigError(
            "bad value for 'learner.liger': Liger's kernels are Triton's and need CUDA "
            f"learners (placement.learners is {p.learners})"
        )
    count, groups = cfg.generators.count, generator_count(cfg)
    if count is not None and count != groups:
        raise ConfigError(
            f"bad value for 'generators.count': {count} disagrees with placement.generators "
            f"({groups} engine(s)); leave it out or make them agree"
        )
    ranks, rows = len(p.learners), cfg.learner.groups_per_step * cfg.generators.group_size
    if rows < ranks:
        raise ConfigError(
            f"bad value for 'placement.learners': {ranks} learner ranks but a step has only "
            f"{rows} samples (learner.groups_per_step x generators.group_size); every rank "
            "needs at least one"
        )


def _check_group(key: str, group: list[str]) -> None:
    """A group is one engine: not empty, one kind of device, cores named one by one."""
    if not group:
        raise ConfigError(f"bad value for '{key}': an empty device group")
    if len({is_cuda(d) for d in group}) > 1:
        raise ConfigError(
            f"bad value for '{key}': a group cannot mix CPU and CUDA devices ({', '.join(group)})"
        )
    if len(group) > 1 and "cpu" in group:
        raise ConfigError(
            f"bad value for '{key}': unpinned 'cpu' cannot be part of a group; name its cores "
            "as 'cpu:N'"
        )


def _colocated_gpu(cfg: RunConfig) -> str | None:
    """With ``placement.colocate``: the learner's GPU, which generators may share."""
    p = cfg.placement
    if not p.colocate:
        return None
    if len(p.learners) != 1 or not is_cuda(p.learners[0]):
        raise ConfigError(
            "bad value for 'placement.colocate': generators share the GPU of a single "
            f"CUDA learner rank (placement.learners is {p.learners})"
        )
    return p.learners[0]


def _check_no_sharing(cfg: RunConfig) -> None:
    """A pinned core or a GPU serves one generator or learner process (the placement's
    point is that they do not compete); unpinned 'cpu' may be shared, and with
    ``placement.colocate`` the learner's GPU by generators. Reward models and teachers may
    share: their lists are reused round-robin by design."""
    owner: dict[str, str] = {}
    shared = _colocated_gpu(cfg)
    for key, device in _entries(cfg, with_model_servers=False):
        if device == "cpu" or device == shared and key.startswith("placement.generators"):
            continue
        if device in owner:
            raise ConfigError(
                f"bad value for '{key}': '{device}' is already used by '{owner[device]}' "
                "(a pinned core or a GPU serves one process; only 'cpu' may be shared)"
            )
        owner[device] = key


# --------------------------------------------------------------------- this machine


def check_devices_exist(cfg: RunConfig) -> None:
    """Every 'cpu:N' is a core this process may run on and every 'cuda:N' a visible GPU;
    the launcher calls this before it starts anything (a config alone is valid anywhere)."""
    cores = os.sched_getaffinity(0)
    gpus: int | None = None  # counted on first need: it imports torch
    for key, device in _entries(cfg):
        index = device_index(device)
        if index is None:
            continue
        if not is_cuda(device) and index not in cores:
            raise ConfigError(
                f"bad value for '{key}': '{device}' is not a core of this machine "
                f"(cores {format_ids(cores)} are available)"
            )
        if is_cuda(device):
            gpus = _cuda_device_count() if gpus is None else gpus
            if index >= gpus:
                seen = f"cuda:0 to cuda:{gpus - 1} are visible" if gpus else "no GPU is visible"
                raise ConfigError(f"bad value for '{key}': '{device}' does not exist here ({seen})")


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def format_ids(ids) -> str:
    """Sorted ids as ranges: {0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
