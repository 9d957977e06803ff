"""Multi-turn samples through the buffer: their checks on the way in, the response cap of
a run with environments, and their loss masks, turn rewards and episode stats in the
learner's ``Batch``."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.batches import encode_step, shard_samples
from buffer.ledger import StepBatch, StoredGroup
from buffer.rollouts import EPISODE_BUDGETS, RolloutLimits, max_response_tokens
from tests.unit.test_buffer_validation import (
    VERSIONS,
    Harness,
    make_group,
    replace,
    unpack,
)
from verl_async import protocol as P
from verl_async.schema import EnvironmentConfig, RunConfig

NAN = float("nan")

# Two samples of 5 tokens. Sample 0: a turn of 2 tokens, an observation of 2, a turn of 1;
# sample 1: one turn. Observation tokens repeat the version of the sampled token before them.
MASK = np.array([1, 1, 0, 0, 1, 1, 1, 1, 1, 1], np.uint8)
VER = np.array([1, 2, 2, 2, 3, 1, 1, 1, 1, 1], np.int32)
# The environment's reward of sample 0's first turn, at that turn's last sampled token.
REWARDS = np.array([0, 0.5, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)


def episode(**fields) -> P.EpisodeStats:
    stats = {
        "turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "env_seconds": 0.25,
        "observation_tokens": 2,
        "budget": "",
        "versions_spanned": 2,
        "template_mismatch": False,
        "env_reward": 0.5,
    }
    return P.EpisodeStats(**{**stats, **fields})


EPISODES = [episode(), episode(turns=1, tool_calls=0, observation_tokens=0, env_reward=0.0)]


def multiturn_group(
    k: int = 5,
    mask: np.ndarray | None = MASK,
    rewards: np.ndarray | None = REWARDS,
    episodes: list[P.EpisodeStats] = EPISODES,
    ver: np.ndarray = VER,
    frames: P.Frames | None = None,
) -> tuple[P.RolloutGroup, P.Frames]:
    """A valid multi-turn group of two 5-token samples; any field may be replaced."""
    group, frames = make_group(k=k, n=2, tokens=5, ver=ver, frames=frames)
    return replace(
        group,
        loss_mask=None if mask is None else frames.add(mask),
        turn_rewards=None if rewards is None else frames.add(rewards),
        episodes=episodes,
    ), frames


# ----------------------------------------------------------------------------- checks


def test_a_valid_multiturn_group_is_unpacked_per_sample():
    stored = unpack(*multiturn_group())
    assert [m.tolist() for m in stored.loss_masks] == [[1, 1, 0, 0, 1], [1] * 5]
    assert [r.tolist() for r in stored.turn_rewards] == [[0, 0.5, 0, 0, 0], [0] * 5]
    assert stored.loss_masks[0].dtype == np.uint8 and stored.turn_rewards[0].dtype == np.float32
    assert stored.episodes == EPISODES
    # Each field travels on its own: turn rewards without a mask (every token sampled), a
    # mask without rewards or stats.
    alone = unpack(*multiturn_group(mask=None, episodes=[]))
    assert alone.loss_masks is None and alone.episodes == []
    assert alone.turn_rewards[0].tolist() == [0, 0.5, 0, 0, 0]
    bare = unpack(*multiturn_group(rewards=None, episodes=[]))
    assert bare.turn_rewards is None and bare.loss_masks[0].tolist() == [1, 1, 0, 0, 1]
    # Every budget that may end an episode, and a single-turn group without any of it.
    budgets = [episode(budget=b) for b in EPISODE_BUDGETS]
    for a, b in zip(budgets, budgets[1:], strict=False):
        assert unpack(*multiturn_group(episodes=[a, b])).episodes == [a, b]
    single = unpack(*make_group(k=5))
    assert (single.loss_masks, single.turn_rewards, single.episodes) == (None, None, [])


def test_a_sample_may_begin_with_the_rest_of_its_own_prompt():
    # Tokens that are not sampled before the first sampled one: the part of its prompt a
    # sample does not share with its group's (an agent's episode); they train nothing.
    mask = np.array([0, 0, 1, 0, 1, 1, 1, 1, 1, 1], np.uint8)
    stored = unpack(*multiturn_group(mask=mask, rewards=None))
    assert stored.loss_masks[0].tolist() == [0, 0, 1, 0, 1]


def test_an_empty_sample_needs_no_sampled_first_or_last_token():
    group, frames = multiturn_group(episodes=[])
    stored = unpack(replace(group, lengths=[0, 10]), frames, limits=RolloutLimits())
    assert [len(m) for m in stored.loss_masks] == [0, 10]


def test_the_version_range_check_reads_only_sampled_tokens():
    # Placeholders repeat the previous sampled version, so they are in range anyway; one
    # outside it on an observation token is still no reason to refuse the group.
    ver = VER.copy()
    ver[2:4] = [0, 9]
    assert unpack(*multiturn_group(ver=ver)).token_versions[0].tolist() == [1, 2, 0, 9, 3]
    # The same version on a sampled token is refused.
    with pytest.raises(
        P.ProtocolError, match=r"^group 5: token versions 0\.\.9 are outside 1\.\.3"
    ):
        unpack(*multiturn_group(ver=ver, mask=np.ones(10, np.uint8), rewards=None))


def _rejections():
    """(group, frames, exact message) for every way a multi-turn field can be wrong."""
    g, f = multiturn_group()
    at = lambda array, i, value: np.concatenate([array[:i], [value], array[i + 1 :]])  # noqa: E731
    mask_refused = "each value is 1 (sampled) or 0 (observation)"
    edge = "(loss_mask 0); a response ends with a sampled token"
    cases = [
        (dict(mask=MASK.astype(np.int32)), "loss_mask must be a 1-D uint8 tensor, got 'int32' of shape (10,)"),
        (dict(mask=MASK.reshape(2, 5)), "loss_mask must be a 1-D uint8 tensor, got 'uint8' of shape (2, 5)"),
        (dict(mask=at(MASK, 2, 2).astype(np.uint8)), f"loss_mask holds 2; {mask_refused}"),
        (dict(mask=MASK[:9]), "loss_mask holds 9 values, lengths add up to 10 tokens"),
        (dict(mask=at(MASK, 4, 0).astype(np.uint8), rewards=None), f"sample 0 ends on an observation token {edge}"),
        (dict(rewards=REWARDS.astype(np.float16)), "turn_rewards must be a 1-D float32 tensor, got 'float16' of shape (10,)"),
        (dict(rewards=REWARDS[:9]), "turn_rewards holds 9 values, lengths add up to 10 tokens"),
        (dict(rewards=at(REWARDS, 7, NAN).astype(np.float32)), "turn_rewards must be finite"),
        (dict(rewards=at(REWARDS, 7, np.inf).astype(np.float32)), "turn_rewards must be finite"),
        (dict(rewards=at(REWARDS, 3, 1.0).astype(np.float32)), "turn_rewards holds a nonzero reward at an observation token (loss_mask 0)"),
        (dict(episodes=EPISODES[:1]), "1 episode stats for 2 samples (one per sample, or none)"),
        (dict(episodes=EPISODES * 2), "4 episode stats for 2 samples (one per sample, or none)"),
        (dict(episodes=[EPISODES[0], episode(turns=-1)]), "episode 1: turns = -1 is negative"),
        (dict(episodes=[episode(tool_timeouts=-2), EPISODES[1]]), "episode 0: tool_timeouts = -2 is negative"),
        (dict(episodes=[episode(observation_tokens=-1)] * 2), "episode 0: observation_tokens = -1 is negative"),
        (dict(episodes=[episode(env_seconds=NAN)] * 2), "episode 0: env_seconds = nan is not a finite, non-negative number of seconds"),
        (dict(episodes=[episode(env_seconds=-1.0)] * 2), "episode 0: env_seconds = -1.0 is not a finite, non-negative number of seconds"),
        (dict(episodes=[episode(env_reward=-np.inf)] * 2), "episode 0: env_reward = -inf is not finite"),
        (dict(episodes=[EPISODES[0], episode(budget="tokens")]), "episode 1: budget 'tokens' is not one of "
         "'', 'turns', 'turn_tokens', 'episode_tokens', 'episode_timeout'"),
    ]  # fmt: skip
    for fields, message in cases:
        yield (*multiturn_group(**fields), f"group 5: {message}")
    ref = g.loss_mask  # a mask frame that is too short for the ref (cut off on the wire)
    wire = [bytes(b) for b in f.buffers]
    yield (
        replace(g, loss_mask=P.TensorRef("uint8", (10,), ref.frame, len(wire[0]) - 4)),
        wire,
        f"group 5: loss_mask: tensor frame 1 holds {len(wire[0])} bytes; shape (10,) of uint8 "
        f"at offset {len(wire[0]) - 4} needs {len(wire[0]) + 6}",
    )


@pytest.mark.parametrize(("group", "frames", "message"), list(_rejections()))
def test_each_wrong_multiturn_field_is_rejected_with_a_message_naming_it(group, frames, message):
    with pytest.raises(P.ProtocolError) as err:
        unpack(group, frames)
    assert str(err.value) == message


def _acceptable(mask: list[int], rewards: list[float], ver: list[int]) -> bool:
    """The rules for two 5-token samples, token by token: what ``unpack`` must accept."""
    lo, hi = VERSIONS
    for m, r, v in zip(mask, rewards, ver, strict=True):
        if m not in (0, 1) or not np.isfinite(r) or (m == 0 and r != 0):
            return False
        if m == 1 and not lo <= v <= hi:
            return False
    return all(mask[at] == 1 for at in (4, 9))  # each sample's last token


@st.composite
def bent_columns(draw) -> tuple[list[int], list[float], list[int]]:
    """(mask, turn rewards, versions) of a valid multi-turn group with up to two tokens
    bent: a mask value, a reward or a version anyone may send."""
    mask = draw(st.lists(st.integers(0, 1), min_size=10, max_size=10))
    for at in (4, 9):  # each sample's last token
        mask[at] = 1
    rewards = [draw(st.sampled_from([0.0, 0.5])) if m else 0.0 for m in mask]
    ver = [draw(st.integers(*VERSIONS)) if m else draw(st.integers(0, 9)) for m in mask]
    columns = (mask, rewards, ver)
    wrong = ([0, 1, 2], [0.0, 1.0, NAN, -np.inf], [0, 2, 9])
    for _ in range(draw(st.integers(0, 2))):
        c = draw(st.integers(0, 2))
        columns[c][draw(st.integers(0, 9))] = draw(st.sampled_from(wrong[c]))
    return columns


@settings(max_examples=300)
@given(columns=bent_columns())
def test_unpack_accepts_exactly_the_multiturn_groups_that_follow_the_rules(columns):
    mask, rewards, ver = columns
    group, frames = multiturn_group(
        mask=np.array(mask, np.uint8),
        rewards=np.array(rewards, np.float32),
        ver=np.array(ver, np.int32),
    )
    try:
        stored = unpack(group, frames)
    except P.ProtocolError:
        assert not _acceptable(mask, rewards, ver)
        return
    assert _acceptable(mask, rewards, ver)
    assert [m.tolist() for m in stored.loss_masks] == [mask[:5], mask[5:]]


# ----------------------------------------------------------------------------- response cap


def test_a_run_with_environments_lets_a_response_hold_a_whole_episode():
    cfg = RunConfig()
    gens = msgspec.structs.replace(cfg.generators, max_new_tokens=32)
    cfg = msgspec.structs.replace(cfg, generators=gens)
    assert max_response_tokens(cfg) == 32  # no environments: one response
    with_env = lambda **mt: msgspec.structs.replace(  # noqa: E731
        cfg,
        multiturn=msgspec.structs.replace(
            cfg.multiturn, environments=[EnvironmentConfig(env="envs.calc:Calc")], **mt
        ),
    )
    assert max_response_tokens(with_env(max_episode_tokens=700)) == 700
    # Prompts no environment claims still get one response of up to max_new_tokens.
    assert max_response_tokens(with_env(max_episode_tokens=20)) == 32


# ----------------------------------------------------------------------------- batches


def _stored(k: int, multiturn: bool) -> StoredGroup:
    """Group ``k``: two samples of k + 2 and k + 3 tokens. Multi-turn: a one-token turn
    rewarded k + i + 0.5, an observation, and a one-token turn; episode i took k + i turns."""
    lengths = [k + 2, k + 3]
    group = StoredGroup(
        k,
        k,
        0,
        np.array([1, 2], np.int32),
        [np.full(n, k, np.int32) for n in lengths],
        [np.full(n, -0.5, np.float32) for n in lengths],
        [np.zeros(n, np.int32) for n in lengths],
        [[1.0], [0.0]],
        [0],
        "default",
    )
    if multiturn:
        group.loss_masks = [np.array([1] + [0] * (n - 2) + [1], np.uint8) for n in lengths]
        group.turn_rewards = [np.zeros(n, np.float32) for n in lengths]
        for i, rewards in enumerate(group.turn_rewards):
            rewards[0] = k + i + 0.5
        group.episodes = [episode(turns=k + i) for i in range(2)]
    return group


def _on_the_wire(step: StepBatch) -> tuple[P.Batch, list]:
    body, frames = encode_step(step, num_sources=1, buffer_size=0, prompts_skipped=0)
    env, wire = P.decode([bytes(b) for b in P.encode(body, 0, frames)])
    return env.body, wire


def test_a_mixed_step_carries_masks_rewards_and_episodes_in_sample_order():
    groups = [_stored(1, multiturn=True), _stored(2, multiturn=False), _stored(3, True)]
    step = StepBatch(4, groups, shard_samples(groups, 2), 0, groups)
    batch, wire = _on_the_wire(step)
    order = [(groups[gi], i) for shard in step.shards for gi, i in shard]
    assert [g.group_id for g, _ in order] == batch.sample_group  # rank by rank
    mask = P.vector(batch.loss_mask, wire, "uint8", "loss_mask")
    rewards = P.vector(batch.turn_rewards, wire, "float32", "turn_rewards")
    ones = lambda g, i: np.ones(len(g.responses[i]), np.uint8)  # noqa: E731
    zeros = lambda g, i: np.zeros(len(g.responses[i]), np.float32)  # noqa: E731
    expected_mask = [ones(g, i) if g.loss_masks is None else g.loss_masks[i] for g, i in order]
    expected_rewards = [
        zeros(g, i) if g.turn_rewards is None else g.turn_rewards[i] for g, i in order
    ]
    assert mask.tolist() == np.concatenate(expected_mask).tolist()
    assert rewards.tolist() == np.concatenate(expected_rewards).tolist()
    assert len(mask) == sum(batch.response_lengths) and 0 in mask and rewards.max() > 0
    assert batch.episodes == [g.episodes[i] if g.episodes else None for g, i in order]
    turns = [None if e is None else e.turns for e in batch.episodes]
    assert turns == [g.group_id + i if g.episodes else None for g, i in order]


def test_a_single_turn_step_carries_none_of_it():
    groups = [_stored(1, multiturn=False), _stored(2, multiturn=False)]
    batch, wire = _on_the_wire(StepBatch(0, groups, shard_samples(groups, 1), 0, groups))
    assert (batch.loss_mask, batch.turn_rewards, batch.episodes) == (None, None, [])
    assert len(wire) == 1  # the four token arrays share one packed frame, nothing else travels


def test_a_multiturn_group_goes_from_push_rollouts_to_the_batch():
    """Through the server: the push, the ledger, the staleness check and the
    encoding of the step, as the learner decodes it."""
    h = Harness()
    try:
        reply = h.request(b"A", P.GetPrompts(generator_id=0, loaded_version=0, max_groups=2))
        assert [g.group_id for g in reply.groups] == [0, 1]
        frames = P.Frames()
        zeros = np.zeros(10, np.int32)
        multi, _ = multiturn_group(k=0, ver=zeros, frames=frames)
        single, _ = make_group(k=1, ver=np.zeros(6, np.int32), frames=frames)
        assert isinstance(h.push(b"A", multi, single, frames=frames), P.Ack)
        req = P.GetBatch(step=0, rank=0, world_size=1, learner_version=0, wait_s=0.0)
        assert isinstance(h.request(b"L", req), P.Batch)
        batch, wire = _on_the_wire(h.server.batches.steps[0])
    finally:
        h.close()
    # One shard: group 0's samples, then group 1's.
    assert (batch.sample_group, batch.sample_index) == ([0, 0, 1, 1], [0, 1, 0, 1])
    mask = P.vector(batch.loss_mask, wire, "uint8", "loss_mask")
    rewards = P.vector(batch.turn_rewards, wire, "float32", "turn_rewards")
    assert mask.tolist() == MASK.tolist() + [1] * 6
    assert rewards.tolist() == REWARDS.tolist() + [0.0] * 6
    assert batch.episodes == [*EPISODES, None, None]
