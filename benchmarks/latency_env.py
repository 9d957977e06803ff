"""A retry environment whose answers take a heavy-tailed time, like a slow tool.

    multiturn:
      environments:
        - env: benchmarks.latency_env:LatencyEnv
          args: {median_s: 0.005, sigma: 2.0, max_s: 0.3, max_attempts: 3, feedback: wrong}

``LatencyEnv`` judges answers exactly as ``verl_async.envs.retry:RetryEnv`` does (every
other argument is RetryEnv's), but each ``step`` first sleeps a lognormal time: median
``median_s``, log-space standard deviation ``sigma``, cut at ``max_s``. With the defaults
half the calls take under 5 ms, about one in 15 over 0.1 s, and one in 50 hits the 0.3 s cap.

The time is drawn from a hash of (``seed``, the prompt, the attempt number), not from a
random generator, so every run of a benchmark sees the same latency for the same episode
turn whatever its order, process or timing. Episodes of one prompt share their latencies.

The generator imports the class by name: run from the repository root, whose directory is
on the roles' import path, so ``benchmarks.latency_env`` resolves there.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from statistics import NormalDist

from verl_async.envs.base import EnvRow, Step
from verl_async.envs.retry import RetryEnv


class LatencyEnv(RetryEnv):
    """RetryEnv whose ``step`` sleeps ``latency(attempt)`` seconds before it answers."""

    def __init__(
        self,
        median_s: float = 0.005,
        sigma: float = 2.0,
        max_s: float = 0.3,
        seed: int = 0,
        **retry_args,
    ) -> None:
        super().__init__(**retry_args)
        if not median_s > 0 or not sigma >= 0 or not max_s >= median_s:
            raise ValueError(
                "need median_s > 0, sigma >= 0 and max_s >= median_s, got "
                f"median_s={median_s!r}, sigma={sigma!r}, max_s={max_s!r}"
            )
        self.median_s = float(median_s)
        self.sigma = float(sigma)
        self.max_s = float(max_s)
        self.seed = seed
        self.prompt_key = ""

    def reset(self, row: EnvRow) -> None:
        """RetryEnv's reset; also remembers the prompt, which the latencies are drawn from."""
        super().reset(row)
        self.prompt_key = json.dumps(row.prompt, sort_keys=True)

    def latency(self, attempt: int) -> float:
        """Seconds the answer to ``attempt`` (1, 2, ...) of this episode's prompt takes."""
        digest = hashlib.blake2b(
            f"{self.seed}|{self.prompt_key}|{attempt}".encode(), digest_size=8
        ).digest()
        # A uniform in (0, 1) from the hash (never 0 or 1, which have no normal quantile).
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64
        return min(self.max_s, self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(u)))

    def step(self, text: str) -> Step:
        """Waits this attempt's latency, then judges the answer as RetryEnv does."""
        time.sleep(self.latency(self.attempts + 1))
        return super().step(text)
