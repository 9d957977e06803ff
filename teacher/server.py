"""The teacher process: one distillation teacher behind a ROUTER.

Socket pattern. ROUTER bound on ``endpoints.teachers[name]``; clients are the generators'
DEALERs (``verl_async.teachers.TeacherClient``), each sending ``Envelope(request_id,
ScoreTokens)`` for one group and getting exactly one reply with the same request_id:
``TokenLogprobs`` or ``Error``. No handshake: ZMQ connects (and, after a restart of this
process, reconnects) by itself; a generator whose request timed out asks again. Queues
and frames are bounded (transport/limits.py). Only the run's generators are admitted
(verl_async/auth.py); the socket chores are ``RouterSocket``'s.

Batching across generators: ``serve_drained`` sleeps until the socket is readable,
drains every message queued, and ``handle`` scores the samples of all of them together
(teacher/scoring.py) and replies to each; a request's share of the batch's compute
time is its share of the batch's tokens (``TokenLogprobs.busy_s``). A request that does
not fit the model (token ids past its vocabulary, arrays of the wrong sizes, a
temperature that is not positive) is answered ``Error("rejected")``; one whose scoring
raises gets an ``Error`` of its own (the batch is then scored request by request, to
blame the right one); the loop goes on. Shutdown: SIGTERM sets ``terminated`` (checked
at least every ``transport.server.POLL_MS``); the socket closes with linger 0.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import zmq

from teacher.scoring import Row, response_logprobs
from verl_async import protocol as P
from verl_async.auth import GENERATOR
from verl_async.transport.server import Request, RouterSocket, ServerOptions, serve_drained

log = logging.getLogger("verl_async.teacher")
ROLES = {P.ScoreTokens: (GENERATOR,)}  # generators ask; nobody else may


@dataclass
class Group:
    """One request: its group's samples as rows, and where its answer goes."""

    identity: bytes
    request_id: int
    rows: list[Row]
    temperature: float
    mask: np.ndarray | None  # [sum lengths] bool, True = sampled; None: all sampled


def read_request(m: Request, vocab_size: int) -> Group:
    """The rows of a ``ScoreTokens``; ``P.ProtocolError`` says why it cannot be scored."""
    body: P.ScoreTokens = m.envelope.body
    prompt = P.vector(body.prompt_ids, m.frames, "int32", "prompt_ids")
    resp = P.vector(body.response_ids, m.frames, "int32", "response_ids")
    if not (body.temperature > 0 and math.isfinite(body.temperature)):
        raise P.ProtocolError(f"temperature must be positive, not {body.temperature}")
    if any(n < 0 for n in body.lengths) or sum(body.lengths) != len(resp):
        raise P.ProtocolError(f"lengths add up to {sum(body.lengths)}, not {len(resp)} tokens")
    if len(prompt) == 0:
        raise P.ProtocolError("an empty prompt (a response token needs one before it)")
    for name, ids in (("prompt_ids", prompt), ("response_ids", resp)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise P.ProtocolError(f"{name} holds ids outside the teacher's [0, {vocab_size})")
    mask = None
    if body.loss_mask is not None:
        mask = P.vector(body.loss_mask, m.frames, "uint8", "loss_mask").astype(bool)
        if len(mask) != len(resp):
            raise P.ProtocolError(f"loss_mask holds {len(mask)} values for {len(resp)} tokens")
    bounds = np.cumsum([0, *body.lengths])
    rows = [
        Row(np.concatenate([prompt, resp[a:b]]).astype(np.int64), len(prompt))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return Group(m.identity, m.envelope.request_id, rows, body.temperature, mask)


class TeacherServer:
    """Serves ``ScoreTokens`` for one teacher model (see the module docstring)."""

    def __init__(
        self,
        model,
        endpoint: str,
        batch_size: int,
        device: str = "cpu",
        options: ServerOptions | None = None,
    ) -> None:
        self.model, self.batch_size, self.device = model, batch_size, device
        self.vocab_size = model.config.vocab_size
        self.endpoint = endpoint
        self.terminated = False  # set by the SIGTERM handler
        self.router = RouterSocket(
            zmq.Context(),
            endpoint,
            options or ServerOptions(),
            log,
            ROLES,
            serves=(P.ScoreTokens,),
            name="a teacher process",
        )

    def serve(self) -> None:
        log.info("serving on %s (batch_size %d)", self.endpoint, self.batch_size)
        serve_drained(self.router, self.handle, lambda: self.terminated, log, "samples")

    def handle(self, messages: list[Request]) -> int:
        """Score the drained requests together and answer each; the samples scored."""
        groups = []
        for m in messages:
            try:
                groups.append(read_request(m, self.vocab_size))
            except P.ProtocolError as exc:
                self.router.rejections.log(
                    "rejected", "rejected a request from %s: %s", m.identity.hex(), str(exc)
                )
                error = P.Error(code="rejected", message=str(exc)[:2000])
                self.router.reply(m.identity, m.envelope.request_id, error)
        by_temperature: dict[float, list[Group]] = {}  # one forward serves one temperature
        for g in groups:
            by_temperature.setdefault(g.temperature, []).append(g)
        for temperature, alike in by_temperature.items():
            self.score_and_reply(alike, temperature)
        return sum(len(g.rows) for g in groups)

    def score_and_reply(self, groups: list[Group], temperature: float) -> None:
        """Score ``groups`` in one go; if that raises, each alone (to blame the right one)."""
        t0 = time.monotonic()
        try:
            rows = [row for g in groups for row in g.rows]
            values = response_logprobs(self.model, rows, temperature, self.batch_size, self.device)
        except Exception as exc:
            if len(groups) == 1:
                log.warning("scoring request %d failed: %r", groups[0].request_id, exc)
                error = P.Error(code="scoring_failed", message=repr(exc)[:2000])
                self.router.reply(groups[0].identity, groups[0].request_id, error)
                return
            for g in groups:
                self.score_and_reply([g], temperature)
            return
        busy = time.monotonic() - t0
        tokens = sum(len(row.ids) for row in rows)
        for g in groups:
            own, values = values[: len(g.rows)], values[len(g.rows) :]
            logp = np.concatenate(own).astype(np.float32) if own else np.zeros(0, np.float32)
            if g.mask is not None:
                logp[~g.mask] = 0.0  # observation tokens: not the model's to score
            share = sum(len(row.ids) for row in g.rows) / max(tokens, 1)
            frames = P.Frames()
            reply = P.TokenLogprobs(logprobs=frames.add(logp), busy_s=busy * share)
            self.router.reply(g.identity, g.request_id, reply, frames)
