"""The ``overlong`` reward source: DAPO's soft overlong punishment, by token count."""

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.reward_config import OverlongReward
from verl_async.rewards.aggregate import combine
from verl_async.rewards.rules import overlong_penalty
from verl_async.rewards.scorer import Scorer


def test_overlong_penalty_hand_values():
    # Lmax = 20, Lb = 4: free up to 16 tokens, then -1/4 per token down to -1 at 20.
    assert [overlong_penalty(n, 4, 1.0, 20) for n in (0, 10, 16, 17, 18, 20)] == [
        0.0,
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
    ]
    assert overlong_penalty(19, 4, 0.5, 20) == -0.375  # -(19 - 16) / 4 * 0.5
    assert overlong_penalty(22, 4, 1.0, 20) == -1.5  # beyond Lmax it keeps falling, as verl's
    assert overlong_penalty(6, 6, 2.0, 6) == -2.0  # the buffer is the whole response
    assert overlong_penalty(3, 6, 2.0, 6) == -1.0


# Outputs of verl 1dda039's own DAPORewardManager with overlong shaping (its float32 reward
# tensor and reward_extra_info), inputs included: tests/reference/verl_1dda039.py writes them.
VERL = json.loads((Path(__file__).parents[2] / "tests/fixtures/verl_1dda039.json").read_text())[
    "overlong"
]


@pytest.mark.parametrize(
    "case", VERL, ids=lambda c: f"{c['max_resp_len']}-{c['valid_response_length']}"
)
def test_overlong_matches_verls_reward_manager(case):
    penalty = overlong_penalty(
        case["valid_response_length"],
        case["overlong_buffer_len"],
        case["penalty_factor"],
        case["max_resp_len"],
    )
    assert penalty == pytest.approx(case["overlong_reward"], abs=1e-7)
    assert (penalty < 0) == case["overlong"]
    # reward = score + penalty: the overlong source beside the score, weights 1, none.
    sources = _cfg(SOURCES).rewards.sources
    total = combine(np.array([[case["score"], penalty]]), np.zeros(1), sources, {})
    assert total[0] == pytest.approx(case["reward"], abs=1e-6)  # verl's is float32


def _cfg(*overrides: str):
    return load_config("configs/tiny.yaml", list(overrides))


SOURCES = (
    "rewards.sources=[{kind: exact, name: correct, extract: first_word}, "
    "{kind: overlong, name: overlong, len: 4, penalty_factor: 1.0}]"
)


def test_scorer_scores_overlong_by_length_and_defaults_to_max_new_tokens(tmp_path):
    cfg = _cfg(SOURCES, "generators.max_new_tokens=8")
    only = cfg.rewards.__class__(sources=[cfg.rewards.sources[1]])
    scorer = Scorer(tmp_path, only, {}, max_new_tokens=8)
    assert scorer.rules is None  # no scoring process for a source that reads no text
    group = P.PromptGroup(
        group_id=0, prompt_id=0, epoch=0, prompt_ids=[1], prompt="q", ground_truth="a"
    )
    out = asyncio.run(scorer.score_group(group, ["a", "b", "c"], None, [4, 6, 8]))
    # Lmax = 8 (generators.max_new_tokens), Lb = 4: 4 -> 0, 6 -> -0.5, 8 -> -1
    assert out.scores == [[0.0, -0.5, -1.0]] and out.failed == [0]
    with pytest.raises(ValueError, match="needs the 3 responses' lengths"):
        asyncio.run(scorer.score_group(group, ["a", "b", "c"]))
    explicit = OverlongReward(name="o", buffer_len=2, penalty_factor=3.0, max_resp_len=5)
    assert scorer.overlong_scores(explicit, [3, 4, 5], 3) == [0.0, -1.5, -3.0]


def test_overlong_combines_with_other_sources_by_weight():
    cfg = _cfg(SOURCES)
    # [N, S]: exact 1/0, overlong penalty; normalize none, weights 1 -> plain sums.
    rewards = combine([[1.0, -0.5], [0.0, 0.0], [1.0, -1.0]], [0, 0, 0], cfg.rewards.sources, {})
    assert rewards.tolist() == [0.5, 0.0, 0.0]


def test_overlong_config_is_checked_at_load_naming_the_key():
    src = _cfg(SOURCES).rewards.sources[1]
    assert isinstance(src, OverlongReward) and src.buffer_len == 4 and src.max_resp_len is None
    assert src.resolved_max(6) == 6
    bad = {
        "len: 7": "'rewards.sources.1.len': 7 tokens is more than .*generators.max_new_tokens = 6",
        "len: 9, max_resp_len: 8": "'rewards.sources.1.len': 9 tokens .*[(]max_resp_len = 8[)]",
        "len: 0": "rewards.sources.1.len",
        "len: 2, penalty_factor: -1": "rewards.sources.1.penalty_factor",
        "len: 2, penalty_factor: .inf": "rewards.sources.1.penalty_factor",
        "len: 2, max_resp_len: 0": "rewards.sources.1.max_resp_len",
    }
    for fields, match in bad.items():
        extra = "" if "penalty_factor" in fields else ", penalty_factor: 1.0"
        override = (
            "rewards.sources=[{kind: exact, name: correct}, "
            f"{{kind: overlong, name: o, {fields}{extra}}}]"
        )
        with pytest.raises(ConfigError, match=match):
            _cfg(override)
    with pytest.raises(ConfigError, match="missing required field `len`"):
        _cfg("rewards.sources=[{kind: overlong, name: o, penalty_factor: 1.0}]")
    # A longer max_resp_len than the generators' is the user's to choose (verl allows it).
    longer = "{kind: overlong, name: o, len: 8, penalty_factor: 1, max_resp_len: 16}"
    assert _cfg(f"rewards.sources=[{longer}]").rewards.sources[0].resolved_max(6) == 16
