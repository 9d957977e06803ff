"""A generator engine without vLLM: the model in this process, sampled with transformers.

``generators.engine: hf`` (verl's ``rollout.name: hf``). For models so small that vLLM's
fixed costs dominate (the tiny default: three serial vLLM imports at start-up, and a
per-step overhead larger than the model's forward pass), and for machines without vLLM.
It implements the same interface as the vLLM engine (``generators.interface.RolloutEngine``),
so the generator's loops do not know which one runs.

Batching is in waves rather than continuous: every request queued when a wave starts
(up to ``max_inflight_groups * group_size`` with the same sampling settings) is decoded
together, left-padded, with a KV cache, for at most ``max_tokens`` steps; requests that
arrive meanwhile wait for the next wave. Requests of a wave with the same prompt (a
group's samples) share its prefill. A wave runs in a worker thread (torch releases
the GIL), so the event loop keeps polling versions and pushing rollouts.

No KV cache outlives its wave: each request's prefix (for a multi-turn episode, the whole
conversation so far) is recomputed by the weights that sample its continuation, so a
cache never mixes two versions across a swap (vLLM's engine resets its prefix cache at
every update for the same reason).

Weights change only between waves, under the lock that a wave holds, and the version is
bumped before the lock is released: every token of a wave is stamped with the version
that computed it, exactly. In ``weights.mode: abort`` a swap ends the running wave at its
next token; its unfinished requests continue from their prefix under the new weights,
as the vLLM engine's do.

Sampling follows vLLM's ``processed_logprobs``: logits / temperature, then top-k, then
top-p, and the log-prob recorded is of that processed distribution.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace

import torch

from generators.interface import Sample, Sampling
from verl_async import lora
from verl_async.protocol import WeightUpdate
from verl_async.schema import RunConfig
from verl_async.weight_sync import SyncGroup, join_group, receive_weights

log = logging.getLogger("verl_async.generator")


@dataclass
class _Request:
    prompt: list[int]
    how: Sampling
    future: asyncio.Future  # -> (tokens, logprobs, version, aborted)


def start_hf_engine(cfg: RunConfig, model_path: str, seed: int) -> HFEngine:
    """The model and tokenizer from ``model_path`` on this process's device, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    dtype = getattr(torch, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if lora.enabled(cfg):  # the learner's adapter, at zero until the first update
        model = lora.apply(model, cfg.model.lora)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    generator = torch.Generator(device).manual_seed(seed)
    return HFEngine(model, tokenizer, cfg, generator)


