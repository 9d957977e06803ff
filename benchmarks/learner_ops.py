"""CPU proxies of the learner step's cost on a GPU: host synchronisations, operators
dispatched, and the step's time, through the learner's own update
(``learners.update.policy_update``) on the tiny model, GRPO-shaped batches (groups of
samples sharing a prompt), fused AdamW:

    python benchmarks/learner_ops.py [--steps 12] [--groups 4] [--samples 4]
                                     [--model models/smollm2-135m]

- ``host_syncs``: the calls inside one update that make the host wait for the device on
  CUDA (``HostSyncs``): a scalar read (``.item()``, ``float(t)``, ``bool(t)``...),
  ``nonzero``, a boolean-mask index, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``torch.cuda.synchronize``, a tensor made from Python numbers (copied to the device). On a GPU each one stalls the launch queue until every
  kernel before it has run.
- ``ops_per_layer``: aten operators dispatched by one update (``torch.profiler`` on the
  CPU), divided by the decoder layers: each is a kernel launch (or several) on a GPU,
  where a small model's step is bound by launches.
- ``step_s`` and ``cpu_s``: median and spread (min, max) of the update's wall time and
  of the CPU time the process spent in it, over ``--steps`` updates after two warm-up
  ones, on ``--threads`` threads (1 by default: on a machine shared with other jobs the
  CPU time of one thread is the steadier figure; a ratio against another commit
  measured in the same run is what to read). The garbage collector runs as the
  checkout's learner loop runs it.

Run it against another commit's code by putting that checkout first on the path:
``PYTHONPATH=/path/to/checkout python benchmarks/learner_ops.py``. It prints one JSON
line per model.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout's learner comes first

aten = torch.ops.aten
# Operators that read a device value on the host, so the host waits for the device.
_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t), `if t:`
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    # A tensor made from Python data (torch.tensor, as_tensor of a number or list): on
    # CUDA it is copied to the device, and a copy from pageable memory waits for the stream.
    aten.lift_fresh.default,
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
              aten._index_put_impl_.default}  # fmt: skip
# Python-level calls that copy to the host (no dispatch on a CPU tensor).
_HOST_METHODS = ("tolist", "numpy", "cpu")


def _bool_index(args) -> bool:
    """Whether an index operator's indices hold a boolean mask (its kernel runs nonzero)."""
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


