"""Command line.

    verl-async train CONFIG [dotted.key=value ...] [--run-dir DIR]
    verl-async train [CONFIG] --resume RUN_DIR [dotted.key=value ...]
    verl-async config CONFIG [dotted.key=value ...]
    verl-async ckpt list RUN_DIR
    verl-async ckpt verify RUN_DIR [--step N]
    verl-async export RUN_DIR [--step N] [--force] [--adapter DIR] OUT_DIR
    verl-async model smollm2-135m DIR
    verl-async keys DIR [--clients NAME ...] [--force]
    verl-async plot RUN_DIR [RUN_DIR ...] [--out DIR] [--window N]
    verl-async buffer CONFIG [dotted.key=value ...] [--run-dir DIR | --resume RUN_DIR]
    verl-async generator --buffer tcp://HOST:PORT [--index I] [--run-dir DIR]
    verl-async learner --buffer tcp://HOST:PORT [--run-dir DIR]
    verl-async --version

Parses and validates the config before anything imports torch or vLLM, so mistakes are
reported in a fraction of a second and ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import signal
import sys

# Models ``verl-async model`` can build (see verl_async/launch/models.py).
MODELS = ("smollm2-135m",)


def package_version() -> str:
    """The installed distribution's version (pyproject.toml: ``name = "verl-async"``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl-async")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-async", description="Asynchronous RL post-training for LLMs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run buffer, generators and learner for one training run")
    train.add_argument(
        "config",
        nargs="?",
        help="YAML run config, e.g. configs/tiny.yaml (with --resume: default RUN_DIR/config.yaml)",
    )
    train.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. staleness.max=0"
    )
    train.add_argument("--run-dir", help="run directory (default runs/<name>-<timestamp>)")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint that verifies, with its "
        "config.yaml (overrides given still apply)",
    )
    show = sub.add_parser("config", help="print the resolved config (YAML) without running")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    ckpt = sub.add_parser("ckpt", help="list or verify the checkpoints of a run")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    ckpt_list = ckpt_sub.add_parser("list", help="checkpoints with step, version, size, state")
    ckpt_list.add_argument("run_dir")
    ckpt_verify = ckpt_sub.add_parser("verify", help="re-hash every file against its manifest")
    ckpt_verify.add_argument("run_dir")
    ckpt_verify.add_argument("--step", type=int, help="only this step (default: all)")
    export = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory (save_pretrained)"
    )
    export.add_argument("run_dir")
    export.add_argument("out_dir")
    export.add_argument("--step", type=int, help="checkpoint step (default: newest valid)")
    export.add_argument(
        "--force", action="store_true", help="replace OUT_DIR if it exists and is not empty"
    )
    export.add_argument(
        "--adapter", metavar="DIR", help="a LoRA run: also write its adapter as a peft directory"
    )
    model = sub.add_parser(
        "model", help="build a real model as a Hugging Face directory (no model hub needed)"
    )
    model.add_argument("name", choices=MODELS, help="which model")
    model.add_argument("out_dir", help="directory to write (kept if already complete)")
    keys = sub.add_parser(
        "keys", help="make CurveZMQ keys for the buffer and reward models (docs/security.md)"
    )
    keys.add_argument("out_dir", metavar="DIR", help="directory of the key set (buffer.keys_dir)")
    keys.add_argument(
        "--clients",
        nargs="+",
        default=["default"],
        metavar="NAME",
        help="one key pair per client machine (default: one named 'default')",
    )
    keys.add_argument("--force", action="store_true", help="replace a key set already in DIR")
    plot = sub.add_parser(
        "plot",
        help="PNG figures of a run (reward, eval, staleness, throughput, KL/entropy); "
        "several runs are overlaid",
    )
    plot.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directory; several are overlaid"
    )
    plot.add_argument(
        "--out",
        help="output directory (default: RUN_DIR/plots for one run; for several, "
        "compare-<name>+<name>... beside the first)",
    )
    plot.add_argument(
        "--window", type=int, default=10, help="trailing-mean window in steps (1: none)"
    )
    from verl_async.launch.role_commands import add_parsers

    add_parsers(sub)  # buffer, generator, learner: one role per command
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Commands that take no dotted.key=value overrides: anything left over is an error.
    plain = {
        "ckpt": _ckpt,
        "export": _export,
        "model": _model,
        "keys": _keys,
        "plot": _plot,
        "generator": _join,
        "learner": _join,
    }
    if args.command in plain:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return plain[args.command](args)
    return _run(parser, args, extra)


def _join(args) -> int:
    from verl_async.launch.role_commands import run_join

    return run_join(args)


