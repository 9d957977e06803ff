"""An OpenAI-compatible chat-completions endpoint served by a generator's engine.

Agents written against the plain ``openai`` client call it; the generator records, for
each episode, exactly which tokens were rendered and sampled (generators/traces.py).

    server = EndpointServer(engine, tokenizer, Sampling.training(cfg), model_name="policy",
                            max_episode_tokens=4096, max_calls=16, parse_calls=hermes)
    await server.start()
    key, base_url = server.open_episode()
    ...  # the agent: openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    trace = server.close_episode(key)  # trace.samples(): token-exact, loss-masked

HTTP (aiohttp, on the event loop of the engine; loopback only, port 0 unless given):
``POST /v1/<key>/chat/completions`` and ``GET /v1/<key>/models``. Each episode has its own
key (``secrets.token_urlsafe``), which is the only thing telling episodes apart: an
unknown or closed key is a 404, a bad request a 400, a failed engine a 500, each with
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; a bad request
never stops the server. Bodies are limited to ``max_body_bytes``. Access logs are off
(they would hold the keys).

Sampling. The run's ``Sampling`` gives the defaults and the ceiling. The behaviour
policy must be known to train on its samples, so the request's ``temperature`` and
``top_p`` are ignored (logged once): every token is sampled at the run's settings and its
log-prob is under those. A request may lower ``max_tokens`` (or
``max_completion_tokens``) below the run's, never raise it, and may add ``stop`` strings.
``seed`` is ignored; ``n`` other than 1, ``stream``, ``logprobs``, penalties, logit bias
and structured ``response_format`` are refused as not supported (each would change or
hide what was sampled). Unknown fields are ignored (logged once).

Budgets per episode: the prompt plus the completion of one call may not exceed
``max_episode_tokens`` (a call's ``max_tokens`` is cut to fit; a prompt that leaves no
room is a 400 ``context_length_exceeded``), and at most ``max_calls`` calls reach the
engine (later ones are a 400 ``max_calls_exceeded``).

Tools. ``tools`` go into the chat template; assistant messages sent back with
``tool_calls`` (the openai client sends ``function.arguments`` as a JSON string) get
their arguments as dicts, which templates such as Qwen2.5's expect. The reply is parsed
for calls by ``parse_calls`` when tools were given and ``tool_choice`` is not "none";
"required" and a named function are not enforced on decoding (the policy samples freely:
constraining it would change what is trained on), they only decide that calls are parsed.

Overlapping calls of one episode (an agent with parallel branches) are served
concurrently, not serialised: each is recorded when it completes, and the trace's merge
treats what does not extend as a new sample. A call still running when its episode is
closed is answered 404 and not recorded (the trace was handed over).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from aiohttp import web

from generators.interface import RolloutEngine, Sampling
from generators.render import Renderer
from generators.traces import Call, EpisodeTrace

log = logging.getLogger("verl_async.generator")

# (text, tools) -> (content, calls [{"id"?, "name", "arguments": JSON str}], errors)
ParseCalls = Callable[[str, list[dict]], tuple[str | None, list[dict], list[str]]]

ROLES = {"system", "developer", "user", "assistant", "tool"}
RENDERERS_KEPT = 64  # renderers with a tool set's schemas kept (then all are dropped)
RENDERS_KEPT = 512  # rendered conversations and deltas kept (the oldest dropped first)
# Fields that would change or hide what is sampled: refused unless at their default.
REFUSED_UNLESS = {
    "n": (None, 1),
    "stream": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
}
USED = {"messages", "model", "tools", "tool_choice", "max_tokens", "max_completion_tokens"}
USED |= {"stop", "temperature", "top_p", "response_format"}
IGNORED = {"seed", "user", "metadata", "store", "parallel_tool_calls", "stream_options"}
IGNORED |= {"service_tier", "modalities", "reasoning_effort", "functions", "function_call"}
SHUTDOWN_S = 5.0  # how long stop() lets running calls finish before cancelling them
LOGGED_AT_MOST = 64  # distinct ignored fields logged (requests choose their names)


class OpenAIError(Exception):
    """A request answered with an error in OpenAI's format."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        kind = kind if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status)


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


@dataclass(frozen=True)
class ChatRequest:
    """What a chat-completions body asks for, checked and normalised."""

    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str | dict  # "auto" | "none" | "required" | {"type": "function", ...}
    max_tokens: int | None
    stop: tuple[str, ...]
    temperature: float | None  # asked for, not used (see the module docstring)
    top_p: float | None
    ignored: tuple[str, ...]  # fields not known to this endpoint


