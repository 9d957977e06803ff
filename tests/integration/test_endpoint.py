"""The chat-completions endpoint (generators/endpoint.py) served by a real engine on the
tiny model, called by the real ``openai`` client over loopback HTTP.

The tiny model gets a word-level tokenizer with a ChatML-like template: turns are
``<|im_start|> role content <eos>``, so a turn ends with the model's own EOS, and
whitespace separates every word. Only ``<eos>`` is a special token, so whatever the model
samples decodes to text that the template renders back to the same ids, and an agent
that appends to its conversation extends one sample (the model is random; the test must
not depend on what it says).

Tool calls: the tiny model cannot be made to write a well-formed ``<tool_call>`` on
purpose, so hermes-style parsing is tested on given text in tests/unit/test_endpoint.py;
here a parser that reads every reply as a call to ``lookup`` (its words the arguments)
carries the model's own text through the whole round trip: parsed, answered as
``tool_calls``, read by the client, sent back with JSON-string arguments and rendered
again by a template that needs them as a dict.
"""

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest

from generators.endpoint import EndpointServer
from generators.interface import Sampling
from generators.recorder import EpisodeCounts
from verl_async.config import load_config
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import TinyModelConfig
from verl_async.tasks.max_digit import VOCAB
from verl_async.tools.parsers import ParsedTurn, ToolCall

from .conftest import ROOT, start_test_engine

EXTRA = ["<|im_start|>", "system", "user", "assistant", "tool", "tools", "lookup", "words"]
TEMPLATE = (
    "{% if tools %}<|im_start|> system tools {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<eos> {% endif %}"
    "{% for m in messages %}<|im_start|> {{ m.role }} {% if m.content %}{{ m.content }} "
    "{% endif %}{% for c in m.tool_calls or [] %}{{ c.function.name }} "
    "{% for k, v in c.function.arguments.items() %}{{ k }} {{ v }} {% endfor %}{% endfor %}"
    "<eos> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
MAX_TOKENS = 4  # the run's max_new_tokens
BUDGET = 100  # max_episode_tokens (the tiny model has 128 positions)
LOOKUP = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def chatml_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    out = build_tiny_model(tmp_path_factory.mktemp("chat"), TinyModelConfig(extra_words=EXTRA))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    chatml_tokenizer([*VOCAB, *EXTRA]).save_pretrained(out)
    return out  # (build_tiny_model keeps it: its marker is the model's, and it is current)


def lookup_every_reply(text: str, tools: list[dict]) -> ParsedTurn:
    return ParsedTurn(None, [ToolCall("", "lookup", json.dumps({"words": text}))], [])


class Served:
    """An engine and an endpoint over it on an event loop of their own."""

    def __init__(self, kind: str, model, overrides=()) -> None:
        from transformers import AutoTokenizer

        self.loop = asyncio.new_event_loop()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        cfg = load_config(ROOT / "configs/tiny.yaml", list(overrides))
        self.engine = self.run(self._start(kind, cfg, model))
        self.server = self.endpoint(self.engine)

    async def _start(self, kind, cfg, model):
        return start_test_engine(kind, cfg, model, seed=0)

    def endpoint(self, engine, **kw) -> EndpointServer:
        args = {"max_episode_tokens": BUDGET, "max_calls": 8, **kw}
        server = EndpointServer(
            engine, self.tokenizer, Sampling(MAX_TOKENS, temperature=1.0), model_name="tiny",
            parse_calls=lookup_every_reply, **args,
        )  # fmt: skip
        self.run(server.start())
        return server

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self._stop())
        self.loop.close()

    async def _stop(self) -> None:
        await self.server.stop()
        self.engine.shutdown()  # on its loop: vLLM's output handler is a task of it

    def render(self, messages, tools=None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"])


@pytest.fixture(scope="module")
def hf(chat_model):
    served = Served("hf", chat_model)
    yield served
    served.close()


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


async def extending_agent(base_url: str, users: list[str], **kw):
    """Sends its whole conversation each time, with each reply and a new user message."""
    messages = [{"role": "system", "content": "max"}]
    replies = []
    async with client(base_url) as c:
        for text in users:
            messages.append({"role": "user", "content": text})
            r = await c.chat.completions.create(model="tiny", messages=messages, **kw)
            replies.append(r)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return replies


def assert_one_exact_sample(episode) -> None:
    """One sample: the last call's prompt and completion, the sampled tokens (and only
    they) under mask 1, log-prob 0.0 on the others."""
    [s] = episode.recorder.samples
    last = episode.calls[-1]
    assert s.ids() == last.prompt_ids + last.token_ids
    assert s.prompt_ids == episode.calls[0].prompt_ids
    pos, mask = len(s.prompt_ids), [0] * len(s.token_ids)
    for call in episode.calls:
        start = len(call.prompt_ids) - pos  # where this call's completion begins
        mask[start : start + len(call.token_ids)] = [1] * len(call.token_ids)
    assert s.loss_mask == mask
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(s.logprobs, mask, strict=True) if m)
    assert len(s.versions) == len(s.token_ids)


