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
message already queued, scores all their conversations together (sorted by length, in
chunks of ``batch_size``) and replies to each request. A message that does not decode or
is not ``ScoreConversations`` gets an ``Error`` reply and a log line; a request whose
scoring raises gets an ``Error`` reply of its own; the loop goes on. Shutdown: SIGTERM sets
``terminated`` (checked at least every ``POLL_MS``); the socket closes with linger=0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import zmq

from verl_async import protocol as P

log = logging.getLogger("verl_async.reward_model")
POLL_MS = 200  # longest sleep before the loop looks at ``terminated`` again
MAX_DRAIN = 1024  # messages taken per wake-up, so one flood cannot starve the replies


# ----------------------------------------------------------------------------- scoring


def load_reward_model(path: str, device: str, dtype: str = "float32") -> tuple[Any, Any]:
    """(model in eval mode on ``device``, tokenizer), both ready for ``score_conversations``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=getattr(torch, dtype)
    )
    prepare(model, tokenizer)
    return model.to(device).eval(), tokenizer


def prepare(model: Any, tokenizer: Any) -> None:
    """Make padding, truncation and pooling agree between tokenizer and model."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the reward model's tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    # The head pools the rightmost token that is not ``config.pad_token_id``; with it unset
    # (or different from what the tokenizer pads with) padded rows would be scored at a pad.
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    # Right padding: a row keeps the positions it has alone (with absolute position
    # embeddings a left-padded row would be shifted; RoPE models do not care).
    tokenizer.padding_side = "right"
    # Keep the end of the conversation (the response being judged) when it is too long.
    tokenizer.truncation_side = "left"


def render(tokenizer: Any, conversation: list[dict[str, str]]) -> str:
    """The conversation as text: the tokenizer's chat template, else "role: content" lines."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(conversation, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation)


def encode(tokenizer: Any, conversations: list[list[dict[str, str]]], max_length: int) -> list:
    """Token ids of each conversation, truncated from the left to ``max_length``."""
    if not conversations:
        return []
    texts = [render(tokenizer, conv) for conv in conversations]
    # A chat template writes its own special tokens (BOS included); plain text needs them.
    special = not tokenizer.chat_template
    enc = tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=special)
    return list(enc["input_ids"])


def forward(model: Any, tokenizer: Any, rows: list[list[int]]) -> list[float]:
    """Scores of one padded batch: logits[:, 0], pooled by the model at the last real token."""
    import torch

    padded = tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(
            input_ids=padded["input_ids"].to(device),
            attention_mask=padded["attention_mask"].to(device),
        ).logits
    return logits[:, 0].float().cpu().tolist()


def score_conversations(
    model: Any,
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    batch_size: int,
    max_length: int,
) -> list[float]:
    """One score per conversation, in order; forwards of at most ``batch_size`` rows.

    Rows are sorted by length before chunking so a batch pads little; a row's score does
    not depend on its batch mates (right padding, pooling at the last non-pad token).
    """
    rows = encode(tokenizer, conversations, max_length)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    scores = [0.0] * len(rows)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        for i, value in zip(
            chunk, forward(model, tokenizer, [rows[i] for i in chunk]), strict=True
        ):
            scores[i] = value
    return scores


# ----------------------------------------------------------------------------- serving


@dataclass
class Request:
    identity: bytes
    request_id: int
    conversations: list[list[dict[str, str]]]


class RewardModelServer:
    """Serves ``ScoreConversations`` for one model (see the module docstring)."""

    def __init__(
        self, model: Any, tokenizer: Any, endpoint: str, batch_size: int, max_length: int
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.endpoint = endpoint
        self.terminated = False  # set by the SIGTERM handler
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def serve(self) -> None:
        """Sleep until readable, drain what is queued, score it together, reply; repeat."""
        log.info("serving on %s (batch_size %d)", self.endpoint, self.batch_size)
        try:
            while not self.terminated:
                if self.sock.poll(POLL_MS):
                    self.score_and_reply(self.drain())
        finally:
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
        convs = [conv for r in requests for conv in r.conversations]
        try:
            scores = self.score(convs)
        except Exception as exc:  # some request is bad; find which below
            if len(requests) == 1:
                self.fail(requests[0], exc)
                return
            for request in requests:
                self.score_and_reply([request])
            return
        start = 0
        for r in requests:
            part = scores[start : start + len(r.conversations)]
            start += len(r.conversations)
            self.send(r.identity, r.request_id, P.Scores(scores=part, errors=[""] * len(part)))

    def score(self, convs: list[list[dict[str, str]]]) -> list[float]:
        return score_conversations(
            self.model, self.tokenizer, convs, self.batch_size, self.max_length
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
