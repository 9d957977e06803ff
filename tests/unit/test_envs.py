"""Multi-turn environments: loading and routing, the step contract, the shipped
environments turn by turn, the hostile test fixture and the guess-the-digit data."""

import asyncio
import json
import re

import pytest

from tests import hostile_env
from tests.hostile_env import AsyncHostileEnv, HostileEnv
from verl_async.config_base import ConfigError
from verl_async.envs import (
    CalculatorEnv,
    EnvironmentTable,
    EnvRow,
    GuessNumberEnv,
    RetryEnv,
    Step,
    as_step,
    check_environments,
    load_environment,
    make_environment,
)
from verl_async.envs.calculator import SYSTEM_PROMPT
from verl_async.schema import EnvironmentConfig, MultiTurnConfig
from verl_async.tasks import guess_number

RETRY = "verl_async.envs.retry:RetryEnv"
GUESS = "verl_async.envs.guess:GuessNumberEnv"
CALC = "verl_async.envs.calculator:CalculatorEnv"
KEY = "multiturn.environments[0]"
KEY_RE = re.escape(KEY)


def row(prompt="max 3 7 1 =", ground_truth="7", data_source="max", extra_info=None):
    return EnvRow(prompt, ground_truth, data_source, extra_info or {})


def user(content):
    return {"role": "user", "content": content}


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "env, message",
    [
        ("verl_async.envs.retry.RetryEnv", "is not of the form package.module:Class"),
        ("verl_async.envs.retry:", "is not of the form"),
        (":RetryEnv", "is not of the form"),
        ("verl_async.envs.retry:RetryEnv.step", "is not of the form"),
        ("no_such_package.envs:Env", "module 'no_such_package.envs' cannot be imported"),
        ("verl_async.envs.retry:NoSuchEnv", "module 'verl_async.envs.retry' has no 'NoSuchEnv'"),
        ("verl_async.envs.safe_math:evaluate", r"is not a class \(function\)"),
        ("verl_async.envs.safe_math:MAX_LENGTH", r"is not a class \(int\)"),
        ("verl_async.envs.base:EnvRow", "has no reset or step method"),
        ("verl_async.envs.base:Step", "has no reset or step method"),
    ],
)
def test_a_class_that_cannot_be_loaded_names_its_key(env, message):
    with pytest.raises(ConfigError, match=rf"bad value for '{KEY_RE}\.env': .*{message}"):
        load_environment(EnvironmentConfig(env=env), KEY)


