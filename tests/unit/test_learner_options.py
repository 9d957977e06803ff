"""The learner's options train as the plain path does (learners/setup.py): activation
checkpointing bit for bit, compiled decoder layers within float32 reassociation, FSDP2
with CPU offload on a one-rank group bit for bit. Each run makes the same policy_update
steps on the tiny model over batches of three shapes (so a compiled run meets a new
shape, and its dynamic recompile, after the first step), then the weights are compared."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from learners.batching import collate
from learners.update import UpdateHooks, policy_update
from verl_async import protocol as P
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, LearnerConfig, TinyModelConfig

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(6, 13), (6, 13), (8, 17), (5, 11)]  # (rows, longest prompt): one batch a step
ALGO = msgspec.structs.replace(AlgoConfig(), minibatches=1)
# share_prefix off: checkpointing turns packing off (learners/logprobs.py), so the plain
# run must not pack either for a bit-for-bit comparison.
SETTINGS = LearnerConfig(share_prefix=False)


def _batch(step: int, rows: int, longest: int):
    rng = np.random.default_rng(step)
    prompts = rng.integers(longest - 6, longest + 1, rows)
    prompts[0] = longest
    responses = rng.integers(2, 8, rows)
    frames = P.Frames()
    body = P.Batch(
        step=step, group_ids=[0], sample_group=[0] * rows,
        prompt_lengths=prompts.tolist(), response_lengths=responses.tolist(),
        prompt_ids=frames.add(rng.integers(3, 14, prompts.sum(), dtype=np.int32)),
        response_ids=frames.add(rng.integers(3, 14, responses.sum(), dtype=np.int32)),
        behav_logprobs=frames.add(rng.uniform(-3, -1, responses.sum()).astype(np.float32)),
        token_versions=frames.add(np.zeros(responses.sum(), np.int32)),
        scores=[[0.0]] * rows, failed=[0], data_sources=["default"], dropped_stale=0,
        buffer_size=0,
    )  # fmt: skip
    return collate(body, [bytes(b) for b in frames.buffers], pad_id=0)


def _tiny(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "tiny", TinyModelConfig())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _train(model, make_optimizer) -> dict[str, torch.Tensor]:
    """The weights after one SGD or AdamW step per batch of ``SHAPES``."""
    optimizer = make_optimizer(model)
    model.train()
    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)
    for step, (rows, longest) in enumerate(SHAPES):
        batch = _batch(step, rows, longest)
        advantages = torch.linspace(-1.0, 1.0, rows)
        stats = policy_update(
            model, optimizer, batch, advantages, ALGO, hooks, version=step, learner=SETTINGS
        )
        assert stats.optimizer_steps == 1
    return _full(model)


def _full(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


def _moved(after: dict, before) -> float:
    return max((after[n] - p.detach()).abs().max().item() for n, p in before.named_parameters())


def test_activation_checkpointing_trains_bit_for_bit(tmp_path):
    base = _tiny(tmp_path)
    plain = _train(copy.deepcopy(base), _sgd)
    model = copy.deepcopy(base)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    checkpointed = _train(model, _sgd)
    assert _moved(plain, base) > 1e-3  # the steps really trained
    for name, value in plain.items():
        assert torch.equal(value, checkpointed[name]), name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_train_as_eager(tmp_path, checkpointing):
    """Inductor fuses and reorders float32 sums, so a compiled step's gradient differs
    from eager's by rounding (about 1e-7 relative). With SGD the weights' differences stay
    that size next to how far the four steps moved them: the bound is 1e-5 of the largest
    move (1e-6 absolute for elements that barely moved), as in the two-rank FSDP2 test. The
    graph count checks that the four steps of three shapes compiled a bounded number of
    graphs (static first, then dynamic batch and sequence sizes), not one per shape."""
    from torch._dynamo.utils import counters

    from learners.setup import compile_layers

    base = _tiny(tmp_path)
    plain = _train(copy.deepcopy(base), _sgd)
    model = copy.deepcopy(base)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    compile_layers(model)
    graphs = counters["stats"]["unique_graphs"]
    compiled = _train(model, _sgd)
    graphs = counters["stats"]["unique_graphs"] - graphs
    assert 1 <= graphs <= 4, graphs
    assert [n for n, _ in model.named_parameters()] == list(plain)  # names unchanged
    moved = _moved(plain, base)
    assert moved > 1e-3
    for name, value in plain.items():
        torch.testing.assert_close(compiled[name], value, rtol=0, atol=1e-6 + 1e-5 * moved)


def test_fsdp2_offload_on_one_rank_trains_bit_for_bit(tmp_path):
    """A fresh interpreter: it joins a process group of one (learners/setup.py:
    own_process_group), which must not outlive the run."""
    out = tmp_path / "offload.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.unit.test_learner_options", str(tmp_path), str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["offloaded"] == ["cpu"]  # every shard in host memory
    assert report["moved"] > 1e-3
    assert report["max_abs_diff"] == 0.0, report
    assert report["published_max_abs_diff"] == 0.0, report


def _offload_run(tmp_path: Path, out: Path) -> None:
    """Plain AdamW steps beside the same steps of the model sharded with FSDP2 and CPU
    offload over one rank; the published (gathered) weights too."""
    from learners.publish import gathered_buckets
    from learners.setup import adamw, fsdp2, leave_job, own_process_group
    from verl_async.weight_sync import param_specs, plan_buckets

    own_process_group()
    base = _tiny(tmp_path)
    make = lambda m: adamw(m, lr=1e-3, weight_decay=0.01)  # noqa: E731
    plain = _train(copy.deepcopy(base), make)
    sharded = fsdp2(copy.deepcopy(base), torch.float32, offload=True)
    offloaded = _train(sharded, make)
    state = sharded.state_dict()
    specs = param_specs(state.items())
    published = {}
    for _, tensors in gathered_buckets(state, plan_buckets(specs, 1 << 20)):
        published.update(tensors)
    report = {
        "offloaded": sorted({p.to_local().device.type for p in sharded.parameters()}),
        "moved": _moved(plain, base),
        "max_abs_diff": max((plain[n] - offloaded[n]).abs().max().item() for n in plain),
        "published_max_abs_diff": max(
            (plain[n] - published[n]).abs().max().item() for n in plain if n in published
        ),
    }
    out.write_text(json.dumps(report))
    leave_job()  # skips the group's teardown (learners/setup.py: leave_job)


if __name__ == "__main__":
    _offload_run(Path(sys.argv[1]), Path(sys.argv[2]))
