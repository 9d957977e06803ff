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


def _train(model, make_optimizer, optimizer=None, steps=None, device=None):
    """The weights after one SGD or AdamW step per batch of ``SHAPES`` (of those
    ``steps`` picks), the batches on ``device``."""
    optimizer = optimizer or make_optimizer(model)
    model.train()
    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)
    for step in steps or range(len(SHAPES)):
        rows, longest = SHAPES[step]
        batch = _batch(step, rows, longest)
        advantages = torch.linspace(-1.0, 1.0, rows)
        if device is not None:
            batch, advantages = batch.to(device), advantages.to(device)
        stats = policy_update(
            model, optimizer, batch, advantages, ALGO, hooks, version=step, learner=SETTINGS
        )
        assert stats.optimizer_steps == 1
    return _full(model)


def _full(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
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


@pytest.mark.slow  # compiles: about 100 s on 2 busy cores with a cold inductor cache
def test_compiled_layers_train_as_eager_with_and_without_checkpointing(tmp_path):
    """Inductor fuses and reorders float32 sums, so a compiled step's gradient differs
    from eager's by rounding (about 1e-7 relative). With SGD the weights' differences stay
    that size next to how far the four steps moved them: the bound is 1e-5 of the largest
    move (1e-6 absolute for elements that barely moved), as in the two-rank FSDP2 test.
    The checkpointed model runs the graphs the first one compiled (the checkpoint wraps
    the compiled layer and recomputes through it), so the count covers both: four steps
    of three shapes compile a bounded number of graphs (static, then the sequence and
    the batch size made dynamic as each first varies), not one per shape or layer."""
    from torch._dynamo.utils import counters

    from learners.setup import compile_layers

    torch._dynamo.reset()  # this test's graphs only, whatever compiled before it
    graphs = counters["stats"]["unique_graphs"]
    base = _tiny(tmp_path)
    plain = _train(copy.deepcopy(base), _sgd)
    moved = _moved(plain, base)
    assert moved > 1e-3
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        if checkpointing:
            model.gradient_checkpointing_enable()
        compile_layers(model)
        assert not model.config.use_cache
        compiled = _train(model, _sgd)
        assert [n for n, _ in model.named_parameters()] == list(plain)  # names unchanged
        for name, value in plain.items():
            torch.testing.assert_close(compiled[name], value, rtol=0, atol=1e-6 + 1e-5 * moved)
    graphs = counters["stats"]["unique_graphs"] - graphs
    assert 1 <= graphs <= 4, graphs


@pytest.mark.slow  # compiles: about 100 s on 2 busy cores with a cold inductor cache
def test_compiled_layers_under_fsdp2_train_as_eager(tmp_path):
    """Bound as in the test above."""
    report = offload_report(tmp_path, "cpu", "compile")
    assert report["moved"] > 1e-3
    assert report["max_abs_diff"] <= 1e-6 + 1e-5 * report["moved"], report
    assert 1 <= report["graphs"] <= 4, report


def offload_report(tmp_path: Path, device: str, run: str = "offload") -> dict:
    """``_offload_run`` (or ``_compiled_fsdp2_run``) in a fresh interpreter: it joins a
    process group of one (learners/setup.py: own_process_group), which must not outlive
    the run."""
    out = tmp_path / "offload.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.unit.test_learner_options", str(tmp_path), str(out)]
    res = subprocess.run(
        [*cmd, device, run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


def test_fsdp2_offload_on_one_rank_trains_bit_for_bit(tmp_path):
    report = offload_report(tmp_path, "cpu")
    assert report["offloaded"] == ["cpu"]  # every shard in host memory
    assert report["sent_from"] == ["cpu"]
    assert report["moved"] > 1e-3
    assert report["max_abs_diff"] == 0.0, report
    assert report["published_max_abs_diff"] == 0.0, report
    assert report["resumed_max_abs_diff"] == 0.0, report  # the full checkpoint's round trip


def _offload_run(tmp_path: Path, out: Path, device: str) -> None:
    """Plain AdamW steps beside the same steps of the model sharded with FSDP2 and CPU
    offload over one rank; the published (gathered) weights too, and the last step taken
    again by a fresh sharded model loaded from the full checkpoint's tensors of the step
    before (learners/checkpoints/full.py)."""
    from learners.checkpoints import full
    from learners.publish import gathered_buckets
    from learners.setup import adamw, allocate_state, fsdp2, leave_job, own_process_group
    from verl_async.weight_sync import param_specs, plan_buckets

    own_process_group()
    base = _tiny(tmp_path)
    make = lambda m: adamw(m, lr=1e-3, weight_decay=0.01)  # noqa: E731
    plain = _train(copy.deepcopy(base).to(device), make, device=device)
    sharded = fsdp2(copy.deepcopy(base), torch.float32, offload=True)
    optimizer = make(sharded)
    _train(sharded, make, optimizer, range(len(SHAPES) - 1), device)
    tensors, rest = full.split_optimizer(optimizer.state_dict())
    saved = written(full.model_state(sharded), tmp_path), written(tensors, tmp_path), rest
    offloaded = _train(sharded, make, optimizer, [len(SHAPES) - 1], device)
    resumed = fsdp2(copy.deepcopy(base), torch.float32, offload=True)
    resumed_optimizer = make(resumed)
    allocate_state(resumed_optimizer)  # as the learner does before it restores
    full.load_model_state(resumed, saved[0], world=1)
    full.load_optimizer_state(resumed, resumed_optimizer, full.join_optimizer(*saved[1:]), 1)
    resumed_weights = _train(resumed, make, resumed_optimizer, [len(SHAPES) - 1], device)
    state = sharded.state_dict()
    specs = param_specs(state.items())
    published = {}
    for _, tensors in gathered_buckets(state, plan_buckets(specs, 1 << 20), device):
        published.update(tensors)
    sent_from = sorted({t.device.type for t in published.values()})
    report = {
        "offloaded": sorted({p.to_local().device.type for p in sharded.parameters()}),
        "sent_from": sent_from,
        "moved": _moved(plain, base),
        "max_abs_diff": max((plain[n] - offloaded[n]).abs().max().item() for n in plain),
        "resumed_max_abs_diff": max(
            (resumed_weights[n] - offloaded[n]).abs().max().item() for n in plain
        ),
        "published_max_abs_diff": max(
            (plain[n] - published[n].cpu()).abs().max().item() for n in plain if n in published
        ),
    }
    out.write_text(json.dumps(report))
    leave_job()  # skips the group's teardown (learners/setup.py: leave_job)


def written(tensors: dict[str, torch.Tensor], tmp_path: Path) -> dict[str, torch.Tensor]:
    """``tensors`` through a safetensors file, as a checkpoint keeps them."""
    from safetensors.torch import load_file, save_file

    save_file(tensors, tmp_path / "tensors.safetensors")
    return load_file(tmp_path / "tensors.safetensors")


def _compiled_fsdp2_run(tmp_path: Path, out: Path, device: str) -> None:
    """SGD steps of the plain model beside those of compiled layers under FSDP2 (one
    rank): the compiled layers, their FSDP2 hooks and the eager head together."""
    from torch._dynamo.utils import counters

    from learners.setup import compile_layers, fsdp2, leave_job, own_process_group

    own_process_group()
    base = _tiny(tmp_path)
    plain = _train(copy.deepcopy(base).to(device), _sgd, device=device)
    model = copy.deepcopy(base)
    compile_layers(model)
    sharded = fsdp2(model.to(device), torch.float32)
    weights = _train(sharded, _sgd, device=device)
    report = {
        "moved": _moved(plain, base),
        "max_abs_diff": max((plain[n] - weights[n]).abs().max().item() for n in plain),
        "graphs": int(counters["stats"]["unique_graphs"]),
    }
    out.write_text(json.dumps(report))
    leave_job()


if __name__ == "__main__":
    run = {"offload": _offload_run, "compile": _compiled_fsdp2_run}[sys.argv[4]]
    run(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