def test_a_module_that_fails_on_import_names_its_key(tmp_path, monkeypatch):
    (tmp_path / "broken_env_module.py").write_text("raise RuntimeError('no sandbox here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"\.env'.*RuntimeError: no sandbox here"):
        load_environment(EnvironmentConfig(env="broken_env_module:Env"), KEY)


def test_arguments_the_class_refuses_name_the_args_key():
    cls = load_environment(EnvironmentConfig(env=RETRY), KEY)
    assert cls is RetryEnv
    with pytest.raises(ConfigError, match=rf"'{KEY_RE}\.args': .*unexpected keyword.*'tries'"):
        make_environment(cls, EnvironmentConfig(env=RETRY, args={"tries": 2}), KEY)
    with pytest.raises(ConfigError, match=rf"'{KEY_RE}\.args': .*extract must be one of"):
        make_environment(cls, EnvironmentConfig(env=RETRY, args={"extract": "middle"}), KEY)
    env = make_environment(cls, EnvironmentConfig(env=RETRY, args={"max_attempts": 5}), KEY)
    assert isinstance(env, RetryEnv) and env.max_attempts == 5


def multiturn(*specs):
    return MultiTurnConfig(environments=[EnvironmentConfig(**s) for s in specs])


def test_the_table_routes_named_sources_then_the_catch_all():
    table = EnvironmentTable(
        multiturn(
            {"env": RETRY, "data_sources": ["max", "arith"]},
            {"env": GUESS, "data_sources": ["guess"]},
            {"env": CALC},
        )
    )
    assert [table.route(s) for s in ["max", "arith", "guess", "gsm8k"]] == [
        ("env", 0), ("env", 0), ("env", 1), ("env", 2),
    ]  # fmt: skip
    assert [(spec.env, cls) for spec, cls in table.entries] == [
        (RETRY, RetryEnv), (GUESS, GuessNumberEnv), (CALC, CalculatorEnv),
    ]  # fmt: skip


def test_without_a_catch_all_other_sources_stay_single_turn():
    table = EnvironmentTable(multiturn({"env": GUESS, "data_sources": ["guess"]}))
    assert table.route("guess") == ("env", 0)
    assert table.route("max") is None
    assert EnvironmentTable(MultiTurnConfig()).route("max") is None


def test_the_table_fails_at_construction_on_a_class_it_cannot_load():
    bad = multiturn({"env": GUESS, "data_sources": ["guess"]}, {"env": "verl_async.envs:Nope"})
    with pytest.raises(ConfigError, match=r"'multiturn\.environments\[1\]\.env'.*has no 'Nope'"):
        EnvironmentTable(bad)


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            [{"env": RETRY, "data_sources": ["a"]}, {"env": "retry", "data_sources": ["b"]}],
            r"'multiturn\.environments\[1\]\.env': 'retry' is not of the form",
        ),
        (
            [{"env": "1pkg.mod:Env"}],
            r"'multiturn\.environments\[0\]\.env'",
        ),
        (
            [{"env": RETRY, "data_sources": ["a", "b"]}, {"env": GUESS, "data_sources": ["b"]}],
            r"'multiturn\.environments\[1\]\.data_sources': 'b' is already "
            r"multiturn\.environments\[0\]'s",
        ),
        (
            [{"env": RETRY}, {"env": GUESS, "data_sources": ["g"]}, {"env": CALC}],
            r"'multiturn\.environments\[2\]\.data_sources': empty, and so is that of "
            r"multiturn\.environments\[0\]",
        ),
    ],
)
def test_check_environments_names_the_key(specs, message):
    with pytest.raises(ConfigError, match=message):
        check_environments(multiturn(*specs))


def test_check_environments_accepts_a_valid_table_without_importing():
    check_environments(
        multiturn(
            {"env": "not_installed.pkg:Env", "data_sources": ["a"]},
            {"env": "other_pkg:Env2", "data_sources": ["b", "c"]},
            {"env": "_private.mod:_Env"},
        )
    )


# ----------------------------------------------------------------------------- as_step


def test_as_step_takes_steps_and_tuples():
    step = Step([user("hi")], 0.5, done=False, tool_call=True)
    assert as_step(step) is step
    assert as_step(([user("higher")], 1, False)) == Step([user("higher")], 1.0, False)
    assert isinstance(as_step(([], 1, True)).reward, float)
    assert as_step(([], None, True)) == Step([], None, True)


@pytest.mark.parametrize(
    "result, message",
    [
        (None, "got NoneType"),
        ("higher", "got str"),
        (([], 0.0), "got a tuple of 2"),
        ([[], 0.0, True], "got list"),
        (("higher", 0.0, False), "observations must be a list of"),
        (([{"role": "user"}], 0.0, False), "observations must be a list of"),
        (([{"role": "user", "content": 3}], 0.0, False), "observations must be a list of"),
        (([], "1.0", False), "reward must be a number finite in float32 or None"),
        (([], float("nan"), False), "reward must be a number finite in float32 or None"),
        (([], 1e39, False), "reward must be a number finite in float32 or None"),  # float64's
        (([], -float("inf"), False), "reward must be a number finite in float32 or None"),
        (([], 0.0, "yes"), "done and tool_call must be bools"),
        (Step([], 0.0, False, tool_call=1), "done and tool_call must be bools"),
    ],
)
def test_as_step_refuses_anything_else_with_a_type_error(result, message):
    with pytest.raises(TypeError, match=message):
        as_step(result)


