"""Placement: the schema's validation messages, the weight-sync rank layout, the
environment each process gets, per-rank pinning, and the processes the launcher starts."""

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from verl_async import placement, runtime
from verl_async.config import ConfigError, load_config, to_yaml
from verl_async.launch import local, plan
from verl_async.schema import PlacementConfig

SHARED = "(a pinned core or a GPU serves one process; only 'cpu' may be shared)"

GPU_NODE = [
    "placement.generators=[[cuda:0, cuda:1], [cuda:2, cuda:3]]",
    "placement.learners=[cuda:4, cuda:5, cuda:6, cuda:7]",
]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # two generator groups share a GPU
            ["placement.generators=[[cuda:0, cuda:1], [cuda:1, cuda:2]]"],
            f"bad value for 'placement.generators.1.0': 'cuda:1' is already used by "
            f"'placement.generators.0.1' {SHARED}",
        ),
        (  # a learner on the generator's core
            ["placement.generators=[cpu:0]", "placement.learners=[cpu:0]"],
            f"bad value for 'placement.learners.0': 'cpu:0' is already used by "
            f"'placement.generators.0' {SHARED}",
        ),
        (  # two learner ranks on one core
            ["placement.learners=[cpu:1, cpu:1]"],
            f"bad value for 'placement.learners.1': 'cpu:1' is already used by "
            f"'placement.learners.0' {SHARED}",
        ),
        (
            ["placement.generators=[[cuda:0, gpu1]]"],
            "bad value for 'placement.generators.0.1': 'gpu1' is not 'cpu', 'cpu:N' or 'cuda:N'",
        ),
        (
            ["placement.learners=[cuda1]"],
            "bad value for 'placement.learners.0': 'cuda1' is not 'cpu', 'cpu:N' or 'cuda:N'",
        ),
        (
            ["placement.reward_models=[cpu, 'tpu:0']"],
            "bad value for 'placement.reward_models.1': 'tpu:0' is not 'cpu', 'cpu:N' or 'cuda:N'",
        ),
        (
            ["placement.generators=[[cuda:0], []]"],
            "bad value for 'placement.generators.1': an empty device group",
        ),
        (["placement.generators=[]"], "bad value for 'placement.generators': must not be empty"),
        (["placement.learners=[]"], "bad value for 'placement.learners': must not be empty"),
        (
            ["placement.generators=[[cpu:0, cuda:0]]"],
            "bad value for 'placement.generators.0': a group cannot mix CPU and CUDA devices "
            "(cpu:0, cuda:0)",
        ),
        (
            ["placement.generators=[[cpu, cpu:0]]"],
            "bad value for 'placement.generators.0': unpinned 'cpu' cannot be part of a group; "
            "name its cores as 'cpu:N'",
        ),
        (
            ["placement.learners=[cpu:1, cuda:0]"],
            "bad value for 'placement.learners': learner ranks must be all CPU or all CUDA "
            "(got cpu:1, cuda:0)",
        ),
        (
            ["generators.count=2"],
            "bad value for 'generators.count': 2 disagrees with placement.generators "
            "(1 engine(s)); leave it out or make them agree",
        ),
        (  # the transformers engine has no tensor parallelism
            ["generators.engine=hf", "placement.generators=[cuda:0, [cuda:1, cuda:2]]"],
            "bad value for 'placement.generators.1': generators.engine 'hf' runs on one GPU, "
            "not 2; use generators.engine 'vllm' for tensor parallelism",
        ),
        (  # without colocate a GPU serves one process
            ["placement.generators=[cuda:0]", "placement.learners=[cuda:0]"],
            "bad value for 'placement.learners.0': 'cuda:0' is already used by "
            f"'placement.generators.0' {SHARED}",
        ),
        (
            [
                "placement.colocate=true",
                "placement.generators=[cuda:0]",
                "placement.learners=[cuda:0, cuda:1]",
            ],
            "bad value for 'placement.colocate': generators share the GPU of a single CUDA "
            "learner rank (placement.learners is ['cuda:0', 'cuda:1'])",
        ),
        (
            ["placement.colocate=true", "placement.learners=[cpu:1]"],
            "bad value for 'placement.colocate': generators share the GPU of a single CUDA "
            "learner rank (placement.learners is ['cpu:1'])",
        ),
        (
            ["learner.liger=true"],
            "bad value for 'learner.liger': Liger's kernels are Triton's and need CUDA "
            "learners (placement.learners is ['cpu:1'])",
        ),
        (  # colocate shares the learner's GPU, not another one between generators
            [
                "placement.colocate=true",
                "placement.generators=[cuda:1, cuda:1]",
                "placement.learners=[cuda:0]",
            ],
            "bad value for 'placement.generators.1': 'cuda:1' is already used by "
            f"'placement.generators.0' {SHARED}",
        ),
        (
            ["placement.generators=[cpu:0, [cpu:2, cpu:3]]", "generators.count=1"],
            "bad value for 'generators.count': 1 disagrees with placement.generators "
            "(2 engine(s)); leave it out or make them agree",
        ),
    ],
)
def test_each_placement_error_is_one_message_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["placement.generators=[cpu, cpu]", "placement.learners=[cpu, cpu]"],  # unpinned: shared
        ["placement.generators=[cpu:0, cpu:2]", "generators.count=2"],  # count agrees
        ["placement.generators=[[cuda:0, cuda:1]]", "placement.learners=[cpu:0, cpu:1]"],
        ["placement.reward_models=[cpu:1, cpu:1]"],  # reward models may share the learner's core
        [
            "generators.engine=hf",
            "placement.generators=[[cpu:0, cpu:1]]",
            "placement.learners=[cpu]",
        ],
        GPU_NODE,
        # one GPU: the learner and two generators on it, weights by CUDA IPC
        [
            "placement.colocate=true",
            "placement.generators=[cuda:0, cuda:0]",
            "placement.learners=[cuda:0]",
            "generators.engine=hf",
        ],
        ["placement.colocate=true", "placement.generators=[cuda:1]", "placement.learners=[cuda:0]"],
    ],
)
def test_valid_layouts_load(overrides):
    load_config(None, overrides)