def parse_request(body: object) -> ChatRequest:
    """``body`` (decoded JSON) as a ``ChatRequest``; raises ``OpenAIError`` (400) naming
    the first field that is wrong or not supported."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, allowed in REFUSED_UNLESS.items():
        if name in body and body[name] not in allowed:
            raise _bad(f"{name}={json.dumps(body[name])} is not supported by this endpoint", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("response_format other than text is not supported", "response_format")
    tools = _tools(body.get("tools"))
    return ChatRequest(
        messages=normalise_messages(body.get("messages")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        ignored=tuple(sorted(set(body) - USED - IGNORED - set(REFUSED_UNLESS))),
    )


def normalise_messages(messages: object) -> list[dict]:
    """Messages as chat templates expect them: content as a string (text parts joined),
    "developer" as "system", tool-call arguments as dicts (JSON strings decoded)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where} must be an object with a role in {sorted(ROLES)}", where)
        m = dict(m)
        m["role"] = "system" if m["role"] == "developer" else m["role"]
        m["content"] = _content(m.get("content"), f"{where}.content", m["role"] == "assistant")
        if m.get("tool_calls") is not None and m["role"] == "assistant":
            m["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in
                               enumerate(_list(m["tool_calls"], f"{where}.tool_calls"))]  # fmt: skip
        out.append(m)
    return out


def _content(content: object, where: str, may_be_empty: bool) -> str | None:
    if isinstance(content, str) or (content is None and may_be_empty):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where} must be a string or a list of text parts (only text is supported)", where)


def _tool_call(call: object, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where} must be an object with function.name", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise _bad(f"{where}.function.arguments is not valid JSON", where) from None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments must be a JSON object", where)
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise _bad(f"{where} must be a list", where)
    return value


def _tools(tools: object) -> list[dict] | None:
    if tools is None:
        return None
    for i, t in enumerate(_list(tools, "tools")):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be a function tool with function.name", f"tools[{i}]")
    return tools or None


def _tool_choice(choice: object, tools: list[dict] | None) -> str | dict:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    names = {t["function"]["name"] for t in tools or []}
    if name is None or name not in names:
        raise _bad(
            'tool_choice must be "auto", "none", "required" or a function among the tools',
            "tool_choice",
        )
    return choice


def _max_tokens(body: dict) -> int | None:
    newer = body.get("max_completion_tokens") is not None  # the name that replaced max_tokens
    name = "max_completion_tokens" if newer else "max_tokens"
    value = body.get(name)
    if value is not None and (type(value) is not int or value < 1):
        raise _bad(f"{name} must be a positive integer", name)
    return value


def _stop(stop: object) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop must be a string or a list of non-empty strings", "stop")
    return tuple(stops)


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise _bad(f"{name} must be a number", name)
    return value


def assistant_reply(
    text: str,
    tools: list[dict] | None,
    tool_choice: str | dict,
    parse_calls: ParseCalls | None,
    ids: str | None = None,
) -> tuple[dict, list[str]]:
    """The assistant message answering ``text`` (decoded completion), and the parser's
    errors: calls are parsed only with a parser, tools, and ``tool_choice`` not "none".
    A call without an id of the parser's gets ``<ids>_<i>`` (the episode's call number:
    an episode replays to the same ids), or a random one."""
    if parse_calls is None or not tools or tool_choice == "none":
        return {"role": "assistant", "content": text}, []
    try:
        content, calls, errors = parse_calls(text, tools)
    except Exception as exc:  # noqa: BLE001 (a parser's failure is the reply's, not the server's)
        content, calls, errors = text, [], [f"the tool-call parser failed: {exc!r}"]
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": c.get("id") or (f"{ids}_{i}" if ids else f"call_{secrets.token_hex(12)}"),
                "type": "function",
                "function": {"name": c["name"], "arguments": _json_text(c.get("arguments"))},
            }
            for i, c in enumerate(calls)
        ]
    return message, list(errors)


def _json_text(arguments: object) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {})


