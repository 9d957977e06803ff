"""What the learner's options cost and save on a SmolLM2-135M-shaped Llama (random
weights, float32, this machine's threads), through the learner's own update
(``learners.update.policy_update``: log-probs at the response positions, backward, one
fused AdamW step):

    python benchmarks/learner_options.py memory  [--layers 30] [--rows 8] [--prompt 128]
                                                 [--response 128]
    python benchmarks/learner_options.py compile [--layers 30] [--rows 8] [--prompt 48]
                                                 [--response 16] [--steps 8] [--tiny]

- ``memory``: two updates per case (plain, ``gradient_checkpointing``, both with
  ``compile``), each case in a fresh interpreter; the peak resident memory
  (``ru_maxrss``) and its rise over what is held between steps (model, AdamW state), the
  second update's time.
- ``compile``: eager and compiled models (``learners.setup.compile_layers``) take the
  same steps in turn, in one process, over batches whose lengths vary by a few tokens
  (as a run's do): each step's time, the compiled graphs so far; then the steady step
  of each (median of the second half), the compile's cost (the compiled model's first
  three steps less three steady ones) and the steps after which it has paid for itself.
  ``--tiny``: the tiny model (configs' default) instead of SmolLM2's shape.

Rows have prompts of their own (no shared prefix), so every case computes the same
positions. Figures are printed as one JSON line per case.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def smollm2_shaped(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def tiny(tmp: Path):
    from transformers import AutoModelForCausalLM

    from verl_async.launch.tiny_model import build_tiny_model
    from verl_async.schema import TinyModelConfig

    path = build_tiny_model(tmp / "tiny", TinyModelConfig())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def batch(seed: int, rows: int, prompt: int, response: int, vocab: int):
    """``rows`` rows of their own prompt (``prompt`` tokens, up to 4 fewer) and
    response (``response`` tokens, up to 4 fewer)."""
    from learners.batching import collate
    from verl_async import protocol as P

    rng = np.random.default_rng(seed)
    prompts = prompt - rng.integers(0, 5, rows)
    responses = response - rng.integers(0, min(5, response), rows)
    frames = P.Frames()
    body = P.Batch(
        step=seed, group_ids=list(range(rows)), sample_group=list(range(rows)),
        prompt_lengths=prompts.tolist(), response_lengths=responses.tolist(),
        prompt_ids=frames.add(rng.integers(3, vocab, prompts.sum(), dtype=np.int32)),
        response_ids=frames.add(rng.integers(3, vocab, responses.sum(), dtype=np.int32)),
        behav_logprobs=frames.add(rng.uniform(-3, -1, responses.sum()).astype(np.float32)),
        token_versions=frames.add(np.zeros(responses.sum(), np.int32)),
        scores=[[0.0]] * rows, failed=[0], data_sources=["default"] * rows,
        dropped_stale=0, buffer_size=0,
    )  # fmt: skip
    return collate(body, [bytes(b) for b in frames.buffers], pad_id=0)


def prepare(model, checkpointing: bool, compiled: bool):
    """The model and its optimizer as learners/setup.py makes them for these options."""
    from learners.setup import adamw, allocate_state, compile_layers

    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable()
    if compiled:
        compile_layers(model)
    optimizer = adamw(model, lr=1e-5, weight_decay=0.0)
    allocate_state(optimizer)
    return model, optimizer


def update(model, optimizer, b) -> None:
    import msgspec

    from learners.update import UpdateHooks, policy_update
    from verl_async.schema import AlgoConfig, LearnerConfig

    algo = msgspec.structs.replace(AlgoConfig(), minibatches=1)
    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)
    advantages = torch.linspace(-1.0, 1.0, len(b.input_ids))
    model.train()
    policy_update(model, optimizer, b, advantages, algo, hooks, learner=LearnerConfig())


def rss_mib(peak: bool) -> float:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def one_pass(args) -> None:
    """``memory``'s subprocess: build, then one update; the figures on stdout."""
    checkpointing, compiled = "checkpointing" in args.case, "compile" in args.case
    model, optimizer = prepare(smollm2_shaped(args.layers), checkpointing, compiled)
    b = batch(0, args.rows, args.prompt, args.response, 49152)
    # A first update on a batch of another shape (a compiled model compiles there): the
    # figures below are a later step's, gradients and optimizer temporaries included.
    update(model, optimizer, batch(1, args.rows, args.prompt - 8, args.response, 49152))
    held = rss_mib(peak=False)
    t0 = time.perf_counter()
    update(model, optimizer, b)
    seconds = time.perf_counter() - t0
    peak = rss_mib(peak=True)
    tokens = int(b.attention_mask.sum())
    out = {"case": args.case, "tokens": tokens, "held_mib": round(held), "peak_mib": round(peak)}
    print(json.dumps(out | {"rise_mib": round(peak - held), "pass_s": round(seconds, 2)}))


def memory(args) -> None:
    for case in ("plain", "checkpointing", "compile", "compile+checkpointing"):
        cmd = [sys.executable, __file__, "_pass", "--case", case] + [
            f"--{k}={getattr(args, k)}" for k in ("layers", "rows", "prompt", "response")
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            sys.exit(f"{case}: failed\n{res.stderr[-3000:]}")
        print(res.stdout.strip().splitlines()[-1], flush=True)


def compile_times(args) -> None:
    import tempfile

    from torch._dynamo.utils import counters

    with tempfile.TemporaryDirectory() as tmp:
        base = tiny(Path(tmp)) if args.tiny else smollm2_shaped(args.layers)
    vocab = base.config.vocab_size
    eager = prepare(copy.deepcopy(base), False, False)
    compiled = prepare(copy.deepcopy(base), False, True)
    times = {"eager": [], "compiled": []}
    for step in range(args.steps):
        b = batch(step, args.rows, args.prompt, args.response, vocab)
        row = {"step": step, "tokens": int(b.attention_mask.sum())}
        for name, (model, optimizer) in (("eager", eager), ("compiled", compiled)):
            t0 = time.perf_counter()
            update(model, optimizer, b)
            times[name].append(time.perf_counter() - t0)
            row[f"{name}_s"] = round(times[name][-1], 3)
        row["graphs"] = int(counters["stats"]["unique_graphs"])
        print(json.dumps(row), flush=True)
    steady = {k: float(np.median(v[len(v) // 2 :])) for k, v in times.items()}  # second half
    first = sum(times["compiled"][:3]) - 3 * steady["compiled"]  # compiling, about
    saved = steady["eager"] - steady["compiled"]
    summary = {"steady_eager_s": steady["eager"], "steady_compiled_s": steady["compiled"]}
    summary |= {"speedup": steady["eager"] / steady["compiled"], "compile_s": first}
    summary["pays_after_steps"] = first / saved if saved > 0 else None
    print(json.dumps({k: round(v, 3) if v is not None else v for k, v in summary.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["memory", "compile", "_pass"])
    ap.add_argument("--case", default="plain")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--response", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    small = args.what == "compile"
    args.prompt = args.prompt or (48 if small else 128)
    args.response = args.response or (16 if small else 128)
    print(f"{torch.get_num_threads()} threads", file=sys.stderr)
    if small and not torch.cuda.is_available():  # timing as a CPU learner runs (keep_freed_memory)
        from learners.setup import keep_freed_memory

        keep_freed_memory()
    {"memory": memory, "compile": compile_times, "_pass": one_pass}[args.what](args)


if __name__ == "__main__":
    main()