class AsyncEcho:
    """An environment whose methods are coroutines."""

    async def reset(self, row):
        return [user(row.prompt)]

    async def step(self, text):
        await asyncio.sleep(0)
        return [user(f"you said {text}")], None, text == "stop"


def test_async_methods_give_a_step_once_awaited():
    env = AsyncEcho()
    assert asyncio.run(env.reset(row("hello"))) == [user("hello")]
    assert as_step(asyncio.run(env.step("go"))) == Step([user("you said go")], None, False)
    assert as_step(asyncio.run(env.step("stop"))).done
    pending = env.step("go")
    with pytest.raises(TypeError, match="awaitable that was not awaited"):
        as_step(pending)
    pending.close()


# ----------------------------------------------------------------------------- calculator


def test_calculator_puts_its_instructions_first_in_chat_prompts():
    env = CalculatorEnv()
    question = [user("What is 17 * 23?")]
    assert env.reset(row(question, "391")) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        *question,
    ]
    assert "<calc>" in SYSTEM_PROMPT and "<answer>" in SYSTEM_PROMPT
    own = [{"role": "system", "content": "Be brief."}, *question]
    assert env.reset(row(own, "391")) is None  # the prompt's own system message stays
    assert env.reset(row("What is 17 * 23?", "391")) is None  # plain prompts are left alone
    custom = CalculatorEnv(system_prompt="Use <calc>.").reset(row(question, "391"))
    assert custom[0] == {"role": "system", "content": "Use <calc>."}


def test_calculator_episode_turn_by_turn():
    env = CalculatorEnv()
    env.reset(row([user("What is 17 * 23 + 1?")], "392"))
    first = as_step(env.step("Let me compute. <calc>17 * 23</calc>"))
    assert first == Step([user("<result>391</result>")], None, done=False, tool_call=True)
    second = as_step(env.step("<calc> 391 + 1 </calc> and <calc>2 * 2</calc>"))
    assert second.observations == [user("<result>392</result>")]  # the first expression only
    final = as_step(env.step("<answer>392</answer>"))
    assert final == Step([], None, done=True, tool_call=False)


def test_calculator_reports_errors_and_reads_a_call_cut_at_its_closing_tag():
    env = CalculatorEnv(role="tool")
    env.reset(row("2 / 0 ?", "0"))
    step = env.step("<calc>2 / 0</calc>")
    assert step.observations == [
        {"role": "tool", "content": "<result>error: division by zero</result>"}
    ]
    assert step.tool_call and not step.done
    refused = env.step("<calc>__import__('os').system('ls')</calc>")
    assert refused.observations[0]["content"].startswith("<result>error: only numbers")
    assert env.step("<calc>6 * 7").observations[0]["content"] == "<result>42</result>"


def test_calculator_role_must_be_user_or_tool():
    with pytest.raises(ConfigError, match=r"\.args': .*role must be 'user' or 'tool'"):
        make_environment(CalculatorEnv, EnvironmentConfig(env=CALC, args={"role": "system"}), KEY)


# ----------------------------------------------------------------------------- retry


def test_retry_gives_feedback_until_right():
    env = RetryEnv(feedback="wrong again")
    assert env.reset(row()) is None
    assert env.step("3") == Step([user("wrong again")], 0.0, done=False)
    assert env.step("7 is the largest") == Step([], 1.0, done=True)


def test_retry_ends_at_the_last_attempt():
    env = RetryEnv(max_attempts=2, right_reward=2.0, wrong_reward=-0.5, role="tool")
    env.reset(row())
    assert env.step("1") == Step([{"role": "tool", "content": "Wrong, try again."}], -0.5)
    assert env.step("9") == Step([], -0.5, done=True)


