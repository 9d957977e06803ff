"""The ``ipc`` part of benchmarks/gpu_check.py: one weight update of a Qwen2.5-0.5B-shaped
model, from this process (learner rank 0) to a member process on the same device, through
the weight-sync group's same-device channel: CUDA IPC on a GPU, the memory file on a CPU.

    python benchmarks/gpu_check.py --ipc [--dry-run] --out DIR

The member receives exactly as a generator does (``receive_weights`` with the offer it
was handed, here through a queue where a run uses the buffer) and sends back a checksum
of every bucket; the sender compares them with its own. Writes ``DIR/ipc.json``: route,
bytes, seconds of each update (the first one sets up the channel and is left out of the
median), and whether every byte arrived.

A member that dies (a crash inside CUDA leaves no Python traceback, and the sender then
sees only its collective fail, "Connection closed by peer") is reported as what it was:
its exit code or signal and the traceback faulthandler wrote to ``DIR/member_fault.txt``,
in ``ipc.json`` (``member_died``) and the summary line.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import queue
import signal
import statistics
import time
from pathlib import Path

import msgspec
import torch

QWEN_SHAPES = {  # Qwen2.5-0.5B: 24 layers, hidden 896, MLP 4864, 2 KV heads of 64, vocab 151,936
    "embed": (151936, 896), "q": (896, 896), "kv": (128, 896), "o": (896, 896),
    "up": (4864, 896), "down": (896, 4864), "norm": (896,),
}  # fmt: skip
REPEATS = 5


def shapes(dry: bool) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the model whose update is sent."""
    layers = 2 if dry else 24
    s = (
        {k: tuple(max(1, d // 64) for d in v) for k, v in QWEN_SHAPES.items()}
        if dry
        else QWEN_SHAPES
    )
    out = {"model.embed_tokens.weight": s["embed"], "lm_head.weight": s["embed"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": s["q"], p + "self_attn.k_proj.weight": s["kv"],
            p + "self_attn.v_proj.weight": s["kv"], p + "self_attn.o_proj.weight": s["o"],
            p + "mlp.gate_proj.weight": s["up"], p + "mlp.up_proj.weight": s["up"],
            p + "mlp.down_proj.weight": s["down"], p + "input_layernorm.weight": s["norm"],
        })  # fmt: skip
    return out


def _checksums(buf: torch.Tensor) -> int:
    """A position-weighted sum of a uint8 tensor's bytes (a moved or changed byte shows)."""
    weights = torch.arange(buf.numel(), device=buf.device) % 251 + 1
    return int((buf.to(torch.int64) * weights).sum())


def in_child(fault_path: str, target, *args) -> None:
    """A child process's body: ``target(*args)`` with faulthandler writing the Python stack
    of every thread to ``fault_path`` if the process dies of a fatal signal (SIGSEGV,
    SIGABRT, SIGBUS, SIGFPE, SIGILL), which no ``except`` sees."""
    with open(fault_path, "w") as faults:
        faulthandler.enable(file=faults, all_threads=True)
        target(*args)


def death_of(child, fault_path: Path, wait_s: float = 10.0) -> str | None:
    """How ``child`` died, or None while it lives or after a clean exit: its exit code or
    signal, then the traceback faulthandler left (waits up to ``wait_s`` for the exit: a
    peer's collective can fail a moment before the process is gone)."""
    child.join(wait_s)
    code = child.exitcode
    if code is None or code == 0:
        return None
    how = f"exit code {code}"
    if code < 0:
        how = f"signal {signal.Signals(-code).name}"
    trace = fault_path.read_text(errors="replace").strip() if fault_path.is_file() else ""
    return f"{how}; " + (f"faulthandler: {trace}" if trace else "no traceback was written")


def _get(results, child, timeout_s: float):
    """The member's next report, or ``ChildProcessError`` as soon as it is seen dead."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                raise ChildProcessError("the member exited before it reported") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the member sent no report within {timeout_s:.0f} s") from None


def member(port: int, wire: list, bucket_bytes: int, device: str, offers, sums) -> None:
    """Rank 1: join, take the offer, receive REPEATS + 1 updates, report each one's sums."""
    from verl_async.protocol import MemoryOffer, ParamSpec
    from verl_async.weight_sync import join_group, receive_weights

    group = join_group("127.0.0.1", port, 1, 2, "gloo", 120)
    offer = offers.get(timeout=120)
    offer = msgspec.convert(offer, MemoryOffer) if offer is not None else None
    specs = [ParamSpec(n, d, tuple(s)) for n, d, s in wire]
    for _ in range(REPEATS + 1):
        total = 0
        for bucket in receive_weights(group, specs, bucket_bytes, torch.device(device), offer):
            total += sum(_checksums(t.reshape(-1).view(torch.uint8)) for _, t in bucket)
        sums.put(total)
    group.close()


def ipc_check(out: Path, dry: bool) -> int:
    from verl_async.runtime import free_port
    from verl_async.weight_sync import (
        join_group,
        pack_bucket,
        param_specs,
        plan_buckets,
        send_update,
    )

    device = "cpu" if dry else "cuda:0"
    dtype = torch.float32 if dry else torch.bfloat16
    torch.manual_seed(0)
    tensors = {n: torch.randn(s, dtype=dtype, device=device) for n, s in shapes(dry).items()}
    specs = param_specs(tensors.items())
    bucket_bytes = 64 << 20
    buckets = plan_buckets(specs, bucket_bytes)
    nbytes = sum(b.nbytes for b in buckets)
    ctx = mp.get_context("spawn")
    offers, sums = ctx.Queue(), ctx.Queue()
    port = free_port("127.0.0.1")
    wire = [[s.name, s.dtype, list(s.shape)] for s in specs]
    out.mkdir(parents=True, exist_ok=True)
    faults = out / "member_fault.txt"
    body = (member, port, wire, bucket_bytes, device, offers, sums)
    child = ctx.Process(target=in_child, args=(str(faults), *body))
    child.start()
    times, routes, identical, error = [], set(), True, None
    try:
        group = join_group("127.0.0.1", port, 0, 2, "gloo", 120, device=torch.device(device))
        group.reserve(nbytes)
        offers.put(msgspec.to_builtins(group.offer) if group.offer is not None else None)
        packed = [pack_bucket(b, tensors) for b in buckets]
        sent = sum(_checksums(t.detach().reshape(-1).view(torch.uint8)) for t in tensors.values())
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            routes.add(send_update(group, packed).route)  # returns once every member has read it
            times.append(time.perf_counter() - t0)
            identical &= _get(sums, child, 120) == sent
        child.join(60)
        group.close()
    except Exception as exc:  # noqa: BLE001 - the member's death explains it, if it died
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        died = death_of(child, faults)
        if child.is_alive():
            child.kill()
    if died or error:
        what = f"the member process died ({died})" if died else f"the update failed ({error})"
        result = {"member_died": died, "sender_error": error, "identical": False}
        (out / "ipc.json").write_text(json.dumps(result, indent=1))
        print(f"summary: {what}")
        return 1
    result = {
        "device": torch.cuda.get_device_name(0) if not dry else "cpu",
        "route": ",".join(sorted(routes)), "bytes": nbytes, "update_s": times[1:],
        "first_update_s": times[0], "identical": identical,
    }  # fmt: skip
    (out / "ipc.json").write_text(json.dumps(result, indent=1))
    med = statistics.median(times[1:])
    print(
        f"summary: {nbytes / 2**20:.0f} MiB by {result['route']} in {med * 1000:.1f} ms "
        f"(median of {REPEATS}; first {times[0] * 1000:.0f} ms), bytes identical: {identical}"
    )
    return 0 if identical else 1
