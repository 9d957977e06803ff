"""Two costs of the learner's step measured alone on a SmolLM2-135M-shaped Llama (random
weights, float32, this machine's threads):

    python benchmarks/learner_kernels.py [--rows 8] [--seq-len 24] [--response-len 6]
                                         [--group-size 4]

- one AdamW step over every parameter: the default per-tensor loop, ``foreach`` and
  ``fused`` (what the learner uses, learners/setup.py: adamw);
- a forward and backward of ``--rows`` sequences with logits at every position against
  logits at the ``--response-len`` last positions only (``logits_to_keep``: what
  learners/logprobs.py gives the model);
- the learner's own pass (``learners.logprobs.token_stats``, log-probs and entropies at
  the response positions, then backward) over rows in groups of ``--group-size`` that
  share their prompt: every row computing its whole sequence against the group's prompt
  computed once (``share_prefix``, the default).

Each figure is the mean of 3 repetitions after one warm-up.

``--logprob-chunk-tokens N`` (and ``--padding-free``) measures instead the learner pass
before and after (``learner.logprob_chunk_tokens``, ``learner.padding_free``): the
model's own head over every kept position and padded rows (chunk 0), against the
chunked head (N), and with ``--padding-free`` also the chunked head over rows packed end
to end. Rows of ``--prompt-len`` tokens in groups of ``--group-size`` sharing them,
with answers of 1 to ``--response-len`` tokens, so the padded batch is part padding.
Each arm runs ``--rounds`` times in a fresh process, the arms interleaved (A B C A B
C ...), and reports its peak resident memory's growth over one warm-up and ``--steps``
passes (forward and backward) and the mean seconds of a pass. ``--layers`` shortens
the model (30 in SmolLM2; the head and the width stay).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def model(layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def timed(fn, reps: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=24)
    ap.add_argument("--response-len", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--logprob-chunk-tokens", type=int, default=None)
    ap.add_argument("--padding-free", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=44)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # "CHUNK,FREE": one arm, this process
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(pass_arm(args, *map(int, args.arm.split(",")))))
    elif args.logprob_chunk_tokens is not None:
        compare_passes(args)
    else:
        kernels(args)


def kernels(args) -> None:
    """AdamW, sliced logits and shared prompts (the list above), on one model."""
    m = model(args.layers)
    params = list(m.parameters())
    print(
        f"{sum(p.numel() for p in params) / 1e6:.0f}M parameters, {torch.get_num_threads()} threads"
    )
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    for label, kw in (("loop", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-5, **kw)
        print(f"AdamW step, {label}: {timed(opt.step):.3f} s")
        del opt
    ids = torch.randint(0, 49152, (args.rows, args.seq_len))
    keep = torch.arange(args.seq_len - args.response_len - 1, args.seq_len - 1)

    def step(**kw) -> None:
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, **kw).logits.float().sum().backward()

    full, sliced = timed(step), timed(lambda: step(logits_to_keep=keep))
    print(f"forward + backward, logits at all {args.seq_len} positions: {full:.3f} s")
    print(
        f"forward + backward, logits at {args.response_len} positions: {sliced:.3f} s ({sliced / full:.2f}x)"
    )
    shared_prompts(m, args)


def shared_prompts(m, args) -> None:
    from learners.logprobs import PassOptions, token_stats

    g = torch.Generator().manual_seed(0)
    prompt_len = args.seq_len - args.response_len
    groups = -(-args.rows // args.group_size)
    prompts = torch.randint(0, 49152, (groups, prompt_len), generator=g)
    ids = torch.cat(
        [
            prompts.repeat_interleave(args.group_size, 0)[: args.rows],
            torch.randint(0, 49152, (args.rows, args.response_len), generator=g),
        ],
        dim=1,
    )
    attn = torch.ones_like(ids)
    mask = torch.zeros(args.rows, args.seq_len - 1)
    mask[:, prompt_len - 1 :] = 1
    seen = {}

    def step(share: bool) -> None:
        m.zero_grad(set_to_none=True)
        options = PassOptions(share_prefix=share)
        stats = token_stats(m, ids, attn, mask, entropy=True, options=options)
        (stats.logp * mask).sum().backward()
        seen[share] = stats

    plain, shared = timed(lambda: step(False)), timed(lambda: step(True))
    print(f"learner pass, {args.rows} rows, each its whole sequence: {plain:.3f} s")
    print(
        f"learner pass, the prompt once per group of {args.group_size}: {shared:.3f} s "
        f"({shared / plain:.2f}x; {seen[True].computed} positions computed against "
        f"{seen[False].computed})"
    )


def unlike_rows(args):
    """ids, attention mask [R, T] and loss mask [R, T-1]: groups sharing a prompt, answers
    of 1 to ``--response-len`` tokens, right-padded."""
    g = torch.Generator().manual_seed(0)
    p, r = args.prompt_len, args.response_len
    answers = torch.randint(1, r + 1, (args.rows,), generator=g)
    prompts = torch.randint(0, 49152, (-(-args.rows // args.group_size), p), generator=g)
    ids = torch.randint(0, 49152, (args.rows, p + r), generator=g)
    ids[:, :p] = prompts.repeat_interleave(args.group_size, 0)[: args.rows]
    attn = (torch.arange(p + r) < p + answers[:, None]).long()
    mask = attn[:, 1:].float()
    mask[:, : p - 1] = 0
    return ids, attn, mask


def pass_arm(args, chunk: int, free: int) -> dict:
    """One arm in this process: its passes' mean seconds and peak memory growth."""
    from learners.logprobs import PassOptions, token_stats

    m = model(args.layers)
    ids, attn, mask = unlike_rows(args)
    options = PassOptions(chunk, padding_free=bool(free))
    seen = []

    def step() -> None:
        m.zero_grad(set_to_none=True)
        stats = token_stats(m, ids, attn, mask, entropy=True, options=options)
        (stats.logp * mask).sum().backward()
        seen.append(stats.computed)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - t0) / args.steps
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"pass_s": seconds, "peak_growth_mib": grown / 1024, "computed": seen[-1]}


def compare_passes(args) -> None:
    """The arms, each ``--rounds`` times in fresh processes, interleaved; one line each."""
    arms = [(0, 0), (args.logprob_chunk_tokens, 0)]
    if args.padding_free:
        arms.append((args.logprob_chunk_tokens, 1))
    ids, attn, mask = unlike_rows(args)
    print(
        f"{args.layers} layers, {args.rows} rows x {ids.shape[1]} positions, "
        f"{int(attn.sum())} real tokens, {int(mask.sum())} masked; {args.rounds} rounds"
    )
    argv = [a for a in sys.argv[1:] if a not in ("--padding-free",)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    results: dict[tuple, list[dict]] = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for chunk, free in arms:
            cmd = [sys.executable, __file__, *argv, "--arm", f"{chunk},{free}"]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            results[(chunk, free)].append(json.loads(out.stdout.splitlines()[-1]))
    base = results[arms[0]]
    for (chunk, free), runs in results.items():
        sec = [r["pass_s"] for r in runs]
        mib = [r["peak_growth_mib"] for r in runs]
        ratio = sum(sec) / sum(r["pass_s"] for r in base)
        print(
            f"chunk {chunk:>5}, {'padding-free' if free else 'padded'}: pass "
            f"{min(sec):.2f}-{max(sec):.2f} s ({ratio:.2f}x), peak growth "
            f"{min(mib):.0f}-{max(mib):.0f} MiB, {runs[-1]['computed']} positions computed"
        )


if __name__ == "__main__":
    main()
