"""Whole weight updates against deltas across two hosts: SmolLM2-135M with a bf16 generator.

    python benchmarks/two_host_delta.py [--steps 6] [--slow] [--arms whole delta]
                                        [--out runs/two_host_delta] [--report]

Two network namespaces joined by a veth pair stand for two hosts (the helpers of
tests/integration/test_two_hosts.py: each namespace has one address on that link and
nothing else, and both are removed afterwards, also on an error or Ctrl-C). Host A runs
the buffer and the learner, host B one generator with the transformers engine in bf16;
the weight-sync group (gloo) crosses the link (``weights.shared_memory=false``). With
``--slow`` both ends of the link are shaped to 20 Mbit/s (``tc tbf``).

The SmolLM2 CPU recipe (configs/math_smollm2_cpu.yaml, made small: few samples, short
responses) runs ``--steps`` steps twice over the same link: ``weights.delta=false`` (every
update sends every bf16 weight) and ``weights.delta=network`` (only the words that
changed), with a digest check every second update. Reports per update, from each run's
metrics.jsonl: MiB on the wire, rank 0's seconds for the update, the share of bf16 words
that changed, and per step the reward; then the ratios and both arms' reward means
against their step-to-step spread (``--report``: the last run's report again, from its
summary.json). Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.test_role_commands import start, wait_all  # noqa: E402
from tests.integration.test_two_hosts import SLOW_LINKS, Hosts, _two_hosts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIGEST_EVERY = 2
RECIPE = [
    "model.dtype=bfloat16",  # the generator's dtype: updates go in bf16
    "generators.engine=hf",  # transformers runs bf16 on a CPU
    "generators.group_size=4",
    "generators.max_new_tokens=16",
    "generators.max_inflight_groups=6",  # (staleness.max + 1) x groups_per_step
    "learner.groups_per_step=2",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "weights.shared_memory=false",  # one machine: memory would skip the link
    f"weights.digest_every={DIGEST_EVERY}",
    "weights.timeout_s=900",  # a whole update takes minutes at 20 Mbit/s
]
ARMS = {"whole": "weights.delta=false", "delta": "weights.delta=network"}


def shape(h: Hosts) -> None:
    """Both ends of the link to 20 Mbit/s."""
    for ns, dev in ((h.a, h.dev_a), (h.b, h.dev_b)):
        subprocess.run(
            ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *SLOW_LINKS["20mbit"]],
            check=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip


def run_arm(h: Hosts, out: Path, keys: Path, arm: str, steps: int) -> Path:
    """One run of the recipe across the two hosts; returns its run folder."""
    port = 20000 + random.randrange(20000)
    address = f"tcp://{h.addr_a}:{port}"
    run_dir, logs = out / arm / "run", {}
    for name in ("buffer", "learner", "generator"):
        logs[name] = out / arm / f"{name}.out"
    (out / arm).mkdir(parents=True, exist_ok=True)
    ns = ["ip", "netns", "exec"]
    join = ["--buffer", address, "--keys-dir", str(keys)]
    args = ["buffer", "configs/math_smollm2_cpu.yaml", *RECIPE, ARMS[arm],
            f"trainer.total_steps={steps}", f"buffer.host={h.addr_a}", f"buffer.port={port}",
            f"buffer.keys_dir={keys}", f"weights.host={h.addr_a}", f"weights.port={port + 1}",
            "--run-dir", str(run_dir)]  # fmt: skip
    procs = {}
    try:
        procs["buffer"] = start(args, logs["buffer"], prefix=[*ns, h.a])
        time.sleep(5)  # the buffer listens before the others ask it for the run
        procs["learner"] = start(
            ["learner", *join, "--timeout-s", "600"], logs["learner"], prefix=[*ns, h.a]
        )
        procs["generator"] = start(
            ["generator", *join, "--index", "0", "--run-dir", str(out / arm / "b")],
            logs["generator"],
            prefix=[*ns, h.b],
        )
    except BaseException:  # Ctrl-C among the starts: stop what has started
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    wait_all(procs, logs, timeout=3600)
    return run_dir


def updates(run_dir: Path) -> list[dict]:
    """Each finished update once (a step's row repeats the last finished one)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seen, out = set(), []
    for r in rows:
        key = (r.get("weight_sent_mb"), r.get("weight_broadcast_s"))
        if key[0] is not None and key not in seen:
            seen.add(key)
            out.append(r)
    return out


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    ups = updates(run_dir)
    return {
        "steps": len(rows),
        "reward": rewards,
        "reward_mean": statistics.mean(rewards),
        "reward_step_sd": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
        "heals": rows[-1].get("weight_heals"),
        "whole_mb": rows[-1]["weight_sync_mb"],
        "updates": [
            {
                "step": u["step"],
                "sent_mb": u["weight_sent_mb"],
                "seconds": u.get("weight_broadcast_s"),
                "whole_buckets": u.get("weight_whole_buckets"),
                "changed": u.get("weight_changed_frac"),
            }
            for u in ups
        ],
        "sync_s": [r["weight_sync_s"] for r in rows],
    }


def checks(loaded: list[int], every: int = DIGEST_EVERY) -> int:
    """Digest checks in a delta run that loaded versions ``loaded``: rank 0 checks before
    its update n (from 0) where n is a multiple of ``every`` and a copy is held (n > 0)."""
    return sum(1 for n in range(len(loaded)) if n > 0 and n % every == 0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(res: dict[str, dict]) -> None:
    for arm, s in res.items():
        print(f"\n{arm}: {s['steps']} steps in {s['run_s']} s, whole update {s['whole_mb']} MiB,")
        print(f"versions loaded by the generator {s['loaded']}, weight_heals {s['heals']}")
        if arm == "delta":
            print(f"digest checks (every {DIGEST_EVERY} updates): {checks(s['loaded'])}")
        print("| row (step) | MiB sent | seconds | whole buckets | bf16 words changed |")
        print("|---|---|---|---|---|")
        for u in s["updates"]:
            ch = "" if u["changed"] is None else f"{100 * u['changed']:.2f}%"
            cells = [u["step"], u["sent_mb"], u["seconds"], u["whole_buckets"], ch]
            print("| " + " | ".join(str(c) for c in cells) + " |")
        print("rewards:", " ".join(f"{r:.3f}" for r in s["reward"]))
        print(f"reward mean {s['reward_mean']:.3f}, step-to-step sd {s['reward_step_sd']:.3f}")
        print(f"weight_sync_s (the step's own wait) median {_median(s['sync_s']):.3f}")
    if {"whole", "delta"} <= res.keys():
        w = res["whole"]["updates"]
        d = [u for u in res["delta"]["updates"] if u["whole_buckets"] == 0]  # sparse ones
        mb = _median([u["sent_mb"] for u in w]) / _median([u["sent_mb"] for u in d])
        sec = _median([u["seconds"] for u in w]) / _median([u["seconds"] for u in d])
        print(f"\nmedian whole update / median sparse delta: bytes {mb:.1f}x, seconds {sec:.1f}x")
        diff = res["whole"]["reward_mean"] - res["delta"]["reward_mean"]
        sd = max(res["whole"]["reward_step_sd"], res["delta"]["reward_step_sd"])
        n = min(res["whole"]["steps"], res["delta"]["steps"])
        print(
            f"reward means differ by {diff:+.3f}; step-to-step sd up to {sd:.3f}, "
            f"so the standard error of a {n}-step mean is about {sd / n**0.5:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--slow", action="store_true", help="shape the link to 20 Mbit/s")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "two_host_delta")
    ap.add_argument("--report", action="store_true", help="print the last run's report")
    args = ap.parse_args()
    # SIGTERM ends the run as Ctrl-C does: the processes stopped, the namespaces removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out / ("20mbit" if args.slow else "plain")
    if args.report:
        report(json.loads((out / "summary.json").read_text()))
        return
    out.mkdir(parents=True, exist_ok=True)
    keys = out / "keys"
    if not keys.is_dir():
        cmd = [sys.executable, "-m", "verl_async.launch.cli", "keys", str(keys)]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=120)
    res = {}
    for arm in args.arms:
        with _two_hosts() as h:  # no namespaces here: pytest's Skipped, with the reason
            if args.slow:
                shape(h)
            t0 = time.monotonic()
            run_dir = run_arm(h, out, keys, arm, args.steps)
            res[arm] = summarize(run_dir) | {"run_s": round(time.monotonic() - t0, 1)}
            log = (out / arm / "generator.out").read_text()
            res[arm]["loaded"] = [int(v) for v in re.findall(r"loaded version (\d+)", log)]
        print(f"{arm}: {res[arm]['run_s']} s", flush=True)
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    report(res)


if __name__ == "__main__":
    main()
