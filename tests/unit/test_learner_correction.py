"""learners/whole_step_correction.py: what the update needs before its first minibatch under
``algo.correction: rollout``, and how its metrics combine."""

import pytest
import torch

from learners.plan import Minibatch
from learners.whole_step_correction import combine, needs_every_prox, recount, whole_step
from verl_async.algos.correction.settings import RolloutCorrection, preset_settings


def test_every_row_first_only_for_decoupled_normalisation_or_rejection():
    assert not needs_every_prox(None)
    assert not needs_every_prox(preset_settings("decoupled_token_is"))
    assert needs_every_prox(preset_settings("decoupled_geo_rs"))
    assert needs_every_prox(RolloutCorrection(rollout_is="token", rollout_is_batch_normalize=True))
    assert not needs_every_prox(preset_settings("bypass_ppo_clip_geo_rs"))  # pass by pass


def test_combine_weighs_means_by_tokens_and_takes_extremes():
    parts = [
        ({"a": 1.0, "x_max": 3.0, "x_min": 0.5}, 1.0),
        ({"a": 4.0, "x_max": 2.0, "x_min": 0.1}, 3.0),
        ({}, 5.0),  # a placeholder pass
        ({"a": 100.0, "x_max": 9.0, "x_min": -9.0}, 0.0),  # no tokens
    ]
    assert combine(parts) == {"a": (1.0 + 12.0) / 4.0, "x_max": 3.0, "x_min": 0.1}
    assert combine([]) == {}


def test_recount_takes_each_minibatchs_kept_tokens_over_the_ranks():
    plan = [
        Minibatch([torch.tensor([0, 1]), torch.tensor([], dtype=torch.long)], 9.0, 4.0, 2),
        Minibatch([torch.tensor([2])], 5.0, 4.0, 2),
    ]
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])  # row 2 rejected
    other_rank = torch.tensor([2.0, 1.0], dtype=torch.float64)
    new = recount(plan, mask, lambda x: x + other_rank)
    assert [mb.tokens for mb in new] == [5.0, 1.0]
    assert [mb.seqs for mb in new] == [4.0, 4.0]  # verl's batch size stays
    assert new[0].micro is plan[0].micro


def test_a_rank_without_tokens_still_joins_the_normalising_sums():
    calls = []

    def reduce(x):
        calls.append(float(x))
        return x

    s = RolloutCorrection(rollout_is="token", rollout_is_batch_normalize=True)
    empty = torch.zeros(2, 3)
    out = whole_step(torch.zeros(2, 3), torch.zeros(2, 3), empty, s, reduce)
    assert calls == [0.0, 0.0] and out.metrics == {}
    assert torch.equal(out.weights, torch.zeros(2, 3)) and out.mask is empty
    full = torch.ones(2, 3)
    out = whole_step(torch.zeros(2, 3), torch.zeros(2, 3), full, s, reduce)
    assert len(calls) == 4  # the same two sums with tokens
    assert out.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.0)
