"""Teachers of on-policy distillation, run in the learner process.

Each teacher is loaded and run like the reference policy (learners/critic.py:
``load_reference``, ``reference_logprobs``): frozen, no optimizer, one no-grad forward per
batch, log-probs of the sampled tokens at the sampling temperature at the loss mask's
positions only (prompt, tool and observation tokens stay 0 and are never read); for
``forward_kl_topk`` the same pass also gives, at those positions, the teacher's
``distillation.topk`` most likely tokens and their log-probs (``teacher_pass``). Each
sample goes to the teacher serving its ``data_source`` (``DistillationConfig.teacher_of``).

``TeacherScores`` is what the learner asks of its teachers. ``LocalTeachers`` answers in
this process (``distillation.scoring: learner``). With ``scoring: process`` each teacher
runs in a process of its own (teacher/, placed on ``placement.teachers``, restarted when it
dies) that the generators ask before they push a group, so the scores come with the batch
and ``FromBatch`` only reads them: no teacher pass on the learner's critical path.

A teacher must use the student's tokenizer, since it scores the student's token ids:
``check_tokenizer`` compares the two vocabularies (every token string and its id) and the
special tokens, and refuses a teacher whose differ, naming both directories.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from learners.batching import TrainBatch
from learners.critic import load_reference
from learners.logprobs import PassOptions, TokenStats, token_stats
from verl_async.config_base import ConfigError
from verl_async.schema import DistillationConfig
from verl_async.teachers import check_tokenizer


@dataclass
class Scored:
    """A batch's teacher log-probs."""

    logp: torch.Tensor  # [N, T-1] the teacher's log-prob of each sampled token; 0 elsewhere
    scored: torch.Tensor  # [N, T-1] float 0/1: the positions a teacher scored
    teacher: list[int]  # [N] index (in distillation.teachers) of each row's teacher
    seconds: float | None  # wall time of the scoring here (None: scored elsewhere)
    # forward_kl_topk: [N, T-1, K] each scored position's K most likely tokens under its
    # teacher, their log-probs and ids (long); 0 elsewhere. None for the other modes.
    top_logp: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


class TeacherScores(Protocol):
    def score(self, batch: TrainBatch, sources: list[str]) -> Scored:
        """The teachers' log-probs of ``batch``'s sampled tokens; ``sources`` is the
        ``data_source`` of each of its rows."""


class LocalTeachers:
    """The teachers as frozen models in this process (one copy on every learner rank)."""

    def __init__(
        self, models: list, cfg: DistillationConfig, temperature: float, options: PassOptions
    ) -> None:
        self.models, self.cfg = models, cfg
        self.temperature, self.options = temperature, options

    @classmethod
    def load(
        cls,
        cfg: DistillationConfig,
        student_path: str,
        device: torch.device,
        dtype: torch.dtype,
        temperature: float,
        options: PassOptions,
    ) -> LocalTeachers:
        """Each teacher of ``cfg`` (its ``path``, resolved at launch), after its tokenizer
        is checked against the student's."""
        models = []
        for teacher in cfg.teachers:
            check_tokenizer(student_path, teacher.path, teacher.name)
            models.append(load_reference(teacher.path, device, dtype))
            check_topk(cfg, models[-1].config.vocab_size, teacher.name)
        return cls(models, cfg, temperature, options)

    def score(self, batch: TrainBatch, sources: list[str]) -> Scored:
        t0 = time.perf_counter()
        route = [self.cfg.teacher_of(source) for source in sources]
        logp = torch.zeros_like(batch.loss_mask)
        scored = torch.zeros_like(batch.loss_mask)
        top_k = self.cfg.topk if self.cfg.loss_mode == "forward_kl_topk" else 0
        top = top_tensors(batch.loss_mask, top_k)
        for i, model in enumerate(self.models):
            rows = [r for r, t in enumerate(route) if t == i]
            if not rows:
                continue
            idx = torch.tensor(rows, device=batch.loss_mask.device)
            part = dataclasses.replace(
                batch,
                input_ids=batch.input_ids[idx],
                attention_mask=batch.attention_mask[idx],
                loss_mask=batch.loss_mask[idx],
            )
            stats = teacher_pass(model, part, self.temperature, self.options, top_k)
            logp[idx] = stats.logp
            scored[idx] = (part.loss_mask > 0).to(scored.dtype)
            if top is not None:
                top[0][idx], top[1][idx] = stats.top_logp, stats.top_ids
        return Scored(logp, scored, route, time.perf_counter() - t0, *(top or ()))


