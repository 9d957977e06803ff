"""``launcher: ray``: the same role processes, each started inside a Ray actor.

Placement follows verl's: every role gets a placement group with one bundle per device
(``cpu``/``cpu:N`` -> {"CPU": 1}, ``cuda:N`` -> {"GPU": 1, "CPU": 1}; the buffer, which
owns no device, one CPU), packed on one node (STRICT_PACK): a generator's tensor-parallel
group and the learner's ranks each run on a single node. One actor per role, in the
group's first bundle (an actor fits in one bundle), starts the role's usual command line
(``plan.plan_roles``) as a subprocess in a session of its own, with its output in
``<run_dir>/logs/<role>.log``; on a GPU node the role sees the GPUs Ray reserved for all
of its group's bundles. The launcher watches and stops the roles through ``RayProcess``,
the same way it handles local processes.

Which node: the buffer, the reward models and the teachers run on the launcher's node
(``prepare`` picked their ports on it); the learner on the node of ``weights.host`` when that is set, else on
the launcher's; generators anywhere, unless ``buffer.host`` is loopback, which keeps
every role on the launcher's node. Every node must see the run directory at the same
path (a shared filesystem): the actors write their logs there and the roles read
``config.yaml`` and ``endpoints.json`` from it.

Only plain strings, lists, numbers and dicts go to the actors. Without ``ray.address``
a Ray instance is started for the run, sized to the bundles (no dashboard, its session
files in a temporary folder), and shut down at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.markup import escape

from verl_async import placement
from verl_async.config import ConfigError, is_loopback
from verl_async.launch.plan import Role, RolePlan, plan_roles, stop_roles
from verl_async.launch.run_dir import RoleFailed
from verl_async.lifetime import tethered
from verl_async.schema import RunConfig

RAY_MIN = (2, 9)
INSTALL = "pip install 'verl-async[ray]'"
LOST = -1  # the exit code reported for a role whose actor is gone


def check_installed() -> None:
    """``launcher: ray`` needs Ray: one error naming the key and the install command."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = tuple(int(p) for p in version("ray").split(".")[:2])
    except PackageNotFoundError:
        found = None
    if found is None or found < RAY_MIN:
        have = "is not installed" if found is None else f"is {version('ray')}"
        raise ConfigError(
            f"bad value for 'launcher': 'ray' needs Ray >= 2.9, which {have}; "
            f"install it with `{INSTALL}` (or `pip install 'ray>=2.9'`)"
        )


# --------------------------------------------------------------------- placement


def bundle(device: str) -> dict[str, float]:
    """The Ray resources of one device."""
    return {"GPU": 1.0, "CPU": 1.0} if placement.is_cuda(device) else {"CPU": 1.0}


def bundles(plan: RolePlan) -> list[dict[str, float]]:
    """One bundle per device of the role; one CPU for a role without a device."""
    return [bundle(d) for d in plan.devices] or [{"CPU": 1.0}]


def node_pins(
    cfg: RunConfig, plans: list[RolePlan], here: str, resolve=socket.gethostbyname
) -> dict[str, str]:
    """The node address each role must run on, by role name ('' for anywhere); ``here``
    is the launcher's node."""
    if is_loopback(cfg.buffer.host):  # nothing off this node could reach the buffer
        return {p.name: here for p in plans}
    weights = cfg.weights.host
    learner = resolve(weights) if weights and not is_loopback(weights) else here
    return {
        p.name: learner if p.name == "learner" else "" if p.name.startswith("generator") else here
        for p in plans
    }


def pinned(group: list[dict[str, float]], node: str) -> list[dict[str, float]]:
    """``group`` held on the node at address ``node`` (Ray's ``node:<ip>`` resource on its
    first bundle; STRICT_PACK keeps the others beside it)."""
    if not node:
        return group
    return [{**group[0], f"node:{node}": 0.001}, *group[1:]]


def local_resources(plans: list[RolePlan]) -> tuple[int, int]:
    """CPUs and GPUs a local Ray instance declares: exactly what the bundles need, so Ray
    schedules nothing beyond the placement (and starts no spare workers)."""
    totals = [sum(b.get(k, 0.0) for p in plans for b in bundles(p)) for k in ("CPU", "GPU")]
    return int(totals[0]), int(totals[1])


# --------------------------------------------------------------------- the actor


