"""Rule reward sources: exact, format, math (math-verify + numeric fallback), function."""

from __future__ import annotations

import pytest

from verl_async.protocol import ScoreItem
from verl_async.reward_config import ExactReward, FormatReward, FunctionReward, MathReward
from verl_async.rewards.rules import (
    MathVerifier,
    RuleError,
    RuleScorerState,
    gsm8k_answer,
    last_boxed,
    last_number,
    load_function,
    score_item,
)

GSM8K_GT = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,234"

MATH_CASES = [
    # (ground truth, response, expected score)
    ("1234", "The answer is 1,234.", 1.0),
    ("1,234", "So the total is 1234", 1.0),
    ("1000000", "\\boxed{1,000,000}", 1.0),
    ("1234", "$\\boxed{1{,}234}$", 1.0),
    (GSM8K_GT, "She sold 1234 clips.", 1.0),
    (GSM8K_GT, "She sold 24 clips.", 0.0),
    ("#### 72", "She earns 72 dollars.", 1.0),
    ("72", "She earns $72.", 1.0),
    ("72 dollars", "\\boxed{\\$72}", 1.0),
    ("72", "The total is $72 per week and $80 next week", 0.0),  # the last answer counts
    ("-5", "x = -5", 1.0),
    ("-5", "the answer is 5", 0.0),
    ("-3", "\\boxed{-3}", 1.0),
    ("3/4", "0.75", 1.0),
    ("0.75", "\\frac{3}{4}", 1.0),
    ("\\frac{3}{4}", "The answer is $\\boxed{3/4}$", 1.0),
    ("3", "first \\boxed{2}, then \\boxed{3}", 1.0),  # the LAST box
    ("2", "first \\boxed{2}, then \\boxed{3}", 0.0),
    ("\\sqrt{2}", "so $\\boxed{\\sqrt{2}}$", 1.0),
    ("\\sqrt{2}", "so $\\boxed{\\sqrt{3}}$", 0.0),
    ("5", "I don't know", 0.0),
    ("5", "", 0.0),
]


@pytest.fixture(scope="module")
def verifier() -> MathVerifier:
    return MathVerifier(timeout_s=5)


@pytest.mark.parametrize(("gold", "response", "want"), MATH_CASES)
def test_math_verify(verifier, gold, response, want):
    assert verifier.score(response, gold) == want


@pytest.mark.parametrize(
    ("gold", "response", "want"),
    [
        ("1,234", "The answer is 1234.", 1.0),
        (GSM8K_GT, "I think 1,234 clips", 1.0),
        ("-5", "x = -5", 1.0),
        ("-5", "x = 5", 0.0),
        ("3/4", "it is 0.75", 1.0),
        ("0.75", "\\boxed{\\frac{3}{4}}", 1.0),
        ("12", "10-5=5, no wait: 12", 1.0),
        ("3", "first \\boxed{2}, then \\boxed{3}", 1.0),
        ("5", "no idea", 0.0),
    ],
)
def test_math_numeric_fallback_without_math_verify(gold, response, want, caplog):
    verifier = MathVerifier()
    verifier._mv = False  # as if math-verify were not installed
    assert verifier.score(response, gold) == want


