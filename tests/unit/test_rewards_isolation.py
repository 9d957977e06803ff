"""The scoring process isolates rule rewards: a raise, a hang or a crash costs defaults for
the affected items, never the run. Real worker processes; real ``function`` sources from
tests/unit/reward_fns.py; a fake reward-model client."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from verl_async import protocol as P
from verl_async.reward_config import ExactReward, FunctionReward, ModelReward, RewardsConfig
from verl_async.rewards.scorer import RuleScorer, Scorer, conversation

FNS = "tests.unit.reward_fns"
SOURCES = [
    FunctionReward(name="ok", function=f"{FNS}:ok"),
    FunctionReward(name="raises", function=f"{FNS}:raises", default_score=-1.0),
    FunctionReward(name="hangs", function=f"{FNS}:hangs", default_score=-2.0),
    FunctionReward(name="kills", function=f"{FNS}:kills_process", default_score=-3.0),
]
OK, RAISES, HANGS, KILLS = range(4)


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch, repo_root: Path):
    """The scoring process imports ``tests.unit.reward_fns`` from the repository root."""
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{repo_root}{os.pathsep}{path}" if path else str(repo_root))


def item(source: int, response: str = "yes", ground_truth: str = "yes") -> P.ScoreItem:
    return P.ScoreItem(source=source, prompt="q", response=response, ground_truth=ground_truth)


def run_with_scorer(tmp_path: Path, body, timeout_s: float = 1.0):
    """Run ``body(scorer)`` on a fresh event loop with a RuleScorer over SOURCES."""

    async def main():
        scorer = RuleScorer(tmp_path, SOURCES, timeout_s)
        try:
            return await body(scorer)
        finally:
            scorer.close()

    return asyncio.run(main())


def test_ok_and_raising_items_in_one_request(tmp_path):
    async def body(scorer: RuleScorer):
        reply = await scorer.score([item(OK), item(RAISES), item(OK, "no")])
        again = await scorer.score([item(OK)])
        return reply, again, scorer.starts

    reply, again, starts = run_with_scorer(tmp_path, body, timeout_s=10.0)
    assert reply.scores == [1.0, -1.0, 0.0]
    assert reply.errors[0] == "" and reply.errors[2] == ""
    assert "reward exploded" in reply.errors[1]
    assert again.scores == [1.0]
    assert starts == 1  # a raise does not cost the process


def test_hang_times_out_and_the_next_request_gets_a_fresh_process(tmp_path):
    async def body(scorer: RuleScorer):
        await scorer.score([item(OK)])  # the process is up: the timing below is the hang's
        first_pid = scorer.proc.pid
        t0 = time.monotonic()
        hung = await scorer.score([item(OK), item(HANGS)])
        waited = time.monotonic() - t0
        after = await scorer.score([item(OK)])
        return hung, waited, after, first_pid, scorer

    hung, waited, after, first_pid, scorer = run_with_scorer(tmp_path, body)
    assert hung.scores == [SOURCES[OK].default_score, -2.0]  # the whole request is lost
    assert all("timed out after 1s" in e for e in hung.errors)
    assert 0.9 < waited < 10.0  # 1 s, not the 60 s the function sleeps
    assert after.scores == [1.0] and after.errors == [""]
    assert scorer.starts == 2


def test_a_slow_start_is_not_a_timeout(tmp_path):
    """The first request to a fresh process waits for its start (here a 2 s import, with
    a 1 s timeout): on a busy machine a start is slow, and that is no failure of the
    source. Later requests have the timeout alone."""
    slow = [FunctionReward(name="slow", function="tests.unit.slow_import_rewards:ok")]

    async def main():
        scorer = RuleScorer(tmp_path, slow, timeout_s=1.0)
        try:
            first = await scorer.score([item(0)])
            return first, await scorer.score([item(0, "no")]), scorer.starts
        finally:
            scorer.close()

    first, second, starts = asyncio.run(main())
    assert first.scores == [1.0] and first.errors == [""]
    assert second.scores == [0.0] and starts == 1


def test_killed_process_is_detected_and_replaced(tmp_path):
    async def body(scorer: RuleScorer):
        await scorer.score([item(OK)])
        t0 = time.monotonic()
        died = await scorer.score([item(KILLS)])
        waited = time.monotonic() - t0
        after = await scorer.score([item(OK), item(OK, "no")])
        return died, waited, after, scorer.starts

    died, waited, after, starts = run_with_scorer(tmp_path, body, timeout_s=5.0)
    assert died.scores == [-3.0]
    assert died.errors == ["scoring process died (exit code 3)"]
    assert waited < 2.0  # noticed by the exit status, not the 5 s deadline
    assert after.scores == [1.0, 0.0]
    assert starts == 2


HOSTILE = "tests.unit.hostile_reward_fns"
# What a user function may do besides raising an Exception, each costing its item alone.
MISCHIEF = {
    "exits": "SystemExit(2)",
    "interrupts": "KeyboardInterrupt()",
    "recurses": "RecursionError(",
    "out_of_memory": "MemoryError('no room for the reward')",
    "returns_bad_float": "SystemExit('not a number after all')",
    "raises_unprintable": "_Unprintable (its repr raised)",
    "returns_none": "returned NoneType, not a number",
}


def test_any_base_exception_of_a_function_costs_its_item_only(tmp_path):
    """SystemExit, KeyboardInterrupt, RecursionError, MemoryError, a result whose float()
    exits, an exception whose repr raises, a module that exits at import: each item gets
    its source's default and an error naming what happened; the items beside it are
    scored and the scoring process lives on (one start)."""
    sources = [FunctionReward(name="ok", function=f"{FNS}:ok")]
    sources += [
        FunctionReward(name=name, function=f"{HOSTILE}:{name}", default_score=-1.0 - i)
        for i, name in enumerate(MISCHIEF)
    ]
    script = "tests.unit.exiting_reward_module:score"
    sources.append(FunctionReward(name="script", function=script, default_score=-9.0))
    items = [item(0)] + [item(s) for s in range(1, len(sources))] + [item(0, "no")]

    async def main():
        scorer = RuleScorer(tmp_path, sources, timeout_s=30.0)
        try:
            return await scorer.score(items), await scorer.score([item(0)]), scorer.starts
        finally:
            scorer.close()

    reply, again, starts = asyncio.run(main())
    defaults = [-1.0 - i for i in range(len(MISCHIEF))] + [-9.0]
    assert reply.scores == [1.0, *defaults, 0.0]
    assert reply.errors[0] == "" and reply.errors[-1] == ""
    expected_errors = [*MISCHIEF.values(), "SystemExit("]
    for error, expected in zip(reply.errors[1:-1], expected_errors, strict=True):
        assert expected in error, (expected, error)
    assert "this module is a script" in reply.errors[-2]
    assert again.scores == [1.0] and again.errors == [""]
    assert starts == 1  # no item cost the process


def test_a_process_killed_between_requests_is_replaced_before_the_next_is_sent(tmp_path):
    """A scoring process that died while idle (the OOM killer, a stray kill) is noticed
    when the next request comes: that request goes to a fresh process and is scored."""

    async def body(scorer: RuleScorer):
        await scorer.score([item(OK)])
        os.kill(scorer.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while scorer.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return await scorer.score([item(OK), item(OK, "no")]), scorer.starts

    after, starts = run_with_scorer(tmp_path, body, timeout_s=10.0)
    assert after.scores == [1.0, 0.0] and after.errors == ["", ""]
    assert starts == 2


def test_sigterm_ends_the_scoring_process_even_inside_a_user_function(tmp_path):
    """The one BaseException an item does not keep: SIGTERM (``Terminated``) ends the
    process, with exit code 0, while a function hangs in it."""

    async def body(scorer: RuleScorer):
        await scorer.score([item(OK)])
        hung = asyncio.ensure_future(scorer.score([item(HANGS)]))
        await asyncio.sleep(0.5)  # the request is sent; the function may have started
        scorer.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(scorer._exit_code(), 30)
        await hung
        return code

    assert run_with_scorer(tmp_path, body, timeout_s=60.0) == 0


def test_concurrent_requests_each_get_their_own_reply(tmp_path):
    async def body(scorer: RuleScorer):
        return await asyncio.gather(
            *(scorer.score([item(OK, str(k % 2), "1")] * (k + 1)) for k in range(6))
        )

    replies = run_with_scorer(tmp_path, body, timeout_s=10.0)
    for k, reply in enumerate(replies):
        assert reply.scores == [float(k % 2)] * (k + 1)


def test_worker_answers_bad_messages_with_error_and_keeps_serving(tmp_path):
    async def body(scorer: RuleScorer):
        await scorer.score([item(OK)])
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(scorer.client.endpoint)
        try:
            await sock.send_multipart([b"\x93garbage"])
            bad = P.decode(await asyncio.wait_for(sock.recv_multipart(), 5))[0].body
            await sock.send_multipart(P.encode(P.GetStats(), 7))
            env = P.decode(await asyncio.wait_for(sock.recv_multipart(), 5))[0]
        finally:
            sock.close(linger=0)
        return bad, env, await scorer.score([item(OK)])

    bad, env, after = run_with_scorer(tmp_path, body, timeout_s=10.0)
    # The transport kit's replies (verl_async/transport/server.py RouterSocket.decode).
    assert isinstance(bad, P.Error) and bad.code == "protocol"
    assert bad.message.startswith("protocol version 103 is not")  # b"\x93g...": [103, ...]
    assert isinstance(env.body, P.Error) and env.body.code == "unexpected"
    assert env.body.message == "the scoring process serves ScoreRules, not GetStats"
    assert env.request_id == 7
    assert after.scores == [1.0]


def test_worker_log_goes_to_run_dir_logs(tmp_path):
    (tmp_path / "logs").mkdir()

    async def body(scorer: RuleScorer):
        return await scorer.score([item(OK)])

    assert run_with_scorer(tmp_path, body, timeout_s=10.0).scores == [1.0]
    logs = list((tmp_path / "logs").glob("reward_worker*.log"))
    assert len(logs) == 1 and "scoring process up" in logs[0].read_text()


# ----------------------------------------------------------------------------- Scorer


class FakeModel:
    """Reward-model client double: scores len(response), or hangs / raises on request."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.calls: list[list[list[dict]]] = []

    async def score(self, conversations: list[list[dict]]) -> list[float]:
        self.calls.append(conversations)
        if self.mode == "hang":
            await asyncio.sleep(60)
        if self.mode == "raise":
            raise ConnectionError("reward model down")
        if self.mode == "1e39":  # a float64, and an infinity in float32
            return [1e39] * len(conversations)
        return [float(len(c[-1]["content"])) for c in conversations]


