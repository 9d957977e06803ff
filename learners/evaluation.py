"""Evaluation rounds seen from the learner: start them at step barriers, write the results.

Round r is started after the step that makes ``steps_done`` a multiple of
``eval.every_steps`` (and before the first step and after the last). The buffer hands its
prompts to generators beside training work, so the learner never waits for an evaluation
except the final one. Each finished round is one line of ``eval.jsonl``:

    step, version            the barrier the round was started at
    eval/reward/<source>     mean raw score of that source (over the samples it scored)
    eval/reward_failed/<source>, eval/reward_mean, eval/reward_ds/<data_source>
    eval/response_length, eval/version_min, eval/version_max, eval/seconds, eval/prompts
    eval/env_reward, eval/turns_mean   (only when the round has multi-turn episodes)
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from verl_async import protocol as P
from verl_async.rewards.aggregate import summarize
from verl_async.schema import RunConfig
from verl_async.transport import BufferClient

log = logging.getLogger("verl_async.learner")


class EvalTracker:
    def __init__(self, cfg: RunConfig, client: BufferClient, run_dir: Path) -> None:
        self.cfg = cfg
        self.client = client
        self.path = run_dir / "eval.jsonl"
        self.pending: list[int] = []  # rounds started, not reported yet
        self.next_round = 0
        self.started_at: set[int] = set()  # steps that already have a round

    def due(self, steps_done: int) -> bool:
        every = self.cfg.eval.every_steps
        last = steps_done == self.cfg.trainer.total_steps
        return (
            bool(every) and steps_done not in self.started_at and (steps_done % every == 0 or last)
        )

    def maybe_start(self, steps_done: int, version: int) -> None:
        if not self.due(steps_done):
            return
        self.client.request(P.StartEval(round=self.next_round, step=steps_done, version=version))
        log.info("evaluation round %d started at step %d", self.next_round, steps_done)
        self.pending.append(self.next_round)
        self.started_at.add(steps_done)
        self.next_round += 1

    def poll(self) -> None:
        """Write every round that has finished (one request per pending round)."""
        for r in list(self.pending):
            reply, _ = self.client.request(P.GetEval(round=r))
            if isinstance(reply, P.EvalReport):
                self.pending.remove(r)
                self.write(reply)

    def finish(self, timeout_s: float) -> None:
        """Wait for the rounds still out (the final weights' one), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.2)
        if self.pending:
            log.warning(
                "evaluation rounds %s not finished within eval.timeout_s=%.0fs; not reported",
                self.pending,
                timeout_s,
            )

    def write(self, report: P.EvalReport) -> None:
        row = eval_row(report, self.cfg)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        main = self.cfg.rewards.sources[0].name
        log.info(
            "eval at step %d (version %d): reward %.3f, %s %.3f, %d prompts in %.1fs; e.g. %r",
            report.step,
            report.version,
            row["eval/reward_mean"],
            main,
            row.get(f"eval/reward/{main}") or 0.0,
            len(report.results),
            report.seconds,
            report.results[0].example[:120] if report.results else "",
        )


def eval_row(report: P.EvalReport, cfg: RunConfig) -> dict:
    """The eval.jsonl line of one round: raw scores combined by weight (no normalisation:
    an evaluation compares checkpoints, so its scale must not drift with the data)."""
    sources = cfg.rewards.sources
    scores = np.array(
        [sample for r in report.results for sample in zip(*r.scores, strict=True)], np.float64
    ).reshape(-1, len(sources))  # [N, S]
    weights = np.array([s.weight for s in sources])
    rewards = np.nansum(scores * weights, axis=1)  # NaN (not routed) counts as absent
    failed = [sum(col) for col in zip(*(r.failed for r in report.results), strict=True)]
    data_sources = [r.data_source for r in report.results for _ in r.response_lengths]
    row = {"step": report.step, "version": report.version}
    for key, value in summarize(scores, rewards, failed, data_sources, sources).items():
        row[f"eval/{key}"] = value
    lengths = [n for r in report.results for n in r.response_lengths]
    versions = [v for r in report.results for v in r.versions]
    row.update(
        {
            "eval/reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "eval/response_length": float(np.mean(lengths)) if lengths else 0.0,
            "eval/version_min": min(versions, default=report.version),
            "eval/version_max": max(versions, default=report.version),
            "eval/seconds": round(report.seconds, 3),
            "eval/prompts": len(report.results),
        }
    )
    # Multi-turn episodes only: a single-turn prompt's result leaves both lists empty.
    env_rewards = [x for r in report.results for x in r.env_rewards]
    turns = [n for r in report.results for n in r.turns]
    if env_rewards:
        row["eval/env_reward"] = float(np.mean(env_rewards))
    if turns:
        row["eval/turns_mean"] = float(np.mean(turns))
    return row
