"""``verl-async buffer | generator | learner``: one role per command, for any launcher.

``verl-async train`` starts every role on this machine. To put roles on several machines,
or to start them under a cluster's own launcher, start each on its own::

    verl-async buffer CONFIG [key=value ...] [--run-dir DIR]   # prints the buffer's address
    verl-async generator --buffer tcp://HOST:PORT --index I    # one per generator group
    verl-async learner --buffer tcp://HOST:PORT                # or under torchrun, one per rank

The buffer command prepares the run directory as ``train`` does (the resolved config, the
endpoints, the tiny model when ``model.path`` is empty) and then serves. The other two ask
the buffer for the run (``GetRun``), write its ``config.yaml`` and ``endpoints.json`` into
their own run directory (by default the buffer's path, which on a shared filesystem is
the same directory), place themselves as ``placement`` says for their role, and become that
role's process (``exec``): from there on they run exactly the code ``train`` runs.

A role trusts the buffer it joins: the config it serves names the code the role runs
(reward functions, environments). So a buffer off loopback is joined only with its
CurveZMQ keys (``--keys-dir``), which prove the buffer is the run's own; without keys
every endpoint the buffer names must be loopback too. The checkpoint a resumed run names
is taken by its name only, from this role's own ``checkpoints/`` directory, and verified
there before anything of it is read.

What every machine must see at the same path: ``model.path`` (or nothing, for the tiny
model, which is rebuilt identically from its seed), the data files are read by the buffer
alone, and checkpoints are written by the learner into its run directory and read back by
``verl-async buffer --resume`` (a shared filesystem, or a copy).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_TIMEOUT_S = 300.0  # waiting for the buffer to answer GetRun (it may still be starting)
BUFFER_EXIT_AFTER_STOP_S = 30.0  # the buffer command's linger after the learner's Shutdown


class JoinFailed(RuntimeError):
    """The run cannot be joined from this machine (the message says why)."""


def add_parsers(sub) -> None:
    """The ``buffer``, ``generator`` and ``learner`` subcommands."""
    buffer = sub.add_parser(
        "buffer", help="prepare a run and serve its buffer (roles then join with --buffer)"
    )
    buffer.add_argument("config", nargs="?", help="YAML run config, e.g. configs/tiny.yaml")
    buffer.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    buffer.add_argument("--run-dir", help="run directory (default runs/<name>-<timestamp>)")
    buffer.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    for name, what in (("generator", "one generator group"), ("learner", "the learner")):
        role = sub.add_parser(name, help=f"join a run served by `verl-async buffer` as {what}")
        role.add_argument("--buffer", required=True, metavar="ADDR", help="tcp://HOST:PORT")
        role.add_argument(
            "--run-dir", help="this role's run directory (default: the buffer's path)"
        )
        role.add_argument(
            "--timeout-s",
            type=float,
            default=DEFAULT_TIMEOUT_S,
            help=f"longest wait for the buffer to answer (default {DEFAULT_TIMEOUT_S:.0f})",
        )
        role.add_argument(
            "--keys-dir",
            help="the buffer's CurveZMQ keys on this machine (when buffer.keys_dir is set)",
        )
        role.add_argument(
            "--client-key", default="", help="client identity in --keys-dir (default: the only one)"
        )
        if name == "generator":
            role.add_argument(
                "--index", type=int, default=0, help="which entry of placement.generators"
            )


# ----------------------------------------------------------------------------- buffer


def buffer_command(cfg, run_dir_arg: str | None, resume: bool, console) -> None:
    """Prepare the run directory, print how to join, become the buffer process."""
    from rich.markup import escape

    from verl_async import placement
    from verl_async.launch.plan import role_argv
    from verl_async.launch.prepare import check_data, prepare
    from verl_async.launch.run_dir import RoleFailed, claim, open_run_dir
    from verl_async.reward_config import ModelReward

    if any(isinstance(s, ModelReward) for s in cfg.rewards.sources):
        raise RoleFailed(
            "`verl-async buffer` does not start reward-model processes: run this config "
            "with `verl-async train`, or without its 'model' reward sources"
        )
    if cfg.distillation.processes:
        raise RoleFailed(
            "`verl-async buffer` does not start teacher processes: run this config with "
            "`verl-async train`, or with distillation.scoring=learner"
        )
    check_data(cfg)
    run_dir_arg, lock = claim(cfg, run_dir_arg, resume)
    lock.keep_across_exec()  # the buffer process holds it for the run's life
    run_dir, ckpt = open_run_dir(cfg, run_dir_arg, console, resume)
    endpoints = prepare(cfg, run_dir, ckpt, data_checked=True)
    address = endpoints.buffer
    console.print(f"run directory: [bold]{escape(str(run_dir))}[/]", soft_wrap=True)
    console.print(f"buffer: [bold]{escape(address)}[/]; join the run with", soft_wrap=True)
    for i in range(len(placement.generator_groups(cfg))):
        console.print(f"  verl-async generator --buffer {address} --index {i}", markup=False)
    console.print(f"  verl-async learner --buffer {address}", markup=False)
    argv = role_argv("buffer", run_dir, ["--exit-after-stop-s", str(BUFFER_EXIT_AFTER_STOP_S)])
    _become(argv, {})


# ----------------------------------------------------------------------------- joining


def fetch_run(args):
    """The ``RunInfo`` of the buffer at ``args.buffer`` (authenticated with
    ``args.keys_dir`` when given); ``JoinFailed`` naming the address if it does not answer."""
    from verl_async import protocol as P
    from verl_async.auth import guest, load_client_keys
    from verl_async.config import ConfigError, is_loopback
    from verl_async.transport import BufferClient, BufferRejected, BufferUnavailable

    address = args.buffer
    if not args.keys_dir and not is_loopback(_host(address)):
        raise JoinFailed(
            f"--buffer {address} is not on this machine, and a buffer off loopback is joined "
            "only with its CurveZMQ keys: pass --keys-dir DIR (this machine's side of the "
            "run's key set, `verl-async keys`; docs/security.md)"
        )
    try:  # a guest without keys: the run's token is read from its directory (join_run)
        credentials = (
            load_client_keys(args.keys_dir, args.client_key, args.command)
            if args.keys_dir
            else guest()
        )
    except ConfigError as exc:
        raise JoinFailed(f"--keys-dir: {exc}") from None
    client = BufferClient(address, args.timeout_s, credentials)
    try:
        reply, _ = client.request(P.GetRun())
    except (BufferUnavailable, BufferRejected) as exc:
        hint = "" if args.keys_dir else " (a buffer with keys refuses a client without --keys-dir)"
        raise JoinFailed(f"cannot join the run at {address}: {exc}{hint}") from None
    finally:
        client.close()
    if not isinstance(reply, P.RunInfo):
        raise JoinFailed(f"{address} answered GetRun with {type(reply).__name__}")
    return reply


def join_run(
    info, run_dir_arg: str | None, keys_dir: str | None = None, client_key: str = ""
) -> tuple[Path, object]:
    """Write the run's files into this role's run directory; return (directory, config).

    The tiny model (empty ``model.path``) is rebuilt here when the buffer's copy is not
    at its path on this machine; a real model must be. With ``keys_dir`` (this machine's
    client keys) the role's config names those instead of the buffer machine's."""
    import msgspec

    from verl_async.config import load_config, to_yaml
    from verl_async.runtime import Endpoints

    run_dir = Path(run_dir_arg or info.run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    served = run_dir / "buffer_config.yaml"  # as the buffer served it
    _write_if_changed(served, info.config_yaml)
    overrides = []
    if keys_dir:
        key = client_key or '""'
        overrides = [f"buffer.keys_dir={Path(keys_dir).resolve()}", f"buffer.client_key={key}"]
    cfg = load_config(served, overrides)
    _write_if_changed(run_dir / "config.yaml", to_yaml(cfg))
    endpoints = msgspec.json.decode(info.endpoints_json, type=Endpoints)
    if not keys_dir:
        _require_loopback(endpoints)
    model = Path(endpoints.model_path)
    if not (model / "config.json").is_file():
        if cfg.model.path:
            raise JoinFailed(
                f"model.path '{model}' is not a model directory on this machine; every "
                "machine needs the model at the same path (a shared filesystem, or a copy)"
            )
        from verl_async.launch.tiny_model import build_tiny_model

        model = build_tiny_model(run_dir / "model", cfg.model.tiny)
    resume_from = _local_checkpoint(run_dir, endpoints.resume_from)
    endpoints = msgspec.structs.replace(endpoints, model_path=str(model), resume_from=resume_from)
    _write_if_changed(run_dir / "endpoints.json", msgspec.json.encode(endpoints).decode())
    if not keys_dir:
        _copy_tokens(Path(info.run_dir), run_dir)
    return run_dir, cfg


def _host(address: str) -> str:
    """HOST of ``tcp://HOST:PORT``."""
    return address.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def _require_loopback(endpoints) -> None:
    """Joined without keys: every endpoint the buffer names must be this machine's too (an
    unauthenticated connection off it could be anybody's)."""
    from verl_async.config import is_loopback

    hosts = [_host(endpoints.buffer), endpoints.weights_host]
    hosts += [_host(e) for e in endpoints.reward_models.values()]
    away = [h for h in hosts if not is_loopback(h)]
    if away:
        raise JoinFailed(
            f"the buffer names endpoints off this machine ({', '.join(sorted(set(away)))}) "
            "and was joined without keys; join it with --keys-dir DIR (docs/security.md)"
        )