def test_missing_math_verify_warns_once(monkeypatch, caplog):
    import importlib

    real = importlib.import_module

    def fake_import(name, *args):
        if name.startswith("math_verify"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    verifier = MathVerifier()
    with caplog.at_level("WARNING", logger="verl_async.rewards"):
        assert verifier.score("it is 7", "7") == 1.0
        assert verifier.score("it is 8", "7") == 0.0
    warnings = [r for r in caplog.records if "math-verify is not installed" in r.message]
    assert len(warnings) == 1


def test_math_helpers():
    assert gsm8k_answer("steps\n#### -12") == "-12"
    assert gsm8k_answer(" 42 ") == "42"
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("no box") is None
    assert last_number("10-5") == 5.0
    assert last_number("a loss of -5 dollars") == -5.0
    assert last_number("2,500,000 people") == 2500000.0
    assert last_number("nothing") is None


def _item(response: str, ground_truth: str = "", **kw) -> ScoreItem:
    return ScoreItem(source=0, prompt="p", response=response, ground_truth=ground_truth, **kw)


@pytest.mark.parametrize(
    ("extract", "case_sensitive", "response", "gt", "want"),
    [
        ("all", True, "  Paris \n", "Paris", 1.0),
        ("all", True, "paris", "Paris", 0.0),
        ("all", False, "paris", " PARIS ", 1.0),
        ("first_word", True, "7 because 7 > 3", "7", 1.0),
        ("first_word", True, "because 7", "7", 0.0),
        ("last_word", True, "the answer is 9", "9", 1.0),
        ("last_word", False, "The answer is YES", "yes", 1.0),
        ("first_word", True, "   ", "7", 0.0),
    ],
)
def test_exact(extract, case_sensitive, response, gt, want):
    src = ExactReward(name="e", extract=extract, case_sensitive=case_sensitive)
    assert score_item(src, _item(response, gt), RuleScorerState()) == want


@pytest.mark.parametrize(
    ("pattern", "full", "response", "want"),
    [
        (r"<think>.*</think>", False, "x <think>a\nb</think> y", 1.0),  # DOTALL
        (r"<think>.*</think>", True, "x <think>a\nb</think> y", 0.0),
        (r"<think>.*</think>\s*\d+", True, "  <think>a\nb</think> 42 \n", 1.0),
        (r"\d+", False, "no digits", 0.0),
    ],
)
def test_format(pattern, full, response, want):
    src = FormatReward(name="f", pattern=pattern, full_match=full)
    assert score_item(src, _item(response), RuleScorerState()) == want


def test_math_source_through_state():
    state = RuleScorerState()
    assert state.score(MathReward(name="m"), _item("\\boxed{1,234}", GSM8K_GT)) == 1.0


def test_function_source_gets_every_keyword_and_kwargs():
    state = RuleScorerState()
    src = FunctionReward(name="fn", function="tests.unit.reward_fns:ok", kwargs={"bonus": 0.5})
    assert state.score(src, _item(" yes ", "yes")) == 1.5
    echo = FunctionReward(name="e", function="tests.unit.reward_fns:echo_info")
    item = _item("r", "g", data_source="abc", extra_info={"x": 2})
    assert state.score(echo, item) == 2 + 3 + 1  # extra_info x + len("abc") + len("p")
    assert set(state.functions) == {"tests.unit.reward_fns:ok", "tests.unit.reward_fns:echo_info"}


@pytest.mark.parametrize("name", ["returns_text", "returns_nan", "returns_1e39"])
def test_function_bad_result_is_an_error(name):
    """1e39 is a float64 and no float32: it would reach the learner as an infinity."""
    src = FunctionReward(name="fn", function=f"tests.unit.reward_fns:{name}")
    with pytest.raises(RuleError):
        RuleScorerState().score(src, _item("r"))


def test_load_function_errors():
    with pytest.raises(RuleError, match="package.module:function"):
        load_function("tests.unit.reward_fns.ok")
    with pytest.raises(ModuleNotFoundError):
        load_function("no_such_module_xyz:f")
    with pytest.raises(AttributeError):
        load_function("tests.unit.reward_fns:missing")


def test_math_verify_timeout_falls_back_to_numbers():
    from math_verify.errors import TimeoutException

    class SlowVerify:
        """math-verify whose comparison always times out."""

        @staticmethod
        def parse(text, parsing_timeout=None):
            return [text]

        @staticmethod
        def verify(gold, target, timeout_seconds=None, raise_on_error=False):
            raise TimeoutException("Timeout during comparison")

    verifier = MathVerifier()
    verifier._mv = SlowVerify
    verifier._timeout_error = TimeoutException
    assert verifier.score("so 42", "42") == 1.0  # decided by the numbers, not the timeout
    assert verifier.score("so 41", "42") == 0.0
