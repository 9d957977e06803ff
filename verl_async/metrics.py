"""Per-step metrics: one JSON object per line in ``metrics.jsonl`` (+ TensorBoard if installed)."""

from __future__ import annotations

import json
from pathlib import Path

# The run-directory contract (README.md, "Run directory"): every line carries at least these keys.
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
    def __init__(self, run_dir: Path) -> None:
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, row: dict) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")
        self.file.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in row.items():
                if isinstance(value, int | float) and key != "step":
                    self.tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


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
