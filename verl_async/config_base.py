"""What every config section is built from: the error type, the strict base section and
the bounded number types. No torch, no vLLM (``verl-async --help`` stays instant)."""

from __future__ import annotations

from typing import Annotated

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass
