"""Soak: a long run of the tiny task, with every role's resident memory sampled.

    python benchmarks/soak.py [--minutes 30] [--every 10] [--config configs/tiny.yaml]
                              [--out runs/soak] [--plot docs/soak_rss.png] [key=value ...]

Starts ``verl-async train CONFIG`` with a step count it will not reach, samples the RSS
of each role every ``--every`` seconds (a role's RSS includes its child processes: the
generator's vLLM engine core and worker and its scoring process), and stops the run with
SIGINT (as Ctrl-C) after ``--minutes`` from its start (and not before its first step).
The summary compares each role's median RSS over
the first and the last fifth of the run, after a warm-up of one fifth: flat means the
ratio stays near 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, interrupt, machine  # noqa: E402

from verl_async.metrics import read_metrics  # noqa: E402

ROLES = ("buffer", "generators", "learners")  # python -m <module> of each role


def children(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [root]
    while todo:
        more = kids.get(todo.pop(), [])
        found += more
        todo += more
    return found


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def role_pids(launcher: int) -> dict[str, int]:
    """The top process of each role under the launcher (``python -m <module>``)."""
    found = {}
    for pid in children(launcher):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for role in ROLES:
            if b"-m" in argv and role.encode() in argv and role not in found:
                found[role] = pid
    return found


def sample(launcher: int) -> dict[str, float]:
    return {
        role: rss_mib(pid) + sum(rss_mib(c) for c in children(pid))
        for role, pid in role_pids(launcher).items()
    }


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def summarize(rows: list[dict]) -> dict[str, dict[str, float]]:
    n = len(rows)
    early, late = rows[n // 5 : 2 * n // 5], rows[4 * n // 5 :]
    out = {}
    for role in ROLES:
        a = median([r["rss"].get(role, 0.0) for r in early])
        b = median([r["rss"].get(role, 0.0) for r in late])
        out[role] = {"early_mib": a, "late_mib": b, "ratio": b / a if a else float("nan")}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for role in ROLES:
        ax.plot([r["t"] / 60 for r in rows], [r["rss"].get(role, 0) for r in rows], label=role)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS, MiB (with child processes)")
    ax.set_title("Soak run of the tiny default: resident memory per role")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/soak")
    parser.add_argument("--plot", type=Path, help="PNG of RSS over time")
    parser.add_argument("override", nargs="*")
    args = parser.parse_args()
    run_dir = args.out.resolve()
    cmd = [sys.executable, "-m", "verl_async.launch.cli", "train", str(args.config), "--run-dir",
           str(run_dir), "trainer.total_steps=1000000", "trainer.log_every=1000", *args.override]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0, rows = time.monotonic(), []
    try:
        metrics = run_dir / "metrics.jsonl"
        # For --minutes from the command's start, and in any case until the first step.
        while time.monotonic() - t0 < args.minutes * 60 or not read_metrics(metrics):
            if time.monotonic() - t0 > args.minutes * 60 + 900:
                raise SystemExit("no step within 15 minutes past --minutes")
            if proc.poll() is not None:
                raise SystemExit(f"the run ended early:\n{proc.stderr.read().decode()[-3000:]}")
            rows.append({"t": time.monotonic() - t0, "rss": sample(proc.pid)})
            time.sleep(args.every)
    finally:
        interrupt(proc)
    steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    summary = {"machine": machine(), "minutes": args.minutes, "steps": steps,
               "roles": summarize(rows), "samples": rows}  # fmt: skip
    (run_dir / "soak.json").write_text(json.dumps(summary, indent=1))
    for role, s in summary["roles"].items():
        print(f"{role:>10}: {s['early_mib']:7.1f} MiB early, {s['late_mib']:7.1f} MiB late "
              f"({s['ratio']:.3f}x)")  # fmt: skip
    worst = max(s["ratio"] for s in summary["roles"].values())
    print(f"summary: {steps} steps in {args.minutes:g} min; largest late/early RSS ratio "
          f"{worst:.3f} ({machine()})")  # fmt: skip
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
