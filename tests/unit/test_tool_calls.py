"""Tool-calling episodes (generators/tool_calls.py through generators/episodes.py): the
real hermes parser on a real tokenizer with the tiny tool template, a scripted engine.
Results come back as ``role: tool`` messages rendered as deltas; each kind of fault is an
error message the model reads next, counted; calls of one turn run at once."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

from generators.env_instances import Environments
from generators.episodes import EnvironmentEpisodes
from generators.interface import Sample, Sampling
from generators.render import Renderer
from generators.tool_calls import ToolBox
from verl_async import protocol as P
from verl_async.envs import EnvironmentTable
from verl_async.launch.tiny_model import build_tokenizer
from verl_async.schema import EnvironmentConfig, MultiTurnConfig, ToolConfig
from verl_async.tasks.max_digit import VOCAB
from verl_async.tools.chat_templates import tool_template


def call(name: str, **arguments) -> str:
    """One hermes call as one word of the test vocabulary."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


CALLS = {
    "add": call("add", a=2, b=3),
    "add_bad": call("add", a="two"),
    "nope": call("nope"),
    "fails": call("fails", x=1),
    "slow": call("slow", seconds=5),
    "shout": call("shout", text="7"),
    "look": call("look"),
    "put": call("put", item="7"),
    "meet": call("meet", who="7"),
    "py": call("python", code="print(6*7)"),
    "py_loop": call("python", code="while(1):pass"),
    "malformed": '<tool_call>{"name":"add",</tool_call>',
    "exits": call("exits", code=2),
    "aexits": call("aexits", code=2),
    "interrupts": call("interrupts"),
    "spawns": call("spawns"),
    "echo": call("echo", text="7"),
    "deep": call("deep"),
}
NAMES = ["add", "nope", "fails", "slow", "shout", "look", "put", "meet", "python"]
NAMES += ["exits", "aexits", "interrupts", "spawns", "echo", "deep"]
WORDS = [*VOCAB, "tools", "<tool_response>", "</tool_response>", *NAMES, *CALLS.values()]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, WORDS)
    return AutoTokenizer.from_pretrained(d)


class Script:
    """Each request answered with the next scripted turn (words, then end-of-sequence)."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.requests = tok, list(turns), []

    async def sample(self, prompt_ids, how):
        self.requests.append(list(prompt_ids))
        ids = [self.tok.convert_tokens_to_ids(w) for w in self.turns.pop(0).split()]
        ids = ids[: how.max_tokens - 1] + [self.tok.eos_token_id]
        return Sample(ids, [-0.5] * len(ids), [0] * len(ids), list(prompt_ids))


class Final:
    """The environment: a turn without a call ends the episode with its first word's reward."""

    def reset(self, row):
        return None

    def step(self, text):
        return [], 1.0 if text.split()[0] == "7" else 0.0, True


GROUP = P.PromptGroup(
    group_id=0, prompt_id=0, epoch=0, prompt_ids=[3, 4], prompt="max 7 =",
    ground_truth="7", data_source="d",
)  # fmt: skip


def run(tok, turns, tools=(), methods_as_tools=False, env="tests.unit.test_tool_calls:Final",
        n=1, **mt):  # fmt: skip
    spec = EnvironmentConfig(
        env=env,
        tools=[
            t if isinstance(t, ToolConfig) else ToolConfig(function=_tool_spec(t)) for t in tools
        ],
        methods_as_tools=methods_as_tools,
    )
    cfg = MultiTurnConfig(environments=[spec], tool_template="tiny_tools", **mt)
    table = EnvironmentTable(cfg)
    engine = Script(tok, turns)
    renderer = Renderer(tok, False, {tok.eos_token_id})
    [(spec, cls)], [(fns, methods)] = table.entries, table.tools
    box = None
    if fns or methods:
        box = ToolBox(fns, methods, cfg, tok, renderer, tool_template("tiny_tools"))
    envs = Environments(renderer, cfg, 16)
    runner = EnvironmentEpisodes(engine, tok, cfg, envs, spec, cls, box)
    how = Sampling(max_tokens=4, temperature=1.0)
    return engine, asyncio.run(runner.run_group(GROUP, n, how))


