"""What every role process needs at start-up: the run directory, endpoints, placement.

The launcher writes ``config.yaml`` (resolved) and ``endpoints.json`` into the run directory
and starts each role as ``python -m <role> --run-dir DIR``; roles read both files, so no
config field is ever filled in after validation.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from verl_async.config import load_config
from verl_async.config_base import ConfigError
from verl_async.lifetime import Stopped, die_with_parent, hold_run_dir
from verl_async.placement import device_index, is_cuda
from verl_async.schema import RunConfig


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    buffer: str
    """ZMQ endpoint of the buffer, e.g. tcp://127.0.0.1:5555."""
    weights_host: str
    weights_port: int
    model_path: str
    """Directory every role loads the initial (version 0) weights from."""
    resume_from: str = ""
    """Checkpoint directory the buffer and learner restore from; empty for a fresh run."""
    reward_models: dict[str, str] = {}
    """ZMQ endpoint of each ``model`` reward source's process, by source name."""
    teachers: dict[str, str] = {}
    """ZMQ endpoint of each distillation teacher's process, by teacher name."""


class RunContext(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    cfg: RunConfig
    endpoints: Endpoints

    @property
    def path(self) -> Path:
        return Path(self.run_dir)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_endpoints(run_dir: Path, endpoints: Endpoints) -> None:
    """The run's role tokens (verl_async/auth.py), then ``endpoints.json`` beside them,
    whole (written aside, then renamed): whoever finds the endpoints can read the tokens
    too, and prove their role with them."""
    from verl_async.auth import write_role_tokens

    write_role_tokens(run_dir)
    tmp = run_dir / f".endpoints.json.{os.getpid()}"
    tmp.write_bytes(msgspec.json.encode(endpoints))
    os.replace(tmp, run_dir / "endpoints.json")


def load_context(run_dir: str | Path) -> RunContext:
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    endpoints = msgspec.json.decode((run_dir / "endpoints.json").read_bytes(), type=Endpoints)
    return RunContext(run_dir=str(run_dir), cfg=cfg, endpoints=endpoints)


def role_args(
    description: str,
    with_index: bool = False,
    with_name: bool = False,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", required=True)
    if with_index:
        parser.add_argument("--index", type=int, required=True)
    if with_name:
        parser.add_argument("--name", required=True, help="the reward source this process serves")
    if more is not None:
        more(parser)
    return parser.parse_args()


QUIET_LOGGERS = ("httpx", "httpcore", "openai", "aiohttp.access", "urllib3", "filelock")
"""Libraries that log a line per request (an agent's every call through the ``openai``
client, thousands a minute) or per lock at INFO: in a role's log from WARNING up only."""


def setup_logging(role: str) -> logging.Logger:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return logging.getLogger(f"verl_async.{role}")


RANK_DEVICES = "VERL_ASYNC_RANK_DEVICES"
"""Set for a multi-rank job: comma list of each rank's device, rank order (LOCAL_RANK)."""


def device_env(devices: str | list[str]) -> dict[str, str]:
    """Environment that places a process on one device ('cpu', 'cpu:N', 'cuda:N') or on one
    engine's group of them (all 'cuda:N': the GPUs it sees; all 'cpu:N': the cores it is
    pinned to and vLLM binds its OpenMP threads to, e.g. VLLM_CPU_OMP_THREADS_BIND=0,1)."""
    group = [devices] if isinstance(devices, str) else list(devices)
    if is_cuda(group[0]):
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(device_index(d)) for d in group)}
    env = {"CUDA_VISIBLE_DEVICES": ""}
    cores = [str(device_index(d)) for d in group if device_index(d) is not None]
    if cores:
        env["VERL_ASYNC_CPU_CORES"] = ",".join(cores)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(cores)
        env["OMP_NUM_THREADS"] = str(len(cores))
    return env


def ranks_env(devices: list[str]) -> dict[str, str]:
    """Environment of a multi-rank job (``torch.distributed.run`` sets each rank's
    LOCAL_RANK) whose rank r runs on ``devices[r]``, all CUDA or all CPU.

    CUDA: every rank sees the job's GPUs and rank r uses the r-th of them (cuda:r).
    CPU: no GPU; each rank pins itself to its core at start-up (``apply_cpu_pinning``).
    ``RANK_DEVICES`` lists the devices as the ranks see them (``rank_device``)."""
    if is_cuda(devices[0]):
        visible = ",".join(str(device_index(d)) for d in devices)
        seen = ",".join(f"cuda:{r}" for r in range(len(devices)))
        return {"CUDA_VISIBLE_DEVICES": visible, RANK_DEVICES: seen}
    return {"CUDA_VISIBLE_DEVICES": "", RANK_DEVICES: ",".join(devices), "OMP_NUM_THREADS": "1"}


def rank_device() -> str | None:
    """This rank's device in a multi-rank job ('cpu', 'cpu:N' or 'cuda:r'); None outside one."""
    devices, local_rank = os.environ.get(RANK_DEVICES), os.environ.get("LOCAL_RANK")
    if not devices or local_rank is None:
        return None
    return devices.split(",")[int(local_rank)]


_UNPINNED: set[int] | None = None  # the cores this process could use before pinning


def apply_cpu_pinning() -> None:
    """Pin this process to the cores the launcher chose: its ``cpu:N`` placement (or core
    group), or, as a rank of a multi-rank job, the core of its own entry in RANK_DEVICES
    (one thread then: the ranks' cores are theirs alone). 'cpu' and CUDA: not pinned."""
    cores = os.environ.get("VERL_ASYNC_CPU_CORES")
    device = rank_device()
    if device is not None:
        index = device_index(device)
        cores = str(index) if index is not None and not is_cuda(device) else None
    if cores is None:
        return
    _pin({int(c) for c in cores.split(",")})


