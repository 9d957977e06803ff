"""A vLLM AsyncLLM engine wrapped for RL: sampling with per-token versions, weight swaps.

``generators.engine: vllm``; implements ``generators.interface.RolloutEngine``. Weight
updates reach each vLLM worker through the worker extension (generators/vllm_extension.py).
A LoRA run's updates are adapters, which vLLM serves side by side, one per version
(generators/vllm_adapters.py): no pause, no prefix-cache reset.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

from generators.interface import Sample, Sampling
from generators.vllm_adapters import Adapters, lora_engine_args
from generators.vllm_extension import memory_offer
from verl_async.protocol import WeightUpdate
from verl_async.schema import RunConfig

EXTENSION = "generators.vllm_extension.WeightSyncExtension"

log = logging.getLogger("verl_async.generator")


def start_vllm_engine(
    cfg: RunConfig, model_path: str, seed: int, tensor_parallel_size: int = 1
) -> VllmEngine:
    """The engine over a new AsyncLLM (call it inside the event loop that will use it)."""
    engine = VllmEngine(start_async_llm(cfg, model_path, seed, tensor_parallel_size), cfg)
    engine.tie_workers_to_this_process()
    return engine


def start_async_llm(cfg: RunConfig, model_path: str, seed: int, tensor_parallel_size: int = 1):
    """AsyncLLM with the weight-sync worker extension; logprobs after temperature/top-p.

    ``tensor_parallel_size``: vLLM workers the engine spans (its placement group's GPUs,
    ``placement.tensor_parallel_size``); each of them joins the weight-sync group. A LoRA
    run enables vLLM's adapters, with a slot for each version in flight (which forces
    eager mode on CPU: this engine is eager anyway)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    g = cfg.generators
    num_seqs = max(g.max_inflight_groups * g.group_size, 8)
    # vLLM requires max_num_batched_tokens >= max_num_seqs; keep its own default otherwise.
    budget = {"max_num_batched_tokens": num_seqs} if num_seqs > 2048 else {}
    args = AsyncEngineArgs(
        model=model_path,
        dtype=cfg.model.dtype,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=g.max_model_len,
        max_num_seqs=num_seqs,
        **budget,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
        kv_cache_memory_bytes=g.kv_cache_mb << 20,
        gpu_memory_utilization=g.gpu_memory_utilization,
        enable_prefix_caching=True,
        **lora_engine_args(cfg),
    )
    return AsyncLLM.from_engine_args(args)


