"""Arithmetic on text a model wrote, without ``eval``: the calculator tool's parser.

    >>> evaluate("(3 + 4) * 2")
    '14'
    >>> evaluate("7 / 2")
    '3.5'
    >>> evaluate("__import__('os')")
    Traceback (most recent call last):
    ...
    verl_async.envs.safe_math.CalcError: only numbers and + - * / // % ** are allowed

The text is parsed with ``ast.parse(expr, mode="eval")`` and the tree is walked against a
whitelist: int and float constants, the binary operators + - * / // % **, unary + and -,
and parentheses (which the tree does not keep). Anything else (names, calls, attributes,
lambdas, comparisons, strings) is refused before a single operation runs.

The limits keep a hostile expression from costing more than a moment: the text's length,
the tree's depth, the size of every exponent and the magnitude of every intermediate
result, so ``9**9**9`` and ``10**10000`` fail fast instead of building huge integers.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_LENGTH = 200  # characters of the expression
MAX_DEPTH = 100  # nested operations (a sum of 100 terms is 99 deep)
MAX_EXPONENT = 64  # |b| in a ** b
MAX_MAGNITUDE = 1e15  # |x| of every constant and every intermediate result
SIGNIFICANT_DIGITS = 10  # of a non-integral result

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_REFUSED = "only numbers and + - * / // % ** are allowed"


class CalcError(ValueError):
    """An expression the calculator will not or cannot evaluate; the message says why."""


def evaluate(expr: str) -> str:
    """The value of the arithmetic expression ``expr``, formatted (see ``format_number``);
    raises ``CalcError`` for anything that is not a bounded arithmetic expression."""
    return format_number(compute(expr))


def compute(expr: str) -> Number:
    """The value of ``expr`` as a number (``evaluate`` without the formatting)."""
    text = expr.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_LENGTH:
        raise CalcError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    return _walk(tree.body, 0)


def format_number(value: Number) -> str:
    """Integers as integers ("14", also for 14.0), other floats to ``SIGNIFICANT_DIGITS``
    significant digits ("3.5", "0.3333333333")."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


def _walk(node: ast.expr, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise CalcError(f"expression nested more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Constant):
        # bool is an int subclass: True is a name to a reader, not a number.
        if type(node.value) not in (int, float):
            raise CalcError(_REFUSED)
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _walk(node.left, depth + 1)
        right = _walk(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("result too large") from None
        return _bounded(result)
    raise CalcError(_REFUSED)


def _bounded(value: Number | complex) -> Number:
    """``value`` if it is a real, finite number within ``MAX_MAGNITUDE``."""
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalcError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result too large")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"result larger than {MAX_MAGNITUDE:.0e}")
    return value
