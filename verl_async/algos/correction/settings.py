"""The settings of rollout correction (``algo.correction: rollout``, verl's
``algorithm.rollout_correction``): the grammar of its options and thresholds, verl's named
presets, and how a preset and keys set by hand combine. No torch: the config schema
imports this, and ``verl-async --help`` stays instant. The tensor side is
``rollout.py`` beside this module.

Grammar (verl 1dda039's, errors included):

  rollout_is            null (no importance weights), "token" or "sequence"
  rollout_is_threshold  U (a number or a number as a string): truncated IS, w = min(w, U);
                        "L_U": IcePop, w = 0 outside [L, U] (0 < L <= U)
  rollout_rs            comma-separated options, all of which must pass (AND); duplicates
                        are dropped, first occurrence kept:
                        token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3
  rollout_rs_threshold  one entry shared by every option, or one per (distinct) option,
                        comma-separated; a k1 entry is "L_U" or U (then L = 1/U), tested
                        in log space; a k2/k3 entry is one positive U

In YAML write an "L_U" threshold with a dot on both sides ("0.5_2.0") or quote it:
YAML 1.1 reads ``0.5_2`` as the number 0.52 and ``1_2`` as 12.

Presets: ``PRESETS`` holds every named preset of verl's ``RolloutCorrectionConfig``
(19) with the values it sets and which of them are its arguments (the thresholds, with
their defaults). ``resolve`` starts from verl's defaults (rollout_is null, as verl's YAML
has it; its dataclass says "sequence"), lays the preset over them, then the keys set by
hand. A key set by hand may change a preset's argument (its thresholds) and
``rollout_is_batch_normalize`` (no preset fixes it); a key the preset fixes (the level,
the options, bypass_mode, loss_type) set to another value is an error naming both, not a
silent winner. A key set by hand that the resolved settings never read (a threshold with
its level or options off, loss_type outside bypass mode) is an error too.

Beside ``algo.correction``: ``rollout`` is its fourth value, and the only one that reads
``algo.rollout_correction``; the section set under another correction is an error naming
it (config.py). Under ``rollout``, ``algo.is_cap`` is not read (it has a default, so a
value set by hand cannot be told from it and is not refused).
bypass_mode true takes the ratio against pi_behav, as ``none`` does (verl's bypass,
``bypass_ppo_clip`` is ``none`` plus the metrics); false takes it against pi_prox, as
``tis`` (= ``decoupled_token_is`` with threshold is_cap) and ``decoupled`` do.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
LOSS_TYPES = ("ppo_clip", "reinforce")


class SettingError(ValueError):
    """A bad rollout-correction setting; ``key`` is the field it is about."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _number(text: str, what: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SettingError(key, f"{what}: '{text}' is not a number") from None
    if not math.isfinite(value):
        raise SettingError(key, f"{what}: '{text}' is not a finite number")
    return value


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> (upper, lower): lower None for truncation (a number),
    a number for IcePop's band ("L_U", split at the first "_")."""
    key = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise SettingError(key, f"must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    if not text:
        raise SettingError(key, "must not be an empty string")
    low_text, sep, high_text = text.partition("_")
    upper = _number(high_text if sep else text, f"bad threshold {spec!r}", key)
    lower = _number(low_text, f"bad threshold {spec!r}", key) if sep else None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise SettingError(key, f"bounds must be positive, got {spec!r}")
    if lower is not None and lower > upper:
        raise SettingError(key, f"lower bound must be <= upper bound, got {spec!r}")
    return upper, lower


def parse_rs_options(spec: str) -> tuple[str, ...]:
    """``rollout_rs`` -> its distinct options in the order given."""
    key = "rollout_rs"
    if not isinstance(spec, str):
        raise SettingError(key, f"must be a comma-separated string of options, got {spec!r}")
    options: list[str] = []
    for option in (part.strip() for part in spec.split(",")):
        if not option:
            continue
        if option not in RS_OPTIONS:
            raise SettingError(key, f"unknown option '{option}' (one of {', '.join(RS_OPTIONS)})")
        if option not in options:
            options.append(option)
    if not options:
        raise SettingError(key, "must name at least one option")
    return tuple(options)


def parse_rs_thresholds(
    options: tuple[str, ...], spec: float | str | None
) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold`` for ``options`` -> option: (lower, upper) as ratios;
    lower is None for the k2/k3 options, which have an upper bound only."""
    key = "rollout_rs_threshold"
    if spec is None:
        raise SettingError(key, "rejection sampling (rollout_rs) needs a threshold")
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise SettingError(key, f"must be a number or a comma-separated string, got {spec!r}")
    entries = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(entries) not in (1, len(options)):
        raise SettingError(
            key,
            f"give one threshold for all options or one per option ({len(options)}: "
            f"{', '.join(options)}), got {len(entries)}",
        )
    entries = entries * len(options) if len(entries) == 1 else entries
    return {opt: _rs_bounds(opt, text) for opt, text in zip(options, entries, strict=True)}


def _rs_bounds(option: str, text: str) -> tuple[float | None, float]:
    key, what = "rollout_rs_threshold", f"bad threshold '{text}' for option '{option}'"
    low_text, sep, high_text = text.partition("_")
    if not option.endswith("k1"):
        if sep:
            raise SettingError(key, f"{what}: a k2/k3 option takes one upper bound, no '_'")
        upper = _number(text, what, key)
        if upper <= 0:
            raise SettingError(key, f"{what}: must be positive")
        return None, upper
    upper = _number(high_text if sep else text, what, key)
    lower = _number(low_text, what, key) if sep else (1.0 / upper if upper > 0 else -1.0)
    if lower <= 0 or upper <= 0:
        raise SettingError(key, f"{what}: bounds must be positive")
    if lower > upper:
        raise SettingError(key, f"{what}: lower bound must be <= upper bound")
    return lower, upper


@dataclass(frozen=True)
class RolloutCorrection:
    """Resolved settings, verl's field names and defaults (``rollout_is`` as verl's YAML)."""

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def validate(self) -> None:
        """Parse every setting the others make live; SettingError names the bad one."""
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise SettingError(
                "rollout_is", f"must be null, 'token' or 'sequence', got {self.rollout_is!r}"
            )
        if self.rollout_is is not None:
            parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        if self.loss_type not in LOSS_TYPES:
            raise SettingError(
                "loss_type", f"must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}"
            )


@dataclass(frozen=True)
class Preset:
    """A named preset: the fields it sets (its arguments at their defaults) and which of
    them are its arguments, which keys set by hand may change."""

    fields: dict[str, Any]
    params: tuple[str, ...] = field(default=())


_IS, _RS = "rollout_is_threshold", "rollout_rs_threshold"
_GEO = {"rollout_rs": "seq_mean_k1", _RS: "0.999_1.001"}
_K3 = {"rollout_rs": "seq_mean_k3", _RS: 0.01}
_BYPASS_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_BYPASS_CLIP = {"bypass_mode": True, "loss_type": "ppo_clip"}


def _p(rollout_is: str | None, params: tuple[str, ...] = (), **fields: Any) -> Preset:
    return Preset({"rollout_is": rollout_is, "rollout_rs": None, **fields}, params)


# verl 1dda039, verl/trainer/config/algorithm.py: RolloutCorrectionConfig's classmethods.
PRESETS: dict[str, Preset] = {
    "decoupled_token_is": _p("token", (_IS,), rollout_is_threshold=2.0),
    "decoupled_seq_is": _p("sequence", (_IS,), rollout_is_threshold=2.0),
    "decoupled_token_icepop": _p("token", (_IS,), rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": _p(
        "sequence",
        (_IS, _RS),
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0",
    ),
    "decoupled_geo_rs": _p(None, (_RS,), **_GEO),
    "bypass_ppo_clip": _p(None, (), **_BYPASS_CLIP),
    "bypass_ppo_clip_geo_rs": _p(None, (_RS,), **_GEO, **_BYPASS_CLIP),
    "bypass_ppo_clip_k3_rs": _p(None, (_RS,), **_K3, **_BYPASS_CLIP),
    "bypass_pg_is": _p("sequence", (_IS,), rollout_is_threshold=2.0, **_BYPASS_PG),
    "bypass_pg_token_icepop": _p("token", (_IS,), rollout_is_threshold="0.5_5.0", **_BYPASS_PG),
    "bypass_pg_geo_rs": _p(None, (_RS,), **_GEO, **_BYPASS_PG),
    "decoupled_geo_rs_seq_tis": _p("sequence", (_IS, _RS), rollout_is_threshold=2.0, **_GEO),
    "decoupled_geo_rs_token_tis": _p("token", (_IS, _RS), rollout_is_threshold=2.0, **_GEO),
    "bypass_pg_geo_rs_seq_tis": _p(
        "sequence", (_IS, _RS), rollout_is_threshold=2.0, **_GEO, **_BYPASS_PG
    ),
    "bypass_pg_geo_rs_token_tis": _p(
        "token", (_IS, _RS), rollout_is_threshold=2.0, **_GEO, **_BYPASS_PG
    ),
    "decoupled_k3_rs": _p(None, (_RS,), **_K3),
    "decoupled_k3_rs_seq_tis": _p("sequence", (_IS, _RS), rollout_is_threshold=2.0, **_K3),
    "decoupled_k3_rs_token_tis": _p("token", (_IS, _RS), rollout_is_threshold=2.0, **_K3),
    "disabled": _p(None),
}

FREE_KEYS = ("rollout_is_batch_normalize",)  # keys no preset fixes


def preset_settings(name: str) -> RolloutCorrection:
    """The settings of preset ``name`` with its arguments at their defaults."""
    if name not in PRESETS:
        raise SettingError("preset", f"unknown preset '{name}' (one of {', '.join(PRESETS)})")
    return RolloutCorrection(**PRESETS[name].fields)


def resolve(preset: str | None, explicit: dict[str, Any]) -> RolloutCorrection:
    """verl's defaults, then ``preset``'s values, then the keys set by hand (``explicit``),
    checked (see the module docstring); SettingError names the key at fault. Resolved once
    per distinct config: the learner asks for every pass."""
    return _resolve(preset, tuple(sorted(explicit.items())))


@functools.lru_cache(maxsize=32)
def _resolve(preset: str | None, items: tuple[tuple[str, Any], ...]) -> RolloutCorrection:
    explicit = dict(items)
    values = asdict(preset_settings(preset)) if preset is not None else asdict(RolloutCorrection())
    if preset is not None:
        spec = PRESETS[preset]
        for key, value in explicit.items():
            fixed = key not in spec.params and key not in FREE_KEYS
            if fixed and value != values[key]:
                raise SettingError(
                    key,
                    f"{value!r} contradicts preset '{preset}', which sets it to "
                    f"{values[key]!r}; drop the key or the preset",
                )
    settings = RolloutCorrection(**{**values, **explicit})
    settings.validate()
    _check_read(settings, explicit)
    return settings


def _check_read(s: RolloutCorrection, explicit: dict[str, Any]) -> None:
    """A key set by hand must be one the settings read."""
    unread = {  # key: why it would not be read, or None
        "rollout_is_threshold": "rollout_is is null" if s.rollout_is is None else None,
        "rollout_is_batch_normalize": "rollout_is is null" if s.rollout_is is None else None,
        "rollout_rs_threshold": "rollout_rs is null" if s.rollout_rs is None else None,
        "loss_type": None if s.bypass_mode else "bypass_mode is false",
    }
    for key, why in unread.items():
        if key in explicit and why is not None:
            raise SettingError(key, f"is set but never read: {why}")
