"""Reward functions for the scoring-process tests (imported by the scoring process)."""

from __future__ import annotations

import itertools
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


def returns_1e39(**kwargs) -> float:
    """Finite in float64 and infinite in float32, where rewards are trained."""
    return 1e39


# What ``sometimes_not_finite`` returns in turn, one in every ``_EVERY`` calls.
_POISON = (1e39, float("nan"), float("inf"), -float("inf"), -1e39)
_EVERY = 5
_calls = itertools.count()  # this scoring process's calls so far


def sometimes_not_finite(prompt, response, ground_truth, data_source, extra_info) -> float:
    """As ``ok``, but every fifth call returns a value that is not finite in float32: by call
    count, so a run of any speed gets its share of them."""
    n = next(_calls)
    if n % _EVERY == 0:
        return _POISON[(n // _EVERY) % len(_POISON)]
    return ok(prompt, response, ground_truth, data_source, extra_info)


def mostly_constant(
    prompt, response, ground_truth, data_source, extra_info, all_alike: str = ""
) -> float:
    """0 for three prompts of four (by a hash of the prompt); for the fourth, a hash bit of
    the response, which differs among a group's responses unless they are all the same.
    Dynamic sampling then drops about three groups of four. Once the file ``all_alike``
    exists, 0 for every prompt: every group is then dropped."""
    import zlib

    if zlib.crc32(str(prompt).encode()) % 4 or (all_alike and os.path.exists(all_alike)):
        return 0.0
    return float(zlib.crc32(response.encode()) % 2)