class HostSyncs(TorchDispatchMode):
    """Counts, while active, the calls that make the host wait for the device on CUDA
    (the module docstring's list), by name: ``calls``. Python methods are patched on
    ``torch.Tensor`` for the duration, operators seen through the dispatcher (the
    autograd engine's backward on the CPU runs on this thread, so it is seen too)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self._stack = contextlib.ExitStack()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_OPS or (func in _INDEX_OPS and _bool_index(args)):
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def _patch(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)
        calls = self.calls

        def counted(*args, **kwargs):
            calls[label] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._stack.callback(setattr, owner, name, original)

    def __enter__(self):
        for name in _HOST_METHODS:
            self._patch(torch.Tensor, name, f"Tensor.{name}")
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def grpo_batch(groups: int, samples: int, prompt: int, vocab: int, seed: int = 0):
    """A collated step of ``groups`` prompts, ``samples`` answers each (lengths 4 to 24):
    the rows of a group share their prompt, as GRPO's do."""
    from learners.batching import collate
    from verl_async import protocol as P

    rng = np.random.default_rng(seed)
    n = groups * samples
    prompts = [prompt + int(rng.integers(0, 8)) for _ in range(groups)]
    lengths = [int(rng.integers(4, 25)) for _ in range(n)]
    prompt_ids = np.concatenate([
        np.tile(rng.integers(3, vocab, p, dtype=np.int32), samples) for p in prompts
    ])  # fmt: skip
    r = sum(lengths)
    frames = P.Frames()
    body = P.Batch(
        step=0,
        group_ids=list(range(groups)),
        sample_group=[i // samples for i in range(n)],
        prompt_lengths=[prompts[i // samples] for i in range(n)],
        response_lengths=lengths,
        prompt_ids=frames.add(prompt_ids),
        response_ids=frames.add(rng.integers(3, vocab, r, dtype=np.int32)),
        behav_logprobs=frames.add(rng.uniform(-3, -1, r).astype(np.float32)),
        token_versions=frames.add(np.zeros(r, np.int32)),
        scores=[[float(rng.integers(0, 2))] for _ in range(n)],
        failed=[0],
        data_sources=["default"] * groups,
        dropped_stale=0,
        buffer_size=0,
    )
    batch = collate(body, [bytes(b) for b in frames.buffers], pad_id=0)
    adv = torch.from_numpy(rng.normal(size=n).astype(np.float32))
    return batch, adv


class Step:
    """One learner update as the learner runs it: ``plan()`` is what is decided on the host
    before the batch goes to the device (where this checkout's learner does that), ``run``
    the update itself."""

    def __init__(self, model, batch, adv, algo, learner) -> None:
        from learners.setup import adamw
        from learners.update import UpdateHooks

        self.model, self.batch, self.adv, self.algo, self.learner = (
            model, batch, adv, algo, learner
        )  # fmt: skip
        self.optimizer = adamw(model, lr=1e-5, weight_decay=0.0)

        def clip() -> torch.Tensor:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        self.hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=clip)

    def plan(self):
        from learners import update
        from learners.plan import plan_update

        b = self.batch
        plan = plan_update(b.loss_mask, b.attention_mask, [len(b.loss_mask)], 0,
                           self.algo.minibatches, self.learner.max_tokens_per_microbatch)  # fmt: skip
        if hasattr(update, "plan_step"):  # the host decides shapes before the device copy
            plan = update.plan_step(self.model, b, plan, self.algo, self.learner)
        return plan

    def run(self, plan):
        from learners.update import policy_update

        return policy_update(
            self.model, self.optimizer, self.batch, self.adv, self.algo, self.hooks,
            plan=plan, version=0, learner=self.learner,
        )  # fmt: skip


def _collector():
    """The garbage collector as the learner's loop runs it (``collector_between_steps``,
    where the checkout has it: frozen, off during steps, young generations collected
    between them); else as it is by default."""
    from learners import trainer

    hold_off = getattr(trainer, "collector_between_steps", None)
    return hold_off() if hold_off is not None else contextlib.nullcontext(lambda: None)


def measure(model, batch, adv, steps: int, algo=None, learner=None) -> dict:
    """Host syncs of one update, operators per decoder layer, and the step's times."""
    from learners.setup import decoder_layers
    from verl_async.schema import AlgoConfig, LearnerConfig

    step = Step(model, batch, adv, algo or AlgoConfig(), learner or LearnerConfig())
    for _ in range(2):  # warm-up: allocator, AdamW state
        step.run(step.plan())
    plan = step.plan()
    with HostSyncs() as syncs:
        step.run(plan)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step.run(step.plan())
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    times, cpu = [], []
    with _collector() as between_steps:
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step.run(step.plan())
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            between_steps()
    layers = len(decoder_layers(model))
    return {
        "host_syncs": syncs.total,
        "host_sync_calls": dict(sorted(syncs.calls.items())),
        "ops_per_layer": round(ops / layers, 1),
        "step_s_median": round(statistics.median(times), 5),
        "step_s_min": round(min(times), 5),
        "step_s_max": round(max(times), 5),
        "cpu_s_median": round(statistics.median(cpu), 5),
        "cpu_s_min": round(min(cpu), 5),
        "cpu_s_max": round(max(cpu), 5),
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="a model directory besides the tiny model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    import learners.update
    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig

    torch.manual_seed(0)
    source = str(Path(learners.update.__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        paths = [("tiny", build_tiny_model(Path(tmp) / "tiny", TinyModelConfig()))]
        if args.model:
            paths.append((Path(args.model).name, args.model))
        for name, path in paths:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model.train()
            vocab = min(model.config.vocab_size, 20_000)
            batch, adv = grpo_batch(args.groups, args.samples, args.prompt, vocab)
            steps = args.steps if name == "tiny" else max(2, args.steps // 4)
            row = measure(copy.deepcopy(model), batch, adv, steps)
            print(json.dumps({"model": name, "learner_code": source, **row}), flush=True)


if __name__ == "__main__":
    main()
