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
wait, within their own deadline (generators/user_code.py: the pool's threads are daemon
threads, and the loop of ``async def`` tools runs on after anything a tool raises). A
malformed call (the parser's errors) is answered with an error message too, and counted in
``tool_parse_errors``.

Whatever a tool raises, ``BaseException`` included (a wrapped CLI's ``SystemExit``), and
whatever it returns (a value ``json.dumps`` cannot write) is an error message for that
call, counted; never the box's threads, its loop or the generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from generators.env_threads import EnvCallError
from generators.recorder import EpisodeCounts
from generators.render import Renderer
from generators.user_code import DaemonPool, LoopThread, error_text
from verl_async.config_base import ConfigError
from verl_async.ratelimit import RateLimitedLog
from verl_async.schema import MultiTurnConfig
from verl_async.tools.parsers import ParsedTurn, ToolCall, ToolCallParser
from verl_async.tools.sandbox import ToolError
from verl_async.tools.schemas import Tool, ToolCallError, check_arguments, result_text

log = logging.getLogger("verl_async.generator")

_CHARS_PER_TOKEN = 8  # a result is cut to this many characters per token before tokenizing
_POOL_THREADS = 32  # threads of a box's pool for plain functions


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
        self._loop: LoopThread | None = None  # for async tools, once needed
        self._faults = RateLimitedLog(log, what="tool faults")

    def parse(self, text: str, turn: int) -> ParsedTurn:
        """Turn ``turn``'s calls (ids ``call_<turn>_<i>``), or its malformed ones."""
        return parse_calls(self.parser, text, turn)

    async def answer(
        self, parsed: ParsedTurn, deadline: float, counts: EpisodeCounts, on_instance=None
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
        except Exception as exc:  # noqa: BLE001 (arguments nested too deep to read, ...)
            return error_text(exc), "error"
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
            self._logged(call.name, f"timed out after {timeout_s:.3g} s")
            return f"error: the tool {call.name} timed out after {timeout_s:.3g} s", "timeout"
        except EnvCallError as err:  # an environment's method
            return err.observation(), "timeout" if err.timed_out else "error"
        except ToolError as exc:  # a contained fault whose text is the answer (a sandbox's)
            return self._cut(str(exc))[0], "error"
        except Exception as exc:  # noqa: BLE001 (the tool's fault, whatever it is: Raised too)
            self._logged(call.name, error_text(exc))
            return error_text(exc), "error"
        try:
            text = result_text(tool, value)
        except Exception as exc:  # noqa: BLE001 (not text nor JSON; nested too deep to write)
            self._logged(call.name, error_text(exc))
            return error_text(exc), "error"
        return self._cut(text)

    def _logged(self, name: str, what: str) -> None:
        """Once per tool and kind of fault (its exception's type); later ones are counted."""
        kind = f"{name}: {what.split(':')[1] if what.startswith('error:') else what}"
        self._faults.log(
            kind,
            "tool %s: %s (later faults of this kind are only counted: multiturn/tool_errors, "
            "multiturn/tool_timeouts)", name, what, once=kind,
        )  # fmt: skip

    def _limit(self, tool: Tool):
        if not tool.max_concurrent:
            return contextlib.nullcontext()
        if tool.name not in self._limits:
            self._limits[tool.name] = asyncio.Semaphore(tool.max_concurrent)
        return self._limits[tool.name]

    async def _call(self, tool: Tool, kwargs: dict) -> Any:
        """The tool's value (what it raises comes out as itself, or as ``Raised``)."""
        if tool.is_async:
            if self._loop is None:
                self._loop = LoopThread("tool-loop")
            future = self._loop.submit(_await_tool, tool, kwargs)
            try:
                return await asyncio.wrap_future(future)
            finally:
                future.cancel()  # past its deadline: the coroutine is cancelled there
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(tool.fn, **kwargs))

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


async def _await_tool(tool: Tool, kwargs: dict) -> Any:
    """(On the tools' loop) an ``async def`` tool called and awaited there: even making
    its coroutine is the tool's code."""
    return await tool.fn(**kwargs)


def _tool_message(call: ToolCall, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def parse_calls(parser: ToolCallParser, text: str, turn: int = 0) -> ParsedTurn:
    """``parser.parse``, and should the parser fail on model text after all (it is built
    not to), that turn's parse error rather than the episode's end."""
    try:
        return parser.parse(text, turn)
    except Exception as exc:  # noqa: BLE001 (model text is a boundary: RecursionError, ...)
        return ParsedTurn(text or None, [], [f"the tool-call parser failed: {error_text(exc)}"])


def templated(renderer: Renderer, what: str) -> Renderer:
    """``renderer`` if it renders with a chat template; else ConfigError naming
    ``multiturn.tool_template`` (``what`` goes through one: tools, an agent's messages)."""
    if not renderer.templated:
        raise ConfigError(
            f"bad value for 'multiturn.tool_template': the tokenizer has no chat template, and "
            f"{what} the prompt through one; name a template (chatml_tools, or a Jinja file)"
        )
    return renderer
