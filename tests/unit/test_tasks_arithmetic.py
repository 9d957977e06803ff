"""The arithmetic prompt set: held-out validation sums and the command that writes it."""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
import pytest

from verl_async.tasks import arithmetic


def test_held_out_training_rows_skip_every_validation_sum_in_either_order():
    val = arithmetic.make_rows("val", 100, arithmetic.VAL_SEED, 0.5)
    held_out = frozenset(map(arithmetic.sum_key, val))
    train = arithmetic.make_rows("train", 500, arithmetic.TRAIN_SEED, 0.5, exclude=held_out)
    assert len(train) == 500
    assert [r["extra_info"]["index"] for r in train] == list(range(500))
    for row in train:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert (a, b) not in held_out and (b, a) not in held_out
        assert row["reward_model"]["ground_truth"] == str(a + b)
    # Without the exclusion the same seed draws validation sums too: the filter did work.
    unfiltered = arithmetic.make_rows("train", 500, arithmetic.TRAIN_SEED, 0.5)
    assert any(arithmetic.sum_key(r) in held_out for r in unfiltered)


def test_too_few_sums_left_is_an_error_not_an_endless_loop():
    every_single_digit_sum = frozenset((a, b) for a in range(10) for b in range(a, 10))
    with pytest.raises(ValueError, match="too few"):
        arithmetic.make_rows("train", 5, 1, 0.0, exclude=every_single_digit_sum)


def test_command_writes_named_held_out_files(tmp_path, monkeypatch, capsys):
    argv = ["arithmetic", "--out-dir", str(tmp_path), "--name", "mix", "--held-out"]
    argv += ["--two-digit-fraction", "0.5", "--train", "300", "--val", "40"]
    monkeypatch.setattr(sys, "argv", argv)
    arithmetic.main()
    train = pq.read_table(tmp_path / "mix_train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "mix_val.parquet").to_pylist()
    assert (len(train), len(val)) == (300, 40)
    assert not {arithmetic.sum_key(r) for r in train} & {arithmetic.sum_key(r) for r in val}
    assert "mix_train.parquet" in capsys.readouterr().out


def test_command_refuses_held_out_single_digit_sums(tmp_path, monkeypatch):
    # 2,000 validation draws take every one of the 55 single-digit sums.
    argv = ["arithmetic", "--out-dir", str(tmp_path), "--held-out", "--val", "2000"]
    argv += ["--train", "10"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        arithmetic.main()
    assert exit_info.value.code == 2
    assert not list(tmp_path.iterdir())
