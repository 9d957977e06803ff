"""Turn a ``Batch`` message into padded tensors, and fetch the next one ahead of time."""

from __future__ import annotations

import queue
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from verl_async import protocol as P
from verl_async.auth import Credentials
from verl_async.transport import BufferClient


@dataclass(frozen=True)
class Filtered:
    """Dynamic sampling's part of a step (buffer/filtering.py)."""

    groups: list[list[int]]  # [group id, prompt index] of each group dropped among the step's
    total: int  # groups dropped so far, this step's included
    past_bound: int  # of the step's groups, those kept past filter_groups.max_in_a_row
    past_bound_total: int  # the same, so far

    def metrics(self) -> dict[str, int]:
        """The ``filter_groups/*`` fields of the step's metrics row."""
        return {
            "filter_groups/dropped": len(self.groups),
            "filter_groups/dropped_total": self.total,
            "filter_groups/admitted_past_bound": self.past_bound,
            "filter_groups/admitted_past_bound_total": self.past_bound_total,
        }


@dataclass
class TrainBatch:
    """A step's samples, right-padded. T = longest prompt + response in the batch.

    With several learner ranks it holds the whole step, rows ordered rank by rank
    (``shard_sizes``); learners/distributed.py cuts out a rank's own rows.

    A multi-turn sample's response holds observation tokens between its sampled turns:
    ``loss_mask`` is 0 there, and their placeholders are sanitised (behaviour log-prob 0,
    version -1, turn reward 0), so they look like positions outside any response to every
    reader that forgets the mask."""

    step: int
    input_ids: torch.Tensor  # [N, T] long
    attention_mask: torch.Tensor  # [N, T] long
    loss_mask: torch.Tensor  # [N, T-1] float, 1 where target t+1 is a sampled response token
    behav_logprobs: torch.Tensor  # [N, T-1] float32, aligned with targets input_ids[:, 1:]
    token_versions: torch.Tensor  # [N, T-1] long (-1 outside responses and on observations)
    scores: np.ndarray  # [N, S] float32 raw score per reward source (NaN: not routed)
    failed: list[int]  # [S] samples whose source failed (scored with its default)
    sample_sources: list[str]  # [N] data_source of each sample
    group_index: torch.Tensor  # [N] long
    response_lengths: torch.Tensor  # [N] long
    dropped_stale: int
    buffer_size: int
    wait_s: float  # what the learner waited for this batch (measured by Prefetcher.get)
    group_ids: list[int]  # the step's groups (audit trail: trained.jsonl)
    group_prompts: list[int]  # prompt index of each group
    group_generators: list[int]  # the generator that sampled each group
    # crc32 of each sample's (group, index), tokens, logprobs, versions (and loss mask and
    # turn rewards, when the message has them)
    sample_digests: list[int]
    prompts_skipped: int  # prompts the buffer left out as too long
    shard_sizes: list[int]  # [ranks] rows of each rank's shard, in order
    # [N, T-1] float32: each turn's environment reward at its last sampled token; None: the
    # step has no turn reward at all.
    turn_rewards: torch.Tensor | None
    episodes: list  # [N] EpisodeStats of each multi-turn sample (None: single-turn), or []
    # The buffer's Stats right after the batch came (generator rate and timing totals),
    # asked by the prefetcher of the rank that writes metrics; None elsewhere.
    buffer_stats: P.Stats | None = None
    filtered: Filtered | None = None  # the groups dynamic sampling dropped among the step's
    # Set by the learner's compute_advantages:
    rewards: torch.Tensor | None = None  # [N] combined reward of each sample
    # [N, T-1] pi_prox, when needed before the update (policy_update then takes it as given)
    logp_prox: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None  # [N, T-1] the reference policy (algo.kl; its KL loss)
    # [N, T-1] the teachers' (distillation): from the batch when teacher processes scored
    # it, else set by the learner's score_teachers
    logp_teacher: torch.Tensor | None = None
    # [N, T-1, K] the teacher's K most likely tokens at each scored position: log-probs and
    # ids (long); this rank's rows only (distillation.loss_mode forward_kl_topk)
    teacher_topk_logp: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    values: torch.Tensor | None = None  # [N, T-1] the critic's, before its update (gae)
    # This batch in host memory, when it was copied to a device (``to``): the learner
    # decides its passes' shapes from it, without reading the device
    host: TrainBatch | None = None

    def to(self, device: torch.device) -> TrainBatch:
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in vars(self).items()
        }
        if self.host is None and self.input_ids.device.type == "cpu":
            moved["host"] = self
        return TrainBatch(**moved)


