"""The learning tests' bars over several seeds, on a quiet machine or beside a CPU hog.

    python benchmarks/margins.py --suite estimators [--cases gae,rloo] [--seeds 1,2,3,4,5]
                                 [--hog] [--out runs/margins]

Each integration test that asserts learning (tests/integration/learning.py) runs a
synchronous ``verl-async train`` and checks a few measured values against bars. This runs
the same cases with other seeds (``learner.seed``, ``data.shuffle_seed``,
``model.tiny.seed``) and prints, per check, every seed's value and the smallest margin
over the bar, so a bar is set where it holds with room rather than where one run ended.
``--hog`` keeps a busy loop on core 1 for the whole sweep (the roles of the tiny configs
are pinned to cores 0 and 1, so the learner then runs about half as fast): a margin that
depended on the machine's speed would show it there. Writes ``margins.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUITES = {  # --suite -> the test module whose CASES it runs
    "estimators": "tests.integration.test_estimators_e2e",
    "multiturn": "tests.integration.test_multiturn",
}


@contextlib.contextmanager
def cpu_hog(core: int = 1) -> Iterator[None]:
    """A busy loop pinned to ``core`` while the block runs."""
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def run_case(case, run_dir: Path, seed: int) -> tuple[list, float]:
    """One training run of ``case`` at ``seed``: (its checks, seconds)."""
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "verl_async.launch.cli", *case.args(run_dir, seed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seconds = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{run_dir} failed:\n{res.stderr[-3000:]}")
    return case.measure(run_dir), seconds


def sweep(cases: dict, names: list[str], seeds: list[int], out: Path) -> dict:
    """Every case at every seed: {case: {"runs": [...], "checks": {name: summary}}}."""
    report = {}
    for name in names:
        runs = []
        for seed in seeds:
            checks, seconds = run_case(cases[name], out / f"{name}-seed{seed}", seed)
            runs.append({"seed": seed, "seconds": round(seconds, 1), "checks": checks})
            print(f"{name} seed {seed} ({seconds:.0f}s): " + "; ".join(map(str, checks)))
        report[name] = {"runs": runs, "checks": summarise(runs)}
    return report


def summarise(runs: list[dict]) -> dict:
    """Per check (by its position): the bar, every seed's value and the smallest margin."""
    out = {}
    for i, first in enumerate(runs[0]["checks"]):
        key = first.name.split(" (")[0]  # the values in parentheses differ from run to run
        values = [r["checks"][i].value for r in runs]
        out[key] = {
            "bound": first.bound,
            "values": [round(v, 4) for v in values],
            "min_margin": round(min(values) - first.bound, 4),
            "all_passed": all(r["checks"][i].passed for r in runs),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--cases", default="", help="comma-separated; default: all")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--hog", action="store_true", help="a busy loop on core 1 throughout")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "margins")
    args = parser.parse_args()
    cases = importlib.import_module(SUITES[args.suite]).CASES
    names = args.cases.split(",") if args.cases else list(cases)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out / f"{args.suite}-{'hog' if args.hog else 'quiet'}-{time.strftime('%H%M%S')}"
    out.mkdir(parents=True)
    with cpu_hog() if args.hog else contextlib.nullcontext():
        report = sweep(cases, names, seeds, out)
    print(f"\n{'case':<22} {'check':<40} {'bar':>7} {'min margin':>10}  values")
    for name, r in report.items():
        for check, s in r["checks"].items():
            flag = "" if s["all_passed"] else "  FAILED"
            print(f"{name:<22} {check:<40} {s['bound']:>7.3f} {s['min_margin']:>10.3f}  "
                  f"{s['values']}{flag}")  # fmt: skip
    for r in report.values():
        for run in r["runs"]:
            run["checks"] = [vars(c) for c in run["checks"]]
    meta = {"suite": args.suite, "seeds": seeds, "hog": args.hog}
    (out / "margins.json").write_text(json.dumps({**meta, "cases": report}, indent=1))
    print(f"wrote {out / 'margins.json'}")


if __name__ == "__main__":
    main()
