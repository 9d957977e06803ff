"""An OpenAI-compatible chat-completions endpoint served by a generator's engine.

Agents written against the plain ``openai`` client call it; each episode's calls are
recorded token for token by the recorder every rollout uses (generators/recorder.py).

    server = EndpointServer(engine, tokenizer, Sampling.training(cfg), model_name="policy",
                            max_episode_tokens=4096, max_calls=16, parse_calls=hermes)
    await server.start()
    key, base_url = server.open_episode()
    ...  # the agent: openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    episode = server.close_episode(key)  # episode.recorder: token-exact, loss-masked samples

HTTP (aiohttp, on the event loop of the engine; loopback only, port 0 unless given):
``POST /v1/<key>/chat/completions`` and ``GET /v1/<key>/models``. Each episode has its own
key (``secrets.token_urlsafe``), which is the only thing telling episodes apart: an
unknown or closed key is a 404, a bad request a 400, a failed engine a 500, each with
OpenAI's error body (generators/chat_api.py says what a request may ask); a bad request
never stops the server. Bodies are limited to ``max_body_bytes``. Access logs are off
(they would hold the keys).

Checked before anything is rendered, in this order: the body (JSON, nesting, fields), the
model (``model_name``, else 404 ``model_not_found``), the episode's ``max_calls`` (400
``max_calls_exceeded``), and the body's size against ``max_episode_tokens`` (a body of
more than ``MAX_CHARS_PER_TOKEN`` characters per token of the episode cannot fit: 400
``context_length_exceeded``). Then the prompt is rendered: a call that continues an
earlier one of its episode as that call's exact ids and the template's continuation
(``Renderer.continuation``), any other whole. A prompt that leaves no room for a token is
a 400 ``context_length_exceeded``; the run's ``Sampling`` gives the defaults and the
ceiling (a request may lower ``max_tokens``, never raise it, and add ``stop`` strings).

What the server keeps between calls is bounded in bytes (``RENDER_CACHE_BYTES``): whole
renders and deltas (the episodes of one group begin with the same messages), renderers and
parsers per tool set.

Overlapping calls of one episode (an agent with parallel branches) are served
concurrently, not serialised: each is recorded when it completes (the recorder treats
what does not extend as a new sample). A call still running when its episode is closed is
answered 404 and not recorded (the episode was handed over).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from generators.chat_api import (
    ChatRequest,
    OpenAIError,
    ParseCalls,
    assistant_reply,
    bad,
    completion_body,
    parse_request,
    same_message,
)
from generators.interface import RolloutEngine, Sampling
from generators.recorder import EpisodeRecorder
from generators.render import Renderer

log = logging.getLogger("verl_async.generator")

SHUTDOWN_S = 5.0  # how long stop() lets running calls finish before cancelling them
LOGGED_AT_MOST = 64  # distinct ignored fields logged (requests choose their names)
RENDER_CACHE_BYTES = 32 << 20  # what the render caches may hold together
MAX_CHARS_PER_TOKEN = 64  # no tokenizer spells a token with more characters on average


class BoundedCache:
    """A least-recently-used map whose entries' sizes (in bytes, as the caller counts
    them) stay within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def get(self, key: str) -> Any:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: Any, size: int) -> None:
        size += len(key)
        if size > self.max_bytes:
            return  # larger than the whole cache: not kept
        old = self._items.pop(key, None)
        self.bytes += size - (old[1] if old else 0)
        self._items[key] = (value, size)
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped


@dataclass(frozen=True)
class Call:
    """One served call: what a later call that continues it needs."""

    prompt_ids: list[int]  # the rendered prompt, as the engine received it
    token_ids: list[int]  # sampled, as the engine returned them
    messages: list[dict]  # the request's messages as rendered (normalised)
    tools: list[dict] | None  # the request's tools, as given to the template
    reply: dict  # the assistant message answered (content, tool_calls)
    finish_reason: str  # "stop" | "length" | "tool_calls", as answered


