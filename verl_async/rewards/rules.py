"""Pure scoring of the rule reward sources: ``exact``, ``format``, ``math``, ``function``.

Contract: ``RuleScorerState().score(source, item) -> float`` for one ``ScoreItem``; a bad
item or a failing user function raises (the scoring process turns that into the source's
``default_score`` and an error string). ``model`` sources are not scored here.

    exact     1.0 if extract(response) == ground_truth.strip() else 0.0
    format    1.0 if re.search(pattern, response, DOTALL) (full_match: re.fullmatch on
              response.strip()) else 0.0
    math      1.0 if the response's final answer equals the ground truth's under math-verify,
              else 0.0; the numeric comparison of the last numbers decides when math-verify
              cannot (nothing parsed, an error, a timeout, or the package is missing)
    function  float(fn(prompt=, response=, ground_truth=, data_source=, extra_info=, **kwargs));
              a result that is not finite in float32 (NaN, inf, 1e39) raises

``overlong`` scores a response by its token count alone (``overlong_penalty``); the scorer
computes it in the generator, with no scoring process involved.

math-verify bounds its own parsing and comparison with ``signal.alarm``, which only works in
the main thread; elsewhere its timeouts are switched off and the scoring process's deadline
(``rewards.timeout_s``, enforced by ``scorer.RuleScorer``) is the only bound.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from verl_async.numerics import finite32
from verl_async.protocol import ScoreItem
from verl_async.reward_config import (
    ExactReward,
    FormatReward,
    FunctionReward,
    MathReward,
    RewardSource,
)

log = logging.getLogger("verl_async.rewards")

# "1,234,567" -> "1234567"; also LaTeX's "1{,}234". Only groups of exactly three digits,
# so a list "1,2" keeps its comma.
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\})(?=\d{3}(?!\d))")
# A minus sign counts only where it cannot be a subtraction ("10-5" ends in 5, not -5).
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?\d+(?:\.\d+)?(?:/\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}")
# A ground truth that is just a number, perhaps with a currency sign and a unit word.
_PLAIN = re.compile(r"(?:\\?\$)?\s*(-?\d+(?:\.\d+)?(?:/\d+)?)\s*%?\s*[A-Za-z ]*\.?")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


class RuleError(ValueError):
    """A rule source that cannot score an item (bad result of a user function, ...)."""


# ----------------------------------------------------------------------------- exact, format


def extract_exact(response: str, mode: str) -> str:
    """The compared part of ``response``: all (stripped), first_word or last_word."""
    if mode == "all":
        return response.strip()
    words = response.split()
    if not words:
        return ""
    return words[0] if mode == "first_word" else words[-1]


def score_exact(source: ExactReward, response: str, ground_truth: str) -> float:
    got, want = extract_exact(response, source.extract), ground_truth.strip()
    if not source.case_sensitive:
        got, want = got.lower(), want.lower()
    return 1.0 if got == want else 0.0


def score_format(source: FormatReward, response: str) -> float:
    if source.full_match:
        return 1.0 if re.fullmatch(source.pattern, response.strip(), re.DOTALL) else 0.0
    return 1.0 if re.search(source.pattern, response, re.DOTALL) else 0.0


def overlong_penalty(length: int, buffer_len: int, penalty_factor: float, max_len: int) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens:
    min(-(length - (max_len - buffer_len)) / buffer_len * penalty_factor, 0)."""
    expected = max_len - buffer_len
    return min(-(length - expected) / buffer_len * penalty_factor, 0.0)


# ----------------------------------------------------------------------------- math helpers


def gsm8k_answer(ground_truth: str) -> str:
    """GSM8K's "<solution> #### 1,234" -> "1,234"; other ground truths stripped as they are."""
    _, sep, after = ground_truth.rpartition("####")
    return (after if sep else ground_truth).strip()


def strip_thousands(text: str) -> str:
    return _THOUSANDS.sub("", text)


def last_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (balanced braces) or ``\\boxed x``; None if none.

    verl's math scorers grade the last box: a response may box intermediate results.
    """
    starts = list(_BOXED.finditer(text))
    for match in reversed(starts):
        i = match.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
            continue  # unbalanced: try an earlier box
        word = re.match(r"[^\s$]+", text[i:])
        if word:
            return word.group(0)
    return None


def to_number(text: str) -> float | None:
    """ "-3", "7.5", "3/4" -> float; None when it is not one of those."""
    num, _, den = text.partition("/")
    try:
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def last_number(text: str) -> float | None:
    """The last number in ``text`` (thousands separators and ``\\frac{a}{b}`` understood)."""
    text = _FRAC.sub(r"\1/\2", strip_thousands(text))
    found = _NUMBER.findall(text)
    return to_number(found[-1]) if found else None


def plain_number(text: str) -> str | None:
    """ "$1,234", "72 dollars", "-5", "3/4" -> the number's text; None for anything else."""
    match = _PLAIN.fullmatch(strip_thousands(text).strip())
    return match.group(1) if match else None


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# ----------------------------------------------------------------------------- math


