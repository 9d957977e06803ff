"""Prompt datasets (JSONL or Parquet, read with pyarrow) and the per-epoch prompt order."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from verl_async.config import ConfigError


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    answer: str


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """Read ``prompt`` and ``answer`` columns; one clear error for a missing file or column."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"bad value for 'data.path': file '{path}' does not exist")
    table = pq.read_table(path) if path.suffix == ".parquet" else pj.read_json(path)
    for column in ("prompt", "answer"):
        if column not in table.column_names:
            raise ConfigError(f"bad value for 'data.path': '{path}' has no '{column}' column")
    if table.num_rows == 0:
        raise ConfigError(f"bad value for 'data.path': '{path}' holds no prompts")
    prompts = table.column("prompt").to_pylist()
    answers = table.column("answer").to_pylist()
    return [PromptRecord(str(p), str(a)) for p, a in zip(prompts, answers, strict=True)]


def epoch_order(num_prompts: int, epoch: int, seed: int) -> list[int]:
    """Prompt indices in the order epoch ``epoch`` issues them (deterministic)."""
    order = list(range(num_prompts))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
