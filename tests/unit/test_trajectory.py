"""The trajectory: one shape for every rollout, single-turn as the one-turn case, and the
one function that packs a group for the wire."""

import numpy as np
import pytest

from generators.interface import Sample
from generators.trajectory import Trajectory, pack
from verl_async import protocol as P

PROMPT = [5, 6, 7]


def _stats(turns: int) -> P.EpisodeStats:
    return P.EpisodeStats(turns, 0, 0, 0, 0.0, 0, "", 0, False, 0.0)


def single_turn(prompt, sample, text) -> Trajectory:
    return Trajectory(list(prompt)).add_turn(sample, text)


def test_a_single_turn_sample_is_the_one_turn_trajectory():
    t = single_turn(PROMPT, Sample([1, 2], [-0.5, -0.25], [3, 3], PROMPT), "a b")
    assert (t.token_ids, t.loss_mask, t.rewards, t.turn_ends) == ([1, 2], [1, 1], [0.0, 0.0], [2])
    assert (t.text, t.messages, t.stats) == ("a b", None, None)
    assert t.ids() == [*PROMPT, 1, 2] and t.length() == 5


def test_turns_and_observations_line_up_and_rewards_sit_at_a_turn_s_last_token():
    t = Trajectory(list(PROMPT)).add_turn(Sample([1, 2], [-1.0, -2.0], [0, 1]), "x")
    t.add_reward(0.5)
    t.add_between([9, 9, 9])
    t.observe([{"role": "tool", "content": "r"}])
    t.add_turn(Sample([4], [-3.0], [2]), "y")
    t.add_reward(1.0)
    assert t.token_ids == [1, 2, 9, 9, 9, 4]
    assert t.loss_mask == [1, 1, 0, 0, 0, 1]
    assert t.logprobs == [-1.0, -2.0, 0.0, 0.0, 0.0, -3.0]
    assert t.versions == [0, 1, 1, 1, 1, 2]  # an observation repeats the version before it
    assert t.rewards == [0.0, 0.5, 0.0, 0.0, 0.0, 1.0]
    assert t.turn_ends == [2, 6] and t.sampled_versions() == [0, 1, 2] and t.text == "y"


def test_a_single_turn_group_packs_without_a_mask_and_an_episode_group_with_one():
    a = single_turn(PROMPT, Sample([1, 2], [-0.5, -0.5], [0, 0]), "a")
    b = single_turn(PROMPT, Sample([3], [-0.1], [1]), "b")
    packed = pack(PROMPT, [a, b])
    assert packed.lengths == [2, 1] and packed.tokens.tolist() == [1, 2, 3]
    assert packed.tokens.dtype == np.int32 and packed.logprobs.dtype == np.float32
    assert packed.loss_mask is None and packed.turn_rewards is None and packed.episodes == []
    # An episode may start from its environment's prompt, not the buffer's.
    own = [1, 1]
    e = Trajectory(own).add_turn(Sample([4], [-0.2], [0]), "c")
    e.add_between([8])
    e.add_turn(Sample([5], [-0.3], [0]), "d")
    e.finish(_stats(1), [])
    packed = pack(PROMPT, [e, e])
    assert packed.prompt_ids == own and packed.loss_mask.tolist() == [1, 0, 1, 1, 0, 1]
    assert packed.loss_mask.dtype == np.uint8 and packed.turn_rewards.dtype == np.float32
    assert packed.episodes == [_stats(1)] * 2
    with pytest.raises(ValueError, match="mixes"):
        pack(PROMPT, [a, e])


def test_episodes_from_different_prompts_share_their_common_prefix_and_keep_every_token():
    def episode(prompt, sampled):
        n = len(sampled)
        t = Trajectory(prompt).add_turn(Sample(sampled, [-0.5] * n, [4] * n), "x")
        return t.finish(_stats(1), [])

    a, b = episode([1, 2, 3, 4], [9]), episode([1, 2, 5], [8, 8])
    packed = pack(PROMPT, [a, b])
    assert packed.prompt_ids == [1, 2]
    assert packed.tokens.tolist() == [3, 4, 9, 5, 8, 8]  # each sample's whole sequence
    assert packed.loss_mask.tolist() == [0, 0, 1, 0, 1, 1]
    assert packed.logprobs.tolist() == [0.0, 0.0, -0.5, 0.0, -0.5, -0.5]
    assert packed.versions.tolist() == [4, 4, 4, 4, 4, 4] and packed.lengths == [3, 3]
    assert a.prompt_ids == [1, 2, 3, 4]  # the trajectories themselves are left as they were
