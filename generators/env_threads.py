"""Where environment code runs: a thread of its own per environment instance, a bounded
number of them per environment.

    EnvThreads      one per ``multiturn.environments`` entry; at most ``limit`` threads
      InstanceThread  one instance's, for its whole life: the constructor, ``reset``, each
                      ``step`` and ``close`` run on it one after another; ``async def``
                      methods on an event loop of the instance's own (``asyncio.Runner``)

Why not one event loop for every ``async`` environment and a thread per plain call, as
before: a coroutine that blocks (a ``time.sleep`` or a synchronous HTTP call inside an
``async def``) stalls the loop it runs on, and on a shared loop it timed out the calls of
every async environment of the generator; and a plain call past its deadline cannot be
stopped, so a thread per call grew without bound under an environment that hangs. Here a
blocking coroutine stalls only its own instance, and every method of an instance runs on
one thread, as code written for one thread expects (a sqlite connection opened in
``__init__``, thread-local state).

A call past its deadline: a coroutine is cancelled; one that does not finish within
``CANCEL_GRACE_S`` after that blocks its loop, and then, like a plain call past its
deadline, leaves the instance *stuck*: nothing more is called on it except ``close``,
queued behind the stuck call. A stuck thread counts against its environment's limit until
its call returns (if ever), so an environment that hangs can use up only its own threads;
its next episodes then wait for one within their deadline, and time out, counted, while
other environments go on. Threads are reused: once an instance is closed and its event loop
shut down, its thread serves the next instance of the same environment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from generators.user_code import Raised, error_text

log = logging.getLogger("verl_async.generator")

CANCEL_GRACE_S = 0.5  # a cancelled coroutine that takes longer than this blocks its loop
_END = object()  # the job that ends an instance on its thread


class EnvCallError(Exception):
    """An environment call that raised (``cause``) or passed its deadline (``timed_out``)."""

    def __init__(
        self, what: str, cause: BaseException | None, timed_out: bool, running: bool = False
    ) -> None:
        super().__init__(what)
        self.cause = cause
        self.timed_out = timed_out
        self.running = running  # past its deadline and still running: the instance is stuck

    def observation(self) -> str:
        if self.timed_out:
            return f"error: the environment's {self} timed out"
        return error_text(self.cause)


@dataclass(eq=False)
class _Job:
    fn: Callable
    args: tuple
    then: Callable[[Any], Any] | None  # checks the result on the instance's thread
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    task: asyncio.Task | None = None  # the coroutine's, once it runs
    cancelled: bool = False  # asked to stop before or while its coroutine runs
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stop the job: if still queued it never runs; a coroutine is cancelled."""
        with self.lock:
            self.cancelled = True
            task = self.task
        self.future.cancel()
        if task is not None:
            # RuntimeError: its loop is already closed, the coroutine is over.
            with contextlib.suppress(RuntimeError):
                task.get_loop().call_soon_threadsafe(task.cancel)


class InstanceThread:
    """One thread that runs one environment instance's calls at a time, in order."""

    def __init__(self, name: str, freed: Callable[[InstanceThread], None]) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._freed = freed  # called on this thread once an instance has ended on it
        self._runner: asyncio.Runner | None = None
        self.stuck = False  # a call past its deadline still runs here
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    # ---------------------------------------------------------------- the thread's side

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _END:
                self._end_instance()
            else:
                self._run(job)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # cancelled while queued
        try:
            result = job.fn(*job.args)
            if inspect.iscoroutine(result):
                result = self._loop_runner().run(self._tracked(job, result))
            if job.then is not None:
                result = job.then(result)
        except Exception as exc:  # noqa: BLE001 (the environment's fault, handed over)
            job.future.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001 (SystemExit and the like, too)
            job.future.set_exception(Raised(exc))
        else:
            job.future.set_result(result)

    async def _tracked(self, job: _Job, coro) -> Any:
        with job.lock:
            job.task = asyncio.current_task()
            if job.cancelled:
                job.task.cancel()
        return await coro

    def _loop_runner(self) -> asyncio.Runner:
        if self._runner is None:
            # loop_factory: the thread's current event loop stays unset, so a plain method
            # that calls asyncio.run() itself still can.
            self._runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
        return self._runner

    def _end_instance(self) -> None:
        """Shut the instance's event loop down (its leftover tasks are cancelled), then
        offer the thread to the next instance."""
        if self._runner is not None:
            try:
                self._runner.close()
            except BaseException as exc:  # noqa: BLE001 (a leftover task's own fault)
                log.warning("an environment's event loop did not shut down cleanly: %r", exc)
            self._runner = None
        self.stuck = False
        self._freed(self)

    # ---------------------------------------------------------------- the caller's side

    async def call(self, what: str, fn: Callable, *args, timeout_s: float, then=None) -> Any:
        """``then(fn(*args))`` on this thread (a coroutine ``fn`` returns runs on the
        instance's loop); raises ``EnvCallError`` when it raises or is not done in
        ``timeout_s``. Cancelling the caller cancels the call as far as it can be."""
        job = _Job(fn, args, then)
        self._jobs.put(job)
        done = asyncio.wrap_future(job.future)
        done.add_done_callback(_retrieve)  # a result nobody waits for any more is dropped
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await asyncio.shield(done)
        except TimeoutError:
            job.cancel()
            if job.task is not None:  # a coroutine: it stops at its next await, if any
                await asyncio.wait([done], timeout=CANCEL_GRACE_S)
            running = not done.done()
            self.stuck = self.stuck or running
            raise EnvCallError(what, None, timed_out=True, running=running) from None
        except asyncio.CancelledError:
            job.cancel()
            self.stuck = self.stuck or not done.done()
            raise
        except Raised as exc:
            raise EnvCallError(what, exc.exc, timed_out=False) from None
        except Exception as exc:  # noqa: BLE001 (the environment's own error)
            raise EnvCallError(what, exc, timed_out=False) from exc

    def submit(self, fn: Callable, *args) -> None:
        """Queue ``fn(*args)`` without waiting for it (a stuck instance's ``close``)."""
        self._jobs.put(_Job(fn, args, None))

    def end(self) -> None:
        """The instance is done with this thread: once its last call has returned, the
        thread goes back to its environment's pool."""
        self._jobs.put(_END)


def _retrieve(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()


class EnvThreads:
    """The threads of one environment's instances: at most ``limit`` at once, reused."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[InstanceThread] = []
        self._numbers = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.made = 0  # threads started (at most limit)

    @property
    def busy(self) -> int:
        """Threads that an instance holds, or that a call past its deadline still holds."""
        return self.made - len(self._idle)

    async def acquire(self, timeout_s: float) -> InstanceThread:
        """A thread for a new instance; raises ``EnvCallError`` (a timeout of the
        constructor) when none is free within ``timeout_s``."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._slots.acquire()
        except TimeoutError:
            what = f"constructor (all {self.limit} of its threads busy)"
            raise EnvCallError(what, None, timed_out=True) from None
        if self._idle:
            return self._idle.pop()
        self.made += 1
        return InstanceThread(f"env-{self.name}-{next(self._numbers)}", self._freed)

    def _freed(self, thread: InstanceThread) -> None:
        """(On ``thread``) its instance has ended: the slot goes back on the caller's loop."""
        # RuntimeError: the generator's loop is closed, it is shutting down.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._give_back, thread)

    def _give_back(self, thread: InstanceThread) -> None:
        self._idle.append(thread)
        self._slots.release()
