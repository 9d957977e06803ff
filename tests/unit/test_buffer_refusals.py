"""A group the buffer refuses costs that group alone (buffer/intake.py).

Through the server (``Harness``: ``BufferServer._dispatch`` driven in-process): a push of
a good group beside one whose content is refused records the good one and issues the other
again, first in line; a group refused three times ends without training and the
run still trains B groups every step, across a snapshot and restore too; and the bound on
an agent episode's samples is the run's largest ``max_calls``, not a number of its own.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from buffer.__main__ import rollout_limits
from tests.unit.test_buffer_validation import Harness, _issue_four, make_group, replace
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.config_base import ConfigError

STEPS, B = 4, 2  # the harness's ledger: 4 steps of 2 groups, staleness bound 1
REFUSALS = 3  # a group refused this many times ends (docs/faults.md)
NAN_LOGPROBS = "group 1: behav_logprobs must be finite and <= 0"


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _good(*ks: int, version: int = 0) -> tuple[list[P.RolloutGroup], P.Frames]:
    """Valid groups ``ks`` in one message, their tokens sampled at ``version``."""
    frames = P.Frames()
    ver = np.full(6, version, np.int32)
    return [make_group(k=k, frames=frames, ver=ver)[0] for k in ks], frames


def _bad(k: int, frames: P.Frames, version: int = 0) -> P.RolloutGroup:
    """Group ``k`` with NaN log-probs: refused for what it holds."""
    ver = np.full(6, version, np.int32)
    return make_group(k=k, frames=frames, ver=ver, lp=np.full(6, np.nan, np.float32))[0]


def _ask(h: Harness, most: int, version: int = 0) -> list[int]:
    reply = h.request(b"A", P.GetPrompts(generator_id=0, loaded_version=version, max_groups=most))
    return [g.group_id for g in reply.groups]


def _stats(h: Harness) -> P.Stats:
    return h.request(b"L", P.GetStats())


def _train_to_the_end(h: Harness) -> list[P.Batch]:
    """Return every group issued (its tokens of the version it was issued at), take each
    step as soon as it is complete, announce the next version after it: the steps' batches."""
    batches = []
    for step in range(STEPS):
        version = h.server.target_version
        groups, frames = _good(*_ask(h, 8, version), version=version)
        if groups:
            assert isinstance(h.push(b"A", *groups, frames=frames), P.Ack)
        req = P.GetBatch(step=step, rank=0, world_size=1, learner_version=step, wait_s=0.0)
        batches.append(h.request(b"L", req))
        assert isinstance(batches[-1], P.Batch), batches[-1]
        update = P.WeightUpdate(version=max(version, step + 1), params=[], bucket_bytes=1)
        assert isinstance(h.request(b"L", P.AnnounceWeights(update=update)), P.Ack)
    return batches


def test_a_refused_group_costs_that_group_alone_and_is_issued_again_first(harness):
    h = harness
    _issue_four(h, version=0)  # A holds groups 0..3
    lg = h.server.ledger
    old_lease = lg.in_flight[1].lease
    [good], frames = _good(0)
    bad = _bad(1, frames)
    reply = h.push(b"A", good, bad, frames=frames)
    assert isinstance(reply, P.Dropped), reply  # not an Error for the whole message
    refusal = P.Refusal(group_id=1, reason=NAN_LOGPROBS, ended=False)
    assert reply == P.Dropped(group_ids=[], reason="", refused=[refusal])
    assert sorted(lg.returned) == [0] and list(lg.reissue) == [1] and 1 not in lg.in_flight
    stats = _stats(h)
    assert (stats.returned, stats.rollouts_refused, stats.groups_ended) == (1, 1, 0)
    # First in line, under a new lease; a copy under the refused lease is only late.
    [again] = h.request(b"A", P.GetPrompts(generator_id=0, loaded_version=0, max_groups=1)).groups
    assert again.group_id == 1 and again.lease > old_lease
    late, frames = _good(1)
    reply = h.push(b"A", replace(late[0], lease=old_lease), frames=frames)
    assert reply == P.Dropped(group_ids=[1], reason="lease expired")
    # Late, refused and good groups in one message: each gets its own answer.
    groups, frames = _good(1, 3)
    late = replace(groups[0], lease=old_lease)
    reply = h.push(b"A", late, _bad(2, frames), groups[1], frames=frames)
    assert (reply.group_ids, [r.group_id for r in reply.refused]) == ([1], [2])
    assert sorted(lg.returned) == [0, 3] and list(lg.reissue) == [2]
    [fresh], frames = _good(1)
    assert isinstance(h.push(b"A", fresh, frames=frames), P.Ack)
    assert sorted(lg.returned) == [0, 1, 3]


def _refuse_until_it_ends(h: Harness, k: int) -> list[P.Refusal]:
    """Push a refused rollout of group ``k``, held by A, until the buffer ends it (at
    most ten times)."""
    refusals = []
    while len(refusals) < 10 and not (refusals and refusals[-1].ended):
        frames = P.Frames()
        [refusal] = h.push(b"A", _bad(k, frames), frames=frames).refused
        refusals.append(refusal)
        if not refusal.ended:
            assert _ask(h, 1) == [k]  # first in line again
    return refusals


def test_a_group_refused_again_and_again_ends_and_every_step_still_has_b_groups(harness, caplog):
    h = harness
    _issue_four(h, version=0)
    with caplog.at_level(logging.ERROR, logger="verl_async.buffer"):
        refusals = _refuse_until_it_ends(h, 1)
    assert [r.ended for r in refusals] == [False] * (REFUSALS - 1) + [True]
    assert (
        f"group 1 ends without training: its rollouts were refused {REFUSALS} times" in caplog.text
    )
    assert NAN_LOGPROBS in caplog.text
    lg = h.server.ledger
    assert lg.dropped == {1} and 1 not in lg.reissue and 1 not in lg.in_flight
    stats = _stats(h)
    assert (stats.rollouts_refused, stats.groups_ended) == (REFUSALS, 1)
    groups, frames = _good(0, 2, 3)
    assert isinstance(h.push(b"A", *groups, frames=frames), P.Ack)
    batches = _train_to_the_end(h)
    trained = [k for batch in batches for k in batch.group_ids]
    assert [len(batch.group_ids) for batch in batches] == [B] * STEPS
    assert sorted(trained) == [k for k in range(STEPS * B + 1) if k != 1]  # one more issued
    assert batches[0].group_ids == [0, 2] and batches[0].filtered_groups == [1]


def test_a_snapshot_taken_after_a_group_ended_restores_without_it(harness, tmp_path):
    h = harness
    _issue_four(h, version=0)
    _refuse_until_it_ends(h, 1)
    groups, frames = _good(0, 2)
    assert isinstance(h.push(b"A", *groups, frames=frames), P.Ack)  # 3 still in flight
    req = P.GetBatch(step=0, rank=0, world_size=1, learner_version=0, wait_s=0.0)
    assert h.request(b"L", req).group_ids == [0, 2]
    assert isinstance(h.request(b"L", P.SnapshotBuffer(step=0, version=0)), P.Ack)
    files, frames = h.server.cuts.files(0)
    wire = [bytes(b) for b in frames.buffers]
    for name, ref in files.files.items():
        (tmp_path / name).write_bytes(P.tensor(ref, wire).tobytes())

    fresh = Harness()
    try:
        fresh.server.restore(tmp_path)
        lg = fresh.server.ledger
        assert lg.dropped == {1} and sorted(lg.returned) == [0, 2] and list(lg.reissue) == [3]
        batches = _train_to_the_end(fresh)
        assert batches[0].group_ids == [0, 2] and batches[0].filtered_groups == [1]  # again
        trained = [k for batch in batches for k in batch.group_ids]
        assert [len(batch.group_ids) for batch in batches] == [B] * STEPS
        assert sorted(trained) == [k for k in range(STEPS * B + 1) if k != 1]
    finally:
        fresh.close()


# ----------------------------------------------------------------------------- episode bound


def _agent_group(k: int, samples_per_episode: list[int]) -> tuple[P.RolloutGroup, P.Frames]:
    """Group ``k``: episode i gave ``samples_per_episode[i]`` one-token samples."""
    n = sum(samples_per_episode)
    group, frames = make_group(k=k, n=n, tokens=1, ver=np.zeros(n, np.int32))
    stats = [
        P.EpisodeStats(1, 0, 0, 0, 0.0, 0, "", 0, False, 0.0, episode=i)
        for i, count in enumerate(samples_per_episode)
        for _ in range(count)
    ]
    mask = frames.add(np.ones(n, np.uint8))
    return replace(group, episodes=stats, loss_mask=mask), frames


def test_an_agent_episode_may_give_as_many_samples_as_its_calls(monkeypatch):
    """The buffer built from a config whose agent may make 17 calls takes an episode of 17
    samples, and refuses (for that group alone) one of 18."""
    import transformers  # the buffer reads the vocabulary's size from the model's config

    overrides = [
        "generators.group_size=2",
        "multiturn.agents=[{agent: examples.react_agent:agent, max_calls: 17}]",
        "multiturn.max_episode_tokens=64",  # tiny.yaml's generators.max_model_len
    ]
    cfg = load_config("configs/tiny.yaml", overrides)
    monkeypatch.setattr(
        transformers.AutoConfig, "from_pretrained", lambda path: SimpleNamespace(vocab_size=32)
    )
    h = Harness(limits=rollout_limits(cfg, "tiny-model"))
    try:
        assert _ask(h, 2) == [0, 1]
        group, frames = _agent_group(0, [17, 1])
        assert isinstance(h.push(b"A", group, frames=frames), P.Ack)
        group, frames = _agent_group(1, [1, 18])
        [refusal] = h.push(b"A", group, frames=frames).refused
        assert refusal.reason == (
            "group 1: an episode of 18 samples, the run allows 17 (the largest "
            "multiturn.agents[i].max_calls)"
        )
        assert sorted(h.server.ledger.returned) == [0]
    finally:
        h.close()


def test_max_calls_has_a_bound_named_at_load():
    agents = "multiturn.agents=[{agent: examples.react_agent:agent, max_calls: %d}]"
    fits = "multiturn.max_episode_tokens=64"
    cfg = load_config("configs/tiny.yaml", [agents % 256, fits])
    assert cfg.multiturn.agents[0].max_calls == 256
    with pytest.raises(ConfigError, match=r"'multiturn.agents.0.max_calls': expected `int` <= 256"):
        load_config("configs/tiny.yaml", [agents % 257, fits])