def completion_body(model: str, message: dict, finish_reason: str, prompt: int, sampled: int):
    """OpenAI's ChatCompletion JSON for one choice."""
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": sampled,
            "total_tokens": prompt + sampled,
        },
    }


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error as OpenAI's JSON body: ours, aiohttp's (unknown route, body too large,
    wrong method), and anything unexpected (logged, 500)."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return OpenAIError(exc.status, exc.text or exc.reason).response()
    except Exception:
        log.exception("the chat endpoint failed on %s", request.method)
        return OpenAIError(500, "the server failed to answer this request").response()


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
        self._renderers: dict[str, Renderer] = {}  # with each tool set's schemas
        self._renders: dict[str, list[int]] = {}  # whole conversations' ids, recent ones
        self._deltas: dict[str, list[int]] = {}  # messages' deltas, recent ones
        self.model_name = model_name
        self.max_episode_tokens, self.max_calls = max_episode_tokens, max_calls
        self.parse_calls = parse_calls
        self.eos_ids = set(eos_ids) if eos_ids else {tokenizer.eos_token_id}
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.url: str | None = None  # http://host:port once started
        self.episodes: dict[str, EpisodeTrace] = {}
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
        self, sampling: Sampling | None = None, max_calls: int | None = None
    ) -> tuple[str, str]:
        """A new episode: (its key, the base URL an openai client is given); ``sampling``
        and ``max_calls`` replace the server's for it (an evaluation episode's settings,
        an agent's own limit)."""
        if self.url is None:
            raise RuntimeError("the chat endpoint is not started: call start() first")
        key = secrets.token_urlsafe(24)
        trace = EpisodeTrace()
        trace.sampling, trace.max_calls = sampling, max_calls
        self.episodes[key] = trace
        return key, f"{self.url}/v1/{key}"

    def close_episode(self, key: str) -> EpisodeTrace:
        """Unregister ``key`` (its calls are refused from now on) and return its trace."""
        trace = self.episodes.pop(key, None)
        if trace is None:
            raise KeyError("no open episode has this key (closed already, or never opened)")
        trace.closed = True
        return trace

    # ------------------------------------------------------------------ handlers

    def _trace(self, request: web.Request) -> EpisodeTrace:
        trace = self.episodes.get(request.match_info["key"])
        if trace is None:
            raise OpenAIError(404, "no open episode has this key", code="episode_not_found")
        return trace

    async def _models(self, request: web.Request) -> web.Response:
        self._trace(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "verl-async"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        trace = self._trace(request)
        try:
            return await self._serve(request, trace)
        except (OpenAIError, web.HTTPException):
            trace.stats.errors += not trace.closed  # a closed trace is no longer ours
            raise
        except Exception:
            trace.stats.errors += not trace.closed
            log.exception("a chat-completions call failed")
            raise OpenAIError(500, "the engine failed to sample this call") from None

    async def _serve(self, request: web.Request, trace: EpisodeTrace) -> web.Response:
        """Check, render, admit, sample, record, answer."""
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise _bad("the request body is not valid JSON") from None
        req = parse_request(body)
        self._log_ignored(req)
        prompt = self._continued(req, trace) or self._render(req)
        how = self._sampling(req, len(prompt), trace.sampling or self.sampling)
        max_calls = trace.max_calls or self.max_calls
        if trace.admitted >= max_calls:
            raise _bad(f"this episode has made its max_calls={max_calls} calls",
                       code="max_calls_exceeded")  # fmt: skip
        trace.admitted += 1
        sample = await self.engine.sample(prompt, how)
        if trace.closed:
            raise OpenAIError(404, "the episode was closed during this call", code="episode_closed")
        text, stopped = self._text(sample.token_ids, how.stop)
        message, errors = assistant_reply(
            text, req.tools, req.tool_choice, self.parse_calls, f"call_{trace.admitted - 1}"
        )
        finish = self._finish_reason(sample.token_ids, how.max_tokens, stopped, message)
        trace.stats.tool_call_errors += len(errors)
        trace.record(
            Call(list(prompt), list(sample.token_ids), list(sample.logprobs),
                 list(sample.versions), finish, req.messages, req.tools, message)
        )  # fmt: skip
        n = len(sample.token_ids)
        return web.json_response(completion_body(self.model_name, message, finish, len(prompt), n))

    def _continued(self, req: ChatRequest, trace: EpisodeTrace) -> list[int] | None:
        """The ids of a call that continues an earlier one of its episode: its messages
        begin with that call's messages and the reply it was given (compared as text and
        parsed calls), with the same tools. Then the prompt is that call's ids as the
        engine saw and sampled them (and the template's end-of-turn after a reply the
        budget cut), followed by the delta the template renders for the new messages
        (generators/render.py), so the sample goes on token for token instead of
        depending on whether the reply's text, or its calls as the template writes them,
        tokenize back to what was sampled. None: no such call (rendered whole)."""
        if self.renderer is None or not self.renderer.templated:
            return None
        for call in reversed(trace.calls):
            seen = [*call.messages, call.reply]
            if (
                len(req.messages) > len(seen)
                and call.tools == req.tools
                and all(_same(a, b) for a, b in zip(seen, req.messages, strict=False))
            ):
                break
        else:
            return None
        renderer = self._renderer_for(req.tools)
        rest = req.messages[len(seen) :]
        key = json.dumps([rest, req.tools], sort_keys=True)
        delta = self._deltas.get(key)
        if delta is None:
            try:
                delta = renderer.observation_ids(rest)
            except Exception:  # noqa: BLE001 (then the whole render decides, or refuses)
                return None
            _keep(self._deltas, key, delta)
        ids = [*call.prompt_ids, *call.token_ids]
        if not (call.token_ids and call.token_ids[-1] in renderer.eos_ids):
            ids.append(renderer.end_of_turn)  # not sampled: what the template writes there
        return ids + delta

    def _renderer_for(self, tools: list[dict] | None) -> Renderer:
        """The renderer with these tools' schemas (kept per tool set: building one renders
        the template's anchor)."""
        if not tools:
            return self.renderer
        key = json.dumps(tools, sort_keys=True)
        renderer = self._renderers.get(key)
        if renderer is None:
            if len(self._renderers) >= RENDERERS_KEPT:
                self._renderers.clear()
            renderer = self.renderer.with_tools(tools, self.renderer.template)
            self._renderers[key] = renderer
        return renderer

    def _render(self, req: ChatRequest) -> list[int]:
        """The whole conversation rendered (kept a while: the episodes of one group all
        begin with the same messages)."""
        key = json.dumps([req.messages, req.tools], sort_keys=True)
        ids = self._renders.get(key)
        if ids is None:
            ids = self._render_whole(req)
            _keep(self._renders, key, ids)
        return list(ids)

    def _render_whole(self, req: ChatRequest) -> list[int]:
        extra = {"chat_template": self.renderer.template} if self._template() else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                req.messages, tools=req.tools, add_generation_prompt=True, tokenize=True, **extra
            )
        except Exception as exc:  # noqa: BLE001 (the template refused these messages)
            raise _bad(
                f"the chat template cannot render these messages: {exc}", "messages"
            ) from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _template(self) -> str | None:
        return self.renderer.template if self.renderer is not None else None

    def _sampling(self, req: ChatRequest, prompt_len: int, sampling: Sampling) -> Sampling:
        """The episode's sampling, its token budget cut to the request's and the episode's."""
        room = self.max_episode_tokens - prompt_len
        if room < 1:
            raise _bad(
                f"This model's maximum context length is {self.max_episode_tokens} tokens. "
                f"However, your messages resulted in {prompt_len} tokens. Please reduce the "
                "length of the messages.",
                "messages",
                "context_length_exceeded",
            )
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
        notes = [f"'{name}' (not known to this endpoint)" for name in req.ignored]
        if req.temperature is not None and req.temperature != self.sampling.temperature:
            notes.append(f"temperature (the run samples at {self.sampling.temperature})")
        if req.top_p is not None and req.top_p != self.sampling.top_p:
            notes.append(f"top_p (the run samples with {self.sampling.top_p})")
        for note in notes:
            if note not in self._logged and len(self._logged) < LOGGED_AT_MOST:
                self._logged.add(note)
                log.info("chat endpoint: requests set %s, which is ignored", note)


def _same(sent: dict, got: dict) -> bool:
    """Whether a message the agent sent back is the one the episode had: role, text, and
    tool calls by name and parsed arguments (ids and JSON spacing may differ)."""
    if sent.get("role") != got.get("role") or (sent.get("content") or "") != (
        got.get("content") or ""
    ):
        return False
    return _calls(sent) == _calls(got)


def _calls(message: dict) -> list[tuple]:
    out = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", c)
        args = f.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        out.append((f.get("name"), json.dumps(args, sort_keys=True)))
    return out


def _keep(cache: dict, key, value) -> None:
    """``cache[key] = value``, dropping the oldest entry past ``RENDERS_KEPT``."""
    if len(cache) >= RENDERS_KEPT:
        del cache[next(iter(cache))]
    cache[key] = value