def _pin(wanted: set[int]) -> None:
    """Restrict the process (its threads started from now on) to ``wanted``, remembering
    the cores it had (``unpin_this_thread``); cores it may not use leave it unpinned."""
    global _UNPINNED
    available = os.sched_getaffinity(0)
    if wanted <= available:
        _UNPINNED = available
        os.sched_setaffinity(0, wanted)
        import torch

        torch.set_num_threads(len(wanted))


def unpin_this_thread() -> None:
    """Let the calling thread run on any core the process had before pinning.

    For background I/O threads (the checkpoint writer): the placement pins the role's
    compute, and a writer confined to the compute core takes its CPU time out of the
    step; unpinned, the kernel runs it on whichever core is idle. Linux applies
    ``sched_setaffinity(0, ...)`` to the calling thread only.
    """
    if _UNPINNED is not None:
        os.sched_setaffinity(0, _UNPINNED)


def start_role(
    name: str,
    description: str,
    with_index: bool = False,
    with_name: bool = False,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Common prologue of a role process: arguments, parent-death signal, logging, pinning.

    ``with_index``: one of several alike (``--index``, generators); ``with_name``: the
    process serving one named reward source (``--name``, reward models); ``more`` adds a
    role's own options to the parser."""
    die_with_parent()  # first: a launcher that died meanwhile leaves nothing behind
    args = role_args(description, with_index, with_name, more)
    hold_run_dir(args.run_dir)  # no other run starts in the directory while this one lives
    # A crash in native code (SIGSEGV, SIGABRT, ...) leaves every thread's Python stack in
    # the role's log instead of a bare exit code.
    faulthandler.enable()
    suffix = str(args.index) if with_index else f"[{args.name}]" if with_name else ""
    setup_logging(name + suffix)
    apply_cpu_pinning()
    return args


@contextlib.contextmanager
def report_exit(log: logging.Logger) -> Iterator[None]:
    """Around a role's work: an end other than a return (or an exit with code 0) is the
    last line of the role's log, naming what ended it, and exits non-zero.

    ``Stopped`` (a stop the role was asked for): one INFO line, its code (128 + the
    signal). ``ConfigError``: one ERROR line (a mistake in the run's config, no
    traceback), code 1. Anything else, ``BaseException`` included (a ``SystemExit`` that
    code deep in the role raised, a KeyboardInterrupt no signal handler of ours raised, an
    exception raised in a ``finally`` on the way out): the traceback, then one ERROR line
    with the exception's type, message and innermost frame; code: the SystemExit's
    number, 130 for a KeyboardInterrupt (as Python's own), else 1. The role leaves by a
    ``SystemExit`` with a number, on which Python prints nothing more."""
    try:
        yield
    except BaseException as exc:
        code = exit_code(exc)
        if code == 0:
            raise
        if isinstance(exc, Stopped):
            log.info("stopped: %s (exit code %d)", exc.why, code)
        else:
            if not isinstance(exc, ConfigError):
                log.error("what ended this process:", exc_info=exc)
            log.error("ended by %s (exit code %d)", describe_exception(exc), code)
        raise SystemExit(code) from None


def exit_code(exc: BaseException) -> int:
    """The exit code a role ended by ``exc`` leaves with (0: a normal end)."""
    if isinstance(exc, SystemExit):
        if exc.code is None or exc.code is False:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def describe_exception(exc: BaseException) -> str:
    """``Type: message, raised at file:line in function`` (the traceback's innermost
    frame), on one line."""
    try:
        message = " ".join(str(exc).split())[:1000]
    except Exception:  # a user's exception whose __str__ fails
        message = "<message unreadable>"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    tb = exc.__traceback__
    if tb is None:
        return text
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = tb.tb_frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        path = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    return f"{text}, raised at {path}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"


STARTUP_FILE = "startup.jsonl"


def mark_cpu(run_dir: str | Path, role: str, live: tuple[float, float] = (0.0, 0.0)) -> None:
    """Record the CPU seconds ``role``'s process used, user and system, and those of its
    child processes that have ended and been waited for: event "cpu". ``live``: what
    descendants that the role could not wait for used (``descendants_cpu`` read before
    they were stopped: a vLLM engine's processes), added to the children's."""
    import resource

    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    mark(
        run_dir, role, "cpu", user_s=round(me.ru_utime, 2), sys_s=round(me.ru_stime, 2),
        children_user_s=round(kids.ru_utime + live[0], 2),
        children_sys_s=round(kids.ru_stime + live[1], 2),
    )  # fmt: skip


def descendants_cpu() -> tuple[float, float]:
    """User and system CPU seconds used so far by this process's live descendants (from
    /proc; (0, 0) where there is none)."""
    children: dict[int, list[int]] = {}
    times: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        times[int(entry.name)] = (int(fields[11]), int(fields[12]))  # utime, stime (ticks)
    user = system = 0
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        u, s_ = times.get(pid, (0, 0))
        user, system = user + u, system + s_
        todo += children.get(pid, [])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


def mark(run_dir: str | Path, role: str, event: str, **fields: float) -> None:
    """Record that ``role`` reached ``event`` now in ``<run_dir>/startup.jsonl`` (one short
    ``O_APPEND`` write, so processes never interleave within a line; best effort: never fails
    the role). The launcher turns the lines into its start-up breakdown."""
    line = json.dumps({"role": role, "event": event, "t": time.time(), **fields}) + "\n"
    try:
        fd = os.open(Path(run_dir) / STARTUP_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass
