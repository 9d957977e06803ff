"""Typed run configuration: YAML file + ``dotted.key=value`` overrides.

Every field has a type, bounds where they matter, and a docstring right under it.
Unknown keys and bad values fail with one line naming the key (``ConfigError``).
This module imports neither torch nor vLLM so that ``verl-async --help`` stays instant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TinyModelConfig(_Section):
    hidden_size: PosInt = 128
    """Width of the tiny model built when ``model.path`` is empty."""
    num_layers: PosInt = 2
    """Decoder layers of the tiny model."""
    num_heads: PosInt = 4
    """Attention heads; hidden_size / num_heads must be >= 32 (vLLM CPU kernels)."""
    num_kv_heads: PosInt = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: PosInt = 256
    """MLP width of the tiny model."""
    seed: int = 0
    """Seed of the random initialisation (same seed -> same weights)."""


class ModelConfig(_Section):
    path: str = ""
    """Hugging Face model directory. Empty: build the tiny model into ``<run_dir>/model``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype in generators and learner (float32 on CPUs without AVX-512)."""
    tiny: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
    """Shape of the locally built tiny model."""


class DataConfig(_Section):
    task: Literal["max_digit"] = "max_digit"
    """Task: prompt formatting and the 0-1 reward (see verl_async/tasks)."""
    path: str = "configs/data/max_digit.jsonl"
    """Prompt file (JSONL or Parquet) with ``prompt`` and ``answer`` columns; relative paths are from the working directory."""
    shuffle_seed: int = 0
    """Seed of the per-epoch prompt order."""


class BufferConfig(_Section):
    host: str = "127.0.0.1"
    """Address the buffer binds (loopback by default; anything else requires CurveZMQ keys)."""
    port: Port = 0
    """Buffer port; 0 picks a free one."""
    request_timeout_s: PosFloat = 60.0
    """A client gives up on the buffer (and says so) after this long without a reply."""


class GeneratorConfig(_Section):
    count: PosInt = 1
    """Number of generator processes (one vLLM engine each)."""
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8
    """Samples per prompt (the GRPO group)."""
    max_new_tokens: PosInt = 6
    """Generation length cap."""
    temperature: PosFloat = 1.0
    """Sampling temperature (1.0 keeps behaviour logprobs comparable to the learner's)."""
    max_inflight_groups: PosInt = 8
    """Prompt groups a generator keeps in its engine at once (continuous batching depth)."""
    kv_cache_mb: PosInt = 64
    """KV-cache size per engine, MiB."""
    max_model_len: PosInt = 64
    """Longest prompt + response the engine accepts."""
    gpu_memory_utilization: Fraction = 0.5
    """Fraction of GPU memory vLLM may take (GPU only)."""


class LearnerConfig(_Section):
    num_processes: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    """Learner ranks. Only 1 for now: the launcher does not start multi-rank jobs yet."""
    lr: PosFloat = 5e-4
    """AdamW learning rate."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """AdamW weight decay."""
    grad_clip: PosFloat = 1.0
    """Max gradient norm."""
    groups_per_step: PosInt = 8
    """Prompt groups per learner step (B in DESIGN.md's admission rule)."""
    prefetch: bool = True
    """Fetch the next batch in a background thread while the current step trains."""
    seed: int = 0
    """Torch seed of the learner."""
    warmup_steps: NonNegInt = 0
    """Linear learning-rate warm-up over this many steps, then constant (0: constant from the start)."""


class AlgoConfig(_Section):
    correction: Literal["none", "tis", "decoupled"] = "decoupled"
    """Off-policy correction: none (pi/pi_behav), tis (truncated pi_prox/pi_behav), decoupled (AReaL)."""
    clip_eps: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2
    """PPO ratio clip epsilon: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Upper clip epsilon (DAPO's clip-higher); empty means equal to clip_eps."""
    is_cap: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    """Cap of the behaviour importance weight pi_prox/pi_behav (tis: truncated; decoupled: masked above)."""
    minibatches: PosInt = 2
    """Optimizer steps per batch (the batch is split into this many minibatches)."""
    normalize_adv_std: bool = True
    """Divide group-relative advantages by the group std (GRPO); false gives Dr. GRPO."""


class StalenessConfig(_Section):
    max: NonNegInt = 2
    """eta: no sample older than this many versions ever enters a gradient step; 0 = synchronous."""


class WeightsConfig(_Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Weight-sync backend: auto = nccl with CUDA, gloo otherwise."""
    mode: Literal["keep", "abort"] = "keep"
    """In-flight requests at a swap. keep: pause with requests and their KV cache kept, swap,
    resume (a prefix computed by the old weights is attended to by the new ones). abort: abort
    them and resubmit prompt + tokens so far, so the new weights re-read the prefix (costs a
    re-prefill). Either way every token carries the version that sampled it."""
    bucket_mb: PosInt = 64
    """Weights are broadcast in packed buckets of this size."""
    overlap: bool = True
    """Broadcast in a background thread while the next step trains (holds one packed copy
    of the weights); false broadcasts bucket by bucket inside the step (one bucket)."""
    timeout_s: PosFloat = 120.0
    """No side waits longer than this for one weight update."""
    join_timeout_s: PosFloat = 600.0
    """How long the learner waits for every generator's engine to start and join the group."""
    port: Port = 0
    """TCPStore port of the weight-sync group; 0 picks a free one."""


class PlacementConfig(_Section):
    generator_devices: list[str] = msgspec.field(default_factory=lambda: ["cpu:0"])
    """Device of each generator: 'cpu', 'cpu:N' (pin to core N) or 'cuda:N'; reused round-robin."""
    learner_devices: list[str] = msgspec.field(default_factory=lambda: ["cpu:1"])
    """Device of each learner rank, same forms as generator_devices."""


class TrainerConfig(_Section):
    total_steps: PosInt = 400
    """Learner steps (= weight publications) in the run."""
    log_every: PosInt = 1
    """Progress line every N steps (metrics.jsonl gets every step)."""
    prefill_steps: NonNegInt = 0
    """Benchmarks: the learner waits until this many steps of groups are in the buffer before
    its first step, so generation and training are each timed alone. Needs
    staleness.max >= prefill_steps - 1 (the groups are all generated by version 0)."""


class CheckpointConfig(_Section):
    every_steps: NonNegInt = 0
    """Snapshot learner and buffer after every N-th step (0: never). The snapshot goes to host
    memory at the step barrier and a background writer persists it while training goes on."""
    keep_last: PosInt = 2
    """Committed checkpoints kept in ``<run_dir>/checkpoints``; older ones are deleted."""
    resume: bool = False
    """With ``--run-dir``: resume that run from its newest valid checkpoint if it has one,
    start it if the directory holds no run yet (the same command restarts a preempted job)."""
    write_timeout_s: PosFloat = 300.0
    """Longest wait for the previous checkpoint write before the next snapshot, or at exit."""


class RunConfig(_Section):
    name: str = "run"
    """Run name; the default run directory is runs/<name>-<timestamp>."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    generators: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)


_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")


def _explain(err: msgspec.ValidationError) -> str:
    """Turn msgspec's message into 'key: problem' with a dotted key."""
    msg = str(err)
    match = _PATH_RE.search(msg)
    where = match.group(1) if match else ""
    what = _PATH_RE.sub("", msg)
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"unknown config key '{key}'"
    where = re.sub(r"\[(\d+)\]", r".\1", where) or "<root>"
    return f"bad value for '{where}': {what[0].lower()}{what[1:]}"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'staleness.max=2'`` -> ``('staleness.max', 2)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"override '{text}' is not of the form dotted.key=value")
    try:
        return key, yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{key}': value is not valid YAML ({exc})") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read ``path`` (or defaults when None), apply overrides, validate, return the config."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
        tree = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    try:
        # strict=False: YAML 1.1 reads "1e-3" as a string; accept numeric strings for numbers.
        cfg = msgspec.convert(tree, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc)) from None
    check_consistency(cfg)
    return cfg


def check_consistency(cfg: RunConfig) -> None:
    """Cross-field rules that a single field's bounds cannot express."""
    tiny = cfg.model.tiny
    if tiny.hidden_size % tiny.num_heads or tiny.hidden_size // tiny.num_heads < 32:
        raise ConfigError(
            "bad value for 'model.tiny.num_heads': hidden_size / num_heads must be an "
            "integer >= 32 (vLLM's CPU attention kernels)"
        )
    if tiny.num_heads % tiny.num_kv_heads:
        raise ConfigError("bad value for 'model.tiny.num_kv_heads': must divide num_heads")
    if not cfg.placement.generator_devices or not cfg.placement.learner_devices:
        raise ConfigError("bad value for 'placement': device lists must not be empty")
    for key, devices in (
        ("placement.generator_devices", cfg.placement.generator_devices),
        ("placement.learner_devices", cfg.placement.learner_devices),
    ):
        for dev in devices:
            if not re.fullmatch(r"cpu(:\d+)?|cuda:\d+", dev):
                raise ConfigError(
                    f"bad value for '{key}': '{dev}' is not 'cpu', 'cpu:N' or 'cuda:N'"
                )
    if cfg.trainer.prefill_steps > min(cfg.staleness.max + 1, cfg.trainer.total_steps):
        raise ConfigError(
            "bad value for 'trainer.prefill_steps': at most staleness.max + 1 and "
            "trainer.total_steps (admission would never let the buffer fill that far)"
        )
    if cfg.buffer.host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(
            "bad value for 'buffer.host': only loopback is supported until CurveZMQ "
            "authentication lands; run multi-node jobs through an SSH tunnel for now"
        )


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run directory's config.yaml holds)."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)
