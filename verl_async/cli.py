"""Command line: ``verl-async train CONFIG [dotted.key=value ...] [--run-dir DIR]``.

Parses and validates the config before anything imports torch or vLLM, so mistakes are
reported in a fraction of a second and ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-async", description="Asynchronous RL post-training for LLMs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run buffer, generators and learner for one training run")
    train.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    train.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. staleness.max=0"
    )
    train.add_argument("--run-dir", help="run directory (default runs/<name>-<timestamp>)")
    show = sub.add_parser("config", help="print the resolved config (YAML) without running")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    return parser


def main(argv: list[str] | None = None) -> int:
    from verl_async.config import ConfigError, load_config, to_yaml

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (``--run-dir X a.b=1``); anything else unknown is an error.
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"verl-async: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
    return _train(cfg, args.run_dir)


def _train(cfg, run_dir: str | None) -> int:
    from rich.console import Console

    from verl_async.launcher import RoleFailed, train

    console = Console(stderr=True)
    try:
        train(cfg, run_dir, console)
    except RoleFailed as exc:
        console.print(f"[bold red]verl-async: {exc}[/]", highlight=False, markup=False)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