def group(data_source: str = "gsm8k", prompt="q?") -> P.PromptGroup:
    return P.PromptGroup(
        group_id=0,
        prompt_id=0,
        epoch=0,
        prompt_ids=[1, 2],
        prompt=prompt,
        ground_truth="yes",
        data_source=data_source,
    )


def test_scorer_routes_sources_and_scores_model_and_rules(tmp_path):
    cfg = RewardsConfig(
        sources=[
            ExactReward(name="exact"),
            FunctionReward(name="fn", function=f"{FNS}:ok", data_sources=["gsm8k"]),
            ModelReward(name="rm", path="x", data_sources=["chat"]),
        ],
        timeout_s=10.0,
    )
    rm = FakeModel()

    async def main():
        scorer = Scorer(tmp_path, cfg, {"rm": rm})
        try:
            gsm = await scorer.score_group(group("gsm8k"), ["yes", "no!"])
            chat = await scorer.score_group(
                group("chat", [{"role": "user", "content": "hi"}]), ["yes"]
            )
        finally:
            scorer.close()
        return gsm, chat

    gsm, chat = asyncio.run(main())
    assert gsm.scores[:2] == [[1.0, 0.0], [1.0, 0.0]]
    assert all(math.isnan(v) for v in gsm.scores[2])  # rm is routed to "chat" only
    assert gsm.failed == [0, 0, 0]
    assert chat.scores[0] == [1.0] and math.isnan(chat.scores[1][0]) and chat.scores[2] == [3.0]
    assert rm.calls == [
        [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]]
    ]