def collate(msg: P.Batch, frames: list, pad_id: int, pin: bool = False) -> TrainBatch:
    """A ``Batch`` message and its frames -> a ``TrainBatch`` (pinned host memory with ``pin``).

    Observation tokens (``loss_mask`` 0) keep their ids and attention but get the
    placeholders of a position outside any response, whatever the message holds there."""
    prompt = P.tensor(msg.prompt_ids, frames)
    resp = P.tensor(msg.response_ids, frames)
    behav = P.tensor(msg.behav_logprobs, frames)
    vers = P.tensor(msg.token_versions, frames)
    sampled = None if msg.loss_mask is None else P.tensor(msg.loss_mask, frames)
    turn = None if msg.turn_rewards is None else P.tensor(msg.turn_rewards, frames)
    teacher = None if msg.teacher_logprobs is None else P.tensor(msg.teacher_logprobs, frames)
    n = len(msg.response_lengths)
    total = [p + r for p, r in zip(msg.prompt_lengths, msg.response_lengths, strict=True)]
    width = max(total, default=1)
    ids = np.full((n, width), pad_id, np.int64)
    attn = np.zeros((n, width), np.int64)
    loss_mask = np.zeros((n, width - 1), np.float32)
    behav_pad = np.zeros((n, width - 1), np.float32)
    vers_pad = np.full((n, width - 1), -1, np.int64)
    turn_pad = None if turn is None else np.zeros((n, width - 1), np.float32)
    teacher_pad = None if teacher is None else np.zeros((n, width - 1), np.float32)
    po = ro = 0
    digests = []
    seen: dict[int, int] = {}  # without sample_index: samples come in group order
    for i, (p, r) in enumerate(zip(msg.prompt_lengths, msg.response_lengths, strict=True)):
        # A rollout is (group id, sample index); the digest also covers what it holds.
        g = msg.sample_group[i]
        j = seen[g] = msg.sample_index[i] if msg.sample_index else seen.get(g, -1) + 1
        digest = zlib.crc32(f"{msg.sample_group[i]}.{j}".encode())
        own = slice(ro, ro + r)
        parts = [resp[own], behav[own], vers[own]]
        parts += [a[own] for a in (sampled, turn) if a is not None]
        for part in parts:
            digest = zlib.crc32(part.tobytes(), digest)
        digests.append(digest)
        ids[i, :p] = prompt[po : po + p]
        ids[i, p : p + r] = resp[own]
        attn[i, : p + r] = 1
        # Target of position t is token t+1; response token j sits at p+j, so position p+j-1.
        cols = slice(p - 1, p - 1 + r)
        if sampled is None:
            loss_mask[i, cols] = 1
            behav_pad[i, cols] = behav[own]
            vers_pad[i, cols] = vers[own]
        else:  # observation tokens get the placeholders of positions outside a response
            keep = sampled[own] > 0
            loss_mask[i, cols] = keep
            behav_pad[i, cols] = np.where(keep, behav[own], 0.0)
            vers_pad[i, cols] = np.where(keep, vers[own], -1)
        if turn_pad is not None:
            turn_pad[i, cols] = turn[own] if sampled is None else np.where(keep, turn[own], 0.0)
        if teacher_pad is not None:  # the buffer checked: 0 on observation tokens
            teacher_pad[i, cols] = teacher[own]
        po += p
        ro += r
    source_of = dict(zip(msg.group_ids, msg.data_sources, strict=True))
    t = lambda a: torch.from_numpy(a).pin_memory() if pin else torch.from_numpy(a)  # noqa: E731
    return TrainBatch(
        step=msg.step,
        input_ids=t(ids),
        attention_mask=t(attn),
        loss_mask=t(loss_mask),
        behav_logprobs=t(behav_pad),
        token_versions=t(vers_pad),
        scores=np.asarray(msg.scores, np.float32).reshape(n, len(msg.failed)),
        failed=list(msg.failed),
        sample_sources=[source_of[g] for g in msg.sample_group],
        group_index=torch.tensor(msg.sample_group, dtype=torch.long),
        response_lengths=torch.tensor(msg.response_lengths, dtype=torch.long),
        dropped_stale=msg.dropped_stale,
        buffer_size=msg.buffer_size,
        wait_s=0.0,  # the learner's own measure, set when the step takes the batch
        group_ids=list(msg.group_ids),
        group_prompts=list(msg.group_prompts),
        group_generators=list(msg.group_generators),
        sample_digests=digests,
        prompts_skipped=msg.prompts_skipped,
        shard_sizes=list(msg.shard_sizes) or [n],
        turn_rewards=None if turn_pad is None else t(turn_pad),
        episodes=list(msg.episodes),
        logp_teacher=None if teacher_pad is None else t(teacher_pad),
        filtered=Filtered(
            [[k, p] for k, p in zip(msg.filtered_groups, msg.filtered_prompts, strict=True)],
            msg.filtered_total,
            msg.past_bound,
            msg.past_bound_total,
        ),
    )


