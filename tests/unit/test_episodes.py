"""The episode loop's bookkeeping (generators/episodes.py) on a scripted engine: masks,
placeholders, versions and turn rewards line up with the tokens; budgets; truncation;
environments that raise, hang or flood. Real engines run episodes in
tests/integration/test_multiturn.py."""

import asyncio
import itertools
import threading
import time
from collections import Counter, defaultdict

import msgspec
import numpy as np
import pytest

from generators.env_instances import Environments
from generators.env_threads import EnvThreads
from generators.episodes import EnvironmentEpisodes
from generators.interface import Sample, Sampling
from generators.render import Renderer
from generators.trajectory import pack
from verl_async import protocol as P
from verl_async.schema import EnvironmentConfig, MultiTurnConfig

EOS = 2


class WordTokenizer:
    """A tokenizer of space-separated words (plain mode: no chat template)."""

    chat_template = None
    eos_token_id = EOS

    def __init__(self):
        self.vocab = {"<pad>": 0, "<bos>": 1, "<eos>": EOS, "max": 3, "3": 4, "7": 5, "=": 6}

    def _id(self, word):
        return self.vocab.setdefault(word, len(self.vocab))

    def __call__(self, text, add_special_tokens=True):
        ids = [self._id(w) for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens=False):
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids if not (skip_special_tokens and i <= EOS))


class ScriptEngine:
    """Answers each request with the next scripted turn (words), stamped ``version``."""

    def __init__(self, tok, turns, version=0, logprob=-0.5):
        self.tok, self.turns, self.version, self.logprob = tok, list(turns), version, logprob
        self.requests = []

    async def sample(self, prompt_ids, how):
        self.requests.append((list(prompt_ids), how))
        words = self.turns.pop(0)
        # A turn ending in "...": the engine stopped without an end-of-sequence token.
        text = words.removesuffix(" ...")
        ids = self.tok(text, add_special_tokens=False)["input_ids"][: how.max_tokens]
        if len(ids) < how.max_tokens and text == words:
            ids.append(EOS)
        version, self.version = self.version, self.version + 1
        return Sample(ids, [self.logprob] * len(ids), [version] * len(ids), list(prompt_ids))


class Retry:
    """Right answer "7"; wrong ones get "wrong" and a -0.25 turn reward."""

    def __init__(self, feedback="wrong"):
        self.feedback = feedback

    def reset(self, row):
        self.truth = row.ground_truth
        return None

    def step(self, text):
        if text.split()[0] == self.truth:
            return [], 1.0, True
        return [{"role": "user", "content": self.feedback}], -0.25, False


class Raises(Retry):
    def step(self, text):
        raise RuntimeError("tool crashed")


class Hangs(Retry):
    def step(self, text):
        time.sleep(30)


class AsyncHangs(Retry):
    async def step(self, text):
        await asyncio.sleep(30)


class Floods(Retry):
    def step(self, text):
        return [{"role": "user", "content": "x " * 500_000}], None, False


class BadReset(Retry):
    def reset(self, row):
        raise ValueError("no such row")


GROUP = P.PromptGroup(
    group_id=0, prompt_id=0, epoch=0, prompt_ids=[1, 3, 4, 5, 6], prompt="max 3 7 =",
    ground_truth="7", data_source="d",
)  # fmt: skip


TURN = Sampling(max_tokens=4, temperature=1.0)


def episodes_of(engine, tok, cfg, cls, templated=False) -> EnvironmentEpisodes:
    """The rollout kind of ``cfg``'s one environment entry, run as ``cls``."""
    envs = Environments(Renderer(tok, templated, {EOS}), cfg, cfg.env_threads or 128)
    return EnvironmentEpisodes(engine, tok, cfg, envs, cfg.environments[0], cls)


def runner_for(turns, cls=Retry, tok=None, args=None, templated=False, **mt):
    tok = tok or WordTokenizer()
    engine = ScriptEngine(tok, turns)
    cfg = MultiTurnConfig(environments=[EnvironmentConfig(env="x:Y", args=args or {})], **mt)
    return tok, engine, episodes_of(engine, tok, cfg, cls, templated)


def run(turns, cls=Retry, n=1, how=TURN, group=GROUP, **mt):
    tok, engine, runner = runner_for(turns, cls, **mt)
    episodes = asyncio.run(runner.run_group(group, n, how))
    return tok, engine, episodes


