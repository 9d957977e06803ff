"""Joining a run from another machine: the run's files land in this role's directory."""

import msgspec
import pytest

from verl_async import protocol as P
from verl_async.auth import GENERATOR, load_role_token, write_role_tokens
from verl_async.config import to_yaml
from verl_async.launch.role_commands import JoinFailed, join_run
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.runtime import Endpoints
from verl_async.schema import RunConfig, TinyModelConfig


def info(
    tmp_path, cfg: RunConfig, model_path: str, resume_from: str = "", tokens: bool = True
) -> P.RunInfo:
    """The buffer's answer to ``GetRun``; its run directory holds the run's role tokens
    (without keys a role joins only on the buffer's machine, as its user)."""
    if tokens:
        (tmp_path / "buffer_machine" / "run").mkdir(parents=True, exist_ok=True)
        write_role_tokens(tmp_path / "buffer_machine" / "run")
    endpoints = Endpoints(
        buffer="tcp://10.0.0.1:5555",
        weights_host="10.0.0.1",
        weights_port=5556,
        model_path=model_path,
        resume_from=resume_from,
    )
    return P.RunInfo(
        config_yaml=to_yaml(cfg),
        endpoints_json=msgspec.json.encode(endpoints).decode(),
        run_dir=str(tmp_path / "buffer_machine" / "run"),
    )


def test_the_tiny_model_is_rebuilt_bit_for_bit_where_the_buffers_copy_is_not_seen(tmp_path):
    cfg = RunConfig()
    unseen = tmp_path / "buffer_machine" / "run" / "model"
    run_dir, joined = join_run(info(tmp_path, cfg, str(unseen)), str(tmp_path / "here"))
    assert joined == cfg
    assert (run_dir / "config.yaml").read_text() == to_yaml(cfg)
    endpoints = msgspec.json.decode((run_dir / "endpoints.json").read_bytes(), type=Endpoints)
    assert endpoints.model_path == str(run_dir / "model")
    assert endpoints.buffer == "tcp://10.0.0.1:5555"
    reference = build_tiny_model(tmp_path / "reference", TinyModelConfig())
    assert (run_dir / "model" / "model.safetensors").read_bytes() == (
        reference / "model.safetensors"
    ).read_bytes()


def test_a_role_joining_without_keys_takes_the_run_s_tokens_or_is_refused(tmp_path):
    model = build_tiny_model(tmp_path / "model", TinyModelConfig())
    run_dir, _ = join_run(info(tmp_path, RunConfig(), str(model)), str(tmp_path / "here"))
    buffer_run = tmp_path / "buffer_machine" / "run"
    assert load_role_token(run_dir, GENERATOR) == load_role_token(buffer_run, GENERATOR)
    with pytest.raises(JoinFailed, match="tokens' is missing or not readable.*as the user"):
        join_run(info(tmp_path / "b", RunConfig(), str(model), tokens=False), str(tmp_path / "c"))


def test_a_real_model_must_be_at_the_same_path(tmp_path):
    cfg = msgspec.structs.replace(
        RunConfig(), model=msgspec.structs.replace(RunConfig().model, path="/models/policy")
    )
    with pytest.raises(JoinFailed, match="model.path '/models/policy' is not a model directory"):
        join_run(info(tmp_path, cfg, "/models/policy"), str(tmp_path / "here"))


def test_a_resume_checkpoint_this_machine_cannot_see_is_refused(tmp_path):
    model = build_tiny_model(tmp_path / "model", TinyModelConfig())
    with pytest.raises(JoinFailed, match="resumes from '/elsewhere/step_10'"):
        join_run(info(tmp_path, RunConfig(), str(model), "/elsewhere/step_10"), str(tmp_path / "r"))


def test_joining_twice_rewrites_nothing(tmp_path):
    model = build_tiny_model(tmp_path / "model", TinyModelConfig())
    run_info = info(tmp_path, RunConfig(), str(model))
    run_dir, _ = join_run(run_info, str(tmp_path / "r"))
    stamp = (
        (run_dir / "config.yaml").stat().st_mtime_ns,
        (run_dir / "endpoints.json").stat().st_mtime_ns,
    )
    join_run(run_info, str(tmp_path / "r"))
    assert stamp == (
        (run_dir / "config.yaml").stat().st_mtime_ns,
        (run_dir / "endpoints.json").stat().st_mtime_ns,
    )


def test_a_cached_tiny_model_is_the_same_bytes_as_a_fresh_build(tmp_path, monkeypatch):
    from verl_async.launch.tiny_model import cache_dir

    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "cache"))
    first = build_tiny_model(tmp_path / "a", TinyModelConfig())  # built, then stored
    stored = list((tmp_path / "cache" / "tiny").iterdir())
    assert len(stored) == 1 and (stored[0] / "model.safetensors").is_file()
    copied = build_tiny_model(tmp_path / "b", TinyModelConfig())  # copied from the cache
    monkeypatch.setenv("VERL_ASYNC_CACHE", "off")
    assert cache_dir("anything") is None
    fresh = build_tiny_model(tmp_path / "c", TinyModelConfig())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (copied / name).read_bytes()
        assert (first / name).read_bytes() == (fresh / name).read_bytes()
    other = msgspec.structs.replace(TinyModelConfig(), seed=TinyModelConfig().seed + 1)
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "cache"))
    build_tiny_model(tmp_path / "d", other)
    assert len(list((tmp_path / "cache" / "tiny").iterdir())) == 2  # its own entry
