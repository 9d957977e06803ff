"""``launcher: ray`` without starting Ray: the config keys and their errors, the bundles
each role asks for, the node each role is held on, and the missing-Ray error."""

import importlib.metadata
import sys
from pathlib import Path

import pytest

from verl_async.config import ConfigError, load_config
from verl_async.launch import cli, ray_roles
from verl_async.launch.plan import plan_roles
from verl_async.launch.ray_roles import bundles, local_resources, node_pins, pinned

CPU, GPU = {"CPU": 1.0}, {"GPU": 1.0, "CPU": 1.0}
GPU_NODE = [
    "placement.generators=[[cuda:0, cuda:1], cuda:2]",
    "placement.learners=[cuda:3, cuda:4]",
    "placement.reward_models=[cpu]",
    "rewards.sources=[{name: rm, kind: model, path: /m}]",
]


def _plans(overrides, run_dir=Path("/runs/r")):
    return {p.name: p for p in plan_roles(load_config(None, overrides), run_dir)}


def test_the_ray_keys_and_their_defaults():
    cfg = load_config(None, [])
    assert cfg.launcher == "local" and cfg.ray.address == "" and cfg.ray.timeout_s == 120
    cfg = load_config(None, ["launcher=ray", "ray.address=auto", "ray.timeout_s=30"])
    assert (cfg.launcher, cfg.ray.address, cfg.ray.timeout_s) == ("ray", "auto", 30)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("launcher=slurm", "bad value for 'launcher': must be one of 'local', 'ray'"),
        ("ray.adress=auto", "unknown config key 'ray.adress'"),
        ("ray.timeout_s=0", "bad value for 'ray.timeout_s'"),
        ("ray.address=ray://head:10001", "bad value for 'ray.address': Ray Client (ray://)"),
    ],
)
def test_a_bad_ray_key_is_one_error_naming_it(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(message), str(err.value)


def test_one_bundle_per_device_and_one_cpu_for_the_buffer():
    plans = _plans(GPU_NODE)
    assert [bundles(p) for p in plans.values()] == [
        [CPU],  # buffer
        [CPU],  # reward model on 'cpu'
        [GPU, GPU],  # two learner ranks, one node
        [GPU, GPU],  # generator0: tensor parallel over two GPUs, one node
        [GPU],
    ]
    assert local_resources(list(plans.values())) == (7, 5)
    tiny = _plans(["placement.generators=[cpu, cpu]", "placement.learners=[cpu]"])
    assert [bundles(p) for p in tiny.values()] == [[CPU]] * 4
    assert local_resources(list(tiny.values())) == (4, 0)


def test_the_actors_run_the_roles_usual_commands():
    plans = _plans(GPU_NODE)
    run_dir = Path("/runs/r")
    assert plans["generator1"].command(run_dir) == [
        sys.executable, "-m", "generators", "--run-dir", "/runs/r", "--index", "1",
    ]  # fmt: skip
    assert plans["generator0"].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert "torch.distributed.run" in plans["learner"].command(run_dir)
    assert plans["reward_model_rm"].command(run_dir)[-2:] == ["--name", "rm"]
    assert plans["reward_model_rm"].max_restarts == 5 and not plans["buffer"].max_restarts
    assert plans["generator0"].max_restarts == 3


def test_a_loopback_buffer_keeps_every_role_on_the_launchers_node():
    cfg = load_config(None, ["placement.generators=[cpu, cpu]"])
    pins = node_pins(cfg, plan_roles(cfg, Path("/r")), "10.0.0.1")
    assert pins == dict.fromkeys(["buffer", "learner", "generator0", "generator1"], "10.0.0.1")


def test_off_loopback_generators_go_anywhere_and_the_learner_to_weights_host(tmp_path):
    from verl_async.auth import make_keys

    make_keys(tmp_path / "keys", ["default"])
    base = ["placement.generators=[cpu, cpu]", f"buffer.keys_dir={tmp_path / 'keys'}"]
    cfg = load_config(None, [*base, "buffer.host=10.0.0.1"])
    pins = node_pins(cfg, plan_roles(cfg, Path("/r")), "10.0.0.1")
    assert pins == {"buffer": "10.0.0.1", "learner": "10.0.0.1", "generator0": "", "generator1": ""}
    cfg = load_config(
        None, [*base, "buffer.host=10.0.0.1", "weights.host=node-b", "weights.port=29600"]
    )
    names = {"node-b": "10.0.0.2"}
    pins = node_pins(cfg, plan_roles(cfg, Path("/r")), "10.0.0.1", resolve=names.__getitem__)
    assert pins["learner"] == "10.0.0.2" and pins["buffer"] == "10.0.0.1"


def test_a_pinned_group_names_its_node_on_the_first_bundle_only():
    assert pinned([GPU, GPU], "10.0.0.2") == [{**GPU, "node:10.0.0.2": 0.001}, GPU]
    assert pinned([CPU], "") == [CPU]


def test_without_ray_train_stops_before_anything_starts(monkeypatch, tmp_path, capsys):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cli, "_interrupt_on_signals", lambda: None)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    run_dir = tmp_path / "run"
    code = cli.main(["train", "configs/tiny.yaml", "launcher=ray", "--run-dir", str(run_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "bad value for 'launcher'" in err and "pip install 'verl-async[ray]'" in err, err
    assert not run_dir.exists()


def test_an_old_ray_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.8.1")
    with pytest.raises(ConfigError, match=r"needs Ray >= 2\.9, which is 2\.8\.1"):
        ray_roles.check_installed()
