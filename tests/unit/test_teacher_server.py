"""The teacher process's scoring and server (teacher/), and the generators' client of it
(verl_async/teachers.py), on a tiny model over real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from teacher.scoring import Row, load_teacher, response_logprobs
from teacher.server import TeacherServer
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import DistillationConfig, TeacherConfig, TinyModelConfig
from verl_async.teachers import TeacherClient, TeacherRejected, Teachers

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("teacher"), TinyModelConfig(seed=3))
    return load_teacher(str(path), "cpu", torch.float32)


def _group(rng: np.random.Generator, vocab: int, lengths: list[int]):
    prompt = rng.integers(1, vocab, 5).astype(np.int32)
    tokens = rng.integers(1, vocab, sum(lengths)).astype(np.int32)
    return prompt, tokens


def _learner_logprobs(model, prompt, tokens, lengths, mask) -> np.ndarray:
    """What the learner's own pass (learners/logprobs.py) gives for the same samples."""
    from learners.logprobs import token_stats

    n, width = len(lengths), len(prompt) + max(lengths)
    ids = torch.zeros((n, width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros((n, width - 1))
    bounds = np.cumsum([0, *lengths])
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        row = np.concatenate([prompt, tokens[a:b]])
        ids[i, : len(row)] = torch.from_numpy(row.astype(np.int64))
        attn[i, : len(row)] = 1
        cols = slice(len(prompt) - 1, len(prompt) - 1 + b - a)
        loss[i, cols] = torch.from_numpy(mask[a:b].astype(np.float32))
    with torch.no_grad():
        logp = token_stats(model, ids, attn, loss, TEMPERATURE).logp
    return np.concatenate(
        [
            logp[i, len(prompt) - 1 : len(prompt) - 1 + b - a].numpy()
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
        ]
    )


def test_scores_equal_the_learners_own_pass_whatever_the_chunking(model):
    """Rows sorted and chunked by length, right-padded: each response token's log-prob is
    the learner's (float32, same temperature), whatever rows share its forward."""
    rng = np.random.default_rng(0)
    lengths = [7, 1, 12, 0, 4]
    prompt, tokens = _group(rng, model.config.vocab_size, lengths)
    mask = np.ones(len(tokens), np.uint8)
    want = _learner_logprobs(model, prompt, tokens, lengths, mask)
    bounds = np.cumsum([0, *lengths])
    rows = [
        Row(np.concatenate([prompt, tokens[a:b]]).astype(np.int64), len(prompt))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    for batch_size in (1, 2, 8):
        got = np.concatenate(response_logprobs(model, rows, TEMPERATURE, batch_size, "cpu"))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        assert (got < 0).all()


class _Serving:
    """A TeacherServer looping in a thread (stopped by ``terminated``)."""

    def __init__(self, model, endpoint: str) -> None:
        self.server = TeacherServer(model, endpoint, batch_size=4)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.terminated = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def test_server_answers_each_request_and_masks_observations(model, free_port):
    """Three generators' requests: a multi-turn group (observation tokens masked: 0 there,
    the learner's values elsewhere), a single-turn one, and one naming a token past the
    vocabulary, refused alone; the server goes on serving."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    serving = _Serving(model, endpoint)
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    lengths = [6, 9]
    prompt, tokens = _group(rng, vocab, lengths)
    mask = np.ones(len(tokens), np.uint8)
    mask[2:4] = 0  # an observation inside the first sample
    bad = tokens.copy()
    bad[3] = vocab + 7

    async def ask():
        clients = [TeacherClient(endpoint, 20.0) for _ in range(3)]
        try:
            return await asyncio.gather(
                clients[0].score(list(prompt), tokens, lengths, mask, TEMPERATURE),
                clients[1].score(list(prompt), tokens, lengths, None, TEMPERATURE),
                clients[2].score(list(prompt), bad, lengths, None, TEMPERATURE),
                return_exceptions=True,
            )
        finally:
            for c in clients:
                c.close()

    try:
        masked, whole, refused = asyncio.run(ask())
        again = asyncio.run(_one(endpoint, prompt, tokens, lengths))
    finally:
        serving.stop()
    want = _learner_logprobs(model, prompt, tokens, lengths, np.ones_like(mask))
    np.testing.assert_allclose(whole[0], want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(masked[0][mask == 1], want[mask == 1], rtol=0, atol=2e-5)
    assert (masked[0][mask == 0] == 0).all()
    assert isinstance(refused, TeacherRejected) and "outside the teacher" in str(refused)
    assert whole[1] > 0 and masked[1] > 0  # busy seconds, shared out
    np.testing.assert_allclose(again[0], want, rtol=0, atol=2e-5)


async def _one(endpoint, prompt, tokens, lengths):
    client = TeacherClient(endpoint, 20.0)
    try:
        return await client.score(list(prompt), tokens, lengths, None, TEMPERATURE)
    finally:
        client.close()


def test_a_teacher_down_at_first_is_asked_again_until_it_answers(model, free_port):
    """No teacher listening for the first request's whole deadline: it times out, the
    group is asked for again, and the teacher that comes up answers; the wait counts from
    the first request."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = DistillationConfig(
        enabled=True, timeout_s=1.0, teachers=[TeacherConfig(name="late", path="/unused")]
    )
    teachers = Teachers(cfg, {"late": endpoint}, TEMPERATURE)
    rng = np.random.default_rng(2)
    prompt, tokens = _group(rng, model.config.vocab_size, [3, 3])
    started: list[_Serving] = []
    timer = threading.Timer(1.5, lambda: started.append(_Serving(model, endpoint)))
    timer.start()
    try:
        score = asyncio.run(teachers.score("any", list(prompt), tokens, [3, 3], None))
    finally:
        timer.join()
        teachers.close()
        for s in started:
            s.stop()
    assert teachers.retries >= 1
    assert score.wait_s >= 1.0 and 0 < score.busy_s <= score.wait_s
    assert score.logprobs.shape == (6,) and (score.logprobs < 0).all()


def test_a_teacher_that_never_answers_ends_with_an_error_naming_it(free_port):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = DistillationConfig(
        enabled=True, timeout_s=0.2, teachers=[TeacherConfig(name="gone", path="/unused")]
    )
    teachers = Teachers(cfg, {"gone": endpoint}, TEMPERATURE)
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception, match="teacher 'gone'.*distillation.timeout_s"):
            asyncio.run(teachers.score("x", [1, 2], np.ones(2, np.int32), [2], None))
    finally:
        teachers.close()
    assert time.monotonic() - t0 >= 0.2 * 5 - 0.05