def top_tensors(loss_mask: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Zeroed [N, T-1, K] log-probs and ids (long) for a batch's teacher top k (None: k 0)."""
    if not top_k:
        return None
    shape = (*loss_mask.shape, top_k)
    return loss_mask.new_zeros(shape), torch.zeros(shape, dtype=torch.long, device=loss_mask.device)


def teacher_pass(
    model, batch: TrainBatch, temperature: float, options: PassOptions, top_k: int = 0
) -> TokenStats:
    """One no-grad pass of a teacher over ``batch`` at the loss mask's positions: the
    sampled tokens' log-probs at the sampling temperature (as the reference's,
    learners/critic.py) and, with ``top_k``, its ``top_k`` most likely tokens there and
    their log-probs, taken chunk by chunk from the same logits (learners/logprobs.py), so
    no [N, T, V] tensor of the batch is kept."""
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.loss_mask
    with torch.no_grad():
        return token_stats(model, ids, attn, mask, temperature, options=options, top_k=top_k)


def check_topk(cfg: DistillationConfig, vocab_size: int, name: str) -> None:
    """forward_kl_topk: refuse a ``topk`` above the teacher's vocabulary."""
    if cfg.loss_mode == "forward_kl_topk" and cfg.topk > vocab_size:
        raise ConfigError(
            f"bad value for 'distillation.topk': {cfg.topk} is more tokens than teacher "
            f"'{name}' has ({vocab_size}); give at most {vocab_size}"
        )


class FromBatch:
    """The teachers' log-probs that came with the batch: teacher processes scored every
    group before its generator pushed it (the buffer refuses a group without them)."""

    def __init__(self, cfg: DistillationConfig) -> None:
        self.cfg = cfg

    def score(self, batch: TrainBatch, sources: list[str]) -> Scored:
        if batch.logp_teacher is None:
            raise RuntimeError(
                f"step {batch.step} came without teacher log-probs, but distillation.scoring "
                "is 'process': the buffer was started with another configuration"
            )
        route = [self.cfg.teacher_of(source) for source in sources]
        return Scored(batch.logp_teacher, (batch.loss_mask > 0).float(), route, None)


def distill_metrics(scored: Scored, batch: TrainBatch, cfg: DistillationConfig) -> dict:
    """distill/<teacher>/reverse_kl: the mean over the teacher's scored tokens of the
    sampling policy's log-prob minus the teacher's (the plain estimate of KL(student ||
    teacher) on the student's own samples); distill/<teacher>/tokens; distill/score_s (scored here);
    distill/scored_fraction: the sampled tokens a teacher scored."""
    mask = batch.loss_mask > 0
    row_teacher = torch.tensor(scored.teacher, device=mask.device)
    gap = batch.behav_logprobs - scored.logp
    row: dict = {}
    if scored.seconds is not None:
        row["distill/score_s"] = round(scored.seconds, 4)
    for i, teacher in enumerate(cfg.teachers):
        mine = mask & (scored.scored > 0) & (row_teacher == i)[:, None]
        n = int(mine.sum())
        row[f"distill/{teacher.name}/tokens"] = n
        row[f"distill/{teacher.name}/reverse_kl"] = float(gap[mine].mean()) if n else 0.0
    total = int(mask.sum())
    row["distill/scored_fraction"] = (
        float((scored.scored > 0)[mask].sum()) / total if total else 1.0
    )
    return row


def score_step(teachers: TeacherScores, batch: TrainBatch, local: TrainBatch, dp, cfg) -> dict:
    """Score this rank's rows (``local``) and gather the log-probs to every rank: sets
    ``local.logp_teacher`` and ``batch.logp_teacher``. Returns the step's distill/* metrics
    (``distill_metrics``, over the whole step; the time is this rank's)."""
    if isinstance(teachers, FromBatch):  # every rank holds the whole step's already
        return distill_metrics(teachers.score(batch, batch.sample_sources), batch, cfg)
    start, stop = dp.bounds(batch) if dp.world > 1 else (0, len(batch.sample_sources))
    scored = teachers.score(local, batch.sample_sources[start:stop])
    if cfg.loss_mode == "forward_kl_topk" and scored.top_logp is None:
        raise RuntimeError("distillation.loss_mode=forward_kl_topk: the teachers gave no top k")
    local.logp_teacher = scored.logp
    # the update reads this rank's rows only: the top k is not gathered
    local.teacher_topk_logp, local.teacher_topk_ids = scored.top_logp, scored.top_ids
    batch.logp_teacher = dp.gather_rows(scored.logp, batch)
    whole = Scored(
        batch.logp_teacher,
        dp.gather_rows(scored.scored, batch),
        [cfg.teacher_of(source) for source in batch.sample_sources],
        scored.seconds,
    )
    return distill_metrics(whole, batch, cfg)