def _local_checkpoint(run_dir: Path, resume_from: str) -> str:
    """The checkpoint a resumed run names, as this role's own: the same name in this run
    directory's ``checkpoints/`` (a path from the buffer is never opened as it is)."""
    from verl_async.checkpoint import checkpoints_root, step_of

    if not resume_from:
        return ""
    name = Path(resume_from).name
    if step_of(name) is None:
        raise JoinFailed(f"the buffer names '{resume_from}' as the checkpoint to resume from")
    ckpt = checkpoints_root(run_dir) / name
    if not ckpt.is_dir():
        raise JoinFailed(
            f"the run resumes from '{resume_from}', which this machine does not see at "
            f"'{ckpt}'; put the run directory on a shared filesystem (or copy the checkpoint)"
        )
    return str(ckpt)


def _copy_tokens(buffer_run_dir: Path, run_dir: Path) -> None:
    """Without keys the buffer is on this machine: the run's role tokens (verl_async/auth.py)
    are in its run directory, readable by its user only; a role joining from another
    directory takes a copy."""
    from verl_async.auth import TOKENS_DIR, write_role_tokens

    source, target = buffer_run_dir / TOKENS_DIR, run_dir / TOKENS_DIR
    if source.resolve() == target.resolve():
        return
    if not source.is_dir():
        raise JoinFailed(
            f"'{source}' is missing or not readable: a role joins a run without keys only "
            "as the user who started it, on its machine"
        )
    write_role_tokens(run_dir)  # the private directory, then the run's own tokens in it
    for token in source.iterdir():
        _write_if_changed(target / token.name, token.read_text())
        (target / token.name).chmod(0o600)


