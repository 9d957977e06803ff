"""The LoRA adapters a vLLM engine serves (``model.lora.rank`` > 0): one per version.

Each update is written as a peft adapter directory by the workers (the worker extension's
``verl_receive_adapter``) and registered with vLLM as ``LoRARequest(f"v{version}",
version + 1, path)``. vLLM binds an adapter to each request when it is submitted, so
versions never mix inside a request: a request runs to its end on the adapter it was
submitted with, while new requests take the newest. Version 0 is the base model (``lora_B``
starts at zero): requests at version 0 carry no adapter.

An adapter is unloaded (``remove_lora``) and its directory deleted once no request uses it
and a newer one is loaded. The directories live in memory-backed storage (``/dev/shm``)
when it has room: vLLM's public API loads adapters by path only, and tmpfs keeps that path
off the disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from collections import defaultdict
from pathlib import Path

import msgspec

from generators.vllm_extension import memory_offer
from verl_async.protocol import WeightUpdate
from verl_async.schema import RunConfig
from verl_async.weight_sync import plan_buckets

log = logging.getLogger("verl_async.generator")

SHM = Path("/dev/shm")


def adapter_slots(cfg: RunConfig) -> int:
    """Adapters vLLM holds at once (``max_loras``): the versions a staleness bound keeps in
    flight (``staleness.max`` + 1), plus the newest one arriving."""
    return cfg.staleness.max + 2


def lora_engine_args(cfg: RunConfig) -> dict:
    """The AsyncEngineArgs that make vLLM serve the run's adapters (none without LoRA)."""
    if not cfg.model.lora.rank:
        return {}
    slots = adapter_slots(cfg)
    return {
        "enable_lora": True,
        "max_lora_rank": cfg.model.lora.rank,
        "max_loras": slots,
        "max_cpu_loras": slots + 1,  # the one being loaded while every slot is busy
    }


class Adapters:
    """The adapter versions loaded in one vLLM engine and the requests using each."""

    def __init__(self, llm, cfg: RunConfig) -> None:
        self.llm = llm
        self.cfg = cfg
        self.newest = 0  # the version new requests are submitted with (0: no adapter)
        self.loaded: dict[int, object] = {}  # version -> its LoRARequest, registered in vLLM
        self.users: dict[int, set[str]] = defaultdict(set)  # version -> request ids using it
        self.tag = f"verl_async_lora_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.roots: set[Path] = set()  # where this engine's directories were written
        self.unloading: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ requests

    def bind(self, request_id: str) -> tuple[int, object | None]:
        """The version (and its ``LoRARequest``, None at version 0) a request submitted now
        runs on; it counts as a user of that adapter until ``release``."""
        version = self.newest
        self.users[version].add(request_id)
        return version, self.loaded.get(version)

    def release(self, version: int, request_id: str) -> None:
        """The request ended (finished, aborted or cancelled): an adapter left without users
        and not the newest is unloaded."""
        users = self.users.get(version)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self.users[version]
        self._unload_unused()

    def older_requests(self, prefix: str) -> list[str]:
        """Ids (starting with ``prefix``) of requests running on an adapter older than the
        newest: those an abort-mode update cuts."""
        return [
            r
            for v, ids in self.users.items()
            if v < self.newest
            for r in ids
            if r.startswith(prefix)
        ]

    # ------------------------------------------------------------------ updates

    async def receive(self, update: WeightUpdate) -> None:
        """Receive ``update`` into a new adapter directory and register it with vLLM (loaded
        at once, so a bad adapter fails here rather than in a request); new requests run on
        it from then on."""
        from vllm.lora.request import LoRARequest

        path = self._path(update)
        specs = [[p.name, p.dtype, list(p.shape)] for p in update.params]
        timeout = self.cfg.weights.timeout_s
        lora_cfg = msgspec.to_builtins(self.cfg.model.lora)
        await self.llm.collective_rpc(
            "verl_receive_adapter",
            timeout=timeout,
            args=(specs, update.bucket_bytes, str(path), lora_cfg, memory_offer(update)),
        )
        request = LoRARequest(f"v{update.version}", update.version + 1, str(path))
        try:
            await asyncio.wait_for(self.llm.add_lora(request), timeout)
        except BaseException:
            self._spawn(self._drop_dir(path))
            raise
        self.loaded[update.version] = request
        self.newest = update.version
        self._unload_unused()

    def _path(self, update: WeightUpdate) -> Path:
        """The update's directory: under /dev/shm when it has room for every adapter slot
        at this size (container defaults can be as small as 64 MiB), else the temp dir."""
        size = sum(b.nbytes for b in plan_buckets(update.params, update.bucket_bytes))
        need = (adapter_slots(self.cfg) + 2) * size
        if SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free > need:
            root = SHM / self.tag
        else:
            root = Path(tempfile.gettempdir()) / self.tag
        self.roots.add(root)
        return root / f"v{update.version}"

    # ------------------------------------------------------------------ unloading

    def _unload_unused(self) -> None:
        for version in [v for v in self.loaded if v != self.newest and v not in self.users]:
            self._spawn(self._unload(self.loaded.pop(version)))

    async def _unload(self, request) -> None:
        """Unload one adapter from vLLM and delete its directory (best effort: a leftover
        goes with the engine's directories at shutdown)."""
        try:
            await asyncio.wait_for(self.llm.remove_lora(request.lora_int_id), 30)
        except Exception as exc:  # noqa: BLE001 (vLLM's LRU cache evicts it in time)
            log.warning("could not unload adapter %s: %r", request.lora_name, exc)
        await self._drop_dir(Path(request.lora_path))

    async def _drop_dir(self, path: Path) -> None:
        try:
            await self.llm.collective_rpc("verl_drop_adapter", timeout=30, args=(str(path),))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not delete adapter directory %s: %r", path, exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.unloading.add(task)
        task.add_done_callback(self.unloading.discard)

    def close(self) -> None:
        """Delete this engine's adapter directories (the engine is shutting down), and drop
        the AsyncLLM: ``VllmEngine.shutdown`` drops it while modules are alive, which a
        reference kept here would defeat (a traceback from its ``__del__`` at exit)."""
        self.llm = None
        for task in list(self.unloading):
            task.cancel()
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)