def test_masks_placeholders_versions_and_turn_rewards_line_up():
    tok, engine, [ep] = run(["3", "9", "7"], max_turns=5)
    w = tok.vocab["wrong"]
    three, nine, seven = tok.vocab["3"], tok.vocab["9"], tok.vocab["7"]
    assert ep.token_ids == [three, EOS, w, nine, EOS, w, seven, EOS]
    assert ep.loss_mask == [1, 1, 0, 1, 1, 0, 1, 1]
    assert ep.logprobs == [-0.5, -0.5, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5]
    # One version per turn (the script bumps it); observations repeat the one before.
    assert ep.versions == [0, 0, 0, 1, 1, 1, 2, 2]
    # Each turn's reward at its last sampled token (its end-of-turn), nothing elsewhere.
    assert ep.rewards == [0, -0.25, 0, 0, -0.25, 0, 0, 1.0]
    s = ep.stats
    assert (s.turns, s.observation_tokens, s.budget, s.versions_spanned) == (3, 2, "", 2)
    assert s.env_reward == pytest.approx(0.5) and not s.template_mismatch
    assert ep.text == "7"
    # Each turn is a request for the whole conversation so far (same engine).
    assert engine.requests[2][0] == [*GROUP.prompt_ids, three, EOS, w, nine, EOS, w]
    packed = pack(GROUP.prompt_ids, [ep, ep])
    assert packed.lengths == [8, 8] and packed.loss_mask.dtype == np.uint8
    assert packed.turn_rewards.tolist() == ep.rewards * 2
    assert packed.prompt_ids == GROUP.prompt_ids


def test_env_reward_weight_scales_turn_rewards_only():
    _, _, [ep] = run(["3", "7"], env_reward_weight=0.5)
    assert ep.rewards == [0, -0.125, 0, 0, 0.5]
    assert ep.stats.env_reward == pytest.approx(0.75)


class HugeReward(Retry):
    """A wrong answer's turn reward is ``huge`` (a float64; float32 may not hold it)."""

    huge = 1e39

    def step(self, text):
        observations, reward, done = super().step(text)
        return observations, reward if done else self.huge, done


class Weighted(HugeReward):
    huge = 1e38  # a float32, but not once multiplied by env_reward_weight 10


@pytest.mark.parametrize("cls, weight", [(HugeReward, 1.0), (Weighted, 10.0)])
def test_a_turn_reward_float32_cannot_hold_is_the_environment_s_fault(cls, weight):
    """Not a turn reward of inf (the buffer would refuse the whole group): the step counts
    as a failed environment call, whose turn gets no reward and an error observation, and
    the episode goes on."""
    tok, _, [ep] = run(["3", "7"], cls=cls, env_reward_weight=weight)
    assert np.isfinite(np.asarray(ep.rewards, np.float32)).all()
    assert ep.rewards[:2] == [0, 0]  # the wrong answer's turn: no reward
    assert ep.rewards[-1] == weight * 1.0  # the right answer's, as usual
    assert ep.stats.tool_errors == 1 and ep.stats.turns == 2
    assert ep.stats.env_reward == 1.0
    error = tok.decode(ep.token_ids[2:-2])
    assert "error: TypeError:" in error and "float32" in error


def test_max_turns():
    _, _, [ep] = run(["1", "2", "3"], max_turns=2)
    assert (ep.stats.turns, ep.stats.budget) == (2, "turns")
    assert ep.loss_mask[-1] == 1  # ends on a sampled token, no observation appended


def test_a_turn_cut_by_its_token_budget_is_answered_and_closed_by_a_placeholder_end():
    how = Sampling(max_tokens=3, temperature=1.0)
    tok, _, [ep] = run(["1 2 3 4 5 ...", "7 7 7 7 ..."], how=how)
    one, two, three, w, seven = (tok.vocab[x] for x in ["1", "2", "3", "wrong", "7"])
    # "1 2 3" is judged (wrong); an end-of-turn nobody sampled closes it before "wrong".
    assert ep.token_ids == [one, two, three, EOS, w, seven, seven, seven]
    assert ep.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert ep.rewards == [0, 0, -0.25, 0, 0, 0, 0, 1.0]
    # The environment ended it; its last turn was cut by the turn budget.
    assert (ep.stats.turns, ep.stats.budget, ep.stats.template_mismatch) == (
        2,
        "turn_tokens",
        False,
    )


