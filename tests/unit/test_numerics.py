"""``finite32``: a float64 decides, before any cast, whether float32 holds the value."""

import math

import numpy as np
import pytest

from verl_async.numerics import FLOAT32_LIMIT, finite32, finite32_mask

BIGGEST = float(np.finfo(np.float32).max)  # 2**128 - 2**104
EDGE = [
    0.0,
    -1.5,
    1e38,
    BIGGEST,
    math.nextafter(FLOAT32_LIMIT, 0.0),  # rounds down to BIGGEST
    FLOAT32_LIMIT,  # the tie: rounds to even, which is infinity
    math.nextafter(FLOAT32_LIMIT, math.inf),
    1e39,
    math.inf,
    math.nan,
]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_finite32_is_numpy_s_float32_cast_at_every_edge(sign):
    values = [sign * v for v in EDGE]
    with np.errstate(over="ignore"):
        cast = np.isfinite(np.asarray(values, np.float64).astype(np.float32))
    assert [finite32(v) for v in values] == cast.tolist()
    assert finite32_mask(values).tolist() == cast.tolist()
    assert cast.tolist() == [True] * 5 + [False] * 5  # the bound is where the docstring says


def test_scalars_of_other_types():
    assert finite32(np.float64(1e39)) is False and finite32(np.float32(BIGGEST)) is True
    assert finite32(10**40) is False and finite32(3) is True
