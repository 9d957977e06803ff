"""A teacher's log-probs of sampled tokens: one no-grad forward of every sample (its
prompt and response) in chunks of ``batch_size`` rows, right-padded, each response
token's log-prob taken from the position before it at the sampling temperature, float32
(the numbers the learner would compute with the same model in its own pass).

Rows of a chunk are sorted by length first, so a chunk pads little; a row's values do
not depend on its chunk mates (right padding, causal attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Row:
    """One sample: ``ids`` = prompt then response; its response starts at ``start``."""

    ids: np.ndarray  # [P + R] int64
    start: int  # P


def load_teacher(path: str, device: str, dtype: torch.dtype):
    """The teacher's causal LM, frozen, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.requires_grad_(False)
    return model.to(device).eval()


@torch.no_grad()
def response_logprobs(
    model, rows: list[Row], temperature: float, batch_size: int, device: str
) -> list[np.ndarray]:
    """Each row's [R] float32 log-probs of its response tokens under ``model``."""
    out: list[np.ndarray | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids), reverse=True)
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        width = len(rows[chunk[0]].ids)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, i in enumerate(chunk):
            n = len(rows[i].ids)
            ids[r, :n] = torch.from_numpy(rows[i].ids)
            attn[r, :n] = 1
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
        for r, i in enumerate(chunk):
            row = rows[i]
            n = len(row.ids)
            if n == row.start:  # an empty response
                out[i] = np.zeros(0, np.float32)
                continue
            scores = logits[r, row.start - 1 : n - 1].float() / temperature  # [R, V]
            logp = torch.log_softmax(scores, dim=-1)
            targets = ids[r, row.start : n].to(logp.device)
            out[i] = logp.gather(1, targets[:, None])[:, 0].cpu().numpy()
    return out