def test_episode_tokens_stop_before_an_observation_that_would_overflow():
    # prompt 5 + turn 2 = 7; an observation of 1 token would leave no room for a token.
    _, _, [ep] = run(["3", "9"], max_episode_tokens=8)
    assert ep.stats.budget == "episode_tokens" and ep.loss_mask == [1, 1]
    # The last turn's budget is what is left of the episode's.
    _, engine, [ep] = run(["3", "9 9 9 9 ..."], max_episode_tokens=10)
    assert engine.requests[1][1].max_tokens == 10 - 8
    assert ep.stats.budget == "episode_tokens"


def test_a_long_observation_is_cut_to_its_budget_and_counted():
    _, _, [ep] = run(["3", "7"], cls=Floods, max_observation_tokens=5, max_turns=2)
    obs = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if not m]
    assert len(obs) <= 5 and ep.stats.observation_tokens == len(obs)
    assert ep.stats.tool_errors == 1


@pytest.mark.parametrize("cls,kind,count", [(Raises, "errors", 2), (AsyncHangs, "timeouts", 2)])
def test_failing_tools_end_their_turn_with_an_error_observation(cls, kind, count):
    t0 = time.monotonic()
    tok, _, [ep] = run(["3", "7"], cls=cls, step_timeout_s=0.3, max_turns=2)
    assert time.monotonic() - t0 < 5  # a hung tool costs its timeout, not 30 s
    assert getattr(ep.stats, f"tool_{kind}") == count
    assert ep.stats.turns == 2 and ep.stats.budget == "turns"
    observed = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if not m]
    assert tok.decode(observed).startswith("error:")


def test_a_plain_method_past_its_deadline_ends_the_episode():
    t0 = time.monotonic()
    _, _, [ep] = run(["3", "7"], cls=Hangs, step_timeout_s=0.3, max_turns=2)
    assert time.monotonic() - t0 < 5
    # Its thread still sleeps in step(): no second call, no observation, one turn.
    assert (ep.stats.tool_timeouts, ep.stats.turns) == (1, 1)
    assert ep.loss_mask == [1, 1]


def test_a_failed_reset_runs_a_single_turn_on_the_row_prompt():
    _, engine, [ep] = run(["3"], cls=BadReset)
    assert ep.stats.tool_errors == 1 and ep.stats.turns == 1
    assert engine.requests[0][0] == GROUP.prompt_ids


def test_episode_timeout_bounds_the_environment_time():
    _, _, [ep] = run(["3", "7"], cls=Hangs, step_timeout_s=5, episode_timeout_s=0.3)
    assert ep.stats.tool_timeouts == 1 and ep.stats.budget == "episode_timeout"


def test_calls_run_off_the_loop():
    async def main():
        threads = EnvThreads("test", 1)
        thread = await threads.acquire(timeout_s=1)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        assert await thread.call("step", lambda: time.sleep(0.3) or 5, timeout_s=2) == 5
        t.cancel()
        thread.end()
        return ticks

    assert asyncio.run(main()) > 10  # the loop kept running while the call slept


def test_a_turn_ended_by_a_stop_string_is_a_whole_turn():
    # The engine stopped early without an end-of-sequence token (a stop string).
    tok, _, [ep] = run(["1 ...", "7"])
    one, w, seven = (tok.vocab[x] for x in ["1", "wrong", "7"])
    assert ep.token_ids == [one, EOS, w, seven, EOS]
    assert ep.loss_mask == [1, 0, 0, 1, 1]
    assert ep.stats.budget == ""


# ----------------------------------------------------------------------------- faults contained
# run_group promises never to raise for an environment's faults; each test below is one
# fault that used to escape it (or a resource it used to take without bound).


class Recorder(Retry):
    """``Retry`` that writes (instance, call, thread) to ``log`` for each of its calls."""

    def __init__(self, log, **kwargs):
        super().__init__(**kwargs)
        self.log = log
        self._note("init")

    def _note(self, what):
        self.log.append((id(self), what, threading.get_ident()))

    def reset(self, row):
        self._note("reset")
        return super().reset(row)

    def step(self, text):
        self._note("step")
        return super().step(text)

    def close(self):
        self._note("close")


def closes(log):
    """Instance -> how many times close() was called on it (every instance constructed)."""
    made = Counter(i for i, what, _ in log if what == "init")
    closed = Counter(i for i, what, _ in log if what == "close")
    return {i: closed[i] for i in made}