def test_retry_one_attempt_is_single_turn_with_a_reward():
    env = RetryEnv(max_attempts=1)
    env.reset(row())
    assert env.step("7") == Step([], 1.0, done=True)
    env.reset(row())  # a reset starts the count again
    assert env.step("6") == Step([], 0.0, done=True)


@pytest.mark.parametrize(
    "extract, right, wrong",
    [
        ("first_word", "7 is it", "it is 7"),
        ("last_word", "it is 7", "7 is it"),
        ("last_number", "the answer is 7.0 .", "7 or 8"),
    ],
)
def test_retry_reads_the_answer_as_extract_says(extract, right, wrong):
    env = RetryEnv(extract=extract)
    env.reset(row(ground_truth=" 7 "))
    assert not env.step(wrong).done
    assert env.step(right).done


def test_retry_compares_numbers_of_a_gsm8k_ground_truth():
    env = RetryEnv(extract="last_number")
    env.reset(row("q", "He pays 3 * 4 = 12.\n#### 1,200"))
    assert env.step("So 1200 dollars.").reward == 1.0


@pytest.mark.parametrize("args", [{"max_attempts": 0}, {"max_attempts": 1.5}, {"extract": "all"}])
def test_retry_refuses_bad_args(args):
    with pytest.raises(ValueError):
        RetryEnv(**args)


# ----------------------------------------------------------------------------- guess


def test_guess_feedback_turn_by_turn():
    env = GuessNumberEnv()
    assert env.reset(row("guess =", "6", "guess", {"lo": 0, "hi": 9})) is None
    assert env.step("4") == Step([user("higher")], 0.0)
    assert env.step("5 7") == Step([user("lower")], 0.0)  # the last integer is the guess
    assert env.step("so") == Step([user("Guess an integer from 0 to 9.")], 0.0)
    assert env.step("2.5") == Step([user("Guess an integer from 0 to 9.")], 0.0)
    assert env.step("6") == Step([], 1.0, done=True)


def test_guess_range_from_args_and_custom_texts():
    env = GuessNumberEnv(
        lo=10,
        hi=20,
        higher="up",
        lower="down",
        no_number="{lo} to {hi}",
        role="tool",
        right_reward=5,
        wrong_reward=-1,
    )
    env.reset(row("guess", "15", "guess"))
    assert env.step("nothing") == Step([{"role": "tool", "content": "10 to 20"}], -1.0)
    assert env.step("12").observations[0]["content"] == "up"
    assert env.step("-3 then 30").observations[0]["content"] == "down"
    assert env.step("15") == Step([], 5.0, done=True)


def test_guess_max_guesses_ends_the_episode():
    env = GuessNumberEnv(max_guesses=2)
    env.reset(row("guess", "50", "guess"))
    assert not env.step("no idea").done  # a turn without a number counts too
    assert env.step("25") == Step([], 0.0, done=True)


def test_guess_refuses_a_ground_truth_that_is_not_an_integer():
    with pytest.raises(ValueError, match="not an integer"):
        GuessNumberEnv().reset(row("guess", "seven", "guess"))
    with pytest.raises(ValueError, match="extra_info lo and hi"):
        GuessNumberEnv().reset(row("guess", "3", "guess", {"lo": 5, "hi": 1}))
    with pytest.raises(ValueError, match="args lo and hi"):
        GuessNumberEnv(lo=3, hi="9")
    with pytest.raises(ValueError, match="max_guesses"):
        GuessNumberEnv(max_guesses=0)


# ----------------------------------------------------------------------------- hostile fixture

PICKED, SPARED = "max 1 2 3 =", "max 3 7 1 ="  # crc32 % 2: 0 and 1


def test_hostile_prompts_are_picked_by_a_stable_hash():
    assert hostile_env.picked(PICKED, 2) and not hostile_env.picked(SPARED, 2)
    assert hostile_env.picked(SPARED, 1)
    assert hostile_env.picked([user("a")], 1)


