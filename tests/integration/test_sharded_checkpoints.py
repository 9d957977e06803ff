"""Sharded checkpoints (learners/checkpoints/shards.py) with real torch.distributed jobs: two FSDP2
ranks save with DCP, each its own file; the shards load back, equal to the gathered
state, on one rank (no process group), on two and on three (resharded); ``export``'s
reader gets the model's full tensors without a process group
(tests/integration/shard_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from verl_async.checkpoint import SHARDS, read_sharded_model

from .conftest import ROOT

WORKER = str(ROOT / "tests" / "integration" / "shard_worker.py")


def _job(ranks: int, what: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    res = subprocess.run(
        [*launch, WORKER, what, str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    _job(2, "save", out)
    return out


def test_each_rank_writes_its_own_shard_file_and_a_tied_head_is_written_once(saved):
    shards = saved / "ckpt" / SHARDS
    files = sorted(p.name for p in shards.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    sizes = [(shards / f).stat().st_size for f in files[1:]]
    assert min(sizes) > 0.3 * max(sizes), sizes  # split between the ranks, not one writer
    import torch.distributed.checkpoint as dcp

    names = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in names and "model.lm_head.weight" not in names
    assert "optim.model.embed_tokens.weight.exp_avg_sq" in names


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_shards_load_on_any_number_of_ranks(saved, ranks):
    _job(ranks, "load", saved)
    report = json.loads((saved / f"loaded-{ranks}.json").read_text())
    reference = load_file(saved / "reference.safetensors")
    assert report["names"] == sorted(reference)  # weights, tied head, every optimizer state
    assert report["max_abs_diff"] == 0.0, report
    assert report["lr"] == 1e-2 and report["tied"], report


def test_export_reads_the_full_weights_without_a_process_group(saved):
    weights = read_sharded_model(saved / "ckpt")
    reference = load_file(saved / "reference.safetensors")
    expected = {k[len("model.") :]: v for k, v in reference.items() if k.startswith("model.")}
    assert sorted(weights) == sorted(set(expected) - {"lm_head.weight"})  # tied: written once
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name
