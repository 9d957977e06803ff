"""Joining a run from another machine: the run's files land in this role's directory; the
buffer joined is trusted only when it is this machine's or proves it is the run's own."""

import argparse
import time

import msgspec
import pytest

from verl_async import protocol as P
from verl_async.auth import GENERATOR, load_role_token, make_keys, write_role_tokens
from verl_async.config import to_yaml
from verl_async.launch.role_commands import JoinFailed, fetch_run, join_run
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.runtime import Endpoints
from verl_async.schema import RunConfig, TinyModelConfig


def info(
    tmp_path,
    cfg: RunConfig,
    model_path: str,
    resume_from: str = "",
    host: str = "127.0.0.1",
    tokens: bool = True,
) -> P.RunInfo:
    """The buffer's answer to ``GetRun``; its run directory holds the run's role tokens
    (without keys a role joins only on the buffer's machine, as its user)."""
    if tokens:
        (tmp_path / "buffer_machine" / "run").mkdir(parents=True, exist_ok=True)
        write_role_tokens(tmp_path / "buffer_machine" / "run")
    endpoints = Endpoints(
        buffer=f"tcp://{host}:5555",
        weights_host=host,
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
    assert endpoints.buffer == "tcp://127.0.0.1:5555"
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
    with pytest.raises(JoinFailed, match="resumes from '/elsewhere/checkpoints/step_00000010'"):
        sent = "/elsewhere/checkpoints/step_00000010"
        join_run(info(tmp_path, RunConfig(), str(model), sent), str(tmp_path / "r"))


def test_the_checkpoint_to_resume_is_taken_by_name_from_this_runs_checkpoints(tmp_path):
    """The buffer's path is never opened as it is: a directory of the buffer's choosing
    (which exists on this machine) is refused, and a checkpoint's name is looked up in
    this role's own checkpoints/."""
    model = build_tiny_model(tmp_path / "model", TinyModelConfig())
    planted = tmp_path / "planted"  # a directory somebody else made, with a pickle in it
    (planted / "learner" / "shards").mkdir(parents=True)
    with pytest.raises(JoinFailed, match=f"names '{planted}' as the checkpoint"):
        join_run(info(tmp_path, RunConfig(), str(model), str(planted)), str(tmp_path / "r"))
    here = tmp_path / "r" / "checkpoints" / "step_00000004"
    here.mkdir(parents=True)
    elsewhere = "/buffer/machine/run/checkpoints/step_00000004"
    run_dir, _ = join_run(info(tmp_path, RunConfig(), str(model), elsewhere), str(tmp_path / "r"))
    endpoints = msgspec.json.decode((run_dir / "endpoints.json").read_bytes(), type=Endpoints)
    assert endpoints.resume_from == str(here)


def test_a_buffer_off_loopback_is_joined_only_with_keys_and_refused_at_once():
    """No connection is tried: the refusal names the fix instead of a timeout later."""
    args = argparse.Namespace(buffer="tcp://10.0.0.1:5555", keys_dir=None, client_key="")
    args.timeout_s = 5.0
    t0 = time.monotonic()
    with pytest.raises(JoinFailed, match="is not on this machine.*pass --keys-dir DIR"):
        fetch_run(args)
    assert time.monotonic() - t0 < 1.0


def test_endpoints_named_off_this_machine_need_keys(tmp_path):
    """A loopback buffer without keys cannot send its roles to talk, unauthenticated, to
    another machine; with the run's keys the same run joins."""
    model = build_tiny_model(tmp_path / "model", TinyModelConfig())
    away = info(tmp_path, RunConfig(), str(model), host="10.0.0.1")
    with pytest.raises(JoinFailed, match=r"endpoints off this machine \(10.0.0.1\)"):
        join_run(away, str(tmp_path / "r"))
    make_keys(tmp_path / "keys", ["default"])
    run_dir, cfg = join_run(away, str(tmp_path / "r"), str(tmp_path / "keys"))
    assert cfg.buffer.keys_dir == str(tmp_path / "keys")


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
