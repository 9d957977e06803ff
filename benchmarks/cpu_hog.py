"""Run a command on a machine made slow on purpose: a busy loop pinned to one core beside it.

    python benchmarks/cpu_hog.py [--core 1] -- make test

The loop takes its core for as long as the command runs, so whatever else runs on that
core gets about half of it: the tiny configs pin their learner to core 1, and the test
suite's processes share both cores. A verdict that depended on the machine's speed shows
it here. Exits with the command's code and prints its wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_hog(core: int = 1) -> Iterator[None]:
    """A busy loop pinned to ``core`` while the block runs (the block starts once the loop
    is pinned: it says so on its output)."""
    loop = f"import os\nos.sched_setaffinity(0, {{{core}}})\nprint(flush=True)\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", loop], stdout=subprocess.PIPE)
    try:
        if hog.stdout.readline() != b"\n":  # empty: it died before pinning itself
            raise SystemExit(f"the busy loop could not be pinned to core {core}")
        yield
    finally:
        hog.kill()
        hog.wait()
        hog.stdout.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    t0 = time.monotonic()
    with cpu_hog(args.core):
        code = subprocess.call(command)
    print(f"summary: {' '.join(command)} exited {code} after {time.monotonic() - t0:.0f} s "
          f"beside a busy loop on core {args.core}")  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
