"""What every config section is built from: the error type, the strict base section and
the bounded number types. No torch, no vLLM (``verl-async --help`` stays instant)."""

from __future__ import annotations

import importlib
import re
from typing import Annotated, Any

import msgspec

from verl_async.numerics import finite32

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


def check_finite32(key: str, value: float) -> None:
    """Refuse, naming ``key``, a number that enters the rewards (a weight, a default score)
    but is not finite in float32, the dtype they are trained in: NaN, an infinity, 1e39.
    msgspec's float accepts all three, and YAML writes them ``.nan``, ``.inf``, ``1e39``."""
    if not finite32(value):
        raise ConfigError(
            f"bad value for '{key}': {value!r} is not a finite number in float32 (rewards are "
            "trained in float32, which holds magnitudes below 3.4e38)"
        )


IMPORT_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:attr


def import_named(spec: str, key: str) -> Any:
    """What ``spec`` (``package.module:attr``, its form checked by the caller) names, imported;
    a module that fails to import, in any way, or has no such attribute raises ConfigError
    naming ``key`` (an environment's class, an agent, a tool: code of the user's)."""
    where = f"bad value for '{key}'"
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail to import in any way
        raise ConfigError(
            f"{where}: module '{module_name}' cannot be imported ({type(exc).__name__}: {exc})"
        ) from None
    value = getattr(module, attr, None)
    if value is None:
        raise ConfigError(f"{where}: module '{module_name}' has no '{attr}'")
    return value
