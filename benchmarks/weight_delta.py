"""Bytes and seconds of a weight update after real optimizer steps: whole float32 (what
every update sent before), whole in the generator's bf16, and bf16 deltas.

    python benchmarks/weight_delta.py [--model models/smollm2-135m] [--steps 5] [--lr 1e-6]
                                      [--bucket-mb 64] [--no-shared-memory]
                                      [--out runs/weight_delta]

The learner is the model in float32 with AdamW, stepping on one fixed sequence of
``--tokens`` tokens (a language-model loss: the weights move as a small RL step moves
them). After each step, rank 0 (this process) publishes the weights three ways, each over
a weight-sync group of its own (gloo, same host: the memory file, or the network with
``--no-shared-memory``) to one member process, which receives all three:

  float32  whole, in the learner's dtype (the generator cast on receipt)
  bf16     whole, cast here (``learners.publish.wire_specs``)
  delta    bf16, only the words that changed (``weights.delta``)

The member checks after every step that the delta arm left it holding the same bytes as
the whole bf16 arm (a mismatch fails the benchmark). Reports, per step, the share of bf16
words that changed, the bytes of each arm and rank 0's seconds (pack, encode, send until
the member has it), and the ratios of bytes and seconds against float32.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine  # noqa: E402

ARMS = ["float32", "bf16", "delta"]
TIMEOUT_S = 300.0


def member(ports: list[int], wire: dict, steps: int, bucket_bytes: int, offers, verdicts) -> None:
    """Rank 1 of each arm's group: receive every step from each arm in turn; report whether
    the delta arm's bytes equal the whole bf16 arm's."""
    from verl_async.protocol import MemoryOffer, ParamSpec
    from verl_async.weight_sync import join_group, receive_weights

    groups = [join_group("127.0.0.1", p, 1, 2, "gloo", TIMEOUT_S) for p in ports]
    specs = {arm: [ParamSpec(n, d, tuple(s)) for n, d, s in wire[arm]] for arm in ARMS}
    for _ in range(steps + 1):
        held = {}
        for arm, group in zip(ARMS, groups, strict=True):
            offer = offers.get(timeout=TIMEOUT_S)
            offer = msgspec.convert(offer, MemoryOffer) if offer is not None else None
            got = receive_weights(group, specs[arm], bucket_bytes, torch.device("cpu"), offer)
            held[arm] = [t.clone() for bucket in got for _, t in bucket]
        same = all(torch.equal(a, b) for a, b in zip(held["bf16"], held["delta"], strict=True))
        verdicts.put(same)
    for group in groups:
        group.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models/smollm2-135m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--shared-memory", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, default=ROOT / "runs/weight_delta")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from verl_async.protocol import ParamSpec
    from verl_async.runtime import free_port
    from verl_async.weight_sync import (
        DeltaPolicy,
        join_group,
        pack_bucket,
        param_specs,
        plan_buckets,
        send_update,
        without_tied,
    )

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    state = without_tied(model, model.state_dict())
    own = param_specs(state.items())
    bf16 = [ParamSpec(s.name, "bfloat16", s.shape) for s in own]  # all floating here
    specs = {"float32": own, "bf16": bf16, "delta": bf16}
    bucket_bytes = args.bucket_mb << 20
    plans = {arm: plan_buckets(specs[arm], bucket_bytes) for arm in ARMS}

    ctx = mp.get_context("spawn")
    ports = [free_port("127.0.0.1") for _ in ARMS]
    offers, verdicts = ctx.Queue(), ctx.Queue()
    wire = {arm: [[s.name, s.dtype, list(s.shape)] for s in specs[arm]] for arm in ARMS}
    child = ctx.Process(
        target=member, args=(ports, wire, args.steps, bucket_bytes, offers, verdicts), daemon=True
    )
    child.start()
    groups = {}
    for arm, port in zip(ARMS, ports, strict=True):
        groups[arm] = join_group(
            "127.0.0.1", port, 0, 2, "gloo", TIMEOUT_S, shared_memory=args.shared_memory
        )
    # Every step sends a delta: no periodic whole update, no digest, in this measurement.
    groups["delta"].delta = DeltaPolicy(full_every=0, digest_every=0)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=g)
    rows = []
    last_bf16 = None
    for step in range(args.steps + 1):  # step 0: the initial weights (every arm whole)
        if step:
            loss = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        row = {"step": step}
        for arm in ARMS:
            offers.put(msgspec.to_builtins(groups[arm].offer) if groups[arm].offer else None)
            t0 = time.perf_counter()
            packed = [pack_bucket(b, state) for b in plans[arm]]
            sent = send_update(groups[arm], packed, plans[arm])
            row[f"{arm}_s"] = time.perf_counter() - t0
            row[f"{arm}_bytes"] = sent.nbytes
            row[f"{arm}_route"] = sent.route
            if arm == "delta":  # buckets as: unchanged, indices, bitmap, whole
                row["delta_forms"] = list(sent.forms)
            if arm == "bf16":
                now = torch.cat([p.view(torch.int16) for p in packed])
                if last_bf16 is not None:
                    row["changed"] = (now != last_bf16).float().mean().item()
                last_bf16 = now
        if not verdicts.get(timeout=TIMEOUT_S):
            print(f"step {step}: the delta arm's bytes differ from the whole bf16 arm's")
            return 1
        rows.append(row)
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))
    child.join(TIMEOUT_S)
    for group in groups.values():
        group.close()

    later = rows[1:]
    med = {arm: statistics.median(r[f"{arm}_s"] for r in later) for arm in ARMS}
    mib = {arm: statistics.median(r[f"{arm}_bytes"] for r in later) / 2**20 for arm in ARMS}
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "weight_delta.json").write_text(json.dumps({"args": settings, "rows": rows}))
    params = sum(t.numel() for t in state.values())
    print(f"machine: {machine()}")
    print(
        f"model: {args.model.name} ({params / 1e6:.1f}M parameters sent), AdamW lr {args.lr}, "
        f"{args.tokens} tokens a step, {args.bucket_mb} MiB buckets, route "
        f"{rows[0]['float32_route']}"
    )
    print(
        "| step | bf16 words changed | float32 MiB | bf16 MiB | delta MiB | delta buckets "
        "(same/indices/bitmap/whole) | float32 s | bf16 s | delta s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in later:
        print(
            f"| {r['step']} | {r['changed']:.2%} | {r['float32_bytes'] / 2**20:.1f} | "
            f"{r['bf16_bytes'] / 2**20:.1f} | {r['delta_bytes'] / 2**20:.1f} | "
            f"{'/'.join(map(str, r['delta_forms']))} | "
            f"{r['float32_s']:.3f} | {r['bf16_s']:.3f} | {r['delta_s']:.3f} |"
        )
    print(
        f"summary: median of steps 1-{args.steps}, bytes bf16 {mib['bf16'] / mib['float32']:.2f}x, "
        f"delta {mib['delta'] / mib['float32']:.3f}x of float32; seconds bf16 "
        f"{med['bf16'] / med['float32']:.2f}x, delta {med['delta'] / med['float32']:.2f}x of float32"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