def test_old_keys_are_unknown():
    for old in ("generator_devices", "learner_devices", "reward_model_devices"):
        with pytest.raises(ConfigError, match=f"^unknown config key 'placement.{old}'$"):
            load_config(None, [f"placement.{old}=[cpu]"])


def test_gpu_node_layout_ranks():
    cfg = load_config(None, GPU_NODE)
    groups = placement.generator_groups(cfg)
    assert groups == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert placement.generator_count(cfg) == 2
    assert [placement.tensor_parallel_size(g) for g in groups] == [2, 2]
    assert placement.sync_world_size(cfg) == 5
    assert [placement.sync_rank_offset(cfg, i) for i in range(2)] == [1, 3]
    assert placement.learner_devices(cfg) == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]


@pytest.mark.parametrize(
    ("generators", "tp", "world", "offsets"),
    [
        ("[[cuda:0, cuda:1], cuda:2, [cuda:3, cuda:4, cuda:5, cuda:6]]", [2, 1, 4], 8, [1, 3, 4]),
        ("[[cpu:0, cpu:1], cpu:2, cpu]", [1, 1, 1], 4, [1, 2, 3]),  # CPU cores: one worker
    ],
)
def test_every_vllm_worker_gets_one_sync_rank(generators, tp, world, offsets):
    cfg = load_config(None, [f"placement.generators={generators}", "placement.learners=[cpu]"])
    groups = placement.generator_groups(cfg)
    assert [placement.tensor_parallel_size(g) for g in groups] == tp
    assert placement.sync_world_size(cfg) == world
    assert [placement.sync_rank_offset(cfg, i) for i in range(len(groups))] == offsets
    # Worker r of generator i joins as offset_i + r (vllm_extension): ranks 1..world-1, once.
    ranks = [offsets[i] + r for i in range(len(groups)) for r in range(tp[i])]
    assert sorted(ranks) == list(range(1, world))