def stats(episode) -> tuple[int, int]:
    """(calls recorded, requests refused or failed) of an episode."""
    return len(episode.calls), episode.recorder.counts.tool_errors


def test_a_plain_call_is_answered_and_recorded_token_for_token(hf):
    key, base_url = hf.server.open_episode()
    messages = [{"role": "system", "content": "max"}, {"role": "user", "content": "3 9 4 ="}]

    async def agent():
        async with client(base_url) as c:
            models = await c.models.list()
            # temperature and top_p are the run's: these are ignored (the module docstring)
            r = await c.chat.completions.create(
                model="tiny", messages=messages, temperature=0.2, top_p=0.5, seed=7
            )
            return [m.id for m in models.data], r

    models, r = hf.run(agent())
    trace = hf.server.close_episode(key)
    assert models == ["tiny"]
    [call] = trace.calls
    assert call.prompt_ids == hf.render(messages)
    assert 1 <= len(call.token_ids) <= MAX_TOKENS
    assert r.object == "chat.completion" and r.model == "tiny" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert choice.message.content == hf.tokenizer.decode(call.token_ids, skip_special_tokens=True)
    ended = call.token_ids[-1] == hf.tokenizer.eos_token_id or len(call.token_ids) < MAX_TOKENS
    assert choice.finish_reason == call.finish_reason == ("stop" if ended else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(call.prompt_ids),
        len(call.token_ids),
    )
    assert stats(trace) == (1, 0)
    # The log-probs are the model's at the run's temperature (1), not the request's.
    ids = call.prompt_ids + call.token_ids
    expected = hf.run(hf.engine.prompt_logprobs(ids))[len(call.prompt_ids) - 1 :]
    [sample] = trace.recorder.samples
    assert sample.logprobs == pytest.approx(expected, abs=1e-4)


def test_tools_reach_the_template_and_a_parsed_call_makes_the_round_trip(hf):
    key, base_url = hf.server.open_episode()
    messages = [{"role": "user", "content": "7 1 ="}]

    async def agent():
        async with client(base_url) as c:
            first = await c.chat.completions.create(model="tiny", messages=messages, tools=LOOKUP)
            reply = first.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))  # arguments: a JSON string
            messages.append(
                {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "7"}
            )
            second = await c.chat.completions.create(
                model="tiny", messages=messages, tools=LOOKUP, tool_choice="none"
            )
            return first, second

    first, second = hf.run(agent())
    trace = hf.server.close_episode(key)
    c1, c2 = trace.calls
    assert c1.prompt_ids == hf.render(messages[:1], LOOKUP)
    assert hf.tokenizer.convert_ids_to_tokens(c1.prompt_ids[:5]) == [
        "<|im_start|>", "system", "tools", "lookup", "<eos>",
    ]  # fmt: skip
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == c1.finish_reason == "tool_calls"
    text = hf.tokenizer.decode(c1.token_ids, skip_special_tokens=True)
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"words": text}
    # Sent back with a JSON-string argument, rendered with it as a dict.
    assert c2.messages[1]["tool_calls"][0]["function"]["arguments"] == {"words": text}
    assert c2.prompt_ids == hf.render(c2.messages, LOOKUP)
    # tool_choice "none": the reply is not parsed.
    assert second.choices[0].message.tool_calls is None and c2.finish_reason != "tool_calls"
    assert stats(trace) == (2, 0) and trace.recorder.counts.tool_calls == 1


class Gate:
    """The real engine, but the first ``n`` calls wait until all ``n`` are waiting at once:
    a server that took calls one at a time would time out here."""

    def __init__(self, engine, n: int) -> None:
        self.engine, self.n, self.waiting = engine, n, 0
        self.all_in = asyncio.Event()

    async def sample(self, prompt_ids, how):
        self.waiting += 1
        if self.waiting == self.n:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 30)
        return await self.engine.sample(prompt_ids, how)


