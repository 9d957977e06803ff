"""Tools for the schema tests (loaded by spec, ``tests.unit.tool_fns:add``)."""

from __future__ import annotations

import asyncio


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def search(query: str, limit: int | None = None) -> list[str]:
    """Search the notes.

    Args:
        query: What to look for.
        limit: At most this many results.
    """
    await asyncio.sleep(0)
    return [f"note about {query}"][:limit]


class Counter:
    """A callable object: each call counts."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, step: int) -> str:
        """Count up.

        Args:
            step: How much to add.
        """
        self.calls += step
        return f"count={self.calls}"


count = Counter()


def undocumented(x: int) -> int:
    return x


def untyped(x):
    """Echo.

    Args:
        x: Anything.
    """
    return x


def takes_any(**kwargs) -> dict:
    return kwargs


def returns_a_set() -> set:
    """A result that is not JSON."""
    return {1}


NOT_CALLABLE = 3


class Inventory:
    """An environment in TRL's environment_factory style: public methods are tools."""

    def __init__(self) -> None:
        self.items: dict[str, int] = {}

    def reset(self, row=None):
        self.items = {}

    def step(self, text: str):
        return [], None, False

    def close(self) -> None:
        pass

    def put(self, item: str, n: int = 1) -> str:
        """Put items in the inventory.

        Args:
            item: The item's name.
            n: How many.
        """
        self.items[item] = self.items.get(item, 0) + n
        return f"{item}: {self.items[item]}"

    async def look(self) -> dict:
        """List the inventory."""
        return dict(self.items)

    @property
    def total(self) -> int:
        raise AssertionError("a property must not be evaluated while listing tools")

    def _helper(self) -> None:
        pass


def fails(x: int) -> int:
    """A tool that raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"tool broke on {x}")


def slow(seconds: float) -> str:
    """A tool that takes a while (past the step deadline in the tests).

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return "late"


def shout(text: str) -> str:
    """A long answer.

    Args:
        text: The word to repeat.
    """
    return " ".join([text] * 1000)


_MEETING = __import__("threading").Barrier(2, timeout=10)


def meet(who: str) -> str:
    """Wait until a second call is here too (two calls that run at once both return).

    Args:
        who: Who came.
    """
    _MEETING.wait()
    return f"{who} met"
