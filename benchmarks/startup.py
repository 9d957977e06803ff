"""Start-up: seconds from `verl-async train` to its first step, against a baseline commit.

    python benchmarks/startup.py [--config configs/tiny.yaml] [--repeats 3]
                                 [--against GIT_REF] [--out runs/startup] [key=value ...]

Each run is the whole command, timed from outside: ``first_step_s`` is from the start of
the command to the first row of metrics.jsonl, ``total_s`` to its exit. The run then
stops at once (``trainer.total_steps`` = 2 by default), so start-up is what is timed.
With ``--against REF`` the same runs are made with the code of REF, checked out in a
temporary git worktree and put first on PYTHONPATH (every role process inherits it); a
config inside the repository is read from that worktree too (the default's settings are
part of what changed).
Runs alternate (ABBA), and the summary is the ratio of the means. Where the code writes
``startup.jsonl``, the per-role milestones of the last run are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, read_jsonl  # noqa: E402


def timed_run(config: Path, run_dir: Path, overrides: list[str], code: Path | None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(":")
        config = config.resolve()
        if config.is_relative_to(ROOT):
            config = code / config.relative_to(ROOT)
    metrics = run_dir / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_async.launch.cli", "train", str(config), "--run-dir", str(run_dir),
         *overrides],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = None
    while proc.poll() is None:
        if first is None and metrics.is_file() and metrics.read_text().endswith("\n"):
            first = time.monotonic() - t0
        if time.monotonic() - t0 > 900:
            proc.kill()
            raise SystemExit(f"{run_dir.name}: no exit within 900 s")
        time.sleep(0.05)
    total = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{proc.stderr.read()[-3000:]}")
    return {"run": run_dir.name, "first_step_s": first or total, "total_s": total}


def milestones(run_dir: Path) -> str:
    path = run_dir / "startup.jsonl"
    if not path.is_file():
        return "(no startup.jsonl: this code marks no milestones)"
    marks = read_jsonl(path)
    t0 = min(m["t"] for m in marks if m["role"] == "launcher") if marks else 0.0
    return ", ".join(f"{m['role']} {m['event']} +{m['t'] - t0:.1f} s" for m in marks)


def worktree(ref: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="verl-async-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm")
    parser.add_argument("--against", help="git ref of the baseline (default: no baseline)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/startup")
    parser.add_argument("override", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["trainer.total_steps=2", "checkpoint.every_steps=0", *args.override]
    arms: list[tuple[str, Path | None]] = [("current", None)]
    base = worktree(args.against) if args.against else None
    if base is not None:
        arms.append((f"baseline {args.against}", base))
    results = []
    try:
        for i in range(args.repeats):
            for arm, code in arms if i % 2 == 0 else arms[::-1]:
                run_dir = out / f"{arm.split()[0]}{i}"
                res = {**timed_run(args.config, run_dir, overrides, code), "arm": arm}
                results.append(res)
                print(f"{res['run']:>10}: first step {res['first_step_s']:6.1f} s, "
                      f"exit {res['total_s']:6.1f} s", flush=True)  # fmt: skip
    finally:
        if base is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    summary = {"machine": machine(), "runs": results}
    for arm, _ in arms:
        first = mean(r["first_step_s"] for r in results if r["arm"] == arm)
        total = mean(r["total_s"] for r in results if r["arm"] == arm)
        summary[arm] = {"first_step_s": first, "total_s": total}
        print(f"{arm}: first step {first:.1f} s, whole command {total:.1f} s (mean of "
              f"{args.repeats})")  # fmt: skip
    print("milestones of the last current run:", milestones(out / f"current{args.repeats - 1}"))
    first = summary["current"]["first_step_s"]
    line = f"summary: first step {first:.1f} s after the command started"
    if base is not None:
        summary["ratio_first_step"] = first / summary[arms[1][0]]["first_step_s"]
        line += f", {summary['ratio_first_step']:.2f}x the baseline's time"
    (out / "startup.json").write_text(json.dumps(summary, indent=1))
    print(f"{line} ({machine()})")


if __name__ == "__main__":
    main()