def test_scorer_failures_give_defaults_count_and_log_once(tmp_path, caplog):
    cfg = RewardsConfig(
        sources=[
            FunctionReward(name="boom", function=f"{FNS}:raises", default_score=-1.0),
            ModelReward(name="slow", path="x", default_score=0.25),
            ModelReward(name="down", path="x"),
        ],
        timeout_s=0.5,
    )
    clients = {"slow": FakeModel("hang"), "down": FakeModel("raise")}

    async def main():
        scorer = Scorer(tmp_path, cfg, clients)
        try:
            t0 = time.monotonic()
            first = await scorer.score_group(group(), ["a", "b", "c"])
            seconds = time.monotonic() - t0
            second = await scorer.score_group(group(), ["d"])
        finally:
            scorer.close()
        return first, seconds, second

    with caplog.at_level(logging.WARNING, logger="verl_async.rewards"):
        first, seconds, second = asyncio.run(main())
    assert first.scores == [[-1.0] * 3, [0.25] * 3, [0.0] * 3]
    assert first.failed == [3, 3, 3] and second.failed == [1, 1, 1]
    assert seconds < 1.5  # the sources ran concurrently, each bounded by 0.5 s
    logged = [r.getMessage() for r in caplog.records if r.name == "verl_async.rewards"]
    for name in ("boom", "slow", "down"):
        assert sum(f"source '{name}' failed" in m for m in logged) == 1
    assert any("timed out after 0.5s" in m for m in logged)


