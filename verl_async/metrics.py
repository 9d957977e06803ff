"""Per-step metrics: one JSON object per line in ``metrics.jsonl``, always; the same numbers
also go to each logger of ``trainer.loggers`` (TensorBoard, W&B: verl_async/loggers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from verl_async.loggers import numeric, open_loggers

if TYPE_CHECKING:
    from verl_async.schema import RunConfig

# The run-directory contract (docs/run_dir.md, docs/metrics.md): every line carries at least these keys.
REQUIRED_FIELDS = (
    "step",
    "version",
    "wall_s",
    "reward_mean",
    "samples",
    "tokens",
    "staleness_mean",
    "staleness_max",
    "dropped_stale",
    "gen_tokens_per_s",
    "buffer_size",
    "weight_sync_s",
    "loss",
    "kl",
    "entropy",
)


class MetricsWriter:
    """``metrics.jsonl`` of ``run_dir`` plus the loggers ``cfg.trainer.loggers`` lists."""

    def __init__(self, run_dir: Path, cfg: RunConfig) -> None:
        path = run_dir / "metrics.jsonl"
        # On resume the launcher has cut metrics.jsonl back to the checkpoint's step.
        rows = read_metrics(path)
        first_step = rows[-1]["step"] + 1 if rows else 0
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.loggers = open_loggers(run_dir, cfg, first_step)

    def write(self, row: dict) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")
        self.file.write(json.dumps(row) + "\n")
        values = numeric(row)
        for logger in self.loggers:
            logger.log(values, row["step"])

    def close(self) -> None:
        self.file.close()
        for logger in self.loggers:
            logger.close()


def complete_lines(text: str) -> list[str]:
    """The lines of a JSONL file that were written whole (with their newline).

    A reader can race the writer, and a process killed mid-write leaves a torn last
    line; neither is a row yet.
    """
    return [line for line in text.splitlines(keepends=True) if line.endswith("\n") and line.strip()]


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in complete_lines(path.read_text())]
