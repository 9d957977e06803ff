"""Learning checks whose verdict does not depend on the machine's speed.

An asynchronous run's schedule depends on the machine: which batch is how stale, which
generator asks first. A learning curve measured on one is a draw from a distribution that
the machine's speed changes, so a bar that one machine clears another may not. The runs
here are synchronous (``staleness.max=0``): batch s holds groups sB .. sB+B-1, all sampled
at version s, whatever the speed; what is left is the seed, and every bar below has been
cleared with room over several seeds, on a quiet machine and beside a CPU hog
(``benchmarks/margins.py``, BENCHMARKS.md section "Test margins").

A ``Case`` is a ``verl-async train`` command and a ``measure`` of its run directory into
``Check`` values (each passes when ``value > bound``). The integration tests assert them;
``benchmarks/margins.py`` runs the same cases over seeds and prints each check's smallest
margin, so a bar is never tuned on one run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYNC = ("staleness.max=0", "generators.max_inflight_groups=8")  # tiny configs: 8 groups a step


@dataclass(frozen=True)
class Check:
    """One measured quantity of a run and the bar it must clear (``value > bound``)."""

    name: str
    value: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.value > self.bound

    def __str__(self) -> str:
        return f"{self.name}: {self.value:.3f} > {self.bound:.3f}"


@dataclass(frozen=True)
class Case:
    """A synchronous training run and what it must show."""

    config: str
    overrides: tuple[str, ...]
    measure: Callable[[Path], list[Check]]

    def args(self, run_dir: Path, seed: int | None = None) -> list[str]:
        """``verl-async`` arguments; ``seed`` changes the model's initialisation, the
        prompt order and the sampling (the tests run the configs' own seeds)."""
        seeded = [] if seed is None else seed_overrides(seed)
        return ["train", self.config, "--run-dir", str(run_dir), *SYNC, *self.overrides, *seeded]


def seed_overrides(seed: int) -> list[str]:
    return [f"learner.seed={seed}", f"data.shuffle_seed={seed}", f"model.tiny.seed={seed}"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def window_means(run_dir: Path, key: str, window: int) -> tuple[float, float]:
    """The mean of ``key`` over the first and over the last ``window`` steps."""
    metrics = rows(run_dir / "metrics.jsonl")
    return mean(r[key] for r in metrics[:window]), mean(r[key] for r in metrics[-window:])


def rise(run_dir: Path, key: str, window: int, min_rise: float) -> Check:
    """``key`` rose by more than ``min_rise`` from the first window to the last."""
    first, last = window_means(run_dir, key, window)
    return Check(f"{key} rise ({first:.3f} -> {last:.3f})", last - first, min_rise)


def fall(run_dir: Path, key: str, window: int, min_fall: float) -> Check:
    """``key`` fell by more than ``min_fall`` from the first window to the last."""
    first, last = window_means(run_dir, key, window)
    return Check(f"{key} fall ({first:.3f} -> {last:.3f})", first - last, min_fall)


def failed(checks: list[Check]) -> list[str]:
    return [str(c) for c in checks if not c.passed]


def train_and_check(case: Case, run_dir: Path, steps: int, timeout: float) -> list[dict]:
    """The case's run (the configs' own seeds) to its end: every step logged, every check
    passed; its metrics rows, for the test's own assertions."""
    from .conftest import run_cli  # the integration tests' runner (margins.py has its own)

    res = run_cli(case.args(run_dir), timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))
    checks = case.measure(run_dir)
    assert not failed(checks), failed(checks)
    return metrics


def tool_use(run_dir: Path, window: int, bar: float) -> list[Check]:
    """The tiny tool task (configs/tiny_tools.yaml, configs/tiny_agent.yaml): the final
    answer's score rises by more than ``bar`` (only a call and a copy beat one in ten), the
    policy calls the tool (more than 0.5 calls an episode in the last window), and greedy
    held-out episodes improve by more than ``bar``."""
    evals = rows(run_dir / "eval.jsonl")
    first_eval, last_eval = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    last = rows(run_dir / "metrics.jsonl")[-window:]
    calls = mean(r["multiturn/tool_calls"] for r in last)
    return [
        rise(run_dir, "reward/correct", window, bar),
        Check("tool calls per episode, last window", calls, 0.5),
        Check(f"eval reward rise ({first_eval:.3f} -> {last_eval:.3f})",
              last_eval - first_eval, bar),
    ]  # fmt: skip
