"""Reward functions that misbehave in every way a ``BaseException`` allows, for the
scoring-process tests (imported by the scoring process): each must cost its item only."""

from __future__ import annotations

import sys


def exits(**kwargs) -> float:
    sys.exit(2)  # what argparse or a stray sys.exit in a user's helper does


def interrupts(**kwargs) -> float:
    raise KeyboardInterrupt


def recurses(**kwargs) -> float:
    return recurses(**kwargs)


def out_of_memory(**kwargs) -> float:
    raise MemoryError("no room for the reward")


class _BadFloat:
    """A result whose conversion to a number raises SystemExit."""

    def __float__(self) -> float:
        raise SystemExit("not a number after all")


def returns_bad_float(**kwargs) -> object:
    return _BadFloat()


class _Unprintable(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


def raises_unprintable(**kwargs) -> float:
    raise _Unprintable


def returns_none(**kwargs) -> None:
    return None
