"""Reward-model scoring in process: padding, pooling and truncation."""

import time

import pytest

from benchmarks.tiny_reward_model import build_tiny_reward_model
from reward_model.scoring import (
    encode,
    forward,
    load_reward_model,
    render,
    score_conversations,
)


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    path = build_tiny_reward_model(tmp_path_factory.mktemp("rm"))
    return load_reward_model(str(path), "cpu")


def conv(prompt: str, response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


CONVS = [
    conv("max 3 7 1 =", "7"),
    conv("max 1 =", "1"),
    conv("max 9 8 7 6 5 4 3 2 1 0 =", "9 9 9 9"),
    conv("max 2 4 =", "2"),
]


def test_score_alone_equals_score_in_padded_batch(rm):
    model, tokenizer = rm
    alone = [score_conversations(model, tokenizer, [c], 8, 64)[0] for c in CONVS]
    batched = score_conversations(model, tokenizer, CONVS, 8, 64)
    chunked = score_conversations(model, tokenizer, CONVS, 3, 64)
    lengths = {len(row) for row in encode(tokenizer, CONVS, 64)}
    assert len(lengths) == len(CONVS), "the batch must mix lengths, or nothing is padded"
    assert batched == pytest.approx(alone, abs=1e-5)
    assert chunked == pytest.approx(alone, abs=1e-5)
    assert max(alone) - min(alone) > 1e-3, "scores of different conversations look alike"


def test_pooling_needs_pad_token_id(rm):
    model, tokenizer = rm
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert tokenizer.padding_side == "right"


def test_left_truncation_keeps_the_end(rm):
    model, tokenizer = rm
    long = conv("max " + " ".join(["1"] * 40) + " =", "9 8 7")
    full = encode(tokenizer, [long], 1000)[0]
    cut = encode(tokenizer, [long], 6)[0]
    assert len(full) == 46  # <bos> max 1*40 = 9 8 7
    assert cut == full[-6:]
    assert cut[-3:] == tokenizer.convert_tokens_to_ids(["9", "8", "7"])
    # The forward pass sees only the kept tail.
    truncated = score_conversations(model, tokenizer, [long], 4, 6)
    assert truncated == pytest.approx(forward(model, tokenizer, [full[-6:]]), abs=1e-6)
    assert truncated != pytest.approx(forward(model, tokenizer, [full]), abs=1e-3)


def test_render_uses_template_or_role_lines(rm):
    _, tokenizer = rm
    text = render(tokenizer, conv("max 1 =", "1"))
    assert tokenizer.convert_ids_to_tokens(encode(tokenizer, [conv("max 1 =", "1")], 64)[0]) == [
        "<bos>",
        "max",
        "1",
        "=",
        "1",
    ]
    assert text.startswith("<bos>")

    class NoTemplate:
        chat_template = None

    assert render(NoTemplate(), conv("a", "b")) == "user: a\nassistant: b"


def test_one_failing_request_gets_an_error_the_others_scores(rm, free_port):
    """Requests drained together are scored together; one that raises is answered alone."""
    import zmq

    from reward_model.server import RewardModelServer
    from verl_async import protocol as P

    model, tokenizer = rm
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = RewardModelServer(model, tokenizer, endpoint, batch_size=2, max_length=64)
    real_score = server.score
    batches = []

    def score(requests):
        batches.append(sum(len(convs) for convs in requests))
        if any(m["content"] == "boom" for convs in requests for c in convs for m in c):
            raise ValueError("boom")
        return real_score(requests)

    server.score = score
    clients = [zmq.Context.instance().socket(zmq.DEALER) for _ in range(3)]
    try:
        asks = [CONVS[:2], [conv("boom", "1")], CONVS[2:]]
        for rid, (sock, ask) in enumerate(zip(clients, asks, strict=True), start=1):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send_multipart(P.encode(P.ScoreConversations(conversations=ask), rid))
        requests = []
        deadline = time.monotonic() + 10
        while len(requests) < 3 and time.monotonic() < deadline:
            if server.router.sock.poll(100):
                requests += server.take(list(server.router.drain()))
        assert len(requests) == 3
        server.score_and_reply(requests)
        replies = []
        for sock in clients:
            assert sock.poll(5000)
            replies.append(P.decode(sock.recv_multipart())[0])
    finally:
        for sock in clients:
            sock.close()
        server.router.close()
    assert batches[0] == 5  # all three requests in one scoring call first
    assert [env.request_id for env in replies] == [1, 2, 3]
    assert isinstance(replies[1].body, P.Error) and "boom" in replies[1].body.message
    for env, ask in ((replies[0], asks[0]), (replies[2], asks[2])):
        alone = score_conversations(model, tokenizer, ask, 2, 64)
        assert env.body.scores == pytest.approx(alone, abs=1e-5)


def test_conversations_that_cannot_be_rendered_are_named():
    from reward_model.server import malformed

    assert malformed([conv("q", "a"), conv("", "")]) is None
    assert malformed([]) is None  # nothing to score: an empty Scores
    assert malformed([conv("q", "a"), []]) == "conversation 1 has no messages"
    for message in ({"role": "user"}, {"content": "x"}, {}):
        want = "conversation 0 has a message without a role or a content"
        assert malformed([[*conv("q", "a"), message]]) == want


# One prompt group: a long shared prompt, responses of different lengths (so suffixes pad).
GROUP = [conv("max 3 1 4 1 5 9 2 6 5 3 5 =", r) for r in ("9", "9 9", "5 3 5 8 9", "1", "9")]


def test_shared_prompt_scores_equal_whole_rows(rm):
    from reward_model.scoring import score_requests, shared_prefix_length

    model, tokenizer = rm
    rows = encode(tokenizer, GROUP, 64)
    assert shared_prefix_length(rows, 64) == 14  # <bos> max + 11 digits + "=": 14 tokens
    whole = score_conversations(model, tokenizer, GROUP, 8, 64)
    other = CONVS[:3]  # no common prefix of 8 tokens: pooled whole with the rest
    shared, pooled = score_requests(model, tokenizer, [GROUP, other], 2, 64, share_prefix=True)
    assert shared == pytest.approx(whole, abs=1e-5)
    assert pooled == pytest.approx(score_conversations(model, tokenizer, other, 8, 64), abs=1e-5)
    assert whole[0] == pytest.approx(whole[4], abs=1e-6)  # equal rows, equal scores
    assert max(whole) - min(whole) > 1e-3


def test_shared_prefix_length_edge_cases(rm):
    from reward_model.scoring import MIN_SHARED_PREFIX, shared_prefix_length

    _, tokenizer = rm
    rows = encode(tokenizer, GROUP, 64)
    assert shared_prefix_length(rows[:1], 64) == 0  # one row: nothing to share
    assert shared_prefix_length(rows, max(map(len, rows))) == 0  # a row may be truncated
    twins = [rows[0], list(rows[0])]
    assert shared_prefix_length(twins, 64) == len(rows[0]) - 1  # a suffix is left to pool
    short = encode(tokenizer, [conv("max 1 =", "1"), conv("max 1 =", "2")], 64)
    assert len(short[0]) - 1 < MIN_SHARED_PREFIX
    assert shared_prefix_length(short, 64) == 0


def test_server_shares_prefix_per_request(rm, monkeypatch):
    """The server passes requests, not a flat list, so a group's prompt is computed once."""
    from reward_model import scoring

    model, tokenizer = rm
    calls = []
    real = scoring.forward_shared
    monkeypatch.setattr(
        scoring,
        "forward_shared",
        lambda m, rows, n: calls.append((len(rows), n)) or real(m, rows, n),
    )
    scores = scoring.score_requests(model, tokenizer, [GROUP, GROUP[:2]], 4, 64)
    assert calls == [(4, 14), (1, 14), (2, 14)]  # chunks of batch_size=4, then the second
    assert scores[1] == pytest.approx(scores[0][:2], abs=1e-5)