class MathVerifier:
    """Final-answer equivalence: math-verify first, numeric comparison as the fallback.

    gold = the ground truth after GSM8K's ``####`` (a plain number is parsed as that number,
    so "72 dollars" is 72); pred = the content of the response's last ``\\boxed{}``, else the
    whole response (math-verify then takes the last answer it can parse). Thousands
    separators are removed from both first. math-verify is imported on first use (sympy takes
    about half a second) and its per-operation timeouts are ``timeout_s`` (whole seconds).
    """

    def __init__(self, timeout_s: int = 5) -> None:
        self.timeout_s = max(1, int(timeout_s))
        self._mv: Any = None  # the math_verify module; False once known to be missing
        self._timeout_error: type[BaseException] = TimeoutError
        self._lock = threading.Lock()

    def module(self) -> Any:
        with self._lock:
            if self._mv is None:
                try:
                    self._mv = importlib.import_module("math_verify")
                    # A BaseException: ``except Exception`` alone would let it through.
                    self._timeout_error = importlib.import_module(
                        "math_verify.errors"
                    ).TimeoutException
                except ImportError:
                    log.warning(
                        "math-verify is not installed: 'math' rewards compare the last "
                        "numbers only (pip install math-verify)"
                    )
                    self._mv = False
            return self._mv

    def score(self, response: str, ground_truth: str) -> float:
        gold_text = strip_thousands(gsm8k_answer(ground_truth))
        boxed = last_boxed(response)
        pred_text = strip_thousands(response if boxed is None else boxed)
        gold_num = plain_number(gold_text)
        verdict = self._verify(gold_text, gold_num, pred_text, boxed is not None)
        if verdict is not None:
            return 1.0 if verdict else 0.0
        want = to_number(gold_num) if gold_num is not None else last_number(gold_text)
        return 1.0 if numbers_equal(last_number(pred_text), want) else 0.0

    def _verify(self, gold_text: str, gold_num: str | None, pred: str, boxed: bool) -> bool | None:
        """math-verify's verdict; None when it cannot decide (missing, unparsed, error)."""
        mv = self.module()
        if not mv:
            return None
        # signal.alarm (math-verify's timeout) exists in the main thread only.
        main = threading.current_thread() is threading.main_thread()
        limit = self.timeout_s if main else None
        if gold_num is not None:
            gold = mv.parse(f"${gold_num}$", parsing_timeout=limit)
        else:
            wrapped = "$" in gold_text or "\\boxed" in gold_text
            gold = mv.parse(gold_text if wrapped else f"${gold_text}$", parsing_timeout=limit)
            gold = gold or mv.parse(gold_text, parsing_timeout=limit)
        target = mv.parse(f"\\boxed{{{pred}}}" if boxed else pred, parsing_timeout=limit)
        if not gold or not target:
            return None
        try:
            return bool(mv.verify(gold, target, timeout_seconds=limit, raise_on_error=True))
        except (Exception, self._timeout_error):
            return None


# ----------------------------------------------------------------------------- function


def load_function(path: str) -> Callable[..., Any]:
    """``package.module:function`` -> the callable (imported with importlib)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RuleError(f"function '{path}' is not of the form package.module:function")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise RuleError(f"'{path}' is not callable")
    return obj


def call_function(fn: Callable[..., Any], source: FunctionReward, item: ScoreItem) -> float:
    result = fn(
        prompt=item.prompt,
        response=item.response,
        ground_truth=item.ground_truth,
        data_source=item.data_source,
        extra_info=item.extra_info,
        **source.kwargs,
    )
    # bool, int, float, numpy and torch scalars all have __float__; str and None do not.
    if not hasattr(result, "__float__"):
        raise RuleError(f"{source.function} returned {type(result).__name__}, not a number")
    value = float(result)
    if not finite32(value):  # trained in float32, where 1e39 is infinite
        raise RuleError(f"{source.function} returned {value!r}, not a finite float32")
    return value


# ----------------------------------------------------------------------------- entry point


class RuleScorerState:
    """What scoring keeps between items: loaded user functions, the math verifier."""

    def __init__(self, math_timeout_s: int = 5) -> None:
        self.functions: dict[str, Callable[..., Any]] = {}
        self.math = MathVerifier(math_timeout_s)

    def function(self, path: str) -> Callable[..., Any]:
        if path not in self.functions:
            self.functions[path] = load_function(path)
        return self.functions[path]

    def score(self, source: RewardSource, item: ScoreItem) -> float:
        """The raw score of ``item`` under ``source``; raises when it cannot be scored."""
        if isinstance(source, ExactReward):
            return score_exact(source, item.response, item.ground_truth)
        if isinstance(source, FormatReward):
            return score_format(source, item.response)
        if isinstance(source, MathReward):
            return self.math.score(item.response, item.ground_truth)
        if isinstance(source, FunctionReward):
            return call_function(self.function(source.function), source, item)
        raise RuleError(f"source '{source.name}' ({type(source).__name__}) is not a rule source")


def score_item(source: RewardSource, item: ScoreItem, state: RuleScorerState) -> float:
    """Module-level spelling of ``state.score(source, item)``."""
    return state.score(source, item)