class RoleActor:
    """Runs one role's command inside its placement group (made a Ray actor with
    ``ray.remote`` when the launcher starts; methods take and return plain values)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: str, cwd: str):
        # Ray's processes share the launcher's process group, so a Ctrl-C in its terminal
        # is sent here too; the launcher stops the role itself (the learner first).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.cwd = cwd if os.path.isdir(cwd) else os.path.dirname(os.path.dirname(log_path))
        self.proc: subprocess.Popen | None = None

    def start(self, more_gpus: list[str]) -> dict[str, str]:
        """Start the role (again, for a reward model) and say where it runs. The role sees
        this actor's GPU and ``more_gpus``, those of its group's other bundles: Ray's
        choice on this node, whatever N the placement wrote."""
        import ray
        from ray.util import get_node_ip_address

        ctx = ray.get_runtime_context()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        gpus = ",".join([*(str(g) for g in ray.get_gpu_ids()), *more_gpus])
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        where = {
            "actor": ctx.get_actor_id(),
            "node": get_node_ip_address(),
            "placement_group": ctx.get_placement_group_id() or "",
            "gpus": gpus,
        }
        header = (
            f"\n--- {datetime.now():%Y-%m-%d %H:%M:%S} verl-async: {self.name} in Ray actor "
            f"{where['actor']} on node {where['node']} (placement group "
            f"{where['placement_group']}, GPUs [{gpus}]) ---\n"
        )
        with open(self.log_path, "ab") as log:
            log.write(header.encode())
            log.flush()
            self.proc = subprocess.Popen(
                tethered([sys.executable, *self.argv[1:]]),  # this node's interpreter
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return where

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


class RayProcess:
    """A role's process inside its actor, seen as ``plan.RoleProcess``. Every call is
    bounded by ``timeout_s``; an actor that is gone or does not answer reads as the role
    having exited with code ``LOST`` (and a line in the role's log says why)."""

    def __init__(self, actor: Any, name: str, log_path: Path, timeout_s: float):
        self.actor, self.name, self.log_path, self.timeout_s = actor, name, log_path, timeout_s
        self.code: int | None = None
        self.lost = False
        self.more_gpus: list[str] = []  # the GPUs of the group's other bundles

    def _call(self, method: str, *args) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.lost:
            return None
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            self.lost, self.code = True, LOST
            why = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            with contextlib.suppress(OSError), open(self.log_path, "a") as log:
                log.write(f"\n--- verl-async: the Ray actor of {self.name} is lost: {why} ---\n")
            return None

    def start(self) -> dict[str, str]:
        """Start the role's command in the actor (again: a reward model's restart)."""
        where = self._call("start", self.more_gpus)
        self.code = LOST if self.lost else None
        return where or {}

    def restart(self) -> RayProcess:
        self.start()
        return self

    def poll(self) -> int | None:
        if self.code is None:
            self.code = self._call("poll") if not self.lost else LOST
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(0.1)
        return code

    def signal_group(self, sig: int) -> None:
        self._call("signal_group", int(sig))


# --------------------------------------------------------------------- a run


@contextlib.contextmanager
def ray_roles(cfg: RunConfig, run_dir: Path, console) -> Iterator[list[Role]]:
    """Join (or start) Ray, start every role in its placement group and yield them; on
    the way out stop the roles, then their actors and groups, then leave Ray (a local
    instance is shut down; its session files are kept only when the run failed)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    plans = plan_roles(cfg, run_dir)
    temp_dir = connect(cfg, plans, console)
    roles: list[Role] = []
    groups: list[Any] = []
    failed = False
    try:
        start_actors(cfg, run_dir, plans, roles, groups, console)
        yield roles
    except Exception:
        failed = True  # an interrupt is no failure: Ray's logs go with the rest
        raise
    finally:
        stop_roles(roles, run_dir=run_dir, write_grace_s=cfg.checkpoint.write_timeout_s)
        for role in roles:
            with contextlib.suppress(Exception):  # gone already: nothing to kill
                ray.kill(role.proc.actor)
        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        ray.shutdown()
        if temp_dir and failed:
            console.print(f"Ray's own logs: {temp_dir}", markup=False, soft_wrap=True)
        elif temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def connect(cfg: RunConfig, plans: list[RolePlan], console) -> str:
    """``ray.init``: join ``ray.address``, or start a local instance for the run; returns
    the local instance's session folder ('' when joining). The launcher's own SIGINT and
    SIGTERM handlers are kept (Ray installs its own)."""
    import ray

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    options: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    temp_dir = "" if cfg.ray.address else tempfile.mkdtemp(prefix="verl-ray-")
    try:
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, **options)
            console.print(f"ray: joined the cluster at {escape(cfg.ray.address)}")
        else:
            start_local(plans, temp_dir, options, console)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        where = f"the Ray cluster at ray.address={cfg.ray.address}" if cfg.ray.address else "Ray"
        raise RoleFailed(f"could not start or reach {where}: {exc}") from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return temp_dir


def start_local(plans: list[RolePlan], temp_dir: str, options: dict[str, Any], console) -> None:
    """A Ray instance of this machine, sized to the bundles (no dashboard), with its
    session files in ``temp_dir``. Its GPUs are the ones the placement names (Ray reads
    CUDA_VISIBLE_DEVICES when it starts), so a role gets one of those."""
    import ray

    cpus, gpus = local_resources(plans)
    named = sorted(
        {placement.device_index(d) for p in plans for d in p.devices if placement.is_cuda(d)}
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in named)
    try:
        # address="local": a new instance, never one found running on this machine
        ray.init(
            address="local",
            num_cpus=cpus,
            num_gpus=gpus,
            include_dashboard=False,
            _temp_dir=temp_dir,
            **options,
        )
    finally:
        if named and visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif named:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    console.print(
        f"ray: started a local instance ({cpus} CPU, {gpus} GPU; session files in {temp_dir})",
        markup=False,
        soft_wrap=True,
    )


def start_actors(
    cfg: RunConfig, run_dir: Path, plans: list[RolePlan], roles: list[Role], groups: list, console
) -> None:
    """Reserve every role's placement group, then start one actor per role in it. Each
    group and role is appended to ``groups`` and ``roles`` as soon as it exists, so that
    whatever fails midway is stopped."""
    import ray
    from ray.util import get_node_ip_address

    pins = node_pins(cfg, plans, get_node_ip_address())
    check_nodes(pins)
    for plan in plans:
        groups.append(reserve(plan, pins[plan.name]))
    deadline = time.monotonic() + cfg.ray.timeout_s
    for plan, group in zip(plans, groups, strict=True):
        if not group.wait(max(deadline - time.monotonic(), 1.0)):
            raise RoleFailed(
                f"Ray could not place the {plan.name} process ({group.bundle_specs}) within "
                f"{cfg.ray.timeout_s:.0f} s; the cluster has {ray.cluster_resources()} in all "
                "(ray.timeout_s sets the wait; see docs/ray.md)"
            )
    actor_class = ray.remote(RoleActor)
    for plan, group in zip(plans, groups, strict=True):
        role = start_actor(actor_class, plan, group, run_dir, cfg.ray.timeout_s)
        roles.append(role)
        role.proc.more_gpus = other_gpus(plan, group, cfg.ray.timeout_s)
        where = role.proc.start()
        if role.proc.code is not None:
            raise RoleFailed(
                f"the Ray actor of the {plan.name} process did not start; see {role.log_path}"
            )
        console.print(
            f"ray: {plan.name} in actor {where['actor']} on {where['node']} "
            f"(placement group {where['placement_group']}, bundles {bundles(plan)})",
            markup=False,
            soft_wrap=True,
        )


def reserve(plan: RolePlan, node: str) -> Any:
    """The role's placement group: its bundles on one node (``node`` if named)."""
    from ray.util.placement_group import placement_group

    return placement_group(
        pinned(bundles(plan), node), strategy="STRICT_PACK", name=f"verl-async:{plan.name}"
    )


def start_actor(
    actor_class: Any, plan: RolePlan, group: Any, run_dir: Path, timeout_s: float
) -> Role:
    """The role's actor, in its group's first bundle (its role is not started yet)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    own = bundles(plan)
    log = run_dir / "logs" / f"{plan.name}.log"
    actor = actor_class.options(
        num_cpus=own[0]["CPU"],
        num_gpus=own[0].get("GPU", 0.0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0
        ),
        max_restarts=0,
    ).remote(plan.name, plan.command(run_dir), plan.env, str(log), os.getcwd())
    proc = RayProcess(actor, plan.name, log, timeout_s)
    restart = proc.restart if plan.max_restarts else None
    return Role(plan.name, proc, log, restart, 0, plan.max_restarts)


def other_gpus(plan: RolePlan, group: Any, timeout_s: float) -> list[str]:
    """The GPU ids Ray reserved for bundles 1.. of the role's ``group`` (its actor holds
    bundle 0: an actor fits in one bundle), asked of a short task in each; the group
    keeps them reserved, and a bundle's GPUs stay the same for as long as it lives."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(bundle_gpu_ids)
    asks = [
        probe.options(
            num_cpus=0,
            num_gpus=b["GPU"],
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        ).remote()
        for i, b in enumerate(bundles(plan))
        if i > 0 and b.get("GPU")
    ]
    try:
        return [g for ids in ray.get(asks, timeout=timeout_s) for g in ids]
    except GetTimeoutError:
        raise RoleFailed(
            f"Ray did not say within {timeout_s:.0f} s which GPUs the {plan.name} process got"
        ) from None


def bundle_gpu_ids() -> list[str]:
    """Run as a Ray task inside a bundle: the GPU ids it was given."""
    import ray

    return [str(g) for g in ray.get_gpu_ids()]


def check_nodes(pins: dict[str, str]) -> None:
    """Every node a role is pinned to is a live node of the cluster."""
    import ray

    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    for name, node in pins.items():
        if node and node not in nodes:
            key = "weights.host" if name == "learner" else "buffer.host"
            raise RoleFailed(
                f"the {name} process must run on {node} ({key}), which is not a node of the "
                f"Ray cluster (nodes: {', '.join(sorted(nodes))}); set {key} to one of them"
            )