def test_a_prompt_that_leaves_no_room_for_a_turn_is_an_episode_without_turns():
    """The row's prompt fills multiturn.max_episode_tokens: nothing is sampled and nothing
    raises; each episode is an empty response (scored like a failed answer) whose budget
    is counted, and its environment is closed."""
    log = []
    _, engine, eps = run(
        ["3"], cls=Recorder, n=2, args={"log": log}, max_episode_tokens=len(GROUP.prompt_ids)
    )
    assert engine.requests == []
    for ep in eps:
        assert ep.token_ids == ep.loss_mask == ep.rewards == []
        assert (ep.stats.turns, ep.stats.budget, ep.text) == (0, "episode_tokens", "")
        assert ep.prompt_ids == GROUP.prompt_ids and not ep.stats.template_mismatch
    assert list(closes(log).values()) == [1, 1]
    assert pack(GROUP.prompt_ids, eps).lengths == [0, 0]


class LongReset(Recorder):
    def reset(self, row):
        super().reset(row)
        return "max " + "9 " * 60 + "="


def test_an_initial_prompt_too_long_for_the_episode_is_a_failed_reset():
    log = []
    _, engine, eps = run(["7", "7"], cls=LongReset, n=2, args={"log": log}, max_episode_tokens=30)
    for ep in eps:
        assert (ep.stats.tool_errors, ep.stats.turns) == (1, 1)
        assert ep.prompt_ids == GROUP.prompt_ids
    assert [r[0] for r in engine.requests] == [GROUP.prompt_ids] * 2
    assert list(closes(log).values()) == [1, 1]


class Disagrees(Recorder):
    """The third instance's reset gives another prompt than the others'."""

    def __init__(self, log, ticket):
        super().__init__(log)
        self.odd = next(ticket) == 2

    def reset(self, row):
        super().reset(row)
        return "max 7 3 = ?" if self.odd else "max 3 7 = ?"


def test_resets_that_disagree_within_a_group_keep_the_most_common_prompt(caplog):
    log = []
    tok, engine, eps = run(
        ["7"] * 4, cls=Disagrees, n=4, args={"log": log, "ticket": itertools.count()}
    )
    common = tok("max 3 7 = ?")["input_ids"]
    assert [ep.prompt_ids for ep in eps] == [common] * 4
    assert [r[0] for r in engine.requests] == [common] * 4
    assert sorted(ep.stats.tool_errors for ep in eps) == [0, 0, 0, 1]
    assert all(ep.stats.turns == 1 for ep in eps)
    assert list(closes(log).values()) == [1] * 4
    assert "different initial prompts" in caplog.text


@pytest.mark.parametrize(
    "value, message",
    [
        (42, "reset must return"),
        (b"max 3 7 =", "reset must return"),
        ([{"role": "user"}], "reset must return"),
        ([{"role": "user", "content": "max 3 7 ="}], "chat template"),  # plain mode: strings
        (["max 3 7 ="] * 100, "reset must return"),
    ],
)
def test_an_initial_prompt_that_cannot_be_rendered_is_a_failed_reset(value, message, caplog):
    class Gives(Recorder):
        def reset(self, row):
            super().reset(row)
            return value

    log = []
    _, engine, [ep] = run(["7"], cls=Gives, args={"log": log})
    assert (ep.stats.tool_errors, ep.stats.turns) == (1, 1)
    assert engine.requests[0][0] == GROUP.prompt_ids
    assert list(closes(log).values()) == [1]
    assert message in caplog.text


class TemplatedWords(WordTokenizer):
    """Words with a chat template that, like many, refuses roles it does not know."""

    chat_template = "role content <eos> per message"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        ids = []
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"the template has no role {m['role']!r}")
            ids += self(f"{m['role']} {m['content']}", add_special_tokens=False)["input_ids"]
            ids.append(EOS)
        if add_generation_prompt:
            ids += self("assistant", add_special_tokens=False)["input_ids"]
        return ids


class Banana(Retry):
    def step(self, text):
        if text.split()[0] == self.truth:
            return [], 1.0, True
        return [{"role": "banana", "content": "wrong"}], None, False


def test_an_observation_the_chat_template_refuses_is_an_error_observation():
    tok, _, [ep] = run(["3", "7"], cls=Banana, tok=TemplatedWords(), templated=True)
    assert (ep.stats.tool_errors, ep.stats.turns, ep.text) == (1, 2, "7")
    observed = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if not m]
    assert "error: ValueError: the template has no role 'banana'" in tok.decode(observed)


