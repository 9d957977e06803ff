"""The environment contract: what a multi-turn episode's environment is, how it is named in
the config, loaded and matched to a prompt's data source.

An episode alternates between the model and an environment::

    prompt = env.reset(row) or row.prompt
    text = <the model's turn>
    step = as_step(env.step(text))      # observations, reward, done, tool_call
    ...                                 # observations appended, next turn sampled
    env.close()                         # if it has one

The generator drives that loop (budgets, timeouts, rendering tokens); an environment only
answers ``reset`` and ``step``. Environments are named in ``multiturn.environments`` as
``package.module:Class``; ``EnvironmentTable`` loads them once and tells which one (if any)
runs the prompts of a data source.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from verl_async.config_base import ConfigError, check_finite32, import_named
from verl_async.numerics import finite32
from verl_async.schema import AgentConfig, EnvironmentConfig, MultiTurnConfig

Message = dict[str, str]
StepResult = tuple[list[Message], float | None, bool]

ENV_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class EnvRow:
    """The prompt an episode starts from, as the dataset gives it."""

    prompt: str | list[Message]  # a plain string prompt, or chat messages
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """What the environment answers to one turn of the model."""

    observations: list[Message]  # appended after the assistant's turn
    reward: float | None = None  # this turn's reward; None: none
    done: bool = False  # the episode ends after this turn
    tool_call: bool = False  # this step ran a tool (counted in the metrics)


class Environment(Protocol):
    """One episode's environment, built as ``Class(**args)`` from its config entry.

    ``reset(row)`` gives the episode's initial prompt: chat messages, a string for plain
    (no chat template) prompts, or None for the row's prompt as it is (which also spares
    the generator rendering it again). Every episode of one prompt must get the same
    initial prompt, because a group of samples is compared with itself: randomness must
    come from the row, never from the instance.

    ``step(text)`` answers the model's turn, given as text with special tokens removed:
    a ``Step``, or for convenience a plain tuple ``(observations, reward, done)``.

    An optional ``close()`` is called when the episode ends, however it ends. Every method
    may be a plain function or ``async def``; the generator calls them off its event loop
    under ``multiturn.step_timeout_s``, so an environment may block.
    """

    def reset(
        self, row: EnvRow
    ) -> list[Message] | str | None | Awaitable[list[Message] | str | None]: ...

    def step(self, text: str) -> Step | StepResult | Awaitable[Step | StepResult]: ...


def as_step(result: Any) -> Step:
    """``result`` of an environment's ``step`` (already awaited) as a ``Step``: a tuple
    ``(observations, reward, done)`` is converted and the reward made a float; anything
    else, a field of the wrong type, or a reward that is not finite in float32, raises
    TypeError saying what came back."""
    if isinstance(result, Awaitable):
        raise TypeError("step returned an awaitable that was not awaited")
    if isinstance(result, tuple) and len(result) == 3:
        step = Step(*result)
    elif isinstance(result, Step):
        step = result
    else:
        raise TypeError(
            "step must return a Step or a tuple (observations, reward, done), got "
            + _describe(result)
        )
    if not isinstance(step.observations, list) or not all(
        _is_message(m) for m in step.observations
    ):
        raise TypeError(
            "step's observations must be a list of {role, content} messages of strings, got "
            + repr(step.observations)[:200]
        )
    reward = step.reward
    # int, float, numpy and torch scalars have __float__; str and None do not. The reward is
    # trained in float32, where 1e39 is infinite.
    if reward is not None and not (hasattr(reward, "__float__") and finite32(reward)):
        raise TypeError(
            f"step's reward must be a number finite in float32 or None, got {reward!r:.200}"
        )
    if not isinstance(step.done, bool) or not isinstance(step.tool_call, bool):
        raise TypeError(
            f"step's done and tool_call must be bools, got {step.done!r:.50} and "
            f"{step.tool_call!r:.50}"
        )
    return step if reward is None or type(reward) is float else replace(step, reward=float(reward))


def as_prompt(value: Any) -> str | list[Message] | None:
    """``value`` of an environment's ``reset`` (already awaited) if it is an initial prompt:
    None, a string, or a list of {role, content} messages of strings; anything else raises
    TypeError saying what came back."""
    # Copies of plain str: what the generator compares and renders is never a subclass.
    if value is None:
        return None
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list) and all(_is_message(m) for m in value):
        return [
            dict(m, role=str.__str__(m["role"]), content=str.__str__(m["content"])) for m in value
        ]
    raise TypeError(
        "reset must return chat messages ({role, content} strings), a string or None, got "
        + repr(value)[:200]
    )


def load_environment(spec: EnvironmentConfig, key: str) -> type:
    """The class ``spec.env`` names (``package.module:Class``, imported with importlib);
    any failure raises ConfigError naming ``<key>.env``."""
    where = f"bad value for '{key}.env'"
    if not ENV_PATTERN.match(spec.env):
        raise ConfigError(f"{where}: '{spec.env}' is not of the form package.module:Class")
    cls = import_named(spec.env, f"{key}.env")
    if not isinstance(cls, type):
        raise ConfigError(f"{where}: '{spec.env}' is not a class ({type(cls).__name__})")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"{where}: '{spec.env}' has no {' or '.join(missing)} method (an environment "
            "needs reset(row) and step(text))"
        )
    return cls


def load_agent(agent: AgentConfig, key: str) -> Any:
    """The ``async def`` function ``agent.agent`` names; any failure raises ConfigError
    naming ``<key>.agent``."""
    fn = import_named(agent.agent, f"{key}.agent")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"bad value for '{key}.agent': '{agent.agent}' is not an async def function (an "
            "agent is 'async def agent(client, row, **args)')"
        )
    return fn


def make_environment(cls: type, spec: EnvironmentConfig, key: str) -> Any:
    """A new instance of ``cls`` built with ``spec.args``; arguments it refuses (TypeError,
    ValueError) raise ConfigError naming ``<key>.args``."""
    try:
        return cls(**spec.args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad value for '{key}.args': {spec.env}: {exc}") from None


def check_environments(mt: MultiTurnConfig) -> None:
    """The checks of ``multiturn`` that import nothing: ``env_reward_weight`` finite in
    float32, the form of every ``env`` and ``agent``, no data source named by two entries
    (environments and agents together), at most one catch-all (an entry with no
    ``data_sources``)."""
    check_finite32("multiturn.env_reward_weight", mt.env_reward_weight)
    if any(spec.tools or spec.methods_as_tools for spec in mt.environments) or mt.agents:
        from verl_async.tools.parsers import check_parser_name

        check_parser_name(mt.tool_parser, "multiturn.tool_parser")
    claimed: dict[str, str] = {}
    catch_all: str | None = None
    for key, name, sources in _routed(mt):
        if not ENV_PATTERN.match(name):
            field_ = "agent" if key.startswith("multiturn.agents") else "env"
            what = "package.module:function" if field_ == "agent" else "package.module:Class"
            raise ConfigError(f"bad value for '{key}.{field_}': '{name}' is not of the form {what}")
        if not sources:
            if catch_all is not None:
                raise ConfigError(
                    f"bad value for '{key}.data_sources': empty, and so is that of "
                    f"{catch_all}; at most one entry may take every data source the others "
                    "do not name"
                )
            catch_all = key
        for source in sources:
            if source in claimed:
                raise ConfigError(
                    f"bad value for '{key}.data_sources': '{source}' is already {claimed[source]}'s"
                )
            claimed[source] = key


def _routed(mt: MultiTurnConfig):
    """(key, class or function, data sources) of every environment and agent entry."""
    for i, spec in enumerate(mt.environments):
        yield f"multiturn.environments[{i}]", spec.env, spec.data_sources
    for i, agent in enumerate(mt.agents):
        yield f"multiturn.agents[{i}]", agent.agent, agent.data_sources


class EnvironmentTable:
    """Which environment runs the prompts of each data source, with every class loaded.

    Built once per generator from ``cfg.multiturn``: a class that cannot be loaded fails
    here, at start, with the key of its entry (``multiturn.environments[i].env``).
    """

    def __init__(self, mt: MultiTurnConfig) -> None:
        check_environments(mt)
        self.entries: list[tuple[EnvironmentConfig, type]] = [
            (spec, load_environment(spec, f"multiturn.environments[{i}]"))
            for i, spec in enumerate(mt.environments)
        ]
        self.agents: list[tuple[AgentConfig, Any]] = [
            (agent, load_agent(agent, f"multiturn.agents[{i}]"))
            for i, agent in enumerate(mt.agents)
        ]
        # Data source -> ("env" | "agent", index); None: the catch-all's, if any.
        routes = [("env", i, spec.data_sources) for i, spec in enumerate(mt.environments)]
        routes += [("agent", i, a.data_sources) for i, a in enumerate(mt.agents)]
        self._by_source = {source: (kind, i) for kind, i, sources in routes for source in sources}
        self._catch_all = next(((kind, i) for kind, i, sources in routes if not sources), None)
        # Each entry's tools, loaded now too (a function that cannot be imported, or whose
        # schema cannot be derived, fails at start naming its key): (functions, methods).
        self.tools: list[tuple[list, list]] = [
            _load_tools(spec, cls, f"multiturn.environments[{i}]")
            for i, (spec, cls) in enumerate(self.entries)
        ]

    def tool_entries(self):
        """(config entry, its tools, its environment's methods as tools) of each entry that
        has tools."""
        for (spec, _), (tools, methods) in zip(self.entries, self.tools, strict=True):
            if tools or methods:
                yield spec, tools, methods

    def route(self, data_source: str) -> tuple[str, int] | None:
        """Which entry runs ``data_source``'s prompts: ("env", i) for
        ``multiturn.environments[i]``, ("agent", i) for ``multiturn.agents[i]``; the entry
        that names the source, else the catch-all, else None (single-turn)."""
        return self._by_source.get(data_source, self._catch_all)


def _load_tools(spec: EnvironmentConfig, cls: type, key: str) -> tuple[list, list]:
    """The entry's tools (``tools``) and its class's methods as tools (``methods_as_tools``);
    two tools of one name raise ConfigError."""
    from verl_async.tools.schemas import build_tool, load_tool, method_tools

    tools = []
    for i, t in enumerate(spec.tools):
        where, limit = f"{key}.tools[{i}]", t.max_concurrent or None
        if t.args:  # a factory's tool, built now (a sandbox checks it can run)
            tools.append(build_tool(t.function, t.args, key=where, max_concurrent=limit))
        else:
            tools.append(load_tool(t.function, key=where, schema=t.schema or None,
                                   max_concurrent=limit))  # fmt: skip
    methods = method_tools(cls, f"{key}.methods_as_tools") if spec.methods_as_tools else []
    seen: set[str] = set()
    for tool in [*tools, *methods]:
        if tool.name in seen:
            raise ConfigError(f"bad value for '{key}.tools': two tools are named {tool.name!r}")
        seen.add(tool.name)
    return tools, methods


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    )


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__
