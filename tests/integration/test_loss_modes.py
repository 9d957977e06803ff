"""Every built-in loss mode trains the tiny default through the real processes.

Each run is ``verl-async train configs/tiny.yaml`` (buffer, generator, learner) as the
tiny default runs, asynchronous with its staleness bound of 2, for 200 steps with
``algo.loss_mode`` set. Learning is not asked of every mode (its values against verl's are
pinned in tests/unit/test_verl_losses.py, and no bar here depends on how fast the machine
is); what is asked is that a whole run stays finite and bounded: every step logged, every
number in metrics.jsonl finite, no optimizer step skipped for a non-finite loss or
gradient, the loss within a bound no healthy run comes near, the clip fractions shares,
and the staleness bound held. ``vanilla`` is every other integration test's loss.
"""

from __future__ import annotations

import math

import pytest
import yaml

from verl_async.algos import policy_loss_names

from .conftest import run_cli
from .learning import rows

STEPS = 200
# |loss| of a step: the tiny default's stays under 1 with every mode (advantages are
# whitened within groups, ratios clipped or bounded); 50 is a blow-up, not noise.
MAX_ABS_LOSS = 50.0
# Settings a mode needs beyond the tiny default's: dro has no default beta; DPPO's
# truncation cap is clip_ratio_c, 20 as its authors use it (docs/algorithms.md).
EXTRA = {"dro": ("algo.dro_beta=0.1",), "dppo_tv": ("algo.clip_ratio_c=20",),
         "dppo_kl": ("algo.clip_ratio_c=20",)}  # fmt: skip
MODES = [m for m in policy_loss_names() if m != "vanilla"]


def _numbers(row: dict):
    for key, value in row.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            yield key, float(value)
        elif isinstance(value, list):
            yield from ((f"{key}[{i}]", float(v)) for i, v in enumerate(value))


@pytest.mark.parametrize("mode", MODES)
def test_loss_mode_trains_the_tiny_default_finite_and_bounded(tmp_path, mode):
    run_dir = tmp_path / mode
    args = ["train", "configs/tiny.yaml", "--run-dir", str(run_dir), f"trainer.total_steps={STEPS}",
            "checkpoint.every_steps=0", f"algo.loss_mode={mode}", *EXTRA.get(mode, ())]  # fmt: skip
    res = run_cli(args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(STEPS))
    for row in metrics:
        bad = [key for key, value in _numbers(row) if not math.isfinite(value)]
        assert not bad, (row["step"], bad)
        assert row["skipped_steps/nonfinite_loss"] == 0, row["step"]
        assert row["skipped_steps/nonfinite_grad"] == 0, row["step"]
        assert abs(row["loss"]) < MAX_ABS_LOSS, (row["step"], row["loss"])
        assert 0 <= row["actor/pg_clipfrac"] <= 1 and 0 <= row["actor/pg_clipfrac_lower"] <= 1
        assert row["staleness_max"] <= 2
    # The run trained with this mode: the resolved config the learner read. (A zero
    # gradient norm is no fault: once every group's samples score alike, GRPO's
    # advantages, and so every mode's gradient, are 0.)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["algo"]["loss_mode"] == mode
    assert config["staleness"]["max"] == 2