@pytest.mark.parametrize("cls", [Raises, Banana])
def test_a_fault_whose_error_observation_is_cut_is_counted_once(cls):
    """The error observation of a failed step (or of an observation the template refuses)
    is longer than max_observation_tokens: it is cut, and the fault is still one error."""
    tok, _, [ep] = run(
        ["3", "7"], cls=cls, tok=TemplatedWords(), templated=True, max_observation_tokens=3,
        max_turns=2,
    )  # fmt: skip
    assert (ep.stats.tool_errors, ep.stats.turns) == (1 + (cls is Raises), 2)
    observed = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if not m]
    assert len(observed) <= 3 + 1  # the cut observation after the turn's end-of-turn


class Exits(Retry):
    def step(self, text):
        raise SystemExit(3)


class Interrupts(Retry):
    def step(self, text):
        raise KeyboardInterrupt


class AsyncExits(Retry):
    async def step(self, text):
        raise SystemExit(3)


class AsyncCancels(Retry):
    async def step(self, text):
        raise asyncio.CancelledError


class OddReward(Retry):
    class Reward:
        def __float__(self):
            raise ValueError("this reward has no value")

    def step(self, text):
        return [{"role": "user", "content": "wrong"}], self.Reward(), False


@pytest.mark.parametrize("cls", [Exits, Interrupts, AsyncExits, AsyncCancels, OddReward])
def test_whatever_an_environment_raises_costs_only_its_turn(cls):
    _, _, [ep] = run(["3", "7"], cls=cls, max_turns=2)
    assert (ep.stats.tool_errors, ep.stats.turns, ep.stats.budget) == (2, 2, "turns")


class BigRewards(Retry):
    def step(self, text):
        return [{"role": "user", "content": "wrong"}], 2e38, False


def test_turn_rewards_whose_sum_float32_cannot_hold_are_the_environment_s_fault():
    """Each reward is finite in float32 but their sum is not: the learner sums an episode's
    turn rewards in float32, so the step that would overflow it is an error, counted."""
    _, _, [ep] = run(["3", "3", "3"], cls=BigRewards, max_turns=3)
    assert np.isfinite(np.asarray(ep.rewards, np.float32).sum(dtype=np.float32))
    assert ep.stats.tool_errors == 2 and sum(ep.rewards) == 2e38


class ManyMessages(Retry):
    def step(self, text):
        if text.split()[0] == self.truth:
            return [], 1.0, True
        return [{"role": "user", "content": "w"}] * 10_000, None, False


def test_an_observation_of_too_many_messages_is_an_error_observation():
    tok, _, [ep] = run(["3", "7"], cls=ManyMessages, max_observation_messages=4, max_turns=2)
    assert ep.stats.tool_errors == 1 and ep.stats.turns == 2
    observed = [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if not m]
    text = tok.decode(observed)
    assert text.startswith("error:") and "10000 observation messages" in text, text


def test_every_call_of_an_instance_runs_on_one_thread_of_its_own():
    """An instance's constructor, reset, steps and close share one thread (code written
    for one thread, a sqlite connection made in __init__, works); two instances in flight
    never share one."""
    log = []
    run(["3"] * 4, cls=Recorder, n=2, args={"log": log}, max_turns=2)
    threads = defaultdict(set)
    for instance, _, thread in log:
        threads[instance].add(thread)
    assert len(threads) == 2 and all(len(t) == 1 for t in threads.values())
    assert len(set.union(*threads.values())) == 2
    assert list(closes(log).values()) == [1, 1]


class AsyncBlocks(Retry):
    """An async environment whose step blocks its thread (a blocking wait inside an
    ``async def``) on the prompt "block", after telling the test it started, until the
    test releases it."""

    def __init__(self, started, release):
        super().__init__()
        self.started, self.release = started, release

    async def reset(self, row):
        self.blocks = row.prompt == "block"
        return Retry.reset(self, row)

    async def step(self, text):
        if self.blocks:
            self.started.set()
            self.release.wait(60)
        return Retry.step(self, text)