def _tool_spec(name: str) -> str:
    module = "hostile_tools" if name in HOSTILE else "tool_fns"
    return f"tests.unit.{module}:{name}"


HOSTILE = {"exits", "aexits", "interrupts", "spawns", "echo", "deep"}


def words(tok, ids):
    return tok.convert_ids_to_tokens(ids)


def test_a_call_is_run_answered_as_a_tool_message_and_the_next_turn_reads_it(tok):
    engine, [ep] = run(tok, [CALLS["add"], "7"], tools=["add"])
    # The prompt carries the tools' names (the template's tools argument).
    assert words(tok, engine.requests[0]) == ["tools", "add", "max", "7", "="]
    assert ep.observations == [
        [{"role": "tool", "tool_call_id": "call_0_0", "name": "add", "content": "5"}]
    ]
    assert words(tok, engine.requests[1][5:]) == [
        CALLS["add"],
        "<eos>",
        "<tool_response>",
        "5",
        "</tool_response>",
    ]
    assert ep.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert ep.rewards[-1] == 1.0 and ep.text == "7"
    s = ep.stats
    assert (s.tool_calls, s.tool_errors, s.tool_timeouts, s.tool_parse_errors) == (1, 0, 0, 0)
    assert s.turns == 2 and not s.template_mismatch


def test_every_fault_is_an_error_message_the_model_reads_and_is_counted(tok):
    cases = [  # turn, tools, content's start, (calls, errors, timeouts, parse errors)
        (CALLS["nope"], ["add"], "error: there is no tool named 'nope'", (1, 1, 0, 0)),
        (CALLS["add_bad"], ["add"], "error: add: argument 'a' must be integer", (1, 1, 0, 0)),
        (CALLS["fails"], ["fails"], "error: RuntimeError: tool broke on 1", (1, 1, 0, 0)),
        (CALLS["slow"], ["slow"], "error: the tool slow timed out after 0.5 s", (1, 0, 1, 0)),
        (CALLS["malformed"], ["add"], "error: tool call 1: invalid JSON", (0, 0, 0, 1)),
    ]
    for turn, tools, says, counts in cases:
        _, [ep] = run(tok, [turn, "7"], tools=tools, step_timeout_s=0.5)
        content = ep.observations[0][0]["content"]
        assert content.startswith(says), (turn, content)
        s = ep.stats
        assert (s.tool_calls, s.tool_errors, s.tool_timeouts, s.tool_parse_errors) == counts
        # The episode went on (the slow tool's deadline ended its call: "timed out" above).
        assert s.turns == 2 and ep.text == "7"


def test_a_long_result_is_cut_to_its_token_budget_and_counted(tok):
    _, [ep] = run(tok, [CALLS["shout"], "7"], tools=["shout"], max_tool_response_tokens=5)
    assert ep.observations[0][0]["content"] == "7 7 7 7 7 [truncated]"
    assert ep.stats.tool_errors == 1


def test_calls_of_one_turn_run_at_once_and_past_max_parallel_calls_get_an_error(tok):
    # Two calls that each wait for the other (a barrier of two) return only if both run
    # at once; the third is past max_parallel_calls and does not run.
    turn = " ".join([CALLS["meet"]] * 3)
    _, [ep] = run(tok, [turn, "7"], tools=["meet"], max_parallel_calls=2)
    contents = [m["content"] for m in ep.observations[0]]
    assert contents[:2] == ["7 met", "7 met"]
    assert contents[2].startswith("error: at most 2 tool calls run per turn")
    ids = [m.get("tool_call_id") for m in ep.observations[0]]
    assert ids == ["call_0_0", "call_0_1", "call_0_2"]
    assert (ep.stats.tool_calls, ep.stats.tool_errors) == (2, 1)


def test_an_environment_s_methods_are_tools_bound_to_its_episode(tok):
    engine, eps = run(
        tok, [CALLS["put"], CALLS["look"], "7"], env="tests.unit.tool_fns:Inventory",
        methods_as_tools=True, max_turns=3,
    )  # fmt: skip
    [ep] = eps
    assert words(tok, engine.requests[0])[:3] == ["tools", "look", "put"]
    assert [o[0]["content"] for o in ep.observations] == ["7: 1", '{"7": 1}']
    assert ep.stats.tool_calls == 2 and ep.stats.tool_errors == 0
    assert ep.stats.budget == "turns"  # its step never says done


