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
"""

from __future__ import annotations

import argparse
import time

import torch


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
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
    args = ap.parse_args()
    m = model()
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


if __name__ == "__main__":
    main()
