"""What ``verl-async train`` shows while a run goes on, read from ``metrics.jsonl`` rows.

On a terminal: a rich bar with step, elapsed time and ETA on one line and the step's
numbers on a second one, so that neither is cut at 80 columns. Anywhere else (``nohup``,
Slurm: output redirected to a file, where a live bar shows nothing): one plain line every
``trainer.log_every`` steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text

from verl_async.metrics import read_metrics

STARTING = "starting engines..."


@dataclass(frozen=True)
class Snapshot:
    """The numbers a progress line shows, after ``done`` of ``total`` steps."""

    done: int
    total: int
    elapsed_s: float
    reward: float | None = None
    lag_mean: float | None = None  # mean version lag (staleness) of the last step's samples
    lag_max: int | None = None
    gen_tokens_per_s: float | None = None
    samples_per_s: float | None = None
    sync_ms: float | None = None
    eta_s: float | None = None  # remaining steps x the mean step time so far
    teacher_kl: float | None = None  # distillation: mean reverse KL to the teachers, last step


def snapshot(rows: list[dict], total: int, elapsed_s: float) -> Snapshot:
    """A ``Snapshot`` of the metrics rows so far.

    The mean step time leaves out the first row when there are others: the first step
    also waited for the engines to start."""
    if not rows:
        return Snapshot(0, total, elapsed_s)
    last = rows[-1]
    timed = rows[1:] or rows
    seconds = sum(float(r.get("step_s", 0.0)) for r in timed)
    mean_step = seconds / len(timed)
    return Snapshot(
        done=len(rows),
        total=total,
        elapsed_s=elapsed_s,
        reward=last["reward_mean"],
        lag_mean=last["staleness_mean"],
        lag_max=last["staleness_max"],
        gen_tokens_per_s=last["gen_tokens_per_s"],
        samples_per_s=sum(r["samples"] for r in timed) / seconds if seconds > 0 else None,
        sync_ms=last["weight_sync_s"] * 1000,
        eta_s=mean_step * max(total - len(rows), 0) if seconds > 0 else None,
        teacher_kl=teacher_kl(last),
    )


def teacher_kl(row: dict) -> float | None:
    """The mean of a metrics row's ``distill/<teacher>/reverse_kl`` (None: no distillation)."""
    values = [v for k, v in row.items() if k.startswith("distill/") and k.endswith("/reverse_kl")]
    return sum(values) / len(values) if values else None


def duration(seconds: float | None) -> str:
    """``h:mm:ss`` ('-:--:--' when unknown)."""
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def numbers(snap: Snapshot) -> str:
    """reward, version lag, generation rate, samples/s, sync time (at most ~75 characters),
    and with distillation the reverse KL to the teachers."""
    if snap.reward is None:
        return STARTING
    samples = "-" if snap.samples_per_s is None else f"{snap.samples_per_s:.1f}"
    line = (
        f"reward {snap.reward:.2f}  lag {snap.lag_mean:.1f} (max {snap.lag_max})  "
        f"gen {snap.gen_tokens_per_s:.0f} tok/s  {samples} samples/s  sync {snap.sync_ms:.0f} ms"
    )
    return line if snap.teacher_kl is None else f"{line}  teacher KL {snap.teacher_kl:.2f}"


def plain_line(snap: Snapshot) -> str:
    """The line printed every ``trainer.log_every`` steps when output is not a terminal."""
    return (
        f"step {snap.done}/{snap.total}  {numbers(snap)}  "
        f"elapsed {duration(snap.elapsed_s)}  ETA {duration(snap.eta_s)}"
    )


class _TwoLineProgress(Progress):
    """A rich Progress whose tasks each get a second line with their ``info`` field."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            # wraps at a space: a distillation run's line is longer than 80 columns
            yield Text(task.fields.get("info", ""))


class ProgressReport:
    """``with ProgressReport(console, total, log_every) as report: report.update(rows)``."""

    def __init__(self, console: Console, total: int, log_every: int = 1) -> None:
        self.console, self.total, self.log_every = console, total, log_every
        self.start = time.monotonic()
        self.printed = 0  # plain mode: steps done at the last line printed
        self.bar: _TwoLineProgress | None = None
        self.task = None

    def __enter__(self) -> ProgressReport:
        if self.console.is_terminal:
            self.bar = _TwoLineProgress(
                TextColumn("[bold]training"),
                BarColumn(bar_width=28),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[elapsed]}  ETA {task.fields[eta]}"),
                console=self.console,
                transient=False,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task(
                "training", total=self.total, info=STARTING, elapsed="0:00:00", eta="-:--:--"
            )
        else:
            self._print(f"training: {self.total} steps; {STARTING}")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, rows: list[dict], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        snap = snapshot(rows, self.total, now - self.start)
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=snap.done,
                info=numbers(snap),
                elapsed=duration(snap.elapsed_s),
                eta=duration(snap.eta_s),
            )
        else:  # one line per multiple of log_every (and the last step), even when several
            # steps landed between two polls: each from the rows up to its step
            for m in range(self.printed + 1, snap.done + 1):
                if m % self.log_every == 0 or m == self.total:
                    self._print(plain_line(snapshot(rows[:m], self.total, now - self.start)))
            self.printed = max(self.printed, snap.done)

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def summarize(run_dir: Path, console: Console) -> None:
    """The line printed when a run finishes."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return
    k = min(10, len(rows))
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    console.print(
        f"done: {len(rows)} steps in {rows[-1]['wall_s']:.0f}s; reward {first:.3f} (first {k}) -> "
        f"{last:.3f} (last {k}); max staleness {max(r['staleness_max'] for r in rows)}; "
        f"dropped_stale {sum(r['dropped_stale'] for r in rows)}; metrics: {run_dir / 'metrics.jsonl'}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