class AgentEpisode:
    """One open episode of the endpoint: its recorder, its calls, its limits."""

    def __init__(self, index: int, sampling: Sampling | None, max_calls: int | None) -> None:
        self.recorder = EpisodeRecorder(index)
        self.calls: list[Call] = []  # in the order they completed
        self.admitted = 0  # calls let through to the engine (``max_calls`` counts these)
        self.closed = False  # a call completing after this is answered 404, not recorded
        self.sampling = sampling  # this episode's Sampling (None: the server's)
        self.max_calls = max_calls  # this episode's call limit (None: the server's)

    def refused(self) -> None:
        """A request of this episode was refused or failed (counted as a tool error)."""
        if not self.closed:  # a closed episode is no longer ours to count in
            self.recorder.counts.tool_errors += 1


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error as OpenAI's JSON body: ours, aiohttp's (unknown route, body too large,
    wrong method), and anything unexpected (logged, 500)."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = OpenAIError(exc.status, exc.text or exc.reason)
        return web.json_response(err.body(), status=exc.status)
    except Exception:
        log.exception("the chat endpoint failed on %s", request.method)
        err = OpenAIError(500, "the server failed to answer this request")
        return web.json_response(err.body(), status=500)


class EndpointServer:
    """The chat-completions endpoint over ``engine``: one HTTP server, many episodes."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        sampling: Sampling,
        *,
        model_name: str,
        max_episode_tokens: int,
        max_calls: int,
        parse_calls: ParseCalls | None = None,
        eos_ids: set[int] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 4 << 20,
        renderer: Renderer | None = None,
    ) -> None:
        """``sampling``: the run's settings (defaults and ceiling); ``eos_ids``: the ids that
        end a completion (default: the tokenizer's EOS), which tell "stop" from "length";
        ``renderer``: the generator's (its template, e.g. ``multiturn.tool_template``), with
        which a call that continues an earlier one is rendered as that call's exact ids and
        a delta (``_continued``); None: every call rendered whole by the tokenizer."""
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.renderer = renderer
        self._cache = BoundedCache(RENDER_CACHE_BYTES)  # renders, deltas, renderers
        self.model_name = model_name
        self.max_episode_tokens, self.max_calls = max_episode_tokens, max_calls
        self.parse_calls = parse_calls
        self.eos_ids = set(eos_ids) if eos_ids else {tokenizer.eos_token_id}
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.url: str | None = None  # http://host:port once started
        self.episodes: dict[str, AgentEpisode] = {}
        self._runner: web.AppRunner | None = None
        self._logged: set[str] = set()  # what has been logged once

    async def start(self) -> str:
        """Listen; returns the server's root URL (each episode's base URL is under it)."""
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[_openai_errors])
        app.router.add_post("/v1/{key}/chat/completions", self._chat)
        app.router.add_get("/v1/{key}/models", self._models)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise RuntimeError(
                f"the chat endpoint cannot listen on {self.host}:{self.port} ({exc.strerror}); "
                "choose another port or leave it 0"
            ) from None
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("chat endpoint listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Stop listening; running calls get ``SHUTDOWN_S`` to finish, then are cancelled."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def open_episode(
        self, sampling: Sampling | None = None, max_calls: int | None = None, index: int = 0
    ) -> tuple[str, str]:
        """A new episode: (its key, the base URL an openai client is given); ``sampling``
        and ``max_calls`` replace the server's for it (an evaluation episode's settings,
        an agent's own limit); ``index`` is its place in its group."""
        if self.url is None:
            raise RuntimeError("the chat endpoint is not started: call start() first")
        key = secrets.token_urlsafe(24)
        self.episodes[key] = AgentEpisode(index, sampling, max_calls)
        return key, f"{self.url}/v1/{key}"

    def close_episode(self, key: str) -> AgentEpisode:
        """Unregister ``key`` (its calls are refused from now on) and return its episode."""
        episode = self.episodes.pop(key, None)
        if episode is None:
            raise KeyError("no open episode has this key (closed already, or never opened)")
        episode.closed = True
        return episode

    # ------------------------------------------------------------------ handlers

    def _episode(self, request: web.Request) -> AgentEpisode:
        episode = self.episodes.get(request.match_info["key"])
        if episode is None:
            raise OpenAIError(404, "no open episode has this key", code="episode_not_found")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "verl-async"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        try:
            return await self._serve(request, episode)
        except (OpenAIError, web.HTTPException):
            episode.refused()
            raise
        except Exception:
            episode.refused()
            log.exception("a chat-completions call failed")
            raise OpenAIError(500, "the engine failed to sample this call") from None

    async def _serve(self, request: web.Request, episode: AgentEpisode) -> web.Response:
        """Check, render, admit, sample, record, answer."""
        raw = await request.read()
        req = self._checked(raw, episode)
        prompt = self._continued(req, episode) or self._render(req)
        how = self._sampling(req, len(prompt), episode.sampling or self.sampling)
        episode.admitted += 1
        sample = await self.engine.sample(prompt, how)
        if episode.closed:
            raise OpenAIError(404, "the episode was closed during this call", code="episode_closed")
        text, stopped = self._text(sample.token_ids, how.stop)
        message, parsed = assistant_reply(
            text, req.tools, req.tool_choice, self.parse_calls, f"call_{episode.admitted - 1}"
        )
        finish = self._finish_reason(sample.token_ids, how.max_tokens, stopped, message)
        counts = episode.recorder.counts
        counts.tool_calls += len(parsed.calls)
        counts.tool_parse_errors += len(parsed.errors)
        episode.recorder.record(prompt, sample, message.get("content") or "")
        episode.calls.append(
            Call(list(prompt), list(sample.token_ids), req.messages, req.tools, message, finish)
        )
        n = len(sample.token_ids)
        return web.json_response(completion_body(self.model_name, message, finish, len(prompt), n))

    def _checked(self, raw: bytes, episode: AgentEpisode) -> ChatRequest:
        """The request, checked before anything is rendered (module docstring)."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise bad("the request body is not valid JSON") from None
        req = parse_request(body)
        if req.model != self.model_name:
            raise OpenAIError(
                404, f"The model `{req.model[:80]}` does not exist: this endpoint serves "
                f"`{self.model_name}`", "model", "model_not_found",
            )  # fmt: skip
        self._log_ignored(req)
        max_calls = episode.max_calls or self.max_calls
        if episode.admitted >= max_calls:
            raise bad(f"this episode has made its max_calls={max_calls} calls",
                      code="max_calls_exceeded")  # fmt: skip
        if len(raw) > self.max_episode_tokens * MAX_CHARS_PER_TOKEN:
            raise _too_long(f"{len(raw)} bytes of messages", self.max_episode_tokens)
        return req

    def _continued(self, req: ChatRequest, episode: AgentEpisode) -> list[int] | None:
        """The ids of a call that continues an earlier one of its episode: its messages
        begin with that call's messages and the reply it was given (compared as text and
        parsed calls), with the same tools. Then the prompt is that call's ids as the
        engine saw and sampled them, continued by the template's end-of-turn (after a
        reply the budget cut) and the delta it renders for the new messages
        (``Renderer.continuation``), so the sample goes on token for token instead of
        depending on whether the reply's text, or its calls as the template writes them,
        tokenize back to what was sampled. None: no such call (rendered whole)."""
        if self.renderer is None or not self.renderer.templated:
            return None
        for call in reversed(episode.calls):
            seen = [*call.messages, call.reply]
            if (
                len(req.messages) > len(seen)
                and call.tools == req.tools
                and all(same_message(a, b) for a, b in zip(seen, req.messages, strict=False))
            ):
                break
        else:
            return None
        renderer = self._renderer_for(req.tools)
        rest = req.messages[len(seen) :]
        key = "delta " + json.dumps([rest, req.tools], sort_keys=True)
        delta = self._cache.get(key)
        if delta is None:
            try:
                delta = renderer.observation_ids(rest)
            except Exception:  # noqa: BLE001 (then the whole render decides, or refuses)
                return None
            self._cache.put(key, delta, 8 * len(delta))
        return renderer.continuation([*call.prompt_ids, *call.token_ids], delta)

    def _renderer_for(self, tools: list[dict] | None) -> Renderer:
        """The renderer with these tools' schemas (kept per tool set: building one renders
        the template's anchor)."""
        if not tools:
            return self.renderer
        key = "renderer " + json.dumps(tools, sort_keys=True)
        renderer = self._cache.get(key)
        if renderer is None:
            renderer = self.renderer.with_tools(tools, self.renderer.template)
            self._cache.put(key, renderer, 8 * len(renderer.separator) + 1024)
        return renderer

    def _render(self, req: ChatRequest) -> list[int]:
        """The whole conversation rendered (kept a while: the episodes of one group all
        begin with the same messages)."""
        key = "whole " + json.dumps([req.messages, req.tools], sort_keys=True)
        ids = self._cache.get(key)
        if ids is None:
            ids = self._render_whole(req)
            self._cache.put(key, ids, 8 * len(ids))
        return list(ids)

    def _render_whole(self, req: ChatRequest) -> list[int]:
        template = self.renderer.template if self.renderer is not None else None
        extra = {"chat_template": template} if template else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                req.messages, tools=req.tools, add_generation_prompt=True, tokenize=True, **extra
            )
        except Exception as exc:  # noqa: BLE001 (the template refused these messages)
            raise bad(
                f"the chat template cannot render these messages: {str(exc)[:200]}", "messages"
            ) from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _sampling(self, req: ChatRequest, prompt_len: int, sampling: Sampling) -> Sampling:
        """The episode's sampling, its token budget cut to the request's and the episode's."""
        room = self.max_episode_tokens - prompt_len
        if room < 1:
            raise _too_long(f"{prompt_len} tokens", self.max_episode_tokens)
        budget = min(sampling.max_tokens, room, req.max_tokens or sampling.max_tokens)
        stop = sampling.stop + tuple(s for s in req.stop if s not in sampling.stop)
        return replace(sampling, max_tokens=budget, stop=stop)

    def _text(self, token_ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
        """The decoded completion, cut before the first stop string (OpenAI leaves it out);
        whether one was found."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def _finish_reason(self, ids: list[int], budget: int, stopped: bool, message: dict) -> str:
        """Calls parsed: "tool_calls" (as vLLM's server answers, even for a reply cut by
        the budget); else "length" when the budget cut the reply, "stop" when it ended."""
        if message.get("tool_calls"):
            return "tool_calls"
        ended = stopped or bool(ids and ids[-1] in self.eos_ids) or len(ids) < budget
        return "stop" if ended else "length"

    def _log_ignored(self, req: ChatRequest) -> None:
        """Once per server: fields that have no effect here."""
        notes = [f"'{name[:40]}' (not known to this endpoint)" for name in req.ignored]
        if req.temperature is not None and req.temperature != self.sampling.temperature:
            notes.append(f"temperature (the run samples at {self.sampling.temperature})")
        if req.top_p is not None and req.top_p != self.sampling.top_p:
            notes.append(f"top_p (the run samples with {self.sampling.top_p})")
        for note in notes:
            if note not in self._logged and len(self._logged) < LOGGED_AT_MOST:
                self._logged.add(note)
                log.info("chat endpoint: requests set %s, which is ignored", note)


def _too_long(what: str, limit: int) -> OpenAIError:
    return bad(
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {what}. Please reduce the length of the messages.",
        "messages",
        "context_length_exceeded",
    )


class CachedParsers:
    """The run's tool-call parser for the tools each request gives, as ``ParseCalls``:
    one parser per distinct tool set (building one is slow), kept in a ``BoundedCache``."""

    def __init__(self, make: Callable[[list[dict]], Any], max_bytes: int = 8 << 20) -> None:
        self.make = make  # tools -> a parser with .parse(text) -> ParsedTurn
        self._parsers = BoundedCache(max_bytes)

    def __call__(self, text: str, tools: list[dict]):
        key = json.dumps(tools, sort_keys=True)
        parser = self._parsers.get(key)
        if parser is None:
            parser = self.make(tools)
            self._parsers.put(key, parser, 64 * 1024 + len(key))
        return parser.parse(text)