def test_hostile_raise_and_huge_hit_picked_prompts_only():
    env = HostileEnv(mode="raise")
    env.reset(row(PICKED, "3"))
    with pytest.raises(RuntimeError, match="hostile"):
        env.step("3")
    env = HostileEnv(mode="huge")
    env.reset(row(PICKED, "3"))
    assert len(env.step("3").observations[0]["content"]) == hostile_env.HUGE_BYTES
    for mode in hostile_env.MODES:
        env = HostileEnv(mode=mode, feedback="wrong")
        env.reset(row(SPARED, "7"))
        assert env.step("1") == Step([user("wrong")], 0.0)
        assert env.step("7") == Step([], 1.0, done=True)


def test_hostile_hang_sleeps_an_hour_in_the_calling_thread(monkeypatch):
    slept = []
    monkeypatch.setattr(hostile_env.time, "sleep", slept.append)
    env = HostileEnv(mode="hang")
    env.reset(row(PICKED, "3"))
    assert env.step("3") == Step([], 1.0, done=True)
    assert slept == [hostile_env.HANG_S]


def test_async_hostile_hang_awaits_an_hour(monkeypatch):
    slept = []

    async def fake_sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(hostile_env.asyncio, "sleep", fake_sleep)
    env = AsyncHostileEnv(mode="hang")

    async def episode(prompt):
        await env.reset(row(prompt, "3" if prompt == PICKED else "7"))
        return as_step(await env.step("1"))

    assert asyncio.run(episode(SPARED)) == Step([user("Wrong, try again.")], 0.0)
    assert slept == []
    assert asyncio.run(episode(PICKED)) == Step([user("Wrong, try again.")], 0.0)
    assert slept == [hostile_env.HANG_S]


def test_hostile_args_are_checked():
    with pytest.raises(ConfigError, match=r"\.args': .*mode must be one of"):
        make_environment(
            HostileEnv,
            EnvironmentConfig(env="tests.hostile_env:HostileEnv", args={"mode": "x"}),
            KEY,
        )
    assert load_environment(EnvironmentConfig(env="tests.hostile_env:AsyncHostileEnv"), KEY)


# ----------------------------------------------------------------------------- guess data


def test_guess_data_is_deterministic_and_the_shipped_files_are_its_output(tmp_path, repo_root):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = guess_number.write_files(tmp_path / "a")
    b = guess_number.write_files(tmp_path / "b")
    for mine, again, shipped in zip(
        a, b, ("guess_digit.jsonl", "guess_digit_val.jsonl"), strict=True
    ):
        assert mine.read_bytes() == again.read_bytes()
        assert mine.read_bytes() == (repo_root / "configs" / "data" / shipped).read_bytes()


def test_guess_data_rows(tmp_path):
    train, val = guess_number.write_files(tmp_path, train=512, val=128)
    rows = {p: [json.loads(line) for line in p.read_text().splitlines()] for p in (train, val)}
    assert [len(rows[train]), len(rows[val])] == [512, 128]
    for records in rows.values():
        assert {r["answer"] for r in records} == {str(d) for d in range(10)}
        for r in records:
            assert r == {
                "prompt": "guess =",
                "answer": r["answer"],
                "data_source": "guess",
                "extra_info": {"lo": 0, "hi": 9},
            }
    # Another seed: the validation secrets are not the first training ones again.
    assert [r["answer"] for r in rows[val]] != [r["answer"] for r in rows[train][:128]]


def test_guess_data_loads_and_runs_an_episode(tmp_path):
    from verl_async.data import load_prompts

    train, _ = guess_number.write_files(tmp_path, train=8, val=2)
    record = load_prompts(train)[0]
    env = GuessNumberEnv()
    env.reset(EnvRow(record.prompt, record.ground_truth, record.data_source, record.extra_info))
    assert (record.data_source, env.lo, env.hi) == ("guess", 0, 9)
    assert env.step(record.ground_truth).reward == 1.0
