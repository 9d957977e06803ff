"""Finite in float32: the check every reward, score and reward weight passes where it is
accepted.

Rewards travel as float64 (Python floats, msgspec, numpy) and are trained as float32: the
learner casts the scores and rewards of a batch to float32. 1e39 is finite in float64 and
infinite in float32, where one such reward makes a group's GRPO advantages NaN and the
step's loss with them. So a value is accepted only when its float32 cast is finite, which is
decided in float64, before any cast:

    finite in float32  <=>  |x| < 2**128 - 2**103

The largest float32 is 2**128 - 2**104; round-to-nearest sends x to infinity from halfway
between that and 2**128 on (the tie rounds to even, which is up: the largest float32's last
bit is odd). NaN fails the comparison. ``np.float32(x)`` agrees on every side of the bound
(tests/unit/test_numerics.py).
"""

from __future__ import annotations

import numpy as np

FLOAT32_LIMIT = 2.0**128 - 2.0**103
"""The smallest magnitude whose float32 cast is infinite."""


def finite32(value: float) -> bool:
    """Whether ``value`` (a Python or numpy scalar) is finite once cast to float32."""
    return abs(float(value)) < FLOAT32_LIMIT


def finite32_mask(values) -> np.ndarray:
    """Elementwise ``finite32`` of an array-like (read as float64): a bool array."""
    with np.errstate(invalid="ignore"):  # NaN compares False without a warning
        return np.abs(np.asarray(values, np.float64)) < FLOAT32_LIMIT
