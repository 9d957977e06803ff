"""The reward-model process: one ``AutoModelForSequenceClassification`` behind a ROUTER.

Socket pattern. ROUTER bound on ``endpoints.reward_models[name]``; clients are DEALERs
(``verl_async.rewards.model_client.RewardModelClient``) that send
``Envelope(request_id, ScoreConversations)`` and get exactly one reply with the same
request_id: ``Scores`` or ``Error``. No handshake: ZMQ connects (and, after a restart of
this process, reconnects) by itself, and a request made meanwhile waits for the
connection within its deadline. Queues and frames are bounded (transport/limits.py);
ROUTER_MANDATORY makes a reply to a vanished client fail (logged) instead of vanishing
silently.

Batching across clients: the loop sleeps until the socket is readable, drains every
message already queued, scores them together (``reward_model.scoring.score_requests``: a
request's shared prompt forwarded once, other rows pooled across requests in chunks of
``batch_size``) and replies to each request. A message that does not decode or
is not ``ScoreConversations`` gets an ``Error`` reply and a log line, so does a request
with a conversation that has no messages or a message without a role or a content
(``Error("rejected")``); a request whose scoring raises gets an ``Error`` reply of its
own; the loop goes on. Shutdown: SIGTERM sets
``terminated`` (checked at least every ``transport.server.POLL_MS``); the socket closes
with linger=0.

The ROUTER admits only the run's generators (a key set's, or holders of the run's
generator token: verl_async/auth.py); each refused one is a line in this process's log.
The socket chores (set-up, limits, admission, roles, decode-or-``Error``, refusing other
request types, replies to vanished clients, close) are ``verl_async.transport.server.RouterSocket``'s; lines a
client provokes are rate-limited.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import zmq

from reward_model.scoring import score_requests
from verl_async import protocol as P
from verl_async.auth import GENERATOR
from verl_async.transport.server import RouterSocket, ServerOptions, serve_drained

log = logging.getLogger("verl_async.reward_model")
ROLES = {P.ScoreConversations: (GENERATOR,)}  # generators score; nobody else may


# ----------------------------------------------------------------------------- serving


def malformed(conversations: list[list[dict[str, str]]]) -> str | None:
    """Why a request's conversations cannot be scored (None: they can): every one must be
    a non-empty list of messages with a role and a content, as ``scorer.conversation``
    makes them. Its cost is a pass over what the frame limit let in."""
    for i, conversation in enumerate(conversations):
        if not conversation:
            return f"conversation {i} has no messages"
        for message in conversation:
            if "role" not in message or "content" not in message:
                return f"conversation {i} has a message without a role or a content"
    return None


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
        options: ServerOptions | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.share_prefix = share_prefix
        self.endpoint = endpoint
        self.terminated = False  # set by the SIGTERM handler
        self.router = RouterSocket(
            zmq.Context(),
            endpoint,
            options or ServerOptions(),
            log,
            ROLES,
            serves=(P.ScoreConversations,),
            name="a reward-model process",
        )

    def serve(self) -> None:
        """Sleep until readable, drain what is queued, score it together, reply; repeat
        (``serve_drained``)."""
        log.info("serving on %s (batch_size %d)", self.endpoint, self.batch_size)
        serve_drained(self.router, self.handle, lambda: self.terminated, log, "conversations")

    def handle(self, messages: list) -> int:
        """Score and answer the drained ``messages``; the conversations scored."""
        requests = self.take(messages)
        self.score_and_reply(requests)
        return sum(len(r.conversations) for r in requests)

    def take(self, messages: list) -> list[Request]:
        """Every request of ``messages`` that can be scored; bad messages (those that do
        not decode, or are not ``ScoreConversations``) were answered with ``Error`` by the
        router, a conversation that cannot be rendered (``malformed``) is answered with
        ``Error("rejected")`` here."""
        requests: list[Request] = []
        for m in messages:
            conversations = m.envelope.body.conversations
            problem = malformed(conversations)
            if problem is None:
                requests.append(Request(m.identity, m.envelope.request_id, conversations))
                continue
            self.router.rejections.log(
                "rejected", "rejected a request from %s: %s", m.identity.hex(), problem
            )
            error = P.Error(code="rejected", message=problem)
            self.router.reply(m.identity, m.envelope.request_id, error)
        return requests

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
            scored = P.Scores(scores=part, errors=[""] * len(part))
            self.router.reply(r.identity, r.request_id, scored)

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
        self.router.reply(request.identity, request.request_id, error)