def test_a_coroutine_that_blocks_stalls_only_its_own_environment():
    """Other episodes of the same async environment finish every step in time while one
    instance's coroutine blocks its thread; it is released only once they are done."""
    started, release = threading.Event(), threading.Event()
    _, _, runner = runner_for(
        ["3"] * 8, AsyncBlocks, args={"started": started, "release": release},
        step_timeout_s=20, max_turns=2,
    )  # fmt: skip
    blocking = msgspec.structs.replace(GROUP, prompt="block")

    async def main():
        blocked = asyncio.create_task(runner.run_group(blocking, 1, TURN))
        try:
            assert await asyncio.to_thread(started.wait, 30)
            others = await runner.run_group(GROUP, 2, TURN)
        finally:
            release.set()
        return others, await blocked

    others, [blocked] = asyncio.run(main())
    # On one loop shared by every async environment the others' steps waited for the
    # blocked one and timed out.
    assert [(ep.stats.tool_timeouts, ep.stats.turns) for ep in others] == [(0, 2), (0, 2)]
    assert blocked.stats.turns == 2


class Blocks(Retry):
    """A plain step that blocks until the test releases it."""

    def __init__(self, release):
        super().__init__()
        self.release = release

    def step(self, text):
        self.release.wait(10)
        return super().step(text)


def test_environment_calls_hold_at_most_env_threads_threads():
    """Two threads for four episodes whose steps never return in time: two episodes time
    out in step, two time out waiting for a thread; no third thread is made."""
    release = threading.Event()
    before = threading.active_count()
    try:
        _, _, eps = run(
            ["3"] * 4, cls=Blocks, n=4, args={"release": release}, env_threads=2,
            step_timeout_s=0.5, max_turns=2,
        )  # fmt: skip
        made = threading.active_count() - before
    finally:
        release.set()
    assert made <= 2, made
    assert [(ep.stats.tool_timeouts, ep.stats.turns) for ep in eps] == [(1, 1)] * 4


class CloseRaises(Retry):
    def close(self):
        raise RuntimeError("close crashed")


RELEASE_CLOSE = threading.Event()


class CloseHangs(Retry):
    def close(self):
        RELEASE_CLOSE.wait(60)


@pytest.mark.parametrize("cls, kind", [(CloseRaises, "errors"), (CloseHangs, "timeouts")])
def test_a_close_that_fails_is_counted(cls, kind):
    """A close that hangs is not waited for past its deadline (released only after)."""
    RELEASE_CLOSE.clear()
    try:
        _, _, [ep] = run(["7"], cls=cls, step_timeout_s=0.5)
    finally:
        RELEASE_CLOSE.set()
    assert getattr(ep.stats, f"tool_{kind}") == 1 and ep.stats.turns == 1


class RecorderBadReset(Recorder):
    def reset(self, row):
        super().reset(row)
        raise ValueError("no such row")


class FailingEngine(ScriptEngine):
    """Fails its ``fail_at``-th request; with ``fail_at`` None, the second request of
    every episode waits forever (until cancelled)."""

    def __init__(self, tok, turns, fail_at=None):
        super().__init__(tok, turns)
        self.fail_at = fail_at

    async def sample(self, prompt_ids, how):
        if len(self.requests) + 1 == self.fail_at:
            raise RuntimeError("the engine failed")
        if self.fail_at is None and len(prompt_ids) > len(GROUP.prompt_ids):
            await asyncio.Event().wait()
        return await super().sample(prompt_ids, how)


@pytest.mark.parametrize("scenario", ["ends", "reset_fails", "engine_fails", "cancelled"])
def test_close_is_called_exactly_once_per_instance(scenario):
    log = []
    tok = WordTokenizer()
    cfg = MultiTurnConfig(environments=[EnvironmentConfig(env="x:Y", args={"log": log})])
    fail_at = {"engine_fails": 3, "cancelled": None}.get(scenario, 99)
    engine = FailingEngine(tok, ["3"] * 12, fail_at)
    cls = RecorderBadReset if scenario == "reset_fails" else Recorder
    runner = episodes_of(engine, tok, cfg, cls)

    async def main():
        task = asyncio.create_task(runner.run_group(GROUP, 3, TURN))
        if scenario == "cancelled":
            while sum(what == "step" for _, what, _ in log) < 3:
                await asyncio.sleep(0.01)
            task.cancel()
        try:
            await task
        except (RuntimeError, asyncio.CancelledError):
            assert scenario in ("engine_fails", "cancelled")
        for _ in range(200):  # closes after a failure or a cancel run in the background
            if sum(closes(log).values()) >= 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # and no second close comes later

    asyncio.run(main())
    assert list(closes(log).values()) == [1, 1, 1], log
