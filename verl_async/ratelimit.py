"""Log lines that a flood of hostile or broken peers cannot turn into a full disk.

Servers log what peers get wrong (messages the buffer rejects, replies to vanished peers,
refused CurveZMQ handshakes). A real peer's mistake is rare and its first lines say what
went wrong; a flood must cost a few lines. ``RateLimitedLog`` writes a burst of lines per
window and one summary line of what it left out; ``short`` cuts a peer-provoked text.
A leaf module (it imports nothing of verl_async), so auth.py and transport/ both use it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Hashable

MAX_TEXT = 400  # characters of a peer-provoked error message kept in a reply or a log line


def short(value):
    """A peer-provoked text cut to MAX_TEXT characters (other values as they are)."""
    if isinstance(value, str) and len(value) > MAX_TEXT:
        return value[:MAX_TEXT] + f"... ({len(value) - MAX_TEXT} more characters)"
    return value


class RateLimitedLog:
    """At most ``burst + 1`` lines a window of ``window_s`` seconds, whatever arrives.

    The first ``burst`` lines of a window are written in full (their string arguments cut
    by ``short``); past that they are only counted by kind, and when the window ends one
    summary line says how many ``what`` were left out, by kind. ``flush`` ends a window
    whose time is up (servers call it from their tickers, so the summary comes without
    waiting for the next line). Optional dedup: a line with ``once=KEY`` is written only
    the first time KEY comes, for good (a peer retrying forever is named once; at most
    ``MAX_KEYS`` keys are remembered, new ones past that are counted, not named); a line
    with ``once_a_window`` only the first time its kind comes in a window. Thread-safe
    (the CurveZMQ guard logs from two threads); ``clock`` is injectable for tests.
    """

    MAX_KEYS = 4096  # ``once`` keys remembered; past that, new ones are counted, not named

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 20,
        window_s: float = 10.0,
        clock=time.monotonic,
        what: str = "rejected messages",
    ) -> None:
        self.logger, self.what = logger, what
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self.lock = threading.Lock()
        self.seen: set[Hashable] = set()  # ``once`` keys already logged (for good)
        self.kinds_seen: set[str] = set()  # ``once_a_window`` kinds logged in this window
        self.window_start = clock()
        self.logged = 0
        self.suppressed: Counter[str] = Counter()

    def log(
        self,
        kind: str,
        msg: str,
        *args,
        once: Hashable | None = None,
        once_a_window: bool = False,
        level: int = logging.WARNING,
        **kw,
    ) -> None:
        """``logger.log(level, msg, *args)`` unless the burst is spent or a dedup says
        this line was written already (see the class doc); otherwise ``kind`` is counted."""
        with self.lock:
            self._roll()
            if self._repeat(kind, once, once_a_window) or self.logged >= self.burst:
                self.suppressed[kind] += 1
                return
            if once is not None:
                self.seen.add(once)
            if once_a_window:
                self.kinds_seen.add(kind)
            self.logged += 1
            self.logger.log(level, msg, *(short(a) for a in args), **kw)

    def _repeat(self, kind: str, once: Hashable | None, once_a_window: bool) -> bool:
        if once_a_window and kind in self.kinds_seen:
            return True
        return once is not None and (once in self.seen or len(self.seen) >= self.MAX_KEYS)

    def flush(self) -> None:
        """End the window if its time is up: the summary line of what was left out."""
        with self.lock:
            self._roll()

    def _roll(self) -> None:
        now = self.clock()
        if now - self.window_start < self.window_s:
            return
        if self.suppressed:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.suppressed.items()))
            self.logger.warning(
                "%d more %s in the last %.0fs were not logged (%s)",
                self.suppressed.total(),
                self.what,
                now - self.window_start,
                kinds,
            )
        self.window_start, self.logged, self.suppressed = now, 0, Counter()
        self.kinds_seen.clear()
