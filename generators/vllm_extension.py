"""vLLM worker extension: lets each engine worker join the weight-sync group.

vLLM mixes this class into its worker (``worker_extension_cls``); the generator calls the
methods through ``AsyncLLM.collective_rpc``. Names carry a ``verl_`` prefix so they never
clash with the worker's own attributes.

Weights are loaded inside vLLM's layerwise reload (initialize before, finalize after):
on CPU vLLM repacks weights after loading, and a bare ``model.load_weights`` there either
fails or silently leaves the packed copy stale.

A LoRA run's update is an adapter instead (``verl_receive_adapter``): it is written as a
peft adapter directory, which vLLM then loads by path (``LoRARequest``); the model's own
weights are never touched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import torch

from verl_async import lora
from verl_async.lifetime import die_with
from verl_async.protocol import MemoryOffer, ParamSpec, WeightUpdate
from verl_async.schema import LoraConfig
from verl_async.weight_sync import join_group, receive_weights


class WeightSyncExtension:
    def verl_die_with(self, pid: int) -> None:
        """End this worker's process when the generator process ``pid`` ends: vLLM's engine
        processes outlive a SIGKILLed generator otherwise, hung in a weight broadcast
        that will never complete (verl_async/lifetime.py)."""
        die_with(pid)

    def verl_join_weight_sync(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float,
        epoch: int = 0,
    ) -> int:
        """Join the group of ``epoch`` as rank ``rank_offset + worker rank``; returns that
        rank. Its rendezvous may take ``join_timeout_s``, each broadcast ``timeout_s``."""
        rank = rank_offset + self.rank
        self.verl_group = join_group(
            host, port, rank, world_size, backend, timeout_s, epoch,
            join_timeout_s=join_timeout_s,
        )  # fmt: skip
        return rank

    def verl_rejoin_weight_sync(self, epoch: int) -> None:
        """The learner rebuilt the group: drop this worker's end of it and join ``epoch``."""
        self.verl_group = self.verl_group.rebuild(epoch)

    def verl_receive_weights(
        self, specs: list[list], bucket_bytes: int, memory: dict | None = None
    ) -> int:
        """Receive one update broadcast by the learner and load it; returns bytes received.
        ``memory``: the update's ``MemoryOffer`` as a dict (``memory_offer``), or None.

        A broadcast that fails midway (a member died) still finalizes the reload, so the
        model stays loadable; its weights are then a mix, and the generator does not
        sample again until a whole update has arrived (``VllmEngine.apply_update``)."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        param_specs = [ParamSpec(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        received = 0
        initialize_layerwise_reload(model)
        try:
            offer = msgspec.convert(memory, MemoryOffer) if memory is not None else None
            for bucket in receive_weights(
                self.verl_group, param_specs, bucket_bytes, self.device, offer
            ):
                model.load_weights(bucket)
                received += sum(t.numel() * t.element_size() for _, t in bucket)
        finally:
            finalize_layerwise_reload(model, self.model_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return received

    def verl_receive_adapter(
        self,
        specs: list[list],
        bucket_bytes: int,
        path: str,
        lora_cfg: dict,
        memory: dict | None = None,
    ) -> int:
        """Receive one adapter update and write it as a peft adapter directory at ``path``;
        returns bytes received.

        Every worker takes part in the broadcast (it is a collective), but one worker per
        machine (local rank 0) keeps the tensors and writes: vLLM's workers all load the
        adapter from the same path, so each machine needs one copy. The directory appears
        whole or not at all (written beside it, then renamed), so a broadcast that fails
        midway leaves nothing a later load could pick up half-written."""
        param_specs = [ParamSpec(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        writer = self.local_rank == 0
        tensors: dict[str, torch.Tensor] = {}
        received = 0
        offer = msgspec.convert(memory, MemoryOffer) if memory is not None else None
        for bucket in receive_weights(
            self.verl_group, param_specs, bucket_bytes, self.device, offer
        ):
            received += sum(t.numel() * t.element_size() for _, t in bucket)
            if writer:
                tensors.update((name, t.cpu()) for name, t in bucket)
        if writer:
            _write_atomically(Path(path), tensors, LoraConfig(**lora_cfg), self.model_config.model)
        return received

    def verl_drop_adapter(self, path: str) -> None:
        """Delete an adapter directory that vLLM no longer uses (the worker that wrote it)."""
        if self.local_rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def verl_leave_weight_sync(self) -> None:
        """Shut the group down while the worker's interpreter is fully alive."""
        group = getattr(self, "verl_group", None)
        if group is not None:
            self.verl_group = None
            group.close()


def memory_offer(update: WeightUpdate) -> dict | None:
    """``update.memory`` as plain values for ``collective_rpc`` (the workers rebuild the
    ``MemoryOffer``), or None."""
    return msgspec.to_builtins(update.memory) if update.memory is not None else None


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], cfg: LoraConfig, base: str):
    """``lora.write_adapter_dir`` into a sibling, then renamed to ``path``: a reader sees
    the whole adapter or none (a directory left by an earlier try is replaced). The
    engine's directory of adapters (in /dev/shm) is this user's alone, so no other local
    user can read an adapter or swap it before vLLM loads it."""
    lora.private_dir(path.parent)
    part = path.with_name(f"{path.name}.part{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    lora.write_adapter_dir(part, tensors, cfg, base)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(part, path)
