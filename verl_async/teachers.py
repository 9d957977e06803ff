"""Distillation teachers as the rest of the run sees them: the tokenizer check every
teacher passes, and the generators' client of the teacher processes.

``distillation.scoring: process``: each teacher runs in a process of its own (teacher/,
placed on ``placement.teachers``), and a generator asks the teacher serving a group's data
source for its log-probs of the group's sampled tokens before it pushes the group, so the
scores reach the learner with the batch (learners/teacher.py, ``FromBatch``).

A teacher that dies is restarted by the launcher (as a reward model is), and a request
made meanwhile times out after ``distillation.timeout_s``: the generator then asks again,
holding the group (its lease is renewed all the while), so the group is pushed once,
scored, and never lost nor repeated. The late reply of a timed-out request is dropped by
request id (``AsyncDealer``). After ``MAX_ATTEMPTS`` timeouts in a row for one group the
generator gives up with an error naming the teacher (a teacher alive but hung); the
launcher's own limit on restarts ends a run whose teacher keeps dying. A reply that is
an ``Error`` or does not fit the request is a bug on one side: it raises at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from verl_async import protocol as P
from verl_async.config_base import ConfigError
from verl_async.ratelimit import RateLimitedLog
from verl_async.schema import DistillationConfig
from verl_async.transport.client import AsyncDealer

log = logging.getLogger("verl_async.teachers")
MAX_ATTEMPTS = 5  # timeouts in a row, for one group, before a generator gives up


class TeacherUnavailable(RuntimeError):
    """A teacher process did not answer in time (down, restarting, or overloaded)."""


class TeacherRejected(RuntimeError):
    """A teacher process answered with an ``Error``, or with scores that do not fit."""


@dataclass
class TeacherScore:
    """A group's teacher log-probs, and what getting them cost."""

    logprobs: np.ndarray  # [sum lengths] float32, 0 on observation tokens
    wait_s: float  # from the first request to the reply (retries included)
    busy_s: float  # the teacher's compute for the group


class TeacherClient(AsyncDealer):
    """``await score(...)``: one teacher process's log-probs of one group's sampled tokens
    (``AsyncDealer``'s docstring: socket pattern, HWM, handshake, shutdown)."""

    def unavailable(self, waited_s: float) -> TeacherUnavailable:
        return TeacherUnavailable(
            f"no reply from the teacher at {self.endpoint} within {waited_s:g}s"
        )

    def bad_reply(self, exc: P.ProtocolError) -> TeacherRejected:
        return TeacherRejected(f"{self.endpoint}: {exc}")

    async def score(
        self,
        prompt_ids: list[int],
        tokens: np.ndarray,
        lengths: list[int],
        loss_mask: np.ndarray | None,
        temperature: float,
    ) -> tuple[np.ndarray, float]:
        """(log-probs [sum lengths] float32, the teacher's busy seconds)."""
        frames = P.Frames()
        body = P.ScoreTokens(
            prompt_ids=frames.add(np.asarray(prompt_ids, np.int32)),
            response_ids=frames.add(tokens),
            lengths=lengths,
            temperature=temperature,
            loss_mask=None if loss_mask is None else frames.add(loss_mask),
        )
        reply, reply_frames = await self.request(body, frames)
        if isinstance(reply, P.Error):
            raise TeacherRejected(
                f"teacher at {self.endpoint} rejected a request ({reply.code}): {reply.message}"
            )
        if not isinstance(reply, P.TokenLogprobs):
            raise TeacherRejected(f"teacher at {self.endpoint} sent {type(reply).__name__}")
        try:
            logp = P.vector(reply.logprobs, reply_frames, "float32", "logprobs", keep=True)
        except P.ProtocolError as exc:
            raise self.bad_reply(exc) from None
        if len(logp) != len(tokens):
            raise TeacherRejected(
                f"teacher at {self.endpoint} sent {len(logp)} log-probs for {len(tokens)} tokens"
            )
        return logp, reply.busy_s


class Teachers:
    """A client of each teacher process, by teacher; ``score`` asks the one serving a
    group's data source until it answers (see the module docstring)."""

    def __init__(
        self,
        cfg: DistillationConfig,
        endpoints: dict[str, str],
        temperature: float,
        credentials=None,
    ) -> None:
        self.cfg, self.temperature = cfg, temperature
        self.clients = [
            TeacherClient(endpoints[t.name], cfg.timeout_s, credentials) for t in cfg.teachers
        ]
        self.retries = 0  # requests asked again after a timeout
        self.notes = RateLimitedLog(log, what="teacher timeouts")

    async def score(
        self,
        data_source: str,
        prompt_ids: list[int],
        tokens: np.ndarray,
        lengths: list[int],
        loss_mask: np.ndarray | None,
    ) -> TeacherScore:
        index = self.cfg.teacher_of(data_source)
        client, name = self.clients[index], self.cfg.teachers[index].name
        t0 = time.monotonic()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                logp, busy_s = await client.score(
                    prompt_ids, tokens, lengths, loss_mask, self.temperature
                )
                waited = time.monotonic() - t0
                return TeacherScore(logp, waited, min(busy_s, waited))
            except TeacherUnavailable as exc:
                if attempt == MAX_ATTEMPTS:
                    break
                self.retries += 1
                self.notes.log(
                    "timeout", "teacher '%s': %s; asking again (attempt %d of %d)",
                    name, str(exc), attempt + 1, MAX_ATTEMPTS,
                )  # fmt: skip
        raise TeacherUnavailable(
            f"teacher '{name}' at {client.endpoint} answered none of {MAX_ATTEMPTS} requests "
            f"of {self.cfg.timeout_s:g}s each (distillation.timeout_s); is its process hung?"
        )

    def close(self) -> None:
        for client in self.clients:
            client.close()


def check_tokenizer(student_path: str, teacher_path: str, name: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's: the same vocabulary (each
    token string with the same id, added tokens included) and the same special tokens.
    A teacher with another tokenizer would score other words under the same ids."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_path)
    teacher = AutoTokenizer.from_pretrained(teacher_path)
    differs = None
    if student.get_vocab() != teacher.get_vocab():
        only = set(teacher.get_vocab().items()) ^ set(student.get_vocab().items())
        differs = f"{len(only)} (token, id) pairs are in one vocabulary only"
    elif student.all_special_tokens != teacher.all_special_tokens:
        differs = (
            f"special tokens {student.all_special_tokens} against {teacher.all_special_tokens}"
        )
    if differs is not None:
        raise ConfigError(
            f"bad value for 'distillation.teachers': teacher '{name}' ({teacher_path}) does not "
            f"use the student's tokenizer ({student_path}): {differs}; a teacher must share the "
            "student's tokenizer"
        )