def test_eight_agents_at_once_keep_their_traces_apart(hf):
    server = hf.endpoint(Gate(hf.engine, 8))
    episodes = [server.open_episode() for _ in range(8)]
    assert len({key for key, _ in episodes}) == 8
    users = [[f"{i} 5 =", "max"] for i in range(8)]

    async def agents():
        return await asyncio.gather(
            *(extending_agent(url, u) for (_, url), u in zip(episodes, users, strict=True))
        )

    try:
        replies = hf.run(agents())
    finally:
        hf.run(server.stop())
    for (key, _), u, r in zip(episodes, users, replies, strict=True):
        trace = server.close_episode(key)
        assert [c.messages[1]["content"] for c in trace.calls] == [u[0], u[0]]
        assert [c.reply["content"] for c in trace.calls] == [
            x.choices[0].message.content for x in r
        ]
        assert_one_exact_sample(trace)


def test_two_calls_of_one_episode_in_flight_at_once_are_both_recorded(hf):
    server = hf.endpoint(Gate(hf.engine, 2))
    key, base_url = server.open_episode()

    async def branches():
        async with client(base_url) as c:
            return await asyncio.gather(
                *(c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"{d} ="}]
                ) for d in (1, 2))
            )  # fmt: skip

    try:
        hf.run(branches())
    finally:
        hf.run(server.stop())
    trace = server.close_episode(key)
    assert sorted(c.messages[0]["content"] for c in trace.calls) == ["1 =", "2 ="]
    samples = trace.recorder.samples
    assert [s.ids() for s in samples] == [c.prompt_ids + c.token_ids for c in trace.calls]
    assert len(samples) == 2  # one break


class Held:
    """The real engine, but each call waits for ``release`` before it samples."""

    def __init__(self, engine) -> None:
        self.engine, self.entered, self.release = engine, asyncio.Event(), asyncio.Event()

    async def sample(self, prompt_ids, how):
        self.entered.set()
        await self.release.wait()
        return await self.engine.sample(prompt_ids, how)


def test_a_call_running_when_its_episode_closes_is_refused_and_not_recorded(hf):
    held = Held(hf.engine)
    server = hf.endpoint(held)
    key, base_url = server.open_episode()

    async def agent():
        async with client(base_url) as c:
            call = asyncio.create_task(
                c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5"}])
            )
            await asyncio.wait_for(held.entered.wait(), 30)
            trace = server.close_episode(key)
            held.release.set()
            with pytest.raises(openai.NotFoundError, match="closed during this call"):
                await call
            return trace

    try:
        trace = hf.run(agent())
    finally:
        hf.run(server.stop())
    assert trace.calls == [] and trace.recorder.samples == []
    assert trace.recorder.counts == EpisodeCounts()


def test_an_agent_that_extends_its_conversation_makes_one_sample(hf):
    key, base_url = hf.server.open_episode()
    hf.run(extending_agent(base_url, ["3 1 =", "max", "9 ="]))
    trace = hf.server.close_episode(key)
    assert len(trace.calls) == 3
    assert_one_exact_sample(trace)
    # Between calls: the template's end-of-turn where the reply was cut, never twice.
    for prev, nxt in zip(trace.calls, trace.calls[1:], strict=False):
        between = nxt.prompt_ids[len(prev.prompt_ids) + len(prev.token_ids) :]
        cut = prev.token_ids[-1] != hf.tokenizer.eos_token_id
        assert hf.tokenizer.convert_ids_to_tokens(between)[: 3 if cut else 2] == (
            ["<eos>", "<|im_start|>", "user"] if cut else ["<|im_start|>", "user"]
        )


def test_an_agent_that_rewrites_its_history_makes_a_sample_per_history(hf):
    key, base_url = hf.server.open_episode()

    async def agent():
        async with client(base_url) as c:
            first = [{"role": "user", "content": "4 2 ="}]
            r = await c.chat.completions.create(model="tiny", messages=first)
            summary = f"earlier: {r.choices[0].message.content}"  # the exchange summarised
            await c.chat.completions.create(
                model="tiny", messages=[{"role": "system", "content": summary}]
            )

    hf.run(agent())
    trace = hf.server.close_episode(key)
    s1, s2 = trace.recorder.samples
    for s, call in zip((s1, s2), trace.calls, strict=True):
        assert s.ids() == call.prompt_ids + call.token_ids and all(s.loss_mask)


async def _raw(method: str, url: str, data: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data) as r:
        return r.status, await r.json()


