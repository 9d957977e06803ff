"""The learning tests' bars over several seeds, on a quiet machine or beside a CPU hog.

    python benchmarks/margins.py --suite estimators [--cases gae,rloo] [--seeds 1,2,3,4,5]
                                 [--hog] [--out runs/margins] [key=value ...]

Each integration test that asserts learning (tests/integration/learning.py) runs a
synchronous ``verl-async train`` and checks a few measured values against bars. This runs
the same cases with other seeds (``learner.seed``, ``data.shuffle_seed``,
``model.tiny.seed``) and prints, per check, every seed's value and the smallest margin
over the bar, so a bar is set where it holds with room rather than where one run ended.
``--hog`` keeps a busy loop on core 1 for the whole sweep (the roles of the tiny configs
are pinned to cores 0 and 1, so the learner then runs about half as fast): a margin that
depended on the machine's speed would show it there. ``key=value`` overrides go to every
run after the case's own (the benchmark test makes the runs short). Writes ``margins.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import run_to_end  # noqa: E402
from cpu_hog import cpu_hog  # noqa: E402

SUITES = {  # --suite -> the test module whose CASES it runs
    "estimators": "tests.integration.test_estimators_e2e",
    "multiturn": "tests.integration.test_multiturn",
    "tools": "tests.integration.test_tools",
    "agents": "tests.integration.test_agents",
}


def run_case(case, run_dir: Path, seed: int, extra: list[str]) -> tuple[list, float]:
    """One training run of ``case`` at ``seed``: (its checks, seconds)."""
    seconds = run_to_end(
        [sys.executable, "-m", "verl_async.launch.cli", *case.args(run_dir, seed), *extra],
        str(run_dir),
    )
    return case.measure(run_dir), seconds


def sweep(cases: dict, names: list[str], seeds: list[int], out: Path, extra: list[str]) -> dict:
    """Every case at every seed: {case: {"runs": [...], "checks": {name: summary}}}."""
    report = {}
    for name in names:
        runs = []
        for seed in seeds:
            checks, seconds = run_case(cases[name], out / f"{name}-seed{seed}", seed, extra)
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
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    cases = importlib.import_module(SUITES[args.suite]).CASES
    names = args.cases.split(",") if args.cases else list(cases)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out / f"{args.suite}-{'hog' if args.hog else 'quiet'}-{time.strftime('%H%M%S')}"
    out.mkdir(parents=True)
    with cpu_hog() if args.hog else contextlib.nullcontext():
        report = sweep(cases, names, seeds, out, args.overrides)
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
    summaries = [(s["min_margin"], f"{n}: {c}", s["all_passed"])
                 for n, r in report.items() for c, s in r["checks"].items()]  # fmt: skip
    worst = min(summaries)
    failing = sum(not ok for *_, ok in summaries)
    print(f"summary: {len(summaries)} checks over {len(seeds)} seeds, {failing} failing; "
          f"smallest margin {worst[0]:.3f} ({worst[1]})")  # fmt: skip


if __name__ == "__main__":
    main()
