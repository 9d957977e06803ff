"""The reward-model process: one ``AutoModelForSequenceClassification`` behind a ROUTER.

Socket pattern. ROUTER bound on ``endpoints.reward_models[name]``; clients are DEALERs
(``verl_async.rewards.model_client.RewardModelClient``) that send
``Envelope(request_id, ScoreConversations)`` and get exactly one reply with the same
request_id: ``Scores`` or ``Error``. No handshake: ZMQ connects (and, after a restart of
this process, reconnects) by itself, and requests sent meanwhile are queued by the client.
HWMs are 0 (unbounded) because every request is answered once and each client bounds what
it has outstanding; ROUTER_MANDATORY makes a reply to a vanished client raise (logged)
instead of vanishing silently.

Batching across clients: the loop sleeps until the socket is readable, drains every
message already queued, scores them together (``reward_model.scoring.score_requests``: a
request's shared prompt forwarded once, other rows pooled across requests in chunks of
``batch_size``) and replies to each request. A message that does not decode or
is not ``ScoreConversations`` gets an ``Error`` reply and a log line; a request whose
scoring raises gets an ``Error`` reply of its own; the loop goes on. Shutdown: SIGTERM sets
``terminated`` (checked at least every ``POLL_MS``); the socket closes with linger=0.

With ``curve`` keys the ROUTER is a CurveZMQ server that admits only authorised clients
(verl_async/auth.py); each refused one is a line in this process's log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from reward_model.scoring import score_requests
from verl_async import protocol as P
from verl_async.auth import ServerKeys, serve_curve

log = logging.getLogger("verl_async.reward_model")
POLL_MS = 200  # longest sleep before the loop looks at ``terminated`` again
LOAD_LOG_S = 30.0  # a load line (busy share, conversations scored) this often while serving
MAX_DRAIN = 1024  # messages taken per wake-up, so one flood cannot starve the replies


# ----------------------------------------------------------------------------- serving


@dataclass
class Request:
    identity: bytes
    request_id: int
    conversations: list[list[dict[str, str]]]


class RewardModelServer:
    """Serves ``ScoreConversations`` for one model (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        endpoint: str,
        batch_size: int,
        max_length: int,
        share_prefix: bool = True,
        curve: ServerKeys | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.share_prefix = share_prefix
        self.endpoint = endpoint
        self.terminated = False  # set by the SIGTERM handler
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.guard = serve_curve(self.sock, curve, log)  # None: no keys, no authentication
        self.sock.bind(endpoint)

    def serve(self) -> None:
        """Sleep until readable, drain what is queued, score it together, reply; repeat."""
        log.info("serving on %s (batch_size %d)", self.endpoint, self.batch_size)
        since, busy, scored = time.monotonic(), 0.0, 0
        try:
            while not self.terminated:
                if self.sock.poll(POLL_MS):
                    t0 = time.monotonic()
                    requests = self.drain()
                    self.score_and_reply(requests)
                    busy += time.monotonic() - t0
                    scored += sum(len(r.conversations) for r in requests)
                if (elapsed := time.monotonic() - since) >= LOAD_LOG_S:
                    if scored:
                        log.info(
                            "busy %.0f%% of the last %.0fs: %d conversations (%.1f/s busy)",
                            100 * busy / elapsed, elapsed, scored, scored / max(busy, 1e-9),
                        )  # fmt: skip
                    since, busy, scored = time.monotonic(), 0.0, 0
        finally:
            if self.guard is not None:
                self.guard.close()
            self.sock.close(linger=0)
            self.ctx.term()

    def drain(self) -> list[Request]:
        """Every ready message, decoded; bad ones are answered with ``Error`` here."""
        requests: list[Request] = []
        for _ in range(MAX_DRAIN):
            try:
                identity, *parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            request = self.parse(identity, parts)
            if request is not None:
                requests.append(request)
        return requests

    def parse(self, identity: bytes, parts: list) -> Request | None:
        try:
            env, _ = P.decode(parts)
        except P.ProtocolError as exc:
            log.warning("bad message from %s: %s", identity.hex(), exc)
            self.send(identity, 0, P.Error(code="protocol", message=str(exc)))
            return None
        if not isinstance(env.body, P.ScoreConversations):
            message = (
                f"a reward-model process serves ScoreConversations, not {type(env.body).__name__}"
            )
            log.warning("unexpected message from %s: %s", identity.hex(), message)
            self.send(identity, env.request_id, P.Error(code="unexpected", message=message))
            return None
        return Request(identity, env.request_id, env.body.conversations)

    def score_and_reply(self, requests: list[Request]) -> None:
        """Score all requests in one go; if that raises, each alone (to blame the right one)."""
        if not requests:
            return
        try:
            scores = self.score([r.conversations for r in requests])
        except Exception as exc:  # some request is bad; find which below
            if len(requests) == 1:
                self.fail(requests[0], exc)
                return
            for request in requests:
                self.score_and_reply([request])
            return
        for r, part in zip(requests, scores, strict=True):
            self.send(r.identity, r.request_id, P.Scores(scores=part, errors=[""] * len(part)))

    def score(self, requests: list[list[list[dict[str, str]]]]) -> list[list[float]]:
        """Scores of each request's conversations (``scoring.score_requests``)."""
        return score_requests(
            self.model,
            self.tokenizer,
            requests,
            self.batch_size,
            self.max_length,
            self.share_prefix,
        )

    def fail(self, request: Request, exc: Exception) -> None:
        log.warning("scoring request %d failed: %r", request.request_id, exc)
        error = P.Error(code="scoring_failed", message=repr(exc)[:2000])
        self.send(request.identity, request.request_id, error)

    def send(self, identity: bytes, request_id: int, body: P.Body) -> None:
        try:
            self.sock.send_multipart([identity, *P.encode(body, request_id)])
        except zmq.ZMQError as exc:  # client gone (ROUTER_MANDATORY): nothing to deliver to
            log.warning("reply to %s lost: %s", identity.hex(), exc)
