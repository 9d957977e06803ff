"""The generator's side of scoring: one ``Scorer`` per generator, awaited on its event loop.

    score_group(group, responses, lengths) -> GroupScores(scores [S][n], failed [S])

    rule sources   one ``ScoreRules`` request per group to the scoring process
                   (``worker.py``, a child process of the generator's own)
    model sources  ``client.score(conversations)`` per source, each conversation being the
                   prompt messages + {"role": "assistant", "content": response}
    overlong       computed here from each response's token count (``lengths``);
                   rules.py: ``overlong_penalty``

All sources of a group run concurrently; every one is bounded by ``rewards.timeout_s``. A
source that raises, times out, returns garbage (a score that is not finite in float32, the
dtype it is trained in, included) or whose process dies scores its
``default_score`` for the affected samples; those are counted in ``failed[s]`` (the
learner's ``reward_failed/<name>``) and the first failure of each source is logged once.
A source not routed to the group's data_source gets NaN.

Isolation: a rule request that gets no reply within ``timeout_s`` (a hanging function) or
whose scoring process dies (``os._exit``, a segfault) kills the process group and starts
a fresh process; the request's items get their defaults and errors saying why. The
scoring process is a server of the transport kit (``RouterSocket``) and ``RuleScorer``
talks to it through the kit's client (``AsyncDealer``): limits, decoding, deadlines and
late replies are handled there, as for every other socket of a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from verl_async import protocol as P
from verl_async.numerics import finite32
from verl_async.reward_config import (
    RULE_SOURCES,
    ModelReward,
    OverlongReward,
    RewardsConfig,
    RewardSource,
)
from verl_async.rewards.rules import overlong_penalty
from verl_async.rewards.worker import ENV_REWARDS
from verl_async.transport.client import AsyncDealer
from verl_async.transport.limits import MAX_MESSAGE_BYTES

log = logging.getLogger("verl_async.rewards")
POLL_S = 0.1  # how often a waiting request looks at the scoring process's exit status
STARTUP_S = 60.0  # a fresh scoring process's first reply may take this much longer


class ModelClient(Protocol):
    """A reward-model client: one score per conversation; raises on timeout or error."""

    async def score(self, conversations: list[list[dict]]) -> list[float]: ...


@dataclass
class GroupScores:
    scores: list[list[float]]  # [S][n] raw score per source and sample; NaN: not routed
    failed: list[int]  # [S] samples scored with the source's default after a failure


class ScoringFailed(RuntimeError):
    """The scoring process gave no usable reply (timed out, died, or refused)."""


class _WorkerClient(AsyncDealer):
    """The kit's asyncio client, its errors named for the scoring process."""

    def unavailable(self, waited_s: float) -> ScoringFailed:
        return ScoringFailed(f"timed out after {waited_s:g}s")

    def bad_reply(self, exc: P.ProtocolError) -> ScoringFailed:
        return ScoringFailed(f"bad reply from the scoring process: {exc}")