def _is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_bad_requests_are_refused_in_openai_format_and_the_server_keeps_serving(hf):
    key, base_url = hf.server.open_episode()
    chat = f"{base_url}/chat/completions"
    hello = [{"role": "user", "content": "1 ="}]

    async def agent():
        out = {
            "unknown key": await _raw("POST", f"{hf.server.url}/v1/nope/chat/completions", b"{}"),
            "bad json": await _raw("POST", chat, b"{not json"),
            "too large": await _raw("POST", chat, b" " * (5 << 20)),
            "no route": await _raw("GET", f"{base_url}/completions"),
        }
        async with client(base_url) as c:
            with pytest.raises(openai.BadRequestError, match="not supported"):
                await c.chat.completions.create(model="tiny", messages=hello, n=2)
            with pytest.raises(openai.BadRequestError, match="not supported"):
                await c.chat.completions.create(model="tiny", messages=hello, stream=True)
            with pytest.raises(openai.NotFoundError) as err:
                await c.chat.completions.create(model="gpt-4o", messages=hello)
            assert err.value.code == "model_not_found" and "serves `tiny`" in err.value.message
            with pytest.raises(openai.BadRequestError) as err:  # was a 500
                await c.chat.completions.create(
                    model="tiny", messages=hello, tools=LOOKUP, tool_choice={"function": "lookup"}
                )
            assert err.value.param == "tool_choice"
            out["good"] = await c.chat.completions.create(model="tiny", messages=hello)
        return out

    out = hf.run(agent())
    assert {k: v[0] for k, v in out.items() if k != "good"} == {
        "unknown key": 404, "bad json": 400, "too large": 413, "no route": 404,
    }  # fmt: skip
    assert all(_is_openai_error(v[1]) for k, v in out.items() if k != "good")
    assert "not valid JSON" in out["bad json"][1]["error"]["message"]
    assert out["good"].choices[0].message.content is not None
    trace = hf.server.close_episode(key)
    # bad json, too large, n, stream, an unknown model, a tool_choice of the wrong shape
    assert stats(trace) == (1, 6)

    async def after_close():
        async with client(base_url) as c:
            with pytest.raises(openai.NotFoundError, match="no open episode"):
                await c.chat.completions.create(model="tiny", messages=hello)

    hf.run(after_close())
    with pytest.raises(KeyError, match="no open episode"):
        hf.server.close_episode(key)


def test_an_episode_keeps_to_its_token_budget_and_its_calls(hf):
    server = hf.endpoint(hf.engine, max_episode_tokens=12, max_calls=2)
    key, base_url = server.open_episode()
    short = [{"role": "user", "content": "1"}]  # 6 tokens: room for MAX_TOKENS
    tight = [{"role": "user", "content": "1 2 3 4 5 6"}]  # 11 tokens: room for 1
    too_long = [{"role": "user", "content": "1 2 3 4 5 6 7"}]  # 12 tokens: no room

    async def agent():
        async with client(base_url) as c:
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model="tiny", messages=too_long)
            assert err.value.code == "context_length_exceeded"
            r1 = await c.chat.completions.create(model="tiny", messages=tight, max_tokens=50)
            r2 = await c.chat.completions.create(model="tiny", messages=short, max_tokens=1)
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model="tiny", messages=short)
            assert err.value.code == "max_calls_exceeded"
            return r1, r2

    try:
        r1, r2 = hf.run(agent())
    finally:
        hf.run(server.stop())
    assert (r1.usage.prompt_tokens, r1.usage.completion_tokens) == (11, 1)
    assert r2.usage.completion_tokens == 1  # the request lowered the run's 4
    trace = server.close_episode(key)
    assert stats(trace) == (2, 2)


def test_the_vllm_engine_serves_an_extending_agent(chat_model):
    served = Served("vllm", chat_model, ["generators.max_model_len=128"])
    try:
        key, base_url = served.server.open_episode()
        served.run(extending_agent(base_url, ["3 1 =", "max"]))
        trace = served.server.close_episode(key)
        last = trace.calls[-1]
        model_logprobs = served.run(served.engine.prompt_logprobs(last.prompt_ids + last.token_ids))
    finally:
        served.close()
    assert stats(trace) == (2, 0)
    assert_one_exact_sample(trace)
    # Sampled at the run's temperature (1): the engine's log-probs are the model's.
    [sample] = trace.recorder.samples
    logprobs = sample.logprobs[-len(last.token_ids) :]
    assert logprobs == pytest.approx(model_logprobs[len(last.prompt_ids) - 1 :], abs=1e-3)