def test_scores_float32_cannot_hold_are_failures_of_their_source(tmp_path, caplog):
    """1e39 (and NaN, inf) from a function or a reward model: the source's default score,
    counted in ``failed`` and logged once, as any failure; the other sources are unaffected."""
    cfg = RewardsConfig(
        sources=[
            FunctionReward(name="fn", function=f"{FNS}:returns_1e39", default_score=-1.0),
            ModelReward(name="rm", path="x", default_score=0.5),
            FunctionReward(name="ok", function=f"{FNS}:ok"),
        ],
        timeout_s=10.0,
    )

    async def main():
        scorer = Scorer(tmp_path, cfg, {"rm": FakeModel("1e39")})
        try:
            return await scorer.score_group(group(), ["yes", "no"])
        finally:
            scorer.close()

    with caplog.at_level(logging.WARNING, logger="verl_async.rewards"):
        out = asyncio.run(main())
    assert out.scores == [[-1.0, -1.0], [0.5, 0.5], [1.0, 0.0]]
    assert out.failed == [2, 2, 0]
    logged = [r.getMessage() for r in caplog.records if r.name == "verl_async.rewards"]
    assert sum("source 'fn' failed" in m and "not a finite float32" in m for m in logged) == 1
    assert sum("source 'rm' failed" in m and "not a finite float32" in m for m in logged) == 1


def test_scorer_needs_a_client_per_model_source(tmp_path):
    cfg = RewardsConfig(sources=[ModelReward(name="rm", path="x")])
    with pytest.raises(ValueError, match="rm"):
        Scorer(tmp_path, cfg, {})


def test_conversation_from_string_and_messages():
    assert conversation("hi", "yo") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert conversation(msgs, "r")[:2] == msgs and conversation(msgs, "r")[2]["content"] == "r"