class VllmEngine:
    """``RolloutEngine`` over a vLLM AsyncLLM: owns it and the version of the weights it
    currently runs."""

    def __init__(self, llm, cfg: RunConfig) -> None:
        self.llm = llm
        self.cfg = cfg
        self.loaded_version = 0
        self.ids = itertools.count()
        self.version_changed = asyncio.Event()
        self.running = asyncio.Event()  # cleared while a swap is in progress
        self.running.set()
        self.resubmitted = 0  # requests aborted by a swap and continued from their prefix
        self.sync_epoch = 0  # the weight-sync group's epoch the workers are members of
        self.weights_lost = False  # an update failed midway: paused until a whole one arrives
        self.adapters = Adapters(llm, cfg) if cfg.model.lora.rank else None  # LoRA runs
        self.tied: asyncio.Future | None = None  # tie_workers_to_this_process's call

    def tie_workers_to_this_process(self) -> None:
        """Make every worker process of the engine (and the engine core above them) end
        when this process ends, SIGKILL included: vLLM's processes do not, and one blocked
        in a weight broadcast would hang there for good. Sent at once; its reply is
        awaited by ``join_weight_sync`` (a failure shows there)."""
        self.tied = asyncio.ensure_future(
            self.llm.collective_rpc("verl_die_with", args=(os.getpid(),))
        )

    async def join_weight_sync(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        epoch: int = 0,
    ) -> None:
        """Every worker joins the weight-sync group of ``epoch`` (blocks until the whole
        group has)."""
        if self.tied is not None:
            await self.tied
        w = self.cfg.weights
        timeouts = (w.timeout_s, w.join_timeout_s)  # of each broadcast, of the rendezvous
        await self.llm.collective_rpc(
            "verl_join_weight_sync",
            timeout=w.join_timeout_s,
            args=(host, port, world_size, rank_offset, backend, *timeouts, epoch),
        )
        self.sync_epoch = epoch

    async def rejoin_weight_sync(self, epoch: int) -> None:
        """The learner rebuilt the group (a generator was restarted): every worker drops its
        end of the old one and joins ``epoch`` (blocks until the whole group has)."""
        await self.llm.collective_rpc(
            "verl_rejoin_weight_sync", timeout=self.cfg.weights.join_timeout_s, args=(epoch,)
        )
        self.sync_epoch = epoch

    async def leave_weight_sync(self, timeout_s: float = 5.0) -> None:
        """Shut each worker's end of the group down before the engine stops (best effort:
        an engine that already died has nothing left to shut down)."""
        try:
            await self.llm.collective_rpc("verl_leave_weight_sync", timeout=timeout_s)
        except Exception as exc:
            log.warning("could not leave the weight-sync group cleanly: %s", exc)
        else:
            log.info("left the weight-sync group")

    async def sample(self, prompt_ids: list[int], how: Sampling) -> Sample:
        """Stream one completion, stamping each token with the version loaded when it arrived
        (LoRA: with the version of the adapter the request was submitted with, which
        sampled every one of its tokens).

        A token computed just before a swap but read just after would be stamped new and
        understate staleness; ``apply_update`` only bumps the version after the swap's RPC
        round-trips and the engine has resumed, by which time pre-swap outputs have been
        delivered (pause_generation drains them). Stamps can only err towards older.

        In ``abort`` mode a swap ends the request early (finish reason "abort"); it is then
        resubmitted as prompt + tokens so far with the remaining token budget, so the prefix
        is re-read by the new weights and only the continuation is sampled from them.
        """
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        out = Sample()
        while True:
            params = SamplingParams(
                max_tokens=how.max_tokens - len(out.token_ids),
                temperature=how.temperature,
                top_p=how.top_p,
                top_k=how.top_k,
                stop=list(how.stop) or None,
                logprobs=0,
                # Stop strings are matched on text; token ids alone need no detokenizer.
                detokenize=bool(how.stop),
                output_kind=RequestOutputKind.DELTA,
            )
            prompt = TokensPrompt(prompt_token_ids=prompt_ids + out.token_ids)
            finish_reason = None
            request_id = f"s{next(self.ids)}"
            bound, adapter = self._bind(request_id)
            try:
                async for chunk in self.llm.generate(
                    prompt, params, request_id, lora_request=adapter
                ):
                    if out.prompt_ids is None:
                        out.prompt_ids = chunk.prompt_token_ids
                    comp = chunk.outputs[0]
                    version = self.loaded_version if bound is None else bound
                    for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=True):
                        out.token_ids.append(tok)
                        out.logprobs.append(lp[tok].logprob)
                        out.versions.append(version)
                    finish_reason = comp.finish_reason
            finally:
                self._release(bound, request_id)
            if finish_reason != "abort" or len(out.token_ids) >= how.max_tokens:
                return out
            # Aborted by a swap: continue once the new weights are in.
            await self.running.wait()
            self.resubmitted += 1

    async def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Logprob of each token of ``ids`` given its prefix (ids[1:]), under the loaded weights.

        The check that a weight push took effect: compare with the learner's own logprobs.
        """
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        final = None
        request_id = f"probe{next(self.ids)}"
        bound, adapter = self._bind(request_id)
        try:
            async for out in self.llm.generate(
                TokensPrompt(prompt_token_ids=ids), params, request_id, lora_request=adapter
            ):
                final = out
        finally:
            self._release(bound, request_id)
        return [d[ids[i]].logprob for i, d in enumerate(final.prompt_logprobs) if d is not None]

    def _bind(self, request_id: str) -> tuple[int | None, object | None]:
        """LoRA: the version and adapter a request submitted now runs on (it holds the
        adapter until ``_release``). Else (None, None): the weights are the engine's own."""
        if self.adapters is None:
            return None, None
        return self.adapters.bind(request_id)

    def _release(self, bound: int | None, request_id: str) -> None:
        if self.adapters is not None:
            self.adapters.release(bound, request_id)

    async def apply_update(self, update: WeightUpdate) -> float:
        """Pause (``weights.mode``: keep or abort in-flight requests), receive, reset, resume.

        If the broadcast fails midway (a member of the group died), the weights are a mix
        of two versions: the engine stays paused, ``weights_lost`` is set, and the error
        propagates; the next whole update (over the rebuilt group) resumes it.

        A LoRA update goes to ``_apply_adapter`` instead: no pause at all."""
        if self.adapters is not None:
            return await self._apply_adapter(update)
        t0 = time.perf_counter()
        self.running.clear()
        if not self.weights_lost:  # else still paused since the failed one
            await self._pause(self.cfg.weights.mode)
        specs = [[p.name, p.dtype, list(p.shape)] for p in update.params]
        try:
            await self.llm.collective_rpc(
                "verl_receive_weights",
                timeout=self.cfg.weights.timeout_s,
                args=(specs, update.bucket_bytes, memory_offer(update)),
            )
        except Exception:
            self.weights_lost = True
            raise
        self.weights_lost = False
        try:
            await self.llm.reset_prefix_cache()
        finally:
            await self.llm.resume_generation()
            self.running.set()
        self.loaded_version = update.version
        self.version_changed.set()
        self.version_changed = asyncio.Event()
        return time.perf_counter() - t0

    async def _apply_adapter(self, update: WeightUpdate) -> float:
        """Receive the adapter of ``update`` and submit new requests with it.

        Nothing pauses: a request keeps the adapter it was submitted with to its end, so in
        ``keep`` mode running requests finish on the old version, stamped with it. In
        ``abort`` mode the requests on older adapters are aborted once the new one is
        loaded, and ``sample`` resubmits each one's continuation on it. A broadcast that
        fails midway leaves the adapters in service whole: sampling goes on with them,
        ``weights_lost`` waits for the next whole update. No prefix-cache reset: vLLM keys
        cached blocks by adapter (name and path), so no version reads another's KV."""
        t0 = time.perf_counter()
        try:
            await self.adapters.receive(update)
        except Exception:
            self.weights_lost = True
            raise
        self.weights_lost = False
        self.loaded_version = update.version
        if self.cfg.weights.mode == "abort":
            stale = self.adapters.older_requests(prefix="s")  # samples, not probes
            if stale:
                await asyncio.wait_for(self.llm.abort(stale), self.cfg.weights.timeout_s)
        self.version_changed.set()
        self.version_changed = asyncio.Event()
        return time.perf_counter() - t0

    async def _pause(self, mode: str) -> None:
        """Pause the scheduler (``keep`` or ``abort`` in-flight requests), KV cache kept.

        ``AsyncLLM.pause_generation`` does exactly this and then sleeps 20 ms so that final
        outputs of aborted requests tend to arrive before it returns; its own docstring
        says the sleep is not needed for correctness. Measured here it is half of a swap's
        engine downtime (22.7 of ~42 ms with the tiny model), so call the engine core
        directly when it offers the method. Stamping stays safe without the sleep: the
        version is bumped only after three more engine round trips (receive RPC, prefix
        cache reset, resume), and the engine returns outputs in order, so every pre-swap
        token has been read by then.
        """
        core = getattr(self.llm, "engine_core", None)
        if hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:  # other vLLM versions: the public call, sleep included
            await self.llm.pause_generation(mode=mode, clear_cache=False)

    def shutdown(self) -> None:
        """Shut the AsyncLLM and its engine processes down."""
        if self.llm is not None:
            self.llm.shutdown()
            if self.adapters is not None:
                self.adapters.close()
            # Drop it while modules are alive: AsyncLLM.__del__ at interpreter exit would
            # otherwise call into half-torn-down modules and print a traceback.
            self.llm = None
