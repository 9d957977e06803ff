"""Load a run configuration: YAML file + ``dotted.key=value`` overrides, validated.

The schema is ``schema.py``. Unknown keys and bad values fail with one line naming the key
(``ConfigError``); ``check_consistency`` adds the rules that span several sections
(placement, loggers, reward sources, endpoints and keys). This module imports neither torch
nor vLLM so that ``verl-async --help`` stays instant.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec
import yaml

from verl_async import placement
from verl_async.algos.correction.settings import SettingError
from verl_async.config_base import IMPORT_SPEC, ConfigError
from verl_async.envs.base import check_environments
from verl_async.loggers import check_loggers
from verl_async.reward_config import check_rewards
from verl_async.schema import AlgoConfig, BufferConfig, RunConfig

_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")


def _explain(err: msgspec.ValidationError) -> str:
    """Turn msgspec's message into 'key: problem' with a dotted key; a key with a fixed set
    of values (a Literal, or the ``kind`` tag of a reward source) lists them."""
    msg = str(err)
    match = _PATH_RE.search(msg)
    where = match.group(1) if match else ""
    what = _PATH_RE.sub("", msg)
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    where = re.sub(r"\[(\d+)\]", r".\1", where)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"unknown config key '{key}'"
    where = where or "<root>"
    what = f"{what[0].lower()}{what[1:]}"
    choices = _choices(RunConfig, where.split("."))
    if choices:
        given = re.fullmatch(r"invalid (?:enum )?value (.+)", what)
        what = f"{given.group(1)} is not one of them" if given else what
        listed = ", ".join(repr(c) for c in choices)
        return f"bad value for '{where}': must be one of {listed} ({what})"
    return f"bad value for '{where}': {what}"


def _choices(tp: Any, parts: list[str]) -> tuple | None:
    """The values allowed at the dotted path ``parts`` below type ``tp``, in the order the
    type declares them, if they are a fixed set; else None."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _choices(args[0], parts)
    if origin in (Union, UnionType):
        members = [a for a in args if a is not type(None)]
        tags = [getattr(getattr(a, "__struct_config__", None), "tag_field", None) for a in members]
        if len(parts) == 1 and tags and all(t == parts[0] for t in tags):
            return tuple(a.__struct_config__.tag for a in members)  # a tagged union's tag
        return next((c for c in (_choices(a, parts) for a in members) if c), None)
    if not parts:
        return args if origin is Literal else None
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        field = get_type_hints(tp, include_extras=True).get(parts[0])
        return _choices(field, parts[1:]) if field is not None else None
    if origin is list and parts[0].isdigit():
        return _choices(args[0], parts[1:])
    return None


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
    placement.validate(cfg)
    check_loggers(cfg.trainer.loggers)
    check_rewards(cfg.rewards, cfg.generators.max_new_tokens)
    check_filter_groups(cfg)
    check_gdpo(cfg)
    check_ipv4("weights.host", cfg.weights.host)
    if cfg.weights.host and not is_loopback(cfg.weights.host) and not cfg.weights.port:
        raise ConfigError(
            "bad value for 'weights.port': set it when weights.host names another machine "
            "(a free port there cannot be picked from here)"
        )
    g = cfg.generators
    if (
        cfg.data.max_prompt_length
        and cfg.data.max_prompt_length + g.max_new_tokens > g.max_model_len
    ):
        raise ConfigError(
            "bad value for 'data.max_prompt_length': plus generators.max_new_tokens it exceeds "
            f"generators.max_model_len ({g.max_model_len})"
        )
    check_lora(cfg)
    check_loss_mode(cfg.algo)
    check_rollout_correction(cfg.algo)
    check_distillation(cfg)
    mt = cfg.multiturn
    check_environments(mt)
    if mt.has_episodes and mt.max_episode_tokens > g.max_model_len:
        raise ConfigError(
            "bad value for 'multiturn.max_episode_tokens': an episode must fit the engine's "
            f"generators.max_model_len ({g.max_model_len})"
        )
    if (
        mt.has_episodes
        and cfg.data.max_prompt_length
        and cfg.data.max_prompt_length + g.max_new_tokens > mt.max_episode_tokens
    ):
        raise ConfigError(
            "bad value for 'data.max_prompt_length': plus generators.max_new_tokens it exceeds "
            f"multiturn.max_episode_tokens ({mt.max_episode_tokens}); an episode's prompt must "
            "leave room for its first turn"
        )
    limit = prompt_limit(cfg)
    if limit.tokens < 1:
        raise limit.too_low()
    if cfg.eval.every_steps and not cfg.data.val_path:
        raise ConfigError("bad value for 'eval.every_steps': evaluation needs data.val_path")
    check_endpoints(cfg.buffer, cfg.weights.host)
    if cfg.ray.address.startswith("ray://"):
        raise ConfigError(
            "bad value for 'ray.address': Ray Client (ray://) is not supported; run "
            "`verl-async train` on a node of the cluster with ray.address=auto"
        )


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens a prompt may have after the chat template (longer ones are skipped),
    and the config key whose value set it."""

    tokens: int
    key: str
    value: int  # the value of ``key``
    max_new_tokens: int  # what a response (a first turn) takes of ``value``

    def too_low(self, what: str = "", shortest: int | None = None) -> ConfigError:
        """The error when no prompt of ``what`` (``key (file)``; every prompt when empty)
        fits, ``shortest`` tokens long, naming the key and what to set it to."""
        prompts = f"every prompt of {what}" if what else "every prompt"
        if self.key == "data.max_prompt_length":
            need = shortest or self.tokens + 1
            return ConfigError(
                f"bad value for '{self.key}': {prompts} is longer than its {self.tokens} "
                f"tokens (the shortest has {need}); raise it to at least {need}, or set 0 "
                "for what generators.max_model_len leaves"
            )
        room = (
            f"leaves {self.tokens} tokens for a prompt"
            if self.tokens > 0
            else "leaves no room for a prompt"
        )
        longer = f", and {prompts} is longer (the shortest has {shortest})" if shortest else ""
        need = self.max_new_tokens + (shortest or 1)
        return ConfigError(
            f"bad value for '{self.key}': {self.value} minus generators.max_new_tokens "
            f"({self.max_new_tokens}) {room}{longer}; raise {self.key} to at least {need}, "
            "or lower generators.max_new_tokens"
        )


def prompt_limit(cfg: RunConfig) -> PromptLimit:
    """``data.max_prompt_length``, or (0 there) what ``generators.max_model_len`` leaves
    for a prompt and one response of ``generators.max_new_tokens``: with environments,
    what ``multiturn.max_episode_tokens`` leaves for a prompt and its first turn, if that
    is less (one limit for every prompt of the run, single-turn ones included)."""
    g, mt = cfg.generators, cfg.multiturn
    if cfg.data.max_prompt_length:
        n = cfg.data.max_prompt_length
        return PromptLimit(n, "data.max_prompt_length", n, g.max_new_tokens)
    key, room = "generators.max_model_len", g.max_model_len
    if mt.environments and mt.max_episode_tokens <= room:
        key, room = "multiturn.max_episode_tokens", mt.max_episode_tokens
    return PromptLimit(room - g.max_new_tokens, key, room, g.max_new_tokens)


LOSS_MODE_NAME = re.compile(r"^[A-Za-z_]\w*$")


def check_loss_mode(algo: AlgoConfig) -> None:
    """``algo.loss_mode``'s form (a name, or package.module:function) and the settings a mode
    needs; the name itself is resolved when the learner starts (the losses need torch)."""
    if not (LOSS_MODE_NAME.match(algo.loss_mode) or IMPORT_SPEC.match(algo.loss_mode)):
        raise ConfigError(
            f"bad value for 'algo.loss_mode': '{algo.loss_mode}' is neither a loss mode's name "
            "nor of the form package.module:function"
        )
    if algo.loss_mode == "dro" and algo.dro_beta is None:
        raise ConfigError("bad value for 'algo.dro_beta': loss_mode dro needs a value > 0")
    if algo.clip_cov_lb >= algo.clip_cov_ub:
        raise ConfigError("bad value for 'algo.clip_cov_ub': must exceed algo.clip_cov_lb")


TEACHER_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # part of a metric's name


def check_distillation(cfg: RunConfig) -> None:
    """``distillation``: teachers named once each, every data source served by at most one
    (and at most one serving the rest), a tiny teacher only beside the tiny student, and a
    loss mode the learner runs as configured."""
    d = cfg.distillation
    if not d.enabled:
        return
    if not d.teachers:
        raise ConfigError("bad value for 'distillation.teachers': distillation needs a teacher")
    names: set[str] = set()
    served: dict[str, str] = {}
    rest = None
    for i, teacher in enumerate(d.teachers):
        key = f"distillation.teachers[{i}]"
        if not TEACHER_NAME.match(teacher.name) or teacher.name in names:
            raise ConfigError(
                f"bad value for '{key}.name': '{teacher.name}' must be unique and made of "
                "letters, digits, '_', '.' or '-' (it names the teacher's metrics)"
            )
        names.add(teacher.name)
        for source in teacher.data_sources:
            if source in served:
                raise ConfigError(
                    f"bad value for '{key}.data_sources': '{source}' is served by teacher "
                    f"'{served[source]}' already"
                )
            served[source] = teacher.name
        if not teacher.data_sources:
            if rest is not None:
                raise ConfigError(
                    f"bad value for '{key}.data_sources': teacher '{rest}' serves every other "
                    "source already (only one teacher may leave data_sources empty)"
                )
            rest = teacher.name
        if not teacher.path and cfg.model.path:
            raise ConfigError(
                f"bad value for '{key}.path': empty means a tiny teacher, whose vocabulary is "
                "not that of the student at model.path; give the teacher's model directory"
            )
    if d.loss_mode in ("kl", "k1") and not d.use_policy_gradient:
        raise ConfigError(
            f"bad value for 'distillation.loss_mode': {d.loss_mode} as a loss has a gradient "
            "that does not depend on the teacher; use k3 (or k2, abs), or set "
            "distillation.use_policy_gradient=true to use it as a per-token reward"
        )
    if d.loss_mode == "forward_kl_topk" and cfg.learner.fused_head:
        raise ConfigError(
            "bad value for 'learner.fused_head': the fused head gives the sampled token's "
            "log-prob only, and distillation.loss_mode=forward_kl_topk needs the student's "
            "log-probs of the teacher's top-k tokens; set learner.fused_head=false or use a "
            "reverse-KL estimator such as k3"
        )
    if d.loss_mode == "forward_kl_topk" and d.scoring == "process":
        raise ConfigError(
            "bad value for 'distillation.scoring': a teacher process sends the log-probs of "
            "the sampled tokens only, and distillation.loss_mode=forward_kl_topk needs the "
            "teacher's top-k tokens; set distillation.scoring=learner or use a reverse-KL "
            "estimator such as k3"
        )


def check_filter_groups(cfg: RunConfig) -> None:
    """``algo.filter_groups.metric`` is ``reward`` or names a reward source."""
    metric = cfg.algo.filter_groups.metric
    names = [src.name for src in cfg.rewards.sources]
    if metric != "reward" and metric not in names:
        raise ConfigError(
            f"bad value for 'algo.filter_groups.metric': '{metric}' is neither 'reward' nor "
            f"the name of a reward source ({', '.join(names)})"
        )


def check_rollout_correction(algo: AlgoConfig) -> None:
    """``algo.rollout_correction`` is read with ``algo.correction: rollout`` only, and its
    keys must resolve (verl_async/algos/correction/settings.py)."""
    section = algo.rollout_correction
    if algo.correction != "rollout":
        if section.is_set:
            raise ConfigError(
                "bad value for 'algo.rollout_correction': it is read only with "
                f"algo.correction: rollout (algo.correction is '{algo.correction}')"
            )
        return
    try:
        s = section.settings()
    except SettingError as exc:
        raise ConfigError(f"bad value for 'algo.rollout_correction.{exc.key}': {exc}") from None
    if s.bypass_mode and s.rollout_is_batch_normalize:
        raise ConfigError(
            "bad value for 'algo.rollout_correction.rollout_is_batch_normalize': not with "
            "bypass_mode, whose weights are computed pass by pass (pi_theta moves)"
        )
    if s.bypass_mode and (s.loss_type == "reinforce") != (algo.loss_mode == "reinforce"):
        raise ConfigError(
            "bad value for 'algo.loss_mode': the rollout correction's bypass loss_type "
            f"'{s.loss_type}' trains "
            + ("algo.loss_mode: reinforce" if s.loss_type == "reinforce" else "a PPO-style loss")
            + f", not '{algo.loss_mode}' (verl replaces the loss mode; here both are said)"
        )


def check_gdpo(cfg: RunConfig) -> None:
    """``algo.adv_estimator: gdpo`` normalises each source's raw scores in their group
    itself, always divides by the std (as verl) and has no place for a KL in the reward:
    settings that would be ignored are refused, not dropped silently."""
    algo = cfg.algo
    if algo.adv_estimator != "gdpo":
        return
    for i, src in enumerate(cfg.rewards.sources):
        if src.normalize != "none":
            raise ConfigError(
                f"bad value for 'rewards.sources.{i}.normalize': adv_estimator gdpo normalises "
                f"each source's raw scores within the group itself; set none (got {src.normalize})"
            )
    if not algo.normalize_adv_std:
        raise ConfigError(
            "bad value for 'algo.normalize_adv_std': adv_estimator gdpo always divides by "
            "the group std (as verl's); set true, or use grpo for Dr.GRPO"
        )
    if algo.kl.in_reward:
        raise ConfigError(
            "bad value for 'algo.kl.in_reward': adv_estimator gdpo reads the sources' raw "
            "scores and would ignore an in-reward KL; use algo.kl.loss_coef instead"
        )


# vLLM's LoRA ranks (vllm/config/lora.py: MaxLoRARanks) when its source cannot be read.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora(cfg: RunConfig) -> None:
    """``model.lora``: a dropout in [0, 1), at least one target module, and with the vLLM
    engine a rank vLLM serves (its ``max_lora_rank`` takes a fixed set of values)."""
    lo = cfg.model.lora
    if not lo.rank:
        return
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError("bad value for 'model.lora.dropout': must be in [0, 1)")
    if not lo.target_modules or not all(lo.target_modules):
        raise ConfigError("bad value for 'model.lora.target_modules': name at least one module")
    if cfg.generators.engine == "vllm" and lo.rank not in vllm_lora_ranks():
        listed = ", ".join(str(r) for r in vllm_lora_ranks())
        raise ConfigError(
            f"bad value for 'model.lora.rank': generators.engine=vllm serves ranks {listed} "
            f"(got {lo.rank}; or use generators.engine=hf)"
        )


@functools.cache
def vllm_lora_ranks() -> tuple[int, ...]:
    """The ranks the installed vLLM serves, read from its source: importing vLLM takes
    seconds (15 on a small CPU machine) and this module must stay instant. Without vLLM,
    or if the source has changed shape, ``VLLM_LORA_RANKS``."""
    try:
        spec = importlib.util.find_spec("vllm")  # locates the package, imports nothing
        source = Path(spec.origin).parent / "config" / "lora.py"
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == (
                "MaxLoRARanks"
            ):
                ranks = tuple(ast.literal_eval(e) for e in node.value.slice.elts)
                if ranks and all(isinstance(r, int) for r in ranks):
                    return ranks
    except (AttributeError, OSError, SyntaxError, TypeError, ValueError):
        pass
    return VLLM_LORA_RANKS


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost`` or an address of 127.0.0.0/8."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 4 and address.is_loopback


def check_ipv4(key: str, host: str) -> None:
    """Endpoints are IPv4 (``tcp://HOST:PORT``, ports picked with an IPv4 socket): an IPv6
    address, ``::1`` included, is refused here rather than failing in a role."""
    if ":" in host:
        raise ConfigError(
            f"bad value for '{key}': '{host}' is an IPv6 address, and endpoints are IPv4 "
            "only; use 127.0.0.1 (this machine) or an IPv4 address or host name"
        )


def check_endpoints(buffer: BufferConfig, weights_host: str = "") -> None:
    """Endpoints off loopback only with CurveZMQ keys; a key set that is named must load.

    The weight-sync rendezvous has no authentication of its own; off loopback it is only
    allowed with keys, which authenticate the buffer's channel that carries its
    shared-memory token and the announcements members check (docs/security.md)."""
    check_ipv4("buffer.host", buffer.host)
    if buffer.keys_dir:
        from verl_async.auth import check_keys_dir  # imports zmq: only when keys are set

        check_keys_dir(buffer)
        return
    if buffer.client_key:
        raise ConfigError("bad value for 'buffer.client_key': set buffer.keys_dir first")
    for key, host in (("buffer.host", buffer.host), ("weights.host", weights_host)):
        if host and not is_loopback(host):
            raise ConfigError(
                f"bad value for '{key}': '{host}' is not loopback, and endpoints off "
                "loopback need CurveZMQ keys: run `verl-async keys DIR` and set "
                "buffer.keys_dir=DIR (docs/security.md)"
            )


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run directory's config.yaml holds)."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)