def _write_if_changed(path: Path, text: str) -> None:
    """Several ranks of one learner job write the same files: atomically, and only when
    the content differs, so no reader ever sees half a file."""
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def generator_command(args) -> None:
    """Join as generator group ``args.index``, placed on its devices; become its process."""
    from verl_async import placement
    from verl_async.launch.plan import role_argv
    from verl_async.runtime import device_env

    run_dir, cfg = join_run(fetch_run(args), args.run_dir, args.keys_dir, args.client_key)
    groups = placement.generator_groups(cfg)
    if not 0 <= args.index < len(groups):
        raise JoinFailed(
            f"--index {args.index}: placement.generators has {len(groups)} group(s) "
            f"(0..{len(groups) - 1})"
        )
    argv = role_argv("generators", run_dir, ["--index", str(args.index)])
    _become(argv, device_env(groups[args.index]))


def learner_command(args) -> None:
    """Join as the learner. Alone: one process, or a torchrun job of its own when
    ``placement.learners`` lists several devices. Started by torchrun (WORLD_SIZE set):
    this rank of that job, which must have one rank per ``placement.learners`` entry."""
    from verl_async import placement
    from verl_async.launch.plan import learner_launch, role_argv
    from verl_async.runtime import device_env, ranks_env

    run_dir, cfg = join_run(fetch_run(args), args.run_dir, args.keys_dir, args.client_key)
    devices = placement.learner_devices(cfg)
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        _become(*learner_launch(cfg, run_dir))
        return
    if int(world) != len(devices) or os.environ.get("LOCAL_WORLD_SIZE", world) != world:
        raise JoinFailed(
            f"this job has {world} rank(s) ({os.environ.get('LOCAL_WORLD_SIZE', world)} on "
            f"this node) but placement.learners lists {len(devices)} device(s); the learner "
            "ranks run on one node, one per entry"
        )
    env = ranks_env(devices) if len(devices) > 1 else device_env(devices[0])
    _become(role_argv("learners", run_dir), env)


def _become(argv: list[str], env: dict[str, str]) -> None:
    """Replace this process with the role's (``TETHER_PID``: torchrun's ranks must find
    this process, which torchrun becomes, as their parent)."""
    from verl_async.lifetime import TETHER_PID

    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env, TETHER_PID: str(os.getpid())}
    os.execve(argv[0], argv, env)


def run_join(args: argparse.Namespace) -> int:
    """``verl-async generator|learner``: returns only on an error (else the process is
    replaced by the role's)."""
    try:
        if args.command == "generator":
            generator_command(args)
        else:
            learner_command(args)
    except JoinFailed as exc:
        print(f"verl-async {args.command}: {exc}", file=sys.stderr)
        return 1
    return 1
