import pytest

from verl_async.config import ConfigError, load_config, to_yaml


def test_tiny_config_loads(repo_root):
    cfg = load_config(repo_root / "configs/tiny.yaml")
    assert cfg.name == "tiny"
    assert cfg.staleness.max == 2
    assert cfg.generators.count is None  # one generator per placement.generators entry
    assert cfg.placement.generators == ["cpu:0"]


def test_overrides_apply_with_yaml_values(repo_root):
    cfg = load_config(
        repo_root / "configs/tiny.yaml",
        ["staleness.max=0", "learner.lr=1e-4", "placement.learners=[cpu]"],
    )
    assert cfg.staleness.max == 0
    assert cfg.learner.lr == pytest.approx(1e-4)
    assert cfg.placement.learners == ["cpu"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.nonsense=1", "unknown config key 'algo.nonsense'"),
        ("nonsense=1", "unknown config key 'nonsense'"),
        ("learner.lr=abc", "'learner.lr'"),
        ("staleness.max=-1", "'staleness.max'"),
        ("algo.correction=magic", "'algo.correction'"),
        ("placement.generators=[gpu7]", "'placement.generators.0'"),
        ("placement.generator_devices=[cpu:0]", "unknown config key 'placement.generator_devices'"),
        ("placement.learner_devices=[cpu:1]", "unknown config key 'placement.learner_devices'"),
        (
            "placement.reward_model_devices=[cpu]",
            "unknown config key 'placement.reward_model_devices'",
        ),
        ("learner.num_processes=1", "unknown config key 'learner.num_processes'"),
        ("learner.logprob_chunk_tokens=-1", "'learner.logprob_chunk_tokens'"),
        ("learner.padding_free=maybe", "'learner.padding_free'"),
        ("generators.count=2", "'generators.count'"),
        ("model.tiny.num_heads=8", "'model.tiny.num_heads'"),
        ("buffer.host=0.0.0.0", "'buffer.host'"),
        ("no_equals_sign", "dotted.key=value"),
        ("rewards.sources=[{name: a, kind: format}]", "'rewards.sources.0'"),
        ("rewards.sources=[{name: a, kind: nope}]", "'rewards.sources.0.kind'"),
        ("rewards.sources=[{name: a, kind: exact, typo: 1}]", "'rewards.sources.0.typo'"),
        ("rewards.sources=[{name: a, kind: format, pattern: '('}]", "'rewards.sources.0.pattern'"),
        (
            "rewards.sources=[{name: a, kind: function, function: x}]",
            "'rewards.sources.0.function'",
        ),
        (
            "rewards.sources=[{name: a, kind: exact}, {name: a, kind: math}]",
            "'rewards.sources.1.name'",
        ),
        ("rewards.sources=[]", "'rewards.sources'"),
        ("eval.every_steps=5", "'eval.every_steps'"),
        ("data.max_prompt_length=60", "'data.max_prompt_length'"),
        ("generators.top_p=0", "'generators.top_p'"),
        ("algo.adv_estimator=ppo", "'algo.adv_estimator'"),
        ("algo.loss_agg_mode=sum", "'algo.loss_agg_mode'"),
        ("algo.clip_ratio_c=0.5", "'algo.clip_ratio_c'"),
        ("algo.kl.loss_type=full", "'algo.kl.loss_type'"),
        ("algo.kl.typo=1", "unknown config key 'algo.kl.typo'"),
        ("critic.cliprange_value=0", "'critic.cliprange_value'"),
    ],
)
def test_bad_input_is_one_error_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e39", "-3.5e38"])
@pytest.mark.parametrize(
    ("template", "key"),
    [
        ("rewards.sources=[{{name: a, kind: exact, weight: {}}}]", "rewards.sources.0.weight"),
        (
            "rewards.sources=[{{name: a, kind: exact}}, {{name: b, kind: math, default_score: {}}}]",
            "rewards.sources.1.default_score",
        ),
        ("multiturn.env_reward_weight={}", "multiturn.env_reward_weight"),
    ],
)
def test_numbers_that_enter_the_rewards_must_be_finite_in_float32(template, key, value):
    """msgspec takes NaN, infinities and 1e39 for a float; rewards are trained in float32."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [template.format(value)])
    assert str(err.value).startswith(f"bad value for '{key}': ")
    assert "is not a finite number in float32" in str(err.value)
    load_config(None, [template.format("3.3e38")])  # the largest float32 is about 3.4e38


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algo.adv_estimator=foo",
            "bad value for 'algo.adv_estimator': must be one of "
            "'grpo', 'gae', 'rloo', 'reinforce_plus_plus', 'gdpo' ('foo' is not one of them)",
        ),
        (
            "algo.kl.loss_type=1",
            "'algo.kl.loss_type': must be one of 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', "
            "'k3', 'kl+', 'k1+', 'abs+', 'mse+', 'k2+', 'low_var_kl+', 'k3+' (expected `str`, got "
            "`int`)",
        ),
        ("weights.mode=drop", "'weights.mode': must be one of 'keep', 'abort'"),
        (
            "rewards.sources=[{name: a, kind: exact, normalize: batch}]",
            "'rewards.sources.0.normalize': must be one of 'none', 'group', 'running'",
        ),
        (
            "rewards.sources=[{name: a, kind: nope}]",
            "'rewards.sources.0.kind': must be one of 'exact', 'format', 'math', 'function', "
            "'model', 'overlong' ('nope' is not one of them)",
        ),
    ],
)
def test_a_value_outside_a_fixed_set_lists_the_choices(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_keys_without_a_fixed_set_list_no_choices():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.lr=abc"])
    assert str(err.value) == "bad value for 'learner.lr': expected `float`, got `str`"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_yaml_roundtrips(tmp_path):
    cfg = load_config(None, ["staleness.max=4"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_reward_sources_are_a_tagged_union(tmp_path):
    cfg = load_config(
        None,
        [
            "rewards.sources=[{name: ok, kind: math, weight: 2},"
            " {name: fmt, kind: format, pattern: 'Answer: \\d+', normalize: group}]"
        ],
    )
    kinds = [type(s).__name__ for s in cfg.rewards.sources]
    assert kinds == ["MathReward", "FormatReward"]
    assert cfg.rewards.sources[0].weight == 2 and cfg.rewards.sources[1].normalize == "group"
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg  # the kind tag survives the resolved config


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algo.adv_estimator=gae", "critic.path=/nonexistent"], "'critic.path'"),
        (["algo.kl.loss_coef=0.1", "algo.kl.ref_path=/nonexistent"], "'algo.kl.ref_path'"),
    ],
)
def test_learner_model_directories_are_checked_before_the_run(overrides, key):
    from verl_async.launch.prepare import resolve_learner_models

    with pytest.raises(ConfigError, match=key):
        resolve_learner_models(load_config(None, overrides))
    # Unused (no gae, no reference): not read, so not checked.
    resolve_learner_models(load_config(None, [overrides[1]]))


def test_a_remote_weight_sync_host_needs_its_port(tmp_path):
    from verl_async.auth import make_keys

    make_keys(tmp_path / "keys", ["default"])
    keys = f"buffer.keys_dir={tmp_path / 'keys'}"  # off loopback: test_auth.py
    with pytest.raises(ConfigError, match="'weights.port': set it when weights.host names"):
        load_config(None, [keys, "weights.host=10.0.0.7"])
    remote = load_config(None, [keys, "weights.host=10.0.0.7", "weights.port=29600"])
    assert remote.weights.port == 29600
    assert load_config(None, ["weights.host=127.0.0.1"]).weights.host == "127.0.0.1"


def test_lora_with_vllm_needs_a_rank_vllm_serves(monkeypatch):
    from verl_async import config

    vllm = ["generators.engine=vllm"]
    assert load_config(None, [*vllm, "model.lora.rank=8"]).model.lora.rank == 8
    with pytest.raises(ConfigError, match=r"'model.lora.rank'.* 8, 16, .*got 12"):
        load_config(None, [*vllm, "model.lora.rank=12"])
    assert load_config(None, ["generators.engine=hf", "model.lora.rank=12"]).model.lora.rank == 12
    # Without vLLM's source to read, the ranks vLLM has always served.
    config.vllm_lora_ranks.cache_clear()
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None)
    try:
        assert config.vllm_lora_ranks() == config.VLLM_LORA_RANKS
    finally:
        config.vllm_lora_ranks.cache_clear()


def test_the_lora_ranks_read_from_vllm_s_source_are_vllm_s_own():
    pytest.importorskip("vllm")
    import typing

    from vllm.config.lora import MaxLoRARanks

    from verl_async.config import vllm_lora_ranks

    assert vllm_lora_ranks() == typing.get_args(MaxLoRARanks)


def test_a_prompt_limit_that_leaves_an_episode_no_turn_names_both_keys(repo_root):
    """tiny_multiturn: episodes of 40 tokens, turns of 4; a prompt of 38 tokens would
    leave its first turn 2."""
    config = repo_root / "configs/tiny_multiturn.yaml"
    with pytest.raises(
        ConfigError, match=r"'data\.max_prompt_length'.*multiturn\.max_episode_tokens \(40\)"
    ):
        load_config(config, ["data.max_prompt_length=38"])
    assert load_config(config, ["data.max_prompt_length=36"]).data.max_prompt_length == 36
    # Single-turn runs keep their own limit.
    assert load_config(config, ["data.max_prompt_length=58", "multiturn.environments=[]"])


@pytest.mark.parametrize(
    ("config", "override", "key", "fix"),
    [
        (
            "tiny_multiturn.yaml",
            "multiturn.max_episode_tokens=4",
            "multiturn.max_episode_tokens",
            "4 minus generators.max_new_tokens (4) leaves no room for a prompt; raise "
            "multiturn.max_episode_tokens to at least 5",
        ),
        (
            "tiny.yaml",
            "generators.max_model_len=6",
            "generators.max_model_len",
            "6 minus generators.max_new_tokens (6) leaves no room for a prompt; raise "
            "generators.max_model_len to at least 7",
        ),
    ],
)
def test_a_limit_that_leaves_no_room_for_a_prompt_is_refused_naming_its_key(
    repo_root, config, override, key, fix
):
    """Every prompt would be skipped, whatever the data: the config check says so, naming
    the key that set the limit (not data.path, not from the buffer)."""
    with pytest.raises(ConfigError) as refused:
        load_config(repo_root / "configs" / config, [override])
    assert str(refused.value).startswith(f"bad value for '{key}': ")
    assert fix in str(refused.value)


def test_the_prompt_limit_names_the_key_that_set_it(repo_root):
    from verl_async.config import prompt_limit

    tiny = load_config(repo_root / "configs/tiny.yaml")
    multiturn = load_config(repo_root / "configs/tiny_multiturn.yaml")
    given = load_config(repo_root / "configs/tiny_multiturn.yaml", ["data.max_prompt_length=5"])
    assert (prompt_limit(tiny).tokens, prompt_limit(tiny).key) == (58, "generators.max_model_len")
    assert (prompt_limit(multiturn).tokens, prompt_limit(multiturn).key) == (
        36,
        "multiturn.max_episode_tokens",
    )
    assert (prompt_limit(given).tokens, prompt_limit(given).key) == (5, "data.max_prompt_length")


def test_the_default_prompt_limit_of_a_multi_turn_run_leaves_room_for_a_turn(repo_root):
    from verl_async.data import max_prompt_tokens

    multiturn = load_config(repo_root / "configs/tiny_multiturn.yaml")
    assert max_prompt_tokens(multiturn) == 40 - 4  # max_episode_tokens - max_new_tokens
    assert max_prompt_tokens(load_config(repo_root / "configs/tiny.yaml")) == 64 - 6