def fetch_batch(
    client: BufferClient,
    step: int,
    rank: int,
    world: int,
    pad_id: int,
    pin: bool,
    deadline_s: float,
    on_wait=None,
) -> TrainBatch:
    """Long-poll the buffer until step ``step`` is complete; the learner version at step s
    is s. ``on_wait()`` is called after each poll that found it incomplete."""
    t0 = time.monotonic()
    poll_s = 2.0
    while True:
        reply, frames = client.request(
            P.GetBatch(step=step, rank=rank, world_size=world, learner_version=step, wait_s=poll_s),
            extra_wait_s=poll_s,
        )
        if isinstance(reply, P.Batch):
            return collate(reply, frames, pad_id, pin)
        if on_wait is not None:
            on_wait()
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(
                f"step {step}: {reply.missing_groups} prompt groups still missing after {deadline_s:.0f}s; "
                "are the generators alive? (see logs/generator*.log)"
            )


def copy_to_device(batch: TrainBatch, device: torch.device, stream=None):
    """(batch on ``device``, event or None). With a CUDA ``stream`` the copy from pinned
    host memory is issued on it and returns at once; ``wait_for_copy`` joins it."""
    if stream is None:
        return batch.to(device), None
    with torch.cuda.stream(stream):
        moved = batch.to(device)
        copied = torch.cuda.Event()
        copied.record(stream)
    return moved, copied


def wait_for_copy(batch: TrainBatch, copied) -> TrainBatch:
    """Make the current stream wait for a side-stream copy (not the host), and tell the
    allocator the tensors are used on the current stream from now on."""
    if copied is not None:
        current = torch.cuda.current_stream(batch.input_ids.device)
        current.wait_event(copied)
        for value in vars(batch).values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(current)
    return batch


class Prefetcher:
    """Hands the learner each step's batch; by default fetched ahead of time.

    ``background`` (``learner.prefetch``): a thread with its own socket fetches step s+1
    while step s trains. On CUDA the batch is collated into pinned host memory and copied
    to ``device`` on a side stream by that thread, so the host-to-device copy overlaps the
    current step's compute too; ``get`` makes the compute stream wait for that copy only.
    Without ``background`` each batch is fetched and copied when the step asks for it.
    ``on_wait()`` runs on the calling thread about once a second while a batch is awaited.
    With ``stats`` (the rank that writes metrics) the buffer's ``Stats`` are asked right
    after each batch comes, on the same thread: the generator telemetry stays off the
    batch and, with ``background``, off the training thread.
    """

    def __init__(
        self,
        endpoint: str,
        timeout_s: float,
        steps: range,
        rank: int,
        world: int,
        pad_id: int,
        device: torch.device,
        deadline_s: float,
        background: bool = True,
        credentials: Credentials | None = None,
        on_wait=None,
        stats: bool = False,
    ) -> None:
        self.on_wait = on_wait
        self.stats = stats
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.deadline_s = deadline_s
        self.device = device
        self.cuda = device.type == "cuda"
        self.args = (endpoint, timeout_s, steps, rank, world, pad_id)
        self.credentials = credentials  # the learner's key or token (verl_async/auth.py)
        self.thread = None
        if background:
            self.thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
            self.thread.start()
        else:
            self.client = BufferClient(endpoint, timeout_s, self.credentials)
            self.steps = iter(steps)

    def _fetch(self, client: BufferClient, step: int, stream=None, on_wait=None):
        _, _, _, rank, world, pad_id = self.args
        batch = fetch_batch(client, step, rank, world, pad_id, self.cuda, self.deadline_s, on_wait)
        if self.stats:
            batch.buffer_stats = client.request(P.GetStats())[0]
        return copy_to_device(batch, self.device, stream)

    def _run(self) -> None:
        endpoint, timeout_s, steps = self.args[:3]
        client = BufferClient(endpoint, timeout_s, self.credentials)
        stream = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            for step in steps:
                self.q.put(self._fetch(client, step, stream))
        except BaseException as exc:  # handed to the training thread, which raises it
            self.q.put(exc)
        finally:
            client.close()

    def get(self) -> TrainBatch:
        t0 = time.monotonic()
        if self.thread is None:
            item = self._fetch(self.client, next(self.steps), on_wait=self.on_wait)
        else:
            item = self._next(t0 + self.deadline_s + 30)
        if isinstance(item, BaseException):
            raise item
        batch = wait_for_copy(*item)
        # What the learner actually waited, not how long the batch took to complete.
        batch.wait_s = time.monotonic() - t0
        return batch

    def _next(self, deadline: float):
        """The prefetch thread's next item, calling ``on_wait`` each second until it comes."""
        while True:
            try:
                return self.q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no batch from the prefetch thread in {self.deadline_s + 30:.0f}s"
                    ) from None
                if self.on_wait is not None:
                    self.on_wait()

    def close(self) -> None:
        if self.thread is None:
            self.client.close()
