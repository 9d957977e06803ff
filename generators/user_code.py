"""Where user code runs, and the boundary its faults stop at.

Tools, agents and environments are the user's code: trusted not to be hostile, never
trusted to behave. Whatever they raise, ``BaseException`` included (a wrapped CLI's
``argparse`` raises ``SystemExit``; ``KeyboardInterrupt``, ``RecursionError``,
``MemoryError``, a ``CancelledError`` of their own), costs their call and nothing else:
never a thread, an event loop or the generator.

Why that needs care: a ``concurrent.futures.Future`` carries any exception to whoever
awaits it, so a tool's ``SystemExit`` set on it is raised again on the generator's event
loop; and an asyncio task whose coroutine raises ``SystemExit`` or ``KeyboardInterrupt``
re-raises it out of ``run_forever``, which ends the thread running that loop (every later
call on it then waits for its deadline). So:

    Raised        what a call raised that is not an ``Exception``, carried as one
    contained()   awaits user code, turning ``BaseException`` into ``Raised`` (a cancel
                  that comes from the caller still cancels)
    DaemonPool    daemon threads for plain functions; a call that never returns keeps
                  its thread, not the process (Python joins a ThreadPoolExecutor's threads
                  at exit); what a call raises reaches the caller as ``Raised`` at worst
    LoopThread    an event loop in a daemon thread for ``async def`` user code; a
                  ``BaseException`` that still escapes the loop (a task the user code
                  started itself) is logged and the loop runs on, and a thread that died
                  anyway is replaced at the next call, loudly

``error_text`` is how any of these faults reads to the model (the error message of a tool
call, an environment's error observation).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from verl_async.ratelimit import RateLimitedLog

log = logging.getLogger("verl_async.generator")


class Raised(Exception):
    """Carries what user code raised that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, a ``CancelledError`` of its own): a fault like any other."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {_text(exc)}")
        self.exc = exc


def cause(exc: BaseException) -> BaseException:
    """The user's own exception behind ``exc`` (``Raised`` unwrapped)."""
    return exc.exc if isinstance(exc, Raised) else exc


def error_text(exc: BaseException) -> str:
    """``exc`` as the error message the model reads next (at most 300 characters)."""
    exc = cause(exc)
    return f"error: {type(exc).__name__}: {_text(exc)}"[:300]


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 (an exception of the user's that cannot print)
        return "(unprintable)"


async def contained(fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """``await fn(*args, **kwargs)``; what it raises that is not an ``Exception`` comes out
    as ``Raised``. A ``CancelledError`` is ours only when this task was asked to cancel
    (a deadline, the group cancelled); one the user code raised by itself is its fault."""
    try:
        return await fn(*args, **kwargs)
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise Raised(exc) from None
    except Exception:
        raise
    except BaseException as exc:  # noqa: BLE001 (SystemExit, KeyboardInterrupt, ...)
        raise Raised(exc) from None


class DaemonPool(concurrent.futures.Executor):
    """At most ``threads`` daemon threads running submitted calls in order of submission,
    started as calls need them. A call that never returns keeps its thread, and the
    process can still exit."""

    def __init__(self, threads: int, name: str) -> None:
        self._max, self._name = threads, name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = self._idle = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._idle <= 0 and self._started < self._max:
                self._started += 1
                self._idle += 1
                name = f"{self._name}-{self._started}"
                threading.Thread(target=self._serve, name=name, daemon=True).start()
            self._idle -= 1  # this call takes an idle thread, or waits for one
        self._work.put((future, fn, args, kwargs))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._work.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001 (the caller's await raises it)
                    future.set_exception(exc)
                except BaseException as exc:  # noqa: BLE001 (never this thread's end)
                    future.set_exception(Raised(exc))
            with self._lock:
                self._idle += 1


class LoopThread:
    """An event loop in a daemon thread of its own, for ``async def`` user code: a
    coroutine that blocks stalls only this loop's other calls, never the generator."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.escaped = 0  # BaseExceptions that came out of the loop (it ran on)
        self.replaced = 0  # threads found dead and replaced
        self._log = RateLimitedLog(log, what=f"faults on the {name} loop")
        self._start()

    def _start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopping:
            try:
                self.loop.run_forever()
            except BaseException as exc:  # noqa: BLE001 (a task of the user's own raised it)
                self.escaped += 1
                self._log.log(
                    type(exc).__name__,
                    "%s came out of the %s loop (a task the user code started raised it; "
                    "%d so far); the loop runs on",
                    repr(exc)[:200], self.name, self.escaped, level=logging.WARNING,
                )  # fmt: skip

    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> concurrent.futures.Future:
        """``fn(*args)`` on this loop, contained (``contained``)."""
        if not self._thread.is_alive() and not self._stopping:
            self.replaced += 1
            log.error(
                "the %s loop's thread died (%d so far): a new one takes its calls",
                self.name, self.replaced,
            )  # fmt: skip
            self._start()
        return asyncio.run_coroutine_threadsafe(contained(fn, *args), self.loop)

    def stop(self) -> None:
        """Stop the loop (its tasks are left as they are: the process is ending)."""
        self._stopping = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
