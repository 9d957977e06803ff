"""The episode loop's bookkeeping (generators/episodes.py) on a scripted engine: masks,
placeholders, versions and turn rewards line up with the tokens; budgets; truncation;
environments that raise, hang or flood. Real engines run episodes in
tests/integration/test_multiturn.py."""

import asyncio
import time

import numpy as np
import pytest

from generators.episodes import EnvCalls, EpisodeRunner, pack_group
from generators.interface import Sample, Sampling
from generators.render import Renderer
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


def run(turns, cls=Retry, n=1, how=TURN, **mt):
    tok = WordTokenizer()
    engine = ScriptEngine(tok, turns)
    cfg = MultiTurnConfig(environments=[EnvironmentConfig(env="x:Y")], **mt)
    runner = EpisodeRunner(engine, Renderer(tok, False, {EOS}), tok, cfg)
    spec = cfg.environments[0]
    episodes = asyncio.run(runner.run_group(spec, cls, GROUP, n, how))
    return tok, engine, episodes


def test_masks_placeholders_versions_and_turn_rewards_line_up():
    tok, engine, [ep] = run(["3", "9", "7"], max_turns=5)
    w = tok.vocab["wrong"]
    three, nine, seven = tok.vocab["3"], tok.vocab["9"], tok.vocab["7"]
    assert ep.sample.token_ids == [three, EOS, w, nine, EOS, w, seven, EOS]
    assert ep.loss_mask == [1, 1, 0, 1, 1, 0, 1, 1]
    assert ep.sample.logprobs == [-0.5, -0.5, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5]
    # One version per turn (the script bumps it); observations repeat the one before.
    assert ep.sample.versions == [0, 0, 0, 1, 1, 1, 2, 2]
    # Each turn's reward at its last sampled token (its end-of-turn), nothing elsewhere.
    assert ep.turn_rewards == [0, -0.25, 0, 0, -0.25, 0, 0, 1.0]
    s = ep.stats
    assert (s.turns, s.observation_tokens, s.budget, s.versions_spanned) == (3, 2, "", 2)
    assert s.env_reward == pytest.approx(0.5) and not s.template_mismatch
    assert ep.final_text == "7"
    # Each turn is a request for the whole conversation so far (same engine).
    assert engine.requests[2][0] == [*GROUP.prompt_ids, three, EOS, w, nine, EOS, w]
    packed = pack_group(GROUP.prompt_ids, [ep, ep])
    assert packed.lengths == [8, 8] and packed.loss_mask.dtype == np.uint8
    assert packed.turn_rewards.tolist() == ep.turn_rewards * 2
    assert packed.prompt_ids == GROUP.prompt_ids


def test_env_reward_weight_scales_turn_rewards_only():
    _, _, [ep] = run(["3", "7"], env_reward_weight=0.5)
    assert ep.turn_rewards == [0, -0.125, 0, 0, 0.5]
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
    assert np.isfinite(np.asarray(ep.turn_rewards, np.float32)).all()
    assert ep.turn_rewards[:2] == [0, 0]  # the wrong answer's turn: no reward
    assert ep.turn_rewards[-1] == weight * 1.0  # the right answer's, as usual
    assert ep.stats.tool_errors == 1 and ep.stats.turns == 2
    assert ep.stats.env_reward == 1.0
    error = tok.decode(ep.sample.token_ids[2:-2])
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
    assert ep.sample.token_ids == [one, two, three, EOS, w, seven, seven, seven]
    assert ep.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert ep.turn_rewards == [0, 0, -0.25, 0, 0, 0, 0, 1.0]
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
    obs = [t for t, m in zip(ep.sample.token_ids, ep.loss_mask, strict=True) if not m]
    assert len(obs) <= 5 and ep.stats.observation_tokens == len(obs)
    assert ep.stats.tool_errors == 1


@pytest.mark.parametrize("cls,kind,count", [(Raises, "errors", 2), (AsyncHangs, "timeouts", 2)])
def test_failing_tools_end_their_turn_with_an_error_observation(cls, kind, count):
    t0 = time.monotonic()
    tok, _, [ep] = run(["3", "7"], cls=cls, step_timeout_s=0.3, max_turns=2)
    assert time.monotonic() - t0 < 5  # a hung tool costs its timeout, not 30 s
    assert getattr(ep.stats, f"tool_{kind}") == count
    assert ep.stats.turns == 2 and ep.stats.budget == "turns"
    observed = [t for t, m in zip(ep.sample.token_ids, ep.loss_mask, strict=True) if not m]
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
        calls = EnvCalls()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        assert await calls.call("step", lambda: time.sleep(0.3) or 5, timeout_s=2) == 5
        t.cancel()
        return ticks

    assert asyncio.run(main()) > 10  # the loop kept running while the call slept


def test_a_turn_ended_by_a_stop_string_is_a_whole_turn():
    # The engine stopped early without an end-of-sequence token (a stop string).
    tok, _, [ep] = run(["1 ...", "7"])
    one, w, seven = (tok.vocab[x] for x in ["1", "wrong", "7"])
    assert ep.sample.token_ids == [one, EOS, w, seven, EOS]
    assert ep.loss_mask == [1, 0, 0, 1, 1]
    assert ep.stats.budget == ""
