"""The ``rewards:`` section: one entry per reward source (``kind`` picks the type), and
its checks. Part of the run configuration (verl_async/config.py)."""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from verl_async.config_base import (
    ConfigError,
    NonNegFloat,
    PosFloat,
    PosInt,
    _Section,
    check_finite32,
)


class _RewardSource(_Section, kw_only=True):
    """What every reward source has; ``kind`` (the tag) picks the subclass."""

    name: str
    """Name of the source in metrics (``reward/<name>``)."""
    weight: float = 1.0
    """Weight of the source in the combined reward (finite in float32)."""
    normalize: Literal["none", "group", "running"] = "none"
    """Scale before weighting: none; group = (x - group mean) / (group std + 1e-6);
    running = (x - mean) / (std + 1e-6) over every score of this source so far."""
    default_score: float = 0.0
    """Score when the source fails (raises, times out, its process dies, or it gives a score
    that is not finite in float32); finite in float32 itself."""
    data_sources: list[str] = []
    """Score only prompts whose ``data_source`` is listed (empty: every prompt)."""


class ExactReward(_RewardSource, tag="exact", tag_field="kind", kw_only=True):
    """1 when the extracted response equals the ground truth (both stripped), else 0."""

    extract: Literal["all", "first_word", "last_word"] = "all"
    """Which part of the response is compared."""
    case_sensitive: bool = True
    """Compare with case (false: both sides lower-cased)."""


class FormatReward(_RewardSource, tag="format", tag_field="kind", kw_only=True):
    """1 when the response matches ``pattern`` (Python regex, DOTALL), else 0."""

    pattern: str
    """Regular expression the response must match."""
    full_match: bool = False
    """Require the whole response (stripped) to match, instead of a match anywhere."""


class MathReward(_RewardSource, tag="math", tag_field="kind", kw_only=True):
    """1 when the response's final answer equals the ground truth under ``math-verify``
    (GSM8K ``####``, ``\\boxed{}``, fractions, LaTeX), numeric comparison as the fallback."""


class FunctionReward(_RewardSource, tag="function", tag_field="kind", kw_only=True):
    """A user function ``module:function`` called with keyword arguments ``prompt``,
    ``response``, ``ground_truth``, ``data_source``, ``extra_info`` (+ ``kwargs``), returning
    a float. It runs in a scoring process of its own, never on the engine's event loop."""

    function: str
    """Import path ``package.module:function`` (the module must be importable)."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments passed on every call."""


class ModelReward(_RewardSource, tag="model", tag_field="kind", kw_only=True):
    """A Hugging Face ``AutoModelForSequenceClassification`` (one output) scoring the
    chat-templated conversation (prompt messages + response), served by a reward-model
    process of its own on ``placement.reward_models``."""

    path: str
    """Reward-model directory (config.json, weights, tokenizer)."""
    batch_size: PosInt = 32
    """Most conversations per forward pass."""
    max_length: PosInt = 1024
    """Conversations are truncated (from the left) to this many tokens."""
    share_prefix: bool = True
    """Forward the prompt a group's conversations share once and only the responses on top
    of its key/value cache (same scores, less compute); false forwards every row whole."""


class OverlongReward(_RewardSource, tag="overlong", tag_field="kind", kw_only=True):
    """DAPO's soft overlong punishment, by the response's token count L alone:
    min(-(L - (max_resp_len - len)) / len * penalty_factor, 0), i.e. 0 up to
    max_resp_len - len tokens, then falling linearly to -penalty_factor at max_resp_len."""

    buffer_len: PosInt = msgspec.field(name="len")
    """Length of the punished stretch before max_resp_len, in tokens (at most max_resp_len)."""
    penalty_factor: NonNegFloat
    """The penalty at max_resp_len tokens (its magnitude; the score is <= 0)."""
    max_resp_len: PosInt | None = None
    """The response length the penalty reaches -penalty_factor at; empty:
    generators.max_new_tokens."""

    def resolved_max(self, max_new_tokens: int) -> int:
        """``max_resp_len``, or the run's ``generators.max_new_tokens`` when it is empty."""
        return self.max_resp_len if self.max_resp_len is not None else max_new_tokens


RewardSource = (
    ExactReward | FormatReward | MathReward | FunctionReward | ModelReward | OverlongReward
)
RULE_SOURCES = (ExactReward, FormatReward, MathReward, FunctionReward)
"""The sources a generator's scoring process scores (by the response's text)."""


def _default_sources() -> list[RewardSource]:
    return [ExactReward(name="correct", extract="first_word")]


class RewardsConfig(_Section):
    sources: list[RewardSource] = msgspec.field(default_factory=_default_sources)
    """Reward sources; a sample's reward is the weighted sum of their (normalised) scores
    over the sources routed to its ``data_source``."""
    timeout_s: PosFloat = 30.0
    """A source that has not scored a group after this long gives its default_score (the
    scoring process is restarted); counted in ``reward_failed/<name>``."""


def check_rewards(rewards: RewardsConfig, max_new_tokens: int | None = None) -> None:
    """Names unique, at least one source, weights and default scores finite in float32,
    regexes and import paths well formed, an overlong source's ``len`` within its
    ``max_resp_len`` (``max_new_tokens``, the generators', when that is empty)."""
    if not rewards.sources:
        raise ConfigError("bad value for 'rewards.sources': at least one reward source is needed")
    names = [src.name for src in rewards.sources]
    for i, src in enumerate(rewards.sources):
        key = f"rewards.sources.{i}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", src.name):
            raise ConfigError(
                f"bad value for '{key}.name': '{src.name}' may use only letters, digits, "
                "'_', '.' and '-' (it names metrics)"
            )
        if src.name in names[:i]:
            raise ConfigError(f"bad value for '{key}.name': '{src.name}' names two sources")
        check_finite32(f"{key}.weight", src.weight)
        check_finite32(f"{key}.default_score", src.default_score)
        if isinstance(src, FormatReward):
            try:
                re.compile(src.pattern)
            except re.error as exc:
                raise ConfigError(f"bad value for '{key}.pattern': not a regex ({exc})") from None
        if isinstance(src, FunctionReward) and not re.fullmatch(
            r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", src.function
        ):
            raise ConfigError(
                f"bad value for '{key}.function': '{src.function}' is not 'package.module:function'"
            )
        if isinstance(src, OverlongReward):
            check_finite32(f"{key}.penalty_factor", src.penalty_factor)
            if max_new_tokens is not None:
                check_overlong(key, src, max_new_tokens)
        if isinstance(src, ModelReward) and not src.path:
            raise ConfigError(f"bad value for '{key}.path': a model reward needs its directory")


def check_overlong(key: str, src: OverlongReward, max_new_tokens: int) -> None:
    """``len`` <= the resolved ``max_resp_len`` (verl refuses a longer buffer too)."""
    limit = src.resolved_max(max_new_tokens)
    if src.buffer_len > limit:
        where = "max_resp_len" if src.max_resp_len is not None else "generators.max_new_tokens"
        raise ConfigError(
            f"bad value for '{key}.len': {src.buffer_len} tokens is more than the response "
            f"length it ends at ({where} = {limit})"
        )
