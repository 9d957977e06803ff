"""Reward functions for the scoring-process tests (imported by the scoring process)."""

from __future__ import annotations

import os
import time


def ok(prompt, response, ground_truth, data_source, extra_info, bonus: float = 0.0) -> float:
    return (1.0 if response.strip() == ground_truth.strip() else 0.0) + bonus


def echo_info(prompt, response, ground_truth, data_source, extra_info) -> float:
    """Proves every keyword arrives: extra_info["x"] + len(data_source) + len(prompt)."""
    return float(extra_info["x"]) + len(data_source) + len(prompt)


def raises(**kwargs) -> float:
    raise ValueError("reward exploded")


def hangs(**kwargs) -> float:
    time.sleep(60)
    return 1.0


def kills_process(**kwargs) -> float:
    os._exit(3)


def returns_text(**kwargs) -> str:
    return "1.0"


def returns_nan(**kwargs) -> float:
    return float("nan")
