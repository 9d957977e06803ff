"""Multi-turn environments: what answers the model between its turns.

The contract (``base.py``): an environment is a class named in ``multiturn.environments``
as ``package.module:Class`` and built once per episode with the entry's ``args``. It has
``reset(row: EnvRow)`` (the initial prompt, or None for the row's own), ``step(text)``
(a ``Step``: observation messages, this turn's reward, done, whether a tool ran; or the
tuple ``(observations, reward, done)``) and optionally ``close()``; any of them may be
``async``. ``EnvironmentTable`` loads the configured classes and picks the one for a data
source.

Shipped environments:

- ``calculator.CalculatorEnv``: evaluates ``<calc>EXPRESSION</calc>`` with the safe
  parser of ``safe_math``;
- ``retry.RetryEnv``: a wrong answer gets feedback and another attempt;
- ``guess.GuessNumberEnv``: guess a secret integer with higher/lower feedback;
- ``tools.ToolAgent``: the plain tool-calling loop (tools in the standard form, no
  environment of its own), and ``tools.calculator``, a tool.
"""

from verl_async.envs.base import (
    Environment,
    EnvironmentTable,
    EnvRow,
    Step,
    as_prompt,
    as_step,
    check_environments,
    load_environment,
    make_environment,
)
from verl_async.envs.calculator import CalculatorEnv
from verl_async.envs.guess import GuessNumberEnv
from verl_async.envs.retry import RetryEnv

__all__ = [
    "CalculatorEnv",
    "EnvRow",
    "Environment",
    "EnvironmentTable",
    "GuessNumberEnv",
    "RetryEnv",
    "Step",
    "as_prompt",
    "as_step",
    "check_environments",
    "load_environment",
    "make_environment",
]
