"""Where each step's metrics go besides ``metrics.jsonl``: ``trainer.loggers``.

- ``tensorboard`` (default): event files in ``<run_dir>/tensorboard``
  (``tensorboard --logdir RUN_DIR/tensorboard``). On resume the steps after the
  checkpoint are trained again; the new event file purges them (``purge_step``), so the
  curves do not fold back on themselves.
- ``wandb``: one Weights & Biases run per run directory, its files in
  ``<run_dir>/wandb``. The run id is kept in ``<run_dir>/wandb_run_id`` so a resumed run
  goes on in the same W&B run (``resume="allow"``). Every value is plotted against the
  learner ``step`` (``define_metric``), not W&B's own counter, so steps trained again after
  a resume land where they belong instead of being dropped. ``WANDB_MODE=offline`` writes
  everything locally without network; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads
  it later.

Only numbers are logged (``staleness_hist`` and other lists stay in metrics.jsonl).
``check_loggers`` runs in config validation, so a logger that is not installed stops
the run before any process starts. Nothing here imports torch or wandb until a logger
is opened.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from verl_async.config_base import ConfigError

if TYPE_CHECKING:
    from verl_async.schema import RunConfig

WANDB_RUN_ID = "wandb_run_id"  # file in the run directory
# The distribution that provides each logger, and how to install it.
_PROVIDERS = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'verl-async[wandb]'"),
}


def check_loggers(loggers: list[str]) -> None:
    """Every logger listed in ``trainer.loggers`` is installed, and listed once."""
    for i, name in enumerate(loggers):
        if name in loggers[:i]:
            raise ConfigError(f"bad value for 'trainer.loggers': '{name}' is listed twice")
        module, install = _PROVIDERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"bad value for 'trainer.loggers': '{name}' is listed but the {module} package "
                f"is not installed; run `{install}` or remove it from trainer.loggers"
            )


def numeric(row: dict) -> dict[str, float]:
    """The finite numbers of a metrics row, without ``step`` (the x axis)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key != "step"
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class Logger(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Scalars into ``<run_dir>/tensorboard``, flushed every few seconds so that a
    TensorBoard watching the run sees each step soon after it ends."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=first_step or None, flush_secs=10
        )

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One W&B run per run directory (see the module docstring for resume and offline)."""

    def __init__(self, run_dir: Path, cfg: RunConfig) -> None:
        import msgspec
        import wandb

        id_file = run_dir / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=cfg.trainer.project,
                name=cfg.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=msgspec.to_builtins(cfg),
                # The learner's output already goes to logs/learner.log; leave its streams be.
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:
            raise RuntimeError(
                f"Weights & Biases could not start the run ({exc}); run `wandb login`, "
                "or set WANDB_MODE=offline and `wandb sync` later"
            ) from exc
        id_file.write_text(self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def close(self) -> None:
        self.run.finish()


def open_loggers(run_dir: Path, cfg: RunConfig, first_step: int) -> list[Logger]:
    """The loggers of ``trainer.loggers``; ``first_step`` is the step about to be trained
    (past 0 on resume)."""
    opened: list[Logger] = []
    for name in cfg.trainer.loggers:
        if name == "tensorboard":
            opened.append(TensorBoardLogger(run_dir, first_step))
        else:
            opened.append(WandbLogger(run_dir, cfg))
    return opened
