"""The calculator's parser: the same numbers as Python on arithmetic, refusal of the rest."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.envs.safe_math import (
    MAX_LENGTH,
    CalcError,
    compute,
    evaluate,
    format_number,
)

# Small leaves and at most four of them keep every value far below MAX_MAGNITUDE, so any
# refusal on these is a bug, not a limit.
_ints = st.integers(0, 9).map(str)
_floats = st.integers(0, 90).map(lambda n: repr(n / 10))
_powers = st.builds(
    lambda base, k: f"({base} ** {k})",
    st.one_of(_ints, _floats, _ints.map("(-{})".format)),
    st.integers(0, 3),
)
_atoms = st.one_of(_ints, _floats, _powers)


def _combine(children):
    binary = st.builds(
        lambda left, op, right, parens: (
            f"({left} {op} {right})" if parens else f"{left} {op} {right}"
        ),
        children,
        st.sampled_from(["+", "-", "*", "/", "//", "%"]),
        children,
        st.booleans(),
    )
    unary = st.builds(lambda sign, e: f"{sign}({e})", st.sampled_from(["-", "+"]), children)
    return st.one_of(binary, unary)


expressions = st.recursive(_atoms, _combine, max_leaves=4)


@settings(max_examples=400)
@given(expressions)
def test_well_formed_arithmetic_is_what_python_computes(expr):
    try:
        want = eval(expr)  # the test's own generated arithmetic: the reference
    except ZeroDivisionError:
        with pytest.raises(CalcError, match="division by zero"):
            compute(expr)
        return
    got = compute(expr)
    assert got == want and type(got) is type(want)
    assert float(evaluate(expr)) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "expr, want",
    [
        ("(3 + 4) * 2", "14"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("1 / 3", "0.3333333333"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("  12  ", "12"),
        ("1_000 * 3", "3000"),
    ],
)
def test_known_values(expr, want):
    assert evaluate(expr) == want


def test_formatting():
    assert format_number(14.0) == "14"
    assert format_number(-0.0) == "0"
    assert format_number(3) == "3"
    assert format_number(1e-20) == "1e-20"


@pytest.mark.parametrize(
    "expr, reason",
    [
        ("__import__('os')", "only numbers"),
        ("__import__('os').system('true')", "only numbers"),
        ("(1).__class__", "only numbers"),
        ("x + 1", "only numbers"),
        ("abs(-3)", "only numbers"),
        ("(lambda: 1)()", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("[1, 2]", "only numbers"),
        ("1 < 2", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 1j", "only numbers"),
        ("2 ^ 3", "only numbers"),
        ("1, 2", "only numbers"),
        ("1 if 1 else 2", "only numbers"),
        ("2 + 3 =", "not an arithmetic expression"),
        ("import os", "not an arithmetic expression"),
        ("", "empty"),
        ("   ", "empty"),
        ("1 / 0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9", "exponent"),
        ("10**10000", "exponent"),
        ("2 ** 64.5", "exponent"),
        ("10 ** 16", "result larger"),
        ("99999999 * 99999999", "result larger"),
        ("1" * 20, "result larger"),
        ("1e300 * 1e300", "result larger"),
        ("(-8) ** 0.5", "not a real number"),
        ("1+" * 150 + "1", "longer than"),
        ("-" * 150 + "1", "nested more than"),
    ],
)
def test_hostile_and_invalid_input_is_refused(expr, reason):
    with pytest.raises(CalcError, match=reason):
        evaluate(expr)


def test_the_longest_allowed_sum_is_evaluated():
    expr = "+".join(["1"] * ((MAX_LENGTH + 1) // 2))
    assert len(expr) <= MAX_LENGTH
    assert evaluate(expr) == str((MAX_LENGTH + 1) // 2)


def test_huge_powers_fail_at_once():
    start = time.perf_counter()
    for expr in ("9**9**9", "10**10000", "(2**60)**60", "99**64 * 99**64"):
        with pytest.raises(CalcError):
            evaluate(expr)
    assert time.perf_counter() - start < 0.5