class RuleScorer:
    """Client of one scoring process; restarts it after a hang or a crash.

    Pattern: the kit's ``AsyncDealer`` (its docstring: request ids, one reader task,
    deadlines, HWM, linger 0) connected to the process's ROUTER on a private ipc path;
    a fresh socket for every fresh process, so nothing meant for a killed one is ever
    delivered to its successor. Handshake: none; a request made before the process has
    bound waits for the connection within its own deadline.

    Requests go one at a time (an ``asyncio.Lock``); each has its own deadline of
    ``timeout_s`` from when it is sent, so a hanging request delays a later one by at most
    its own timeout, and the later one then runs on a fresh process. The first request to
    a fresh process also waits for its start (an interpreter and the user's imports, up to
    ``STARTUP_S`` more): a start slowed by a busy machine is not a failure of the source.
    While a request waits, the process's exit status is looked at every ``POLL_S``: a
    crash fails the request at once, not at its deadline. A process found dead before a
    request is sent (killed between requests) is replaced first, so the request is scored.
    Every restart is logged with its cause.
    """

    def __init__(
        self,
        run_dir: str | Path,
        sources: Sequence[RewardSource],
        timeout_s: float,
        log_name: str = "reward_worker",
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        self.run_dir = Path(run_dir)
        self.log_name = log_name  # logs/<log_name>.log in the run directory
        self.sources = list(sources)
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes  # the scoring process's frame limit
        self.rewards_json = msgspec.json.encode(
            RewardsConfig(sources=self.sources, timeout_s=timeout_s)
        ).decode()
        # AF_UNIX paths are limited to ~107 bytes: a short private directory, not run_dir.
        self.sock_dir = tempfile.mkdtemp(prefix="verl-rewards-")
        self.starts = 0
        self.lock = asyncio.Lock()
        self.proc: subprocess.Popen | None = None
        self.fresh = True  # no reply from this process yet: its start counts in STARTUP_S
        self.client: _WorkerClient | None = None
        self.log_file: Any = None
        self._start()

    # ------------------------------------------------------------------ process

    def _start(self) -> None:
        self.starts += 1
        endpoint = f"ipc://{self.sock_dir}/w{self.starts}.sock"
        logs = self.run_dir / "logs"
        if self.log_file is None and logs.is_dir():
            self.log_file = open(logs / f"{self.log_name}.log", "ab")  # noqa: SIM115 (closed in close())
        env = dict(os.environ, **{ENV_REWARDS: self.rewards_json})
        # The child imports user functions from the working directory (python -m does that).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_async.rewards.worker"]
            + ["--run-dir", str(self.run_dir), "--endpoint", endpoint]
            + ["--max-message-bytes", str(self.max_message_bytes)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT if self.log_file is not None else None,
            start_new_session=True,  # its own process group: a kill takes user children too
        )
        self.client = _WorkerClient(endpoint, self.timeout_s)
        self.fresh = True

    def _stop(self) -> None:
        """Kill the scoring process's whole group, reap it, drop the socket."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)  # SIGKILL: reaped within milliseconds
        self.proc = None

    def restart(self) -> None:
        self._stop()
        self._start()

    def _replace(self, cause: str) -> None:
        log.warning(
            "%s; starting a fresh scoring process (start %d; its log: logs/%s.log)",
            cause,
            self.starts + 1,
            self.log_name,
        )
        self.restart()

    def close(self) -> None:
        self._stop()
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    # ------------------------------------------------------------------ requests

    async def _exchange(self, body: P.ScoreRules) -> P.Body:
        """Send ``body``, wait for its reply; raise ScoringFailed on timeout or death."""
        assert self.client is not None
        extra_s = STARTUP_S if self.fresh else 0.0
        reply = asyncio.ensure_future(self.client.request(body, extra_wait_s=extra_s))
        died = asyncio.ensure_future(self._exit_code())
        try:
            await asyncio.wait((reply, died), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reply, died):
                task.cancel()
        if reply.done() and not reply.cancelled():
            body_in, _ = reply.result()  # ScoringFailed when it timed out
            self.fresh = False
            return body_in
        raise ScoringFailed(f"scoring process died (exit code {died.result()})")

    async def _exit_code(self) -> int:
        """The scoring process's exit status, once it has one."""
        assert self.proc is not None
        while (code := self.proc.poll()) is None:
            await asyncio.sleep(POLL_S)
        return code

    async def score(self, items: list[P.ScoreItem]) -> P.Scores:
        """One score per item, never raises: failures give defaults with errors set."""
        if not items:
            return P.Scores(scores=[], errors=[])
        async with self.lock:
            if self.proc is not None and (code := self.proc.poll()) is not None:
                self._replace(f"the scoring process died between requests (exit code {code})")
            try:
                reply = await self._exchange(P.ScoreRules(items=items))
            except ScoringFailed as exc:  # bad replies included (_WorkerClient.bad_reply)
                self._replace(f"a rule-scoring request failed: {exc}")  # hung or dead
                return self.defaults(items, str(exc))
        if isinstance(reply, P.Error):
            return self.defaults(items, f"scoring process refused ({reply.code}): {reply.message}")
        if (
            not isinstance(reply, P.Scores)
            or len(reply.scores) != len(items)
            or len(reply.errors) not in (0, len(items))
            or not all(map(finite32, reply.scores))
        ):
            return self.defaults(items, f"bad reply from the scoring process: {reply!r:.200}")
        errors = list(reply.errors) or [""] * len(items)
        return P.Scores(scores=list(reply.scores), errors=errors)

    def defaults(self, items: list[P.ScoreItem], error: str) -> P.Scores:
        return P.Scores(
            scores=[self.sources[i.source].default_score for i in items],
            errors=[error] * len(items),
        )


def routed(source: RewardSource, data_source: str) -> bool:
    """A source scores a prompt when it lists the prompt's data_source or lists none."""
    return not source.data_sources or data_source in source.data_sources


def conversation(prompt: str | list[P.Message], response: str) -> list[dict]:
    """Prompt messages + the response as the assistant's message (a string prompt becomes
    one user message)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return [*(dict(m) for m in messages), {"role": "assistant", "content": response}]


class Scorer:
    """The generator's single entry point for rewards (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        rewards_cfg: RewardsConfig,
        model_clients: dict[str, ModelClient],
        log_name: str = "reward_worker",
        max_new_tokens: int | None = None,
    ) -> None:
        self.sources = list(rewards_cfg.sources)
        self.max_new_tokens = max_new_tokens  # an overlong source's default max_resp_len
        self.timeout_s = rewards_cfg.timeout_s
        missing = [
            s.name
            for s in self.sources
            if isinstance(s, ModelReward) and s.name not in model_clients
        ]
        if missing:
            raise ValueError(f"no reward-model client for model sources {missing}")
        self.model_clients = model_clients
        self.rules = (
            RuleScorer(run_dir, self.sources, self.timeout_s, log_name)
            if any(isinstance(s, RULE_SOURCES) for s in self.sources)
            else None
        )
        self.logged: set[str] = set()  # sources whose first failure has been logged

    def _failure(self, s: int, error: str, count: int) -> None:
        source = self.sources[s]
        if source.name in self.logged:
            return
        self.logged.add(source.name)
        log.warning(
            "reward source '%s' failed (%s); %d sample(s) scored default_score %g. Later "
            "failures of this source are only counted (reward_failed/%s)",
            source.name,
            error,
            count,
            source.default_score,
            source.name,
        )

    async def _score_rules(
        self, group: P.PromptGroup, responses: list[str], rule_idx: list[int], out: GroupScores
    ) -> None:
        items = [
            P.ScoreItem(
                source=s,
                prompt=group.prompt,
                response=text,
                ground_truth=group.ground_truth,
                data_source=group.data_source,
                extra_info=group.extra_info,
            )
            for s in rule_idx
            for text in responses
        ]
        assert self.rules is not None
        reply = await self.rules.score(items)
        for k, (item, value, error) in enumerate(
            zip(items, reply.scores, reply.errors, strict=True)
        ):
            out.scores[item.source][k % len(responses)] = float(value)
            if error:
                out.failed[item.source] += 1
                self._failure(item.source, error, 1)

    async def _score_model(
        self,
        group: P.PromptGroup,
        responses: list[str],
        s: int,
        out: GroupScores,
        conversations: list[list[dict]] | None,
    ) -> None:
        source = self.sources[s]
        convs = conversations or [conversation(group.prompt, text) for text in responses]
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: see transport.py
                values = await self.model_clients[source.name].score(convs)
            values = [float(v) for v in values]
            if len(values) != len(responses):
                raise ValueError(f"{len(values)} scores for {len(responses)} responses")
            if not all(map(finite32, values)):  # trained in float32, where 1e39 is infinite
                raise ValueError(f"a score that is not a finite float32 in {values!r:.200}")
        except Exception as exc:  # TimeoutError included; the run goes on with defaults
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(f"timed out after {self.timeout_s:g}s")
            values = [source.default_score] * len(responses)
            out.failed[s] += len(responses)
            self._failure(s, repr(exc), len(responses))
        out.scores[s] = values

    async def score_group(
        self,
        group: P.PromptGroup,
        responses: list[str],
        conversations: list[list[dict]] | None = None,
        lengths: Sequence[int] | None = None,
    ) -> GroupScores:
        """Raw scores [S][n] of the group's responses (NaN where a source is not routed).

        ``conversations``: multi-turn episodes' whole conversations, which reward models
        read instead of prompt + response; rule sources score ``responses`` (the episodes'
        last turns). ``lengths``: each response's token count, which ``overlong`` sources
        score (needed when one is routed to the group)."""
        n = len(responses)
        out = GroupScores(
            scores=[[math.nan] * n for _ in self.sources], failed=[0] * len(self.sources)
        )
        active = [s for s, src in enumerate(self.sources) if routed(src, group.data_source)]
        rule_idx = [s for s in active if isinstance(self.sources[s], RULE_SOURCES)]
        for s in active:
            if isinstance(self.sources[s], OverlongReward):
                out.scores[s] = self.overlong_scores(self.sources[s], lengths, n)
        jobs = [
            self._score_model(group, responses, s, out, conversations)
            for s in active
            if isinstance(self.sources[s], ModelReward)
        ]
        if rule_idx and n:
            jobs.append(self._score_rules(group, responses, rule_idx, out))
        await asyncio.gather(*jobs)
        return out

    def overlong_scores(
        self, source: OverlongReward, lengths: Sequence[int] | None, n: int
    ) -> list[float]:
        """``source``'s score of each of ``n`` responses of ``lengths`` tokens."""
        if lengths is None or len(lengths) != n:
            raise ValueError(f"overlong source '{source.name}' needs the {n} responses' lengths")
        if source.max_resp_len is None and self.max_new_tokens is None:
            raise ValueError(f"overlong source '{source.name}' needs max_resp_len")
        top = source.resolved_max(self.max_new_tokens or 0)
        return [
            overlong_penalty(length, source.buffer_len, source.penalty_factor, top)
            for length in lengths
        ]

    def close(self) -> None:
        """Stop the scoring process and close the model clients (idempotent)."""
        if self.rules is not None:
            self.rules.close()
            self.rules = None
        for client in self.model_clients.values():
            close = getattr(client, "close", None)
            # A coroutine close() cannot be awaited here; its owner closes such a client.
            if callable(close) and not asyncio.iscoroutinefunction(close):
                close()