def test_groups_survive_the_resolved_config(tmp_path):
    cfg = load_config(None, [*GPU_NODE, "placement.generators=[[cuda:0, cuda:1], cuda:2]"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert load_config(path).placement.generators == [["cuda:0", "cuda:1"], "cuda:2"]


def test_resolved_config_states_the_generator_count():
    cfg = load_config(None, ["placement.generators=[cpu:0, [cpu:2, cpu:3]]"])
    assert cfg.generators.count is None
    resolved = placement.resolve_count(cfg)
    assert resolved.generators.count == 2
    assert resolved.placement == cfg.placement


# ------------------------------------------------------------------ this machine's devices


def test_missing_core_is_named_with_the_cores_there_are():
    cfg = load_config(None, ["placement.generators=[cpu:0, cpu:4096]"])  # parses anywhere
    cores = placement.format_ids(os.sched_getaffinity(0))
    with pytest.raises(ConfigError) as err:
        placement.check_devices_exist(cfg)
    assert str(err.value) == (
        "bad value for 'placement.generators.1': 'cpu:4096' is not a core of this machine "
        f"(cores {cores} are available)"
    )


def test_missing_reward_model_core_is_checked_too():
    cfg = load_config(None, ["placement.reward_models=[cpu:4096]"])
    with pytest.raises(
        ConfigError, match=r"^bad value for 'placement.reward_models.0': 'cpu:4096'"
    ):
        placement.check_devices_exist(cfg)


@pytest.mark.parametrize(
    ("visible", "seen"), [(0, "no GPU is visible"), (2, "cuda:0 to cuda:1 are visible")]
)
def test_missing_gpu_is_named_with_the_gpus_there_are(monkeypatch, visible, seen):
    monkeypatch.setattr(placement, "_cuda_device_count", lambda: visible)
    cfg = load_config(None, ["placement.learners=[cuda:2]"])
    with pytest.raises(ConfigError) as err:
        placement.check_devices_exist(cfg)
    assert (
        str(err.value)
        == f"bad value for 'placement.learners.0': 'cuda:2' does not exist here ({seen})"
    )


def test_real_gpu_count_is_asked_for_cuda_devices():
    cfg = load_config(None, ["placement.generators=[cuda:4096]"])
    with pytest.raises(ConfigError, match="'cuda:4096' does not exist here"):
        placement.check_devices_exist(cfg)


def test_cores_that_exist_pass_without_asking_for_gpus(monkeypatch):
    def no_gpu_question():
        raise AssertionError("a CPU-only placement must not import torch to count GPUs")

    monkeypatch.setattr(placement, "_cuda_device_count", no_gpu_question)
    core = max(os.sched_getaffinity(0))
    placement.check_devices_exist(
        load_config(None, [f"placement.generators=[cpu:{core}]", "placement.learners=[cpu]"])
    )


def test_format_ids():
    assert placement.format_ids({5, 0, 2, 1}) == "0-2,5"
    assert placement.format_ids({3}) == "3"


# ------------------------------------------------------------------ environment and pinning


def test_device_env_of_one_device_and_of_a_group():
    assert runtime.device_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert runtime.device_env(["cuda:2", "cuda:3"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert runtime.device_env("cpu") == {"CUDA_VISIBLE_DEVICES": ""}
    one_core = {
        "CUDA_VISIBLE_DEVICES": "",
        "VERL_ASYNC_CPU_CORES": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert runtime.device_env("cpu:1") == one_core
    assert runtime.device_env(["cpu:0", "cpu:3"]) == {
        "CUDA_VISIBLE_DEVICES": "",
        "VERL_ASYNC_CPU_CORES": "0,3",
        "VLLM_CPU_OMP_THREADS_BIND": "0,3",  # vLLM's list syntax: one engine worker, two cores
        "OMP_NUM_THREADS": "2",
    }


def test_ranks_env():
    assert runtime.ranks_env(["cpu:0", "cpu:1"]) == {
        "CUDA_VISIBLE_DEVICES": "",
        "VERL_ASYNC_RANK_DEVICES": "cpu:0,cpu:1",
        "OMP_NUM_THREADS": "1",
    }
    assert runtime.ranks_env(["cuda:4", "cuda:5", "cuda:6", "cuda:7"]) == {
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "VERL_ASYNC_RANK_DEVICES": "cuda:0,cuda:1,cuda:2,cuda:3",  # as the ranks see them
    }


@pytest.fixture
def fake_affinity(monkeypatch):
    """os.sched_* and torch.set_num_threads recorded instead of applied (4 cores)."""
    import torch

    calls = {"affinity": [], "threads": []}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: calls["affinity"].append(cores))
    monkeypatch.setattr(torch, "set_num_threads", calls["threads"].append)
    monkeypatch.setattr(runtime, "_UNPINNED", None)
    for name in ("LOCAL_RANK", "VERL_ASYNC_RANK_DEVICES", "VERL_ASYNC_CPU_CORES"):
        monkeypatch.delenv(name, raising=False)
    return calls


@pytest.mark.parametrize(
    ("env", "pinned", "threads"),
    [
        ({"LOCAL_RANK": "1", "VERL_ASYNC_RANK_DEVICES": "cpu:2,cpu:3"}, [{3}], [1]),
        ({"LOCAL_RANK": "0", "VERL_ASYNC_RANK_DEVICES": "cpu:2,cpu:3"}, [{2}], [1]),
        ({"LOCAL_RANK": "1", "VERL_ASYNC_RANK_DEVICES": "cpu,cpu"}, [], []),  # unpinned
        ({"LOCAL_RANK": "1", "VERL_ASYNC_RANK_DEVICES": "cuda:0,cuda:1"}, [], []),
        (  # a rank's own device wins over an inherited process placement
            {"LOCAL_RANK": "0", "VERL_ASYNC_RANK_DEVICES": "cpu:3", "VERL_ASYNC_CPU_CORES": "0,1"},
            [{3}],
            [1],
        ),
        ({"VERL_ASYNC_CPU_CORES": "0,2"}, [{0, 2}], [2]),  # a generator's core group
        ({"VERL_ASYNC_RANK_DEVICES": "cpu:2,cpu:3"}, [], []),  # no LOCAL_RANK: not a rank
        ({}, [], []),
    ],
)
def test_apply_cpu_pinning(fake_affinity, monkeypatch, env, pinned, threads):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runtime.apply_cpu_pinning()
    assert fake_affinity["affinity"] == pinned
    assert fake_affinity["threads"] == threads
    assert ({0, 1, 2, 3} if pinned else None) == runtime._UNPINNED


def test_rank_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("VERL_ASYNC_RANK_DEVICES", "cpu:0,cpu:5")
    assert runtime.rank_device() is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert runtime.rank_device() == "cpu:5"


def test_a_rank_really_pins_itself_to_its_core():
    core = max(os.sched_getaffinity(0))
    env = {**os.environ, "LOCAL_RANK": "1", "VERL_ASYNC_RANK_DEVICES": f"cpu,cpu:{core}"}
    env.pop("VERL_ASYNC_CPU_CORES", None)
    code = (
        "import os, torch; from verl_async.runtime import apply_cpu_pinning, rank_device;"
        "apply_cpu_pinning(); print(rank_device(), sorted(os.sched_getaffinity(0)),"
        " torch.get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[0] == f"cpu:{core} [{core}] 1"


# ------------------------------------------------------------------ what the launcher starts


def test_learner_command_for_two_ranks(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = load_config(None, ["placement.generators=[cpu]", "placement.learners=[cpu:0, cpu:1]"])
    argv, env = plan.learner_launch(cfg, tmp_path)
    assert argv == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "2", "-m", "learners", "--run-dir", str(tmp_path),
    ]  # fmt: skip
    assert env == {
        "CUDA_VISIBLE_DEVICES": "",
        "VERL_ASYNC_RANK_DEVICES": "cpu:0,cpu:1",
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",  # waiting threads sleep: the cores are shared
    }
    # torch.distributed.run reads it as: 2 ranks of `python -m learners --run-dir DIR`.
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[3:])
    assert (args.standalone, args.nnodes, args.nproc_per_node) == (True, "1", "2")
    assert (args.module, args.training_script) == (True, "learners")
    assert args.training_script_args == ["--run-dir", str(tmp_path)]


def test_learner_command_for_cuda_ranks_and_for_one_rank(tmp_path, monkeypatch):
    argv, env = plan.learner_launch(load_config(None, GPU_NODE), tmp_path)
    assert argv[argv.index("--nproc-per-node") + 1] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice is kept
    argv, env = plan.learner_launch(load_config(None, []), tmp_path)  # learners: [cpu:1]
    assert argv == [sys.executable, "-m", "learners", "--run-dir", str(tmp_path)]
    assert env == {**runtime.device_env("cpu:1"), "OMP_WAIT_POLICY": "ACTIVE"}


def test_start_roles_starts_one_generator_per_group(monkeypatch, tmp_path):
    started = []

    def fake_spawn(name, module, run_dir, env=None, extra=(), max_restarts=0, argv=None):
        started.append((name, module, env, list(extra), argv))
        return name

    monkeypatch.setattr(local, "spawn", fake_spawn)
    cfg = load_config(
        None,
        [
            "placement.generators=[[cuda:0, cuda:1], cuda:2]",
            "placement.learners=[cuda:3, cuda:4]",
            "placement.reward_models=[cpu:0]",
            "rewards.sources=[{name: rm, kind: model, path: /m}]",
        ],
    )
    assert local.start_roles(cfg, Path(tmp_path)) == [
        "buffer", "reward_model_rm", "learner", "generator0", "generator1",
    ]  # fmt: skip
    by_name = {name: (module, env, extra, argv) for name, module, env, extra, argv in started}
    assert by_name["generator0"][1:3] == ({"CUDA_VISIBLE_DEVICES": "0,1"}, ["--index", "0"])
    assert by_name["generator1"][1:3] == ({"CUDA_VISIBLE_DEVICES": "2"}, ["--index", "1"])
    assert by_name["learner"][1]["CUDA_VISIBLE_DEVICES"] == "3,4"
    assert "torch.distributed.run" in by_name["learner"][3]
    assert by_name["reward_model_rm"][1]["VERL_ASYNC_CPU_CORES"] == "0"


def test_every_learner_rank_needs_a_sample():
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "placement.learners=[cpu, cpu, cpu]",
                "learner.groups_per_step=1",
                "generators.group_size=2",
            ],
        )
    assert str(err.value) == (
        "bad value for 'placement.learners': 3 learner ranks but a step has only 2 samples "
        "(learner.groups_per_step x generators.group_size); every rank needs at least one"
    )


@pytest.mark.parametrize(
    ("generators", "learners", "shared"),
    [
        ("[cpu:0]", "[cpu:1]", False),  # the tiny default: a core each
        ("[cpu:0]", "[cpu]", True),  # an unpinned learner may use core 0 too
        ("[cpu]", "[cpu:1]", True),
        ("[[cpu:0, cpu:1]]", "[cpu:1]", True),
        ("[cuda:0]", "[cpu]", False),
    ],
)
def test_a_generator_sharing_cores_with_the_learner_is_found(generators, learners, shared):
    """Such a generator lowers its scheduling priority (placement.generator_nice). The
    placement is built without load_config, which would refuse cuda:0 on a CPU machine."""
    import yaml

    cfg = load_config(None, [])
    where = {"generators": yaml.safe_load(generators), "learners": yaml.safe_load(learners)}
    cfg = msgspec.structs.replace(cfg, placement=msgspec.convert(where, PlacementConfig))
    assert placement.shares_cores_with_learner(cfg, 0) is shared