def _sandbox_python() -> str | None:
    """This Python if the sandbox user can run it, else the system's (as root programs run
    as uid 65534, which cannot run a Python under /root)."""
    from verl_async.tools.sandbox import Sandbox, SandboxError

    for python in (sys.executable, "/usr/bin/python3"):
        try:
            Sandbox(python=python).close()
            return python
        except SandboxError:
            continue
    return None


def test_the_sandboxed_python_tool_answers_and_a_contained_fault_is_a_tool_error(tok):
    python = _sandbox_python()
    if python is None:
        pytest.skip("no Python interpreter that the sandbox user can run")
    tool = ToolConfig(
        function="verl_async.tools.sandbox:python_tool",
        args={"python": python, "cpu_s": 1, "wall_s": 5.0},
        max_concurrent=2,
    )
    _, [ep] = run(tok, [CALLS["py"], "7"], tools=[tool])
    assert ep.observations[0][0]["content"] == "42\n" and ep.stats.tool_errors == 0
    _, [ep] = run(tok, [CALLS["py_loop"], "7"], tools=[tool])
    content = ep.observations[0][0]["content"]
    assert content.startswith("Error:") and "CPU" in content, content
    assert ep.stats.tool_errors == 1 and ep.stats.turns == 2


def test_a_factory_that_refuses_its_args_fails_at_start_naming_the_key(tok):
    from verl_async.config_base import ConfigError

    tool = ToolConfig(function="verl_async.tools.sandbox:python_tool", args={"cpu": 1})
    with pytest.raises(ConfigError, match=r"multiturn.environments\[0\].tools\[0\].args"):
        run(tok, ["7"], tools=[tool])


def test_daemon_pool_runs_calls_within_its_bound_and_a_hung_call_cannot_hold_exit(tmp_path):
    import subprocess
    import threading as th

    from generators.user_code import DaemonPool

    pool = DaemonPool(2, "t")
    gate = th.Event()
    hung = [pool.submit(gate.wait) for _ in range(2)]  # both threads busy
    queued = pool.submit(lambda x: x * 2, 21)
    failing = pool.submit(int, "x")
    assert not queued.done()  # waits: no third thread
    assert sum(t.name.startswith("t-") for t in th.enumerate()) == 2
    gate.set()
    assert queued.result(timeout=10) == 42 and all(f.result(timeout=10) for f in hung)
    with pytest.raises(ValueError):
        failing.result(timeout=10)
    # A call that never returns: the process still exits at once (a ThreadPoolExecutor's
    # thread would be joined at exit, forever).
    script = (
        "import threading, time\n"
        "from generators.user_code import DaemonPool\n"
        "DaemonPool(1, 'x').submit(threading.Event().wait)\n"
        "time.sleep(0.2)\n"
        "print('exiting')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "exiting", res.stderr[-2000:]


def test_a_tool_that_raises_systemexit_or_keyboardinterrupt_costs_only_its_call(tok):
    """A wrapped CLI's SystemExit (plain and async), an async KeyboardInterrupt, a task a
    tool started that raises SystemExit on the tools' loop, and a result nested too deep
    for JSON: each is the error message of its call, counted; the episode goes on, and an
    async call after them is answered (the tools' loop survived every one)."""
    turns = [CALLS[k] for k in ("exits", "aexits", "interrupts", "spawns", "deep", "echo")]
    _, [ep] = run(tok, [*turns, "7"], tools=sorted(HOSTILE), max_turns=7, step_timeout_s=5)
    contents = [o[0]["content"] for o in ep.observations]
    assert contents[0].startswith("error: SystemExit: 2"), contents
    assert contents[1].startswith("error: SystemExit: 2"), contents
    assert contents[2].startswith("error: KeyboardInterrupt"), contents
    assert contents[3] == "spawned"
    assert contents[4].startswith("error: RecursionError"), contents
    assert contents[5] == "7"  # the async tool after all of them still runs
    assert (ep.stats.tool_calls, ep.stats.tool_errors, ep.stats.tool_timeouts) == (6, 4, 0)
    assert ep.stats.turns == 7 and ep.text == "7"