def _run(parser: argparse.ArgumentParser, args, extra: list[str]) -> int:
    from verl_async.config import ConfigError, load_config, to_yaml

    # Overrides may follow options (``--run-dir X a.b=1``); anything else unknown is an error.
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    resume = getattr(args, "resume", None)
    if resume and args.run_dir and resume != args.run_dir:
        parser.error("--resume RUN_DIR already names the run directory; drop --run-dir")
    try:
        config, overrides = _config_source(args.config, args.overrides, resume)
        if config is None:
            alternative = " (or --resume RUN_DIR)" if args.command == "train" else ""
            parser.error(f"the following arguments are required: config{alternative}")
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        print(f"verl-async: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
    return _train(cfg, resume or args.run_dir, resume=resume is not None, command=args.command)


def _config_source(
    config: str | None, overrides: list[str], resume: str | None
) -> tuple[str | None, list[str]]:
    """(config file, overrides) of a command line. ``train --resume RUN_DIR`` without a
    config reads RUN_DIR/config.yaml (argparse then hands the first override over as the
    config: it is one when it holds '=' and names no file)."""
    from pathlib import Path

    from verl_async.config import ConfigError

    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]
    if config is not None or resume is None:
        return config, overrides
    stored = Path(resume) / "config.yaml"
    if not stored.is_file():
        raise ConfigError(f"cannot resume: '{resume}' holds no run (no config.yaml)")
    keys = [o.partition("=")[0] for o in overrides]
    if any(k.startswith("placement.generators") for k in keys) and "generators.count" not in keys:
        # config.yaml states the count it resolved; new generator groups set their own
        overrides = ["generators.count=null", *overrides]
    return str(stored), overrides


def _interrupt_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler preempting the job) both stop the run
    cleanly: the launcher raises KeyboardInterrupt, lets the learner finish a checkpoint
    write in progress, then stops every process. Set explicitly, because a shell that
    starts the command in the background leaves SIGINT ignored, and Python then installs
    no handler of its own."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def print_error(console, message: str, style: str | None = None) -> None:
    """``message`` exactly as it is: no markup read into its brackets (a log tail may hold
    any text), no highlighting, and no line breaks added (paths stay whole)."""
    console.print(message, style=style, markup=False, highlight=False, soft_wrap=True)


def _train(cfg, run_dir: str | None, resume: bool, command: str = "train") -> int:
    """``train`` (every role, watched until the run ends) or ``buffer`` (this process
    becomes the buffer; see verl_async/launch/role_commands.py)."""
    from rich.console import Console

    from verl_async.config import ConfigError
    from verl_async.launch.role_commands import buffer_command
    from verl_async.launch.run_dir import RoleFailed
    from verl_async.launch.train import train

    console = Console(stderr=True)
    _interrupt_on_signals()
    try:
        if command == "buffer":
            buffer_command(cfg, run_dir, resume, console)  # returns only by raising (exec)
        else:
            train(cfg, run_dir, console, resume=resume)
    except ConfigError as exc:
        print_error(console, f"verl-async: config error: {exc}")
        return 2
    except RoleFailed as exc:
        print_error(console, f"verl-async: {exc}", style="bold red")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _ckpt(args) -> int:
    from pathlib import Path

    from verl_async.checkpoint import MANIFEST, list_checkpoints, read_manifest, step_dir, verify

    run_dir = Path(args.run_dir)
    if args.action == "list":
        dirs = list_checkpoints(run_dir)
        if not dirs:
            print(f"no checkpoints in {run_dir / 'checkpoints'}")
            return 0
        print(f"{'checkpoint':<16} {'step':>8} {'version':>8} {'MiB':>9}  state")
        for d in dirs:
            if (d / MANIFEST).is_file():
                m = read_manifest(d)
                mib = sum(f.bytes for f in m.files.values()) / 2**20
                print(f"{d.name:<16} {m.step:>8} {m.version:>8} {mib:>9.2f}  committed")
            else:
                print(f"{d.name:<16} {'':>8} {'':>8} {'':>9}  uncommitted (write never finished)")
        return 0
    dirs = [step_dir(run_dir, args.step)] if args.step is not None else list_checkpoints(run_dir)
    if not dirs or not dirs[0].is_dir():
        print(f"no checkpoint to verify in {run_dir / 'checkpoints'}", file=sys.stderr)
        return 1
    bad = 0
    for d in dirs:
        problems = verify(d)
        bad += bool(problems)
        print(f"{d.name}: {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"  {problem}")
    return 1 if bad else 0


def _export(args) -> int:
    from verl_async.checkpoint import CheckpointError
    from verl_async.launch.export import export

    try:
        ckpt, out = export(
            args.run_dir, args.out_dir, args.step, force=args.force, adapter_dir=args.adapter
        )
    except CheckpointError as exc:
        print(f"verl-async: {exc}", file=sys.stderr)
        return 1
    print(f"exported {ckpt.name} to {out}")
    return 0


def _model(args) -> int:
    from verl_async.launch.models import MissingExtraError, build_smollm2

    try:
        out = build_smollm2(args.out_dir)
    except MissingExtraError as exc:
        print(f"verl-async: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name} is in {out}")
    return 0


def _keys(args) -> int:
    from pathlib import Path

    from verl_async.auth import make_keys

    try:
        make_keys(args.out_dir, args.clients, force=args.force)
    except (FileExistsError, ValueError) as exc:
        print(f"verl-async: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out_dir)
    print(f"CurveZMQ keys in {out}; set buffer.keys_dir={out} on every machine")
    print(f"  {out / 'server'}: to the machine of the buffer and reward models")
    for name in args.clients:
        print(f"  {out / 'clients' / name}: to client machine '{name}' (buffer.client_key={name})")
    return 0


def _plot(args) -> int:
    from pathlib import Path

    from verl_async.launch.plot import PlotError, plot_runs

    if args.window < 1:
        print("verl-async: --window must be at least 1", file=sys.stderr)
        return 2
    try:
        plot_runs(
            [Path(d) for d in args.run_dirs], Path(args.out) if args.out else None, args.window
        )
    except PlotError as exc:
        print(f"verl-async: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
