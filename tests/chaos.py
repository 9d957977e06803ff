"""Faults for the chaos test (tests/integration/test_chaos.py): an environment that hangs,
raises and floods now and then, and a reward function that returns numbers float32 cannot
hold now and then. Each fault it injects is appended to a file as one JSON line
({"kind": ...}), so the test can compare what was injected with what the run counted.

``ChaosEnv`` is ``RetryEnv`` (first word, ``max_attempts``) whose ``reset`` and ``step``
misbehave on the calls a hash of (seed, prompt, call) picks, with these shares in 1000
(``reset_raise`` of resets, the others of steps):

    reset_raise   reset raises                          (the episode runs without it)
    raise         step raises RuntimeError              (an error observation)
    hang          step blocks ``hang_s`` in time.sleep  (past multiturn.step_timeout_s)
    flood         step answers 1 MB in one message      (cut to max_observation_tokens)
    many          step answers 10,000 messages          (over max_observation_messages)
    reward        step's reward is 1e39, NaN or -inf    (not finite in float32)

Chosen by hash, not by a random generator: every episode of a group sees the same faults
on the same turns, and a run replays with its seed. ``chaos_reward`` is an ``exact``
first-word reward whose every ``every``-th call (by the scoring process's count) returns
1e39, NaN, inf, -inf or -1e39 in turn.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import zlib

from verl_async.envs import EnvRow, RetryEnv, Step

SHARES = {"reset_raise": 80, "raise": 60, "hang": 50, "flood": 50, "many": 50, "reward": 50}
HUGE_BYTES = 1 << 20
_BAD_REWARDS = (1e39, math.nan, -math.inf)
_POISON = (1e39, math.nan, math.inf, -math.inf, -1e39)


def record(path: str, kind: str) -> None:
    """Append one injected fault to ``path`` (one short line: O_APPEND keeps lines whole)."""
    line = json.dumps({"kind": kind, "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def pick(seed: int, prompt, call: str) -> str:
    """The fault (or "") for ``call`` of an episode of ``prompt``."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    h = zlib.crc32(f"{seed}|{text}|{call}".encode()) % 1000
    for kind, share in SHARES.items():
        if h < share:
            return kind
        h -= share
    return ""


class ChaosEnv(RetryEnv):
    def __init__(self, faults: str, seed: int = 0, hang_s: float = 4.0, **retry_args) -> None:
        super().__init__(**retry_args)
        self.faults, self.seed, self.hang_s = faults, seed, hang_s
        self.prompt = ""
        self.steps = 0  # step calls so far (a step that raised counts too)

    def _fault(self, call: str) -> str:
        kind = pick(self.seed, self.prompt, call)
        if kind and (kind == "reset_raise") == (call == "reset"):
            record(self.faults, kind)
            return kind
        return ""

    def reset(self, row: EnvRow) -> None:
        self.prompt = row.prompt
        super().reset(row)
        if self._fault("reset"):
            raise RuntimeError("chaos: reset raised")

    def step(self, text: str) -> Step:
        kind = self._fault(f"step{self.steps}")
        self.steps += 1
        if kind == "raise":
            raise RuntimeError("chaos: step raised")
        if kind == "hang":
            time.sleep(self.hang_s)
        if kind == "flood":
            return Step([{"role": self.role, "content": "x" * HUGE_BYTES}], self.wrong_reward)
        if kind == "many":
            return Step([{"role": self.role, "content": "x"}] * 10_000, self.wrong_reward)
        step = super().step(text)
        if kind == "reward":
            bad = _BAD_REWARDS[zlib.crc32(text.encode()) % len(_BAD_REWARDS)]
            return Step(step.observations, bad, step.done, step.tool_call)
        return step


_calls = itertools.count()  # this scoring process's calls so far


def chaos_reward(
    prompt, response, ground_truth, data_source, extra_info, faults: str = "", every: int = 7
) -> float:
    """1.0 when the first word of ``response`` is ``ground_truth``, else 0.0; every
    ``every``-th call a value that is not finite in float32, recorded in ``faults``."""
    n = next(_calls)
    if n % every == every - 1:
        if faults:
            record(faults, "reward_fn")
        return _POISON[(n // every) % len(_POISON)]
    words = response.split()
    return 1.0 if words and words[0] == ground_truth.strip() else 0.0
