"""The chat endpoint checks before it renders, and keeps what it renders within bytes
(generators/endpoint.py): a real aiohttp server and HTTP requests on loopback, a scripted
engine, and a tokenizer that counts how often the chat template runs."""

import asyncio
import json

import aiohttp

from generators.endpoint import RENDER_CACHE_BYTES, CachedParsers, EndpointServer
from generators.interface import Sample, Sampling
from verl_async.tools.parsers import ParsedTurn


class Tokenizer:
    """Each character one token; ``renders`` counts chat-template renders."""

    eos_token_id = 0

    def __init__(self) -> None:
        self.renders = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kw):
        self.renders += 1
        text = "".join(m.get("content") or "" for m in messages)
        return [ord(c) % 50 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "x" * len(ids)


class Engine:
    def __init__(self) -> None:
        self.calls = 0

    async def sample(self, prompt_ids, how):
        self.calls += 1
        return Sample([5, 0], [-0.5, -0.5], [0, 0], list(prompt_ids))


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body)) as r:
        return r.status, await r.json()


def _big(i: int) -> list[dict]:
    return [{"role": "user", "content": f"{i} " + "y" * (1 << 20)}]


def _serve(tok, engine, **kw):
    server = EndpointServer(
        engine, tok, Sampling(max_tokens=4, temperature=1.0), model_name="policy",
        max_episode_tokens=kw.pop("max_episode_tokens", 64), max_calls=2,
        max_body_bytes=8 << 20, **kw,
    )  # fmt: skip
    return server


def test_requests_are_refused_before_the_template_runs_and_renders_stay_within_bytes():
    tok, engine = Tokenizer(), Engine()

    async def main():
        server = _serve(tok, engine)
        await server.start()
        try:
            key, base = server.open_episode()
            chat = f"{base}/chat/completions"
            hello = [{"role": "user", "content": "hi"}]
            out = {}
            # Six prompts of 1 MiB each: too long to fit, refused without a render.
            out["big"] = [
                await _post(chat, {"model": "policy", "messages": _big(i)}) for i in range(6)
            ]
            out["model"] = await _post(chat, {"model": "gpt-4o", "messages": hello})
            renders_before = tok.renders
            out["ok"] = [
                await _post(chat, {"model": "policy", "messages": hello}) for _ in range(2)
            ]
            renders_ok = tok.renders - renders_before
            out["third"] = await _post(chat, {"model": "policy", "messages": hello})
            return out, renders_ok, server.close_episode(key), server._cache.bytes
        finally:
            await server.stop()

    out, renders_ok, episode, cached = asyncio.run(main())
    assert all(status == 400 for status, _ in out["big"])
    assert {b["error"]["code"] for _, b in out["big"]} == {"context_length_exceeded"}
    assert out["model"][0] == 404 and out["model"][1]["error"]["code"] == "model_not_found"
    assert [status for status, _ in out["ok"]] == [200, 200]
    assert out["third"][0] == 400 and out["third"][1]["error"]["code"] == "max_calls_exceeded"
    # The template ran for the two good calls only (the second from the cache): not for the
    # long prompts, the unknown model, or the call past max_calls.
    assert tok.renders == renders_ok == 1
    assert engine.calls == 2 and len(episode.calls) == 2
    assert episode.recorder.counts.tool_errors == 8  # six too long, the model, the third
    assert cached <= RENDER_CACHE_BYTES


def test_parsers_per_tool_set_are_kept_within_their_bytes():
    made = []

    class Parser:
        def parse(self, text, turn=0):
            return ParsedTurn(text, [], [])

    def make(tools):
        made.append(tools)
        return Parser()

    parsers = CachedParsers(make, max_bytes=200_000)
    for i in range(100):  # a hundred distinct tool sets: old ones are dropped
        tools = [{"type": "function", "function": {"name": f"t{i}"}}]
        parsers("text", tools)
        parsers("text", tools)  # the same set again: kept, not built again
    assert len(made) == 100
    assert parsers._parsers.bytes <= 200_000 and len(parsers._parsers._items) < 100
