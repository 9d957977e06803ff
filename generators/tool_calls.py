"""A turn's tool calls: found by the run's parser, run at once (each under its deadline and
its tool's limit) and answered as ``role: tool`` messages.

    ToolBox          one per environment entry with tools, per generator
      parse(text)    the turn's calls and malformed ones (verl_async/tools/parsers.py,
                     ``multiturn.tool_parser``)
      answer(...)    one ``role: tool`` message per call, in call order, with its id and
                     name: the result, or an error the model reads next

Where a tool runs, never on the generator's event loop:

- a plain function: on a thread of the box's pool;
- an ``async def`` function: on an event loop of the box's own, in a thread (a coroutine
  that blocks stalls only the box's other async tools, never the generator);
- an environment's method (``methods_as_tools``): on its instance's thread, one call at
  a time after the other, as code written for one thread expects.

A tool that raises ``ToolError`` (the sandboxed ``python`` tool, when a limit stopped the
program) is answered with that error's text (what the program printed, then
``Error: ...``), counted as a tool error.

Each call has the deadline of an environment call (``multiturn.step_timeout_s``, and what
is left of the episode's ``episode_timeout_s``), waits for its tool's
``max_concurrent`` within it, and ends in one of: a result (cut to
``multiturn.max_tool_response_tokens``, a cut counted as a tool error); an error message
for an unknown tool, arguments the schema refuses, a tool that raised, or a call past
``multiturn.max_parallel_calls`` (tool errors); a timeout (a tool timeout). A plain function
past its deadline keeps its pool thread until it returns; calls that find no thread free
wait, within their own deadline. The pool's threads are daemon threads
(``DaemonPool``): one that never returns cannot hold the generator's exit, as a
``ThreadPoolExecutor``'s would (Python joins those at interpreter exit). A malformed call (the parser's errors) is answered with
an error message too, and counted in ``tool_parse_errors``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from generators.env_instances import EnvCounts
from generators.env_threads import EnvCallError, error_text
from generators.render import Renderer
from verl_async.config_base import ConfigError
from verl_async.schema import MultiTurnConfig
from verl_async.tools.parsers import ParsedTurn, ToolCall, ToolCallParser
from verl_async.tools.sandbox import ToolError
from verl_async.tools.schemas import Tool, ToolCallError, check_arguments, result_text

_CHARS_PER_TOKEN = 8  # a result is cut to this many characters per token before tokenizing
_POOL_THREADS = 32  # threads of a box's pool for plain functions


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
                except BaseException as exc:  # the caller's await raises it
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1


class ToolBox:
    """The tools of one environment entry on one generator: their schemas, the parser, the
    renderer that puts the schemas in prompts, and where each tool runs."""

    def __init__(
        self,
        tools: list[Tool],
        method_tools: list[Tool],
        mt: MultiTurnConfig,
        tokenizer,
        renderer: Renderer,
        template: str | None,
    ) -> None:
        self.mt = mt
        self.tokenizer = tokenizer
        self.tools = {t.name: t for t in tools}
        self.methods = {t.name: t for t in method_tools}  # bound per episode, by name
        self.schemas = [t.schema for t in [*tools, *method_tools]]
        self.renderer = templated(renderer.with_tools(self.schemas, template), "tools go into")
        self.parser = ToolCallParser(
            mt.tool_parser, tokenizer, self.schemas, "multiturn.tool_parser"
        )
        self._limits: dict[str, asyncio.Semaphore] = {}
        self._pool = DaemonPool(_POOL_THREADS, "tool")
        self._loop: asyncio.AbstractEventLoop | None = None  # for async tools, once needed

    def parse(self, text: str, turn: int) -> ParsedTurn:
        """Turn ``turn``'s calls (ids ``call_<turn>_<i>``), or its malformed ones."""
        return self.parser.parse(text, turn)

    async def answer(
        self, parsed: ParsedTurn, deadline: float, counts: EnvCounts, on_instance=None
    ) -> list[dict]:
        """The turn's calls run at once and answered in call order, each counted in the
        episode's ``counts``; ``on_instance(name, kwargs, timeout_s)`` runs an
        environment's method on its instance's thread."""
        messages = []
        calls = parsed.calls[: self.mt.max_parallel_calls]
        results = await asyncio.gather(*(self._run(call, deadline, on_instance) for call in calls))
        for call, (content, fault) in zip(calls, results, strict=True):
            messages.append(_tool_message(call, content))
            counts.tool_calls += 1
            counts.tool_errors += fault == "error"
            counts.tool_timeouts += fault == "timeout"
        for call in parsed.calls[self.mt.max_parallel_calls :]:
            content = (
                f"error: at most {self.mt.max_parallel_calls} tool calls run per turn; "
                "this one did not run"
            )
            messages.append(_tool_message(call, content))
            counts.tool_errors += 1
        if not parsed.calls:  # malformed: none ran (an unknown name is answered above)
            for problem in parsed.errors:
                messages.append({"role": "tool", "content": f"error: {problem}"[:300]})
                counts.tool_parse_errors += 1
        return messages

    async def _run(self, call: ToolCall, deadline: float, on_instance) -> tuple[str, str]:
        """(what the model reads, "" or the fault: "error" or "timeout")."""
        tool = self.tools.get(call.name) or self.methods.get(call.name)
        if tool is None or (call.name in self.methods and on_instance is None):
            known = ", ".join(sorted([*self.tools, *self.methods])) or "none"
            return f"error: there is no tool named {call.name!r} (tools: {known})"[:300], "error"
        try:
            kwargs = check_arguments(tool, call.arguments())
        except (ToolCallError, ValueError) as exc:
            return f"error: {exc}"[:300], "error"
        timeout_s = min(self.mt.step_timeout_s, deadline - time.monotonic())
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                async with self._limit(tool):
                    left = timeout_s - (time.monotonic() - t0)
                    if call.name in self.methods:
                        value = await on_instance(call.name, kwargs, left)
                    else:
                        value = await self._call(tool, kwargs)
        except TimeoutError:
            return f"error: the tool {call.name} timed out after {timeout_s:.3g} s", "timeout"
        except EnvCallError as err:  # an environment's method
            return err.observation(), "timeout" if err.timed_out else "error"
        except ToolError as exc:  # a contained fault whose text is the answer (a sandbox's)
            return self._cut(str(exc))[0], "error"
        except Exception as exc:  # noqa: BLE001 (the tool's fault, whatever it is)
            return error_text(exc), "error"
        try:
            text = result_text(tool, value)
        except TypeError as exc:  # a result that is neither text nor JSON
            return error_text(exc), "error"
        return self._cut(text)

    def _limit(self, tool: Tool):
        if not tool.max_concurrent:
            return contextlib.nullcontext()
        if tool.name not in self._limits:
            self._limits[tool.name] = asyncio.Semaphore(tool.max_concurrent)
        return self._limits[tool.name]

    async def _call(self, tool: Tool, kwargs: dict) -> Any:
        if tool.is_async:
            coro_future = asyncio.run_coroutine_threadsafe(tool.fn(**kwargs), self._tool_loop())
            try:
                return await asyncio.wrap_future(coro_future)
            finally:
                coro_future.cancel()  # past its deadline: the coroutine is cancelled there
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(tool.fn, **kwargs))

    def _tool_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="tool-loop", daemon=True).start()
            self._loop = loop
        return self._loop

    def _cut(self, text: str) -> tuple[str, str]:
        """``text`` within ``max_tool_response_tokens`` ("error" if it had to be cut)."""
        limit = self.mt.max_tool_response_tokens
        cut = len(text) > limit * _CHARS_PER_TOKEN
        if cut:
            text = text[: limit * _CHARS_PER_TOKEN]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > limit:
            text, cut = self.tokenizer.decode(ids[:limit]), True
        return (text + " [truncated]", "error") if cut else (text, "")


def _tool_message(call: ToolCall, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def templated(renderer: Renderer, what: str) -> Renderer:
    """``renderer`` if it renders with a chat template; else ConfigError naming
    ``multiturn.tool_template`` (``what`` goes through one: tools, an agent's messages)."""
    if not renderer.templated:
        raise ConfigError(
            f"bad value for 'multiturn.tool_template': the tokenizer has no chat template, and "
            f"{what} the prompt through one; name a template (chatml_tools, or a Jinja file)"
        )
    return renderer
