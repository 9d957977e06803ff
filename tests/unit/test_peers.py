"""benchmarks/peers.py, the parts that need neither TRL nor a training run: the
hyper-parameter mapping, the time to the target reward, and the TRL reward functions
scoring exactly as verl-async's scorer does."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from verl_async.config import load_config
from verl_async.data import PromptRecord
from verl_async.protocol import ScoreItem
from verl_async.reward_config import ExactReward, FormatReward, RewardsConfig
from verl_async.rewards.rules import RuleScorerState, score_exact, score_format

ROOT = Path(__file__).resolve().parents[2]


def _load_peers():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "benchmarks/peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


peers = _load_peers()


def test_trl_is_imported_only_where_trl_runs():
    """CI does not install the bench extra: the module imports without TRL or torch."""
    source = (ROOT / "benchmarks/peers.py").read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    heavy = ("trl", "torch", "transformers", "datasets")
    assert not [line for line in top_level if line.split()[1].split(".")[0] in heavy]


# ----------------------------------------------------------------------------- mapping


def test_mapping_tiny():
    cfg = load_config(ROOT / "configs/tiny.yaml")
    kw = {key: value for key, value, _ in peers.trl_mapping(cfg, 400)}
    assert kw["num_generations"] == 8
    # 8 groups x 8 samples in 2 minibatches: generation batch 64, 2 optimizer steps of 32
    assert kw["per_device_train_batch_size"] == 32
    assert kw["steps_per_generation"] == 2
    assert kw["gradient_accumulation_steps"] == 1
    assert kw["per_device_train_batch_size"] * kw["steps_per_generation"] == 64
    assert kw["max_steps"] == 800
    assert kw["num_iterations"] == 1 and kw["beta"] == 0.0
    assert kw["learning_rate"] == 5e-4 and kw["max_grad_norm"] == 1.0
    assert kw["lr_scheduler_type"] == "constant" and kw["warmup_steps"] == 0
    assert kw["max_completion_length"] == 6
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (1.0, 1.0, 0)
    assert (kw["epsilon"], kw["epsilon_high"], kw["delta"]) == (0.2, 0.28, 3.0)
    assert kw["loss_type"] == "bnpo" and kw["scale_rewards"] == "group"
    assert kw["reward_weights"] == [1.0]
    assert kw["use_vllm"] is False and kw["use_cpu"] is True
    assert kw["bf16"] is False and kw["fp16"] is False
    assert kw["gradient_checkpointing"] is False
    assert kw["seed"] == 0


def test_mapping_smollm2():
    cfg = load_config(ROOT / "configs/math_smollm2_cpu.yaml")
    kw = {key: value for key, value, _ in peers.trl_mapping(cfg, 75)}
    assert kw["num_generations"] == 8
    assert kw["per_device_train_batch_size"] == 32  # 4 groups x 8, one minibatch
    assert kw["steps_per_generation"] == 1 and kw["max_steps"] == 75
    assert kw["learning_rate"] == 2e-5
    assert kw["max_completion_length"] == 32
    assert kw["epsilon"] == kw["epsilon_high"] == 0.2  # clip_eps_high empty: clip_eps
    assert kw["reward_weights"] == [1.0, 0.2]


def test_mapping_follows_overrides_and_warmup():
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        ["algo.minibatches=4", "learner.warmup_steps=5", "algo.normalize_adv_std=false",
         "algo.loss_agg_mode=seq-mean-token-mean", "algo.clip_ratio_c=null"],
    )  # fmt: skip
    kw = dict((k, v) for k, v, _ in peers.trl_mapping(cfg, 10))
    assert kw["per_device_train_batch_size"] == 16 and kw["steps_per_generation"] == 4
    assert kw["max_steps"] == 40 and kw["warmup_steps"] == 20
    assert kw["lr_scheduler_type"] == "constant_with_warmup"
    assert kw["scale_rewards"] == "none" and kw["loss_type"] == "grpo"
    assert kw["delta"] is None
    assert any("Warm-up" in note for note in peers.unmatched(cfg))


@pytest.mark.parametrize(
    "override",
    [
        "algo.adv_estimator=rloo",
        "algo.kl.loss_coef=0.01",
        "algo.loss_agg_mode=seq-mean-token-sum",
        "algo.minibatches=3",
        "algo.clip_ratio_c=1.1",
    ],
)
def test_mapping_refuses_what_trl_cannot_match(override):
    cfg = load_config(ROOT / "configs/tiny.yaml", [override])
    with pytest.raises(SystemExit):
        peers.trl_mapping(cfg, 10)


def test_unmatched_names_the_asynchrony_and_placement():
    notes = peers.unmatched(load_config(ROOT / "configs/tiny.yaml"))
    assert any("staleness.max=2" in n for n in notes)
    assert any("cpu:1" in n for n in notes)


def test_dataset_rows_render_like_verl():
    records = [
        PromptRecord(prompt="max 3 7 1 4 =", ground_truth="7"),
        PromptRecord(prompt=[{"role": "user", "content": "What is 2 + 3?"}], ground_truth="5",
                     data_source="arith", extra_info={"a": 2}),
    ]  # fmt: skip
    raw = peers.dataset_rows(records[:1], templated=False)
    assert raw == [{"prompt": "max 3 7 1 4 =", "ground_truth": "7", "data_source": "default",
                    "extra_info": ""}]  # fmt: skip
    chat = peers.dataset_rows(records, templated=True)
    assert chat[0]["prompt"] == [{"role": "user", "content": "max 3 7 1 4 ="}]
    assert chat[1]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert chat[1]["extra_info"] == '{"a": 2}'


# ----------------------------------------------------------------------------- time to target


def test_time_to_target_first_full_window():
    rewards = [0.0, 0.0, 1.0, 1.0, 1.0]
    times = [10.0, 11.0, 12.0, 13.0, 14.0]
    # trailing means over 2: 0, 0, 0.5, 1, 1
    assert peers.time_to_target(rewards, times, window=2, target=0.75) == (3, 13.0)
    assert peers.time_to_target(rewards, times, window=2, target=0.5) == (2, 12.0)


def test_time_to_target_needs_a_full_window():
    rewards = [1.0, 1.0, 0.0, 0.0]
    # step 0 alone averages 1.0, but a window of 3 is full only from step 2 (mean 2/3)
    assert peers.time_to_target(rewards, [1, 2, 3, 4], window=3, target=0.9) == (None, None)
    assert peers.time_to_target(rewards, [1, 2, 3, 4], window=3, target=0.6) == (2, 3)
    assert peers.time_to_target([1.0, 1.0], [1, 2], window=5, target=0.1) == (None, None)


def test_time_to_target_never_reached():
    assert peers.time_to_target([0.1] * 30, list(range(30)), 10, 0.5) == (None, None)


def test_summarize_figures():
    rows = [{"t": 5.0 + i, "reward": r, "samples": 64} for i, r in enumerate([0, 0, 1, 1])]
    args = type("A", (), {"window": 2, "target": 0.75})()
    res = peers.summarize("x", rows, wall_s=12.0, args=args)
    assert res["first_step_s"] == 5.0 and res["train_s"] == 3.0
    assert res["samples"] == 256
    assert math.isclose(res["samples_per_s"], 256 / 12.0)
    assert math.isclose(res["train_samples_per_s"], 192 / 3.0)
    assert (res["target_step"], res["target_s"]) == (3, 8.0)
    assert (res["reward_first"], res["reward_final"]) == (0.0, 1.0)
    table = peers.results_table([res], 2, 0.75)
    assert "| x | 12.0 | 5.0 | 3.0 |" in table


# ----------------------------------------------------------------------------- rewards


def test_reward_wrapper_exact_matches_verl():
    rewards = RewardsConfig(sources=[ExactReward(name="correct", extract="first_word")])
    (fn,), weights = peers.reward_functions(rewards)
    assert fn.__name__ == "correct" and weights == [1.0]
    completions = ["7", " 7 9", "9", "", "7<eos>", "  seven 7"]
    truth = ["7"] * len(completions)
    got = fn(prompts=["max 3 7 1 4 ="] * len(completions), completions=completions,
             ground_truth=truth, data_source=["default"] * len(completions), extra_info=[""] * 6)  # fmt: skip
    want = [score_exact(rewards.sources[0], c, t) for c, t in zip(completions, truth, strict=True)]
    assert got == want == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_wrapper_smollm2_sources_match_verl():
    cfg = load_config(ROOT / "configs/math_smollm2_cpu.yaml")
    funcs, weights = peers.reward_functions(cfg.rewards)
    assert [f.__name__ for f in funcs] == ["correct", "just_number"] and weights == [1.0, 0.2]
    texts = ["12", "6 + 6 = 12", "The answer is 12.", "13", " 12 ", "twelve", "\\boxed{12}"]
    prompt = [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]
    completions = [[{"role": "assistant", "content": t}] for t in texts]  # TRL's chat form
    n = len(texts)
    state = RuleScorerState()
    for i, fn in enumerate(funcs):
        got = fn(prompts=[prompt] * n, completions=completions, ground_truth=["12"] * n,
                 data_source=["arith"] * n, extra_info=[""] * n)  # fmt: skip
        want = [
            state.score(cfg.rewards.sources[i], ScoreItem(source=i, prompt=prompt, response=t,
                                                          ground_truth="12"))
            for t in texts
        ]  # fmt: skip
        assert got == want
    fmt = cfg.rewards.sources[1]
    assert [score_format(fmt, t) for t in texts] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_reward_wrapper_routing_and_default_score():
    rewards = RewardsConfig(
        sources=[
            FormatReward(name="fmt", pattern=r"\d+", data_sources=["math"], weight=0.5),
            ExactReward(name="ex", default_score=-1.0),
        ]
    )
    fmt, ex = peers.reward_functions(rewards)[0]
    kwargs = {"prompts": ["p", "p"], "completions": ["12", "12"], "ground_truth": ["12", None]}
    assert fmt(data_source=["math", "other"], **kwargs) == [1.0, None]  # not routed: None
    # a ground truth the rule cannot read scores the source's default_score, as in verl-async
    assert ex(**kwargs) == [1.0, -1.0]


def test_reward_wrapper_refuses_normalized_sources():
    rewards = RewardsConfig(sources=[ExactReward(name="ex", normalize="group")])
    with pytest.raises(SystemExit):
        peers.reward_functions(rewards)
