"""learners/plan.py: minibatches, micro-batches and denominators over data-parallel ranks."""

import torch

from learners.plan import micro_rows, plan_update, shard_bounds
from verl_async.algos import AGG_MODES, GlobalBatch


def _masks(lengths: list[int], width: int = 10):
    """Rows with ``n`` response tokens each (loss mask [N, width-1], attention [N, width])."""
    loss = torch.zeros(len(lengths), width - 1)
    attn = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        loss[i, 2 : 2 + n] = 1
        attn[i, : 3 + n] = 1
    return loss, attn


def test_shard_bounds_are_rank_major():
    assert [shard_bounds([3, 1, 2], r) for r in range(3)] == [(0, 3), (3, 4), (4, 6)]


def test_denominators_are_the_global_minibatch_times_the_ranks():
    loss, attn = _masks([1, 2, 3, 4, 0, 6])  # row 4 has no response token
    sizes = [4, 2]
    plans = [plan_update(loss, attn, sizes, r, minibatches=2) for r in range(2)]
    # Minibatch 0 = rows {0, 1} of rank 0 and {4} of rank 1; minibatch 1 = {2, 3} and {5}.
    assert [m.micro[0].tolist() for m in plans[0]] == [[0, 1], [2, 3]]
    assert [m.micro[0].tolist() for m in plans[1]] == [[0], [1]]
    for plan in plans:
        assert [m.tokens for m in plan] == [1 + 2 + 0, 3 + 4 + 6]
        # verl 1dda039's global_batch_size: every row, the empty row 4 included
        assert [m.seqs for m in plan] == [3, 3]
    info = plans[0][0].global_batch(loss_scale_factor=8.0)
    assert info == GlobalBatch(
        dp_size=2, batch_num_tokens=3, global_batch_size=3, loss_scale_factor=8.0
    )


def test_ranks_losses_averaged_are_the_one_rank_loss():
    """Each mode: the two ranks' micro-batch losses, averaged (DDP's gradient mean), equal
    the loss of the whole minibatch on one rank."""
    loss, attn = _masks([1, 2, 3, 4, 0, 6])
    values = torch.arange(loss.numel(), dtype=torch.float64).view(loss.shape) / 7 - 2
    plans = [plan_update(loss, attn, [3, 3], r, minibatches=1) for r in range(2)]
    whole = plan_update(loss, attn, [6], 0, minibatches=1)[0]
    for mode in AGG_MODES:
        ranks = []
        for r, plan in enumerate(plans):
            rows = plan[0].micro[0] + 3 * r
            ranks.append(plan[0].global_batch(5.0).agg(values[rows], loss[rows], mode))
        one = whole.global_batch(5.0).agg(values, loss, mode)
        torch.testing.assert_close(sum(ranks) / 2, one, rtol=1e-12, atol=1e-12, msg=mode)


def test_every_rank_runs_as_many_passes_as_the_busiest_one():
    loss, attn = _masks([5, 5, 5, 5, 5, 1])
    # Rank 0: 5 rows of width 8 (40 tokens); rank 1: 1 row of width 4. Budget 16 tokens.
    plans = [plan_update(loss, attn, [5, 1], r, 1, max_tokens_per_microbatch=16) for r in range(2)]
    assert [len(p[0].micro) for p in plans] == [3, 3]
    assert [m.tolist() for m in plans[0][0].micro] == [[0, 1], [2, 3], [4]]
    assert [m.tolist() for m in plans[1][0].micro] == [[0], [], []]


def test_micro_batches_bucket_rows_of_like_length():
    loss, attn = _masks([1, 6, 2, 5])  # 4, 9, 5 and 8 tokens
    plan = plan_update(loss, attn, [4], 0, 1, max_tokens_per_microbatch=18)
    # Longest first, filled while rows x the first row's length fits: 2 x 9, then 2 x 5
    # (array_split in row order would pad [0, 1] and [2, 3] to 9 and 8: 34 cells, not 28).
    assert [m.tolist() for m in plan[0].micro] == [[1, 3], [2, 0]]
    assert plan_update(loss, attn, [4], 0, 1, max_tokens_per_microbatch=5)[0].micro[0].tolist() == [
        1
    ]


def test_a_pass_computes_its_rows_up_to_their_longest():
    loss, attn = _masks([2, 3, 1])  # 5, 6 and 4 tokens, padded to 10
    rows = micro_rows(torch.tensor([0, 2]), attn)
    assert rows.width == 5 and not rows.placeholder
    ids, mask = rows.inputs(torch.arange(30).view(3, 10), attn)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [20, 21, 22, 23, 24]] and mask.shape == (2, 5)
    assert torch.equal(rows.mask(loss), loss[[0, 2], :4])
    assert rows.take(torch.ones(3, 1)).shape == (2, 1)  # a per-sample column is kept


def test_an_empty_micro_batch_is_a_placeholder_with_nothing_to_learn():
    loss, attn = _masks([2, 3])
    rows = micro_rows(torch.tensor([], dtype=torch.long), attn)
    assert rows.placeholder and rows.idx.tolist() == [0]
    assert rows.mask(loss).sum() == 0 and rows.mask(loss).shape == (1, rows.width - 1)
    rows = micro_rows(torch.tensor([1]), attn)
    assert rows.idx.tolist() == [1] and rows.mask(loss).sum() == 3 and rows.width == 6


def test_one_rank_without_a_budget_is_the_plain_minibatch_split():
    loss, attn = _masks([1, 2, 3, 4, 5])
    plan = plan_update(loss, attn, [5], 0, minibatches=2)
    assert [m.micro[0].tolist() for m in plan] == [[0, 1, 2], [3, 4]]
    assert [m.tokens for m in plan] == [6.0, 9.0] and [m.seqs for m in plan] == [3, 2]
