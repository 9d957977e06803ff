"""Two FSDP2 learner ranks (gloo on CPU, real torch.distributed processes) compute the
gradient one rank computes on the same step batch (tests/integration/dp_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "tests" / "integration" / "dp_worker.py"), str(out),
    ]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case",
    [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "token-sum",
        "gspo",
        "micro-batches",
        "two-minibatches",
        "lora",
        "unpacked",
        "cpu-offload",
        "rollout-correction",
    ],
)
def test_two_ranks_take_the_one_rank_step(report, case):
    r = report["cases"][case]
    assert r["max_abs_delta"] > 1e-3  # the step moved the weights
    assert r["max_abs_diff"] <= 1e-6 + 1e-5 * r["max_abs_delta"], r
    assert r["grad_norm_dp"] == pytest.approx(r["grad_norm_one"], rel=1e-5)
    one, dp = r["shared_prefix_fraction"]
    if case == "unpacked":
        assert one == dp == 0.0
    elif case != "micro-batches":  # packed behind each group's prompt, on one rank as on two
        assert one > 0.2 and dp > 0.2, r
    if case == "micro-batches":
        assert r["micro_passes"] == [3], r  # 6 rows of 13..20 tokens in budgets of 48
    if case == "lora":  # only the adapter moved, on one rank as on two
        assert r["trained_all_adapter"]
    if case == "rollout-correction":  # rank 0's rows: some tokens rejected, weights rescaled
        one, dp = r["rollout_corr"]
        assert 0 < one["rollout_corr/rollout_rs_masked_fraction"] < 1, one
        assert dp["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(
            one["rollout_corr/rollout_is_batch_norm_factor"], rel=1e-6
        )
        both = r["rollout_corr_ranks"]  # token-weighted means and extremes over the ranks
        for key in ("rollout_rs_masked_fraction", "rollout_is_max", "kl", "chi2_token"):
            key = f"rollout_corr/{key}"
            assert both[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), key


def test_gathered_rows_equal_one_pass_over_the_step(report):
    assert report["gather_max_abs_diff"] <= 1e-6


def test_a_nan_on_one_rank_skips_the_step_and_stops_the_publish_on_every_rank(report):
    """Rank 1 alone has NaN advantages, then a NaN in its shard of a weight: both ranks skip
    the step for the loss (rank 0's own loss was finite: the verdict is shared) and keep
    their shards of weights and AdamW state; both refuse to publish, rank 0 without a bad
    tensor of its own, and both refuse the sharded checkpoint, which writes nothing."""
    rank0, rank1 = report["nonfinite"]
    assert rank0 == [1, 0, 1, 1, 0, 1, 0], rank0
    assert rank1 == [1, 0, 1, 1, 1, 1, 0], rank1


def test_shards_balance_tokens_within_one_sequence(report):
    assert report["world"] == 2 and sum(report["shard_sizes"]) == 12
    tokens = report["shard_tokens"]
    assert max(tokens) - min(tokens) <= report["longest_row"]