class HFEngine:
    """``RolloutEngine`` over a transformers model held in this process."""

    def __init__(self, model, tokenizer, cfg: RunConfig, generator: torch.Generator) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.rng = generator
        self.device = next(model.parameters()).device
        g = cfg.generators
        self.max_batch = max(g.max_inflight_groups * g.group_size, 8)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(model, tokenizer)
        self.keep_last = _takes_logits_to_keep(model)
        self.loaded_version = 0
        self.version_changed = asyncio.Event()
        self.running = asyncio.Event()  # cleared while a swap is in progress
        self.running.set()
        self.resubmitted = 0
        self.sync_epoch = 0
        self.weights_lost = False
        self.group: SyncGroup | None = None
        self.waves = 0
        self.queue: list[_Request] = []
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()  # held by a wave, a swap or a probe
        self.abort = threading.Event()  # a swap in abort mode: end the wave at its next token
        self.server = asyncio.create_task(self._serve())
        self.server.add_done_callback(self._server_ended)

    # ------------------------------------------------------------------ weight sync

    async def join_weight_sync(
        self, host: str, port: int, world_size: int, rank_offset: int, backend: str, epoch: int = 0
    ) -> None:
        w = self.cfg.weights
        self.group = await asyncio.to_thread(
            join_group, host, port, rank_offset, world_size, backend, w.timeout_s, epoch,
            join_timeout_s=w.join_timeout_s,
        )  # fmt: skip
        self.sync_epoch = epoch

    async def rejoin_weight_sync(self, epoch: int) -> None:
        self.group = await asyncio.to_thread(self.group.rebuild, epoch)
        self.sync_epoch = epoch

    async def leave_weight_sync(self, timeout_s: float = 5.0) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
            log.info("left the weight-sync group")

    async def apply_update(self, update: WeightUpdate) -> float:
        """Wait for the running wave (or end it, in abort mode), receive, resume; a receive
        that fails midway leaves sampling paused (``weights_lost``) and raises."""
        t0 = time.perf_counter()
        self.running.clear()
        if self.cfg.weights.mode == "abort":
            self.abort.set()
        async with self.lock:
            self.abort.clear()
            try:
                await asyncio.to_thread(self._receive, update)
            except Exception:
                self.weights_lost = True
                raise
            self.weights_lost = False
            self.loaded_version = update.version  # before any wave can start again
            self.running.set()
        self.version_changed.set()
        self.version_changed = asyncio.Event()
        return time.perf_counter() - t0

    @torch.no_grad()
    def _receive(self, update: WeightUpdate) -> None:
        state = self.model.state_dict(keep_vars=True)  # tied weights under each name
        adapter = lora.enabled(self.cfg)  # a LoRA run sends the adapter alone
        received = receive_weights(
            self.group, update.params, update.bucket_bytes, self.device, update.memory
        )
        for bucket in received:
            for name, tensor in bucket:
                name = lora.model_name(name) if adapter else name
                if name not in state:
                    raise KeyError(f"the learner sent '{name}', which this model does not have")
                state[name].copy_(tensor)

    # ------------------------------------------------------------------ sampling

    async def sample(self, prompt_ids: list[int], how: Sampling) -> Sample:
        """One completion; a request cut short by an abort-mode swap goes on from its
        prefix under the new weights."""
        out = Sample(prompt_ids=list(prompt_ids))
        while True:
            if self.server.done():
                raise RuntimeError("the transformers engine's wave loop is not running")
            budget = how.max_tokens - len(out.token_ids)
            future = asyncio.get_running_loop().create_future()
            self.queue.append(
                _Request(prompt_ids + out.token_ids, replace(how, max_tokens=budget), future)
            )
            self.wake.set()
            tokens, logprobs, version, aborted = await future
            out.token_ids += tokens
            out.logprobs += logprobs
            out.versions += [version] * len(tokens)
            if not aborted or len(out.token_ids) >= how.max_tokens:
                return out
            await self.running.wait()
            self.resubmitted += 1

    async def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Logprob of each token of ``ids`` given its prefix (ids[1:]), loaded weights."""
        async with self.lock:
            return await asyncio.to_thread(self._prompt_logprobs, ids)

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int]) -> list[float]:
        x = torch.tensor([ids], device=self.device)
        logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), -1)
        return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()

    async def _serve(self) -> None:
        """Run waves while requests wait; a wave that raises fails its requests only."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(0)  # let every request made in this turn of the loop queue
            while self.queue:
                await self.running.wait()
                async with self.lock:
                    batch = self._take() if self.running.is_set() else []
                    if not batch:
                        continue
                    version = self.loaded_version
                    try:
                        results = await asyncio.to_thread(self._wave, batch)
                    except Exception as exc:  # noqa: BLE001 (reported to each request)
                        for req in batch:
                            if not req.future.done():
                                req.future.set_exception(exc)
                        continue
                    self.waves += 1
                for req, (tokens, logprobs, aborted) in zip(batch, results, strict=True):
                    if not req.future.done():  # a cancelled request has no one waiting
                        req.future.set_result((tokens, logprobs, version, aborted))

    def _server_ended(self, task: asyncio.Task) -> None:
        """The wave loop ends at shutdown; should it ever die, no request waits forever."""
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("the transformers engine's wave loop failed: %r", error)
        for req in self.queue:
            if req.future.done():
                continue
            if error is None:
                req.future.cancel()
            else:
                req.future.set_exception(error)
        self.queue = []

    def _take(self) -> list[_Request]:
        """The next wave: the oldest request's sampling settings, up to ``max_batch``."""
        self.queue = [r for r in self.queue if not r.future.done()]
        if not self.queue:
            return []
        how = self.queue[0].how
        batch = [r for r in self.queue if r.how == how][: self.max_batch]
        taken = {id(r) for r in batch}
        self.queue = [r for r in self.queue if id(r) not in taken]
        return batch

    @torch.no_grad()
    def _wave(self, batch: list[_Request]) -> list[tuple[list[int], list[float], bool]]:
        """Decode the batch together: left-padded prompts, one token a step, KV cache.

        Requests with the same prompt (a group's samples) share its prefill: each distinct
        prompt is computed once, then its keys, values and last logits are copied to every
        request that asked for it, and each samples on its own from there."""
        from transformers import DynamicCache

        how = batch[0].how
        owners: dict[tuple[int, ...], int] = {}
        owner = [owners.setdefault(tuple(r.prompt), len(owners)) for r in batch]
        n, width = len(batch), max(len(r.prompt) for r in batch)
        ids = torch.full((len(owners), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(owners), width), dtype=torch.long)
        for i, prompt in enumerate(owners):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        last = {"logits_to_keep": 1} if self.keep_last else {}  # the head at the last position
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, **last,
        ).logits[:, -1].float()  # fmt: skip
        if len(owners) < n:  # every request gets its own copy of its prompt's state
            rows = torch.tensor(owner, device=self.device)
            cache.batch_select_indices(rows)
            logits, mask, positions = logits[rows], mask[rows], positions[rows]
        tokens = [[] for _ in batch]
        logprobs = [[] for _ in batch]
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        for step in range(how.max_tokens):
            tok, lp = sample_processed(logits, how, self.rng)
            for i in (~done).nonzero()[:, 0].tolist():
                tokens[i].append(int(tok[i]))
                logprobs[i].append(float(lp[i]))
            done |= torch.isin(tok, self.eos_ids)
            if how.stop:
                done |= self._stopped(tokens, how.stop)
            if bool(done.all()) or step + 1 == how.max_tokens or self.abort.is_set():
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], 1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=tok[:, None], attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            ).logits[:, -1].float()  # fmt: skip
        return [
            (t, p, self.abort.is_set() and not bool(d) and len(t) < how.max_tokens)
            for t, p, d in zip(tokens, logprobs, done.tolist(), strict=True)
        ]

    def _stopped(self, tokens: list[list[int]], stop: tuple[str, ...]) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return torch.tensor([any(s in t for s in stop) for t in texts], device=self.device)

    def shutdown(self) -> None:
        """Stop the wave loop."""
        self.server.cancel()  # its done-callback cancels the requests still queued


def sample_processed(
    logits: torch.Tensor, how: Sampling, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the processed distribution (temperature,
    then top-k, then top-p: the smallest set of most likely tokens whose probability
    reaches top_p, the most likely always kept). Temperature 0 is greedy."""
    if how.temperature == 0:
        logp = torch.log_softmax(logits, -1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logits = logits / how.temperature
    if 0 < how.top_k < logits.shape[-1]:
        kth = logits.topk(how.top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if how.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the more likely tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= how.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    tok = torch.multinomial(logp.exp(), 1, generator=rng)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def _takes_logits_to_keep(model) -> bool:
    """Whether the model's forward (under peft's wrapper, which passes it on) can compute
    its head at the last position only."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def _eos_ids(model, tokenizer) -> torch.Tensor:
    """Every token that ends a completion: the generation config's and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return torch.tensor(sorted(ids), dtype=torch.long, device=next(model.parameters()).device)
