"""Where start-up time goes: each role marks its milestones (``runtime.mark``), the
launcher prints them.

A user times the whole command, and before the first step every role imports its
libraries, loads a model, and waits for the others. Each role's ``mark(run_dir, role,
event)`` appends ``{"role", "event", "t"}`` (wall-clock seconds) to
``<run_dir>/startup.jsonl``. When the first step is logged, ``breakdown`` turns the lines
into one table. Every time in it
counts from the command's start.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_async.runtime import STARTUP_FILE as FILE

# The order the milestones are shown in (roles may mark others; they follow these).
ORDER = (
    ("launcher", "roles started"),
    ("buffer", "serving"),
    ("generator0", "imported"),
    ("generator0", "engine up"),
    ("generator0", "joined weight sync"),
    ("learner", "imported"),
    ("learner", "models ready"),
    ("learner", "joined weight sync"),
    ("learner", "first batch"),
    ("learner", "first step"),
)


def read_marks(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def breakdown(marks: list[dict], t0: float) -> list[tuple[str, str, float]]:
    """(role, event, seconds since ``t0``) per milestone: the first time each was reached
    since ``t0`` (earlier lines are an earlier launch of a resumed run), in ``ORDER`` and
    then by time."""
    first: dict[tuple[str, str], float] = {}
    for m in marks:
        if m["t"] < t0:
            continue
        key = (m["role"], m["event"])
        first[key] = min(first.get(key, m["t"]), m["t"])
    known = [k for k in ORDER if k in first]
    others = sorted((k for k in first if k not in ORDER), key=first.get)
    return [(role, event, first[(role, event)] - t0) for role, event in known + others]


def format_breakdown(rows: list[tuple[str, str, float]]) -> str:
    """One line: 'start-up: buffer serving 3.1 s, generator0 engine up 17.9 s, ...'."""
    parts = [f"{role} {event} {seconds:.1f} s" for role, event, seconds in rows]
    return "start-up: " + ", ".join(parts)


def report_start_up(run_dir: str | Path, console, t0: float) -> None:
    """Print the breakdown of this launch (the launcher calls it at the first step) and
    keep it in ``logs/launcher.log``; returns None, for the caller's ``t0``."""
    line = format_breakdown(breakdown(read_marks(run_dir), t0))
    console.print(line, markup=False, highlight=False, soft_wrap=True)
    try:
        with open(Path(run_dir) / "logs" / "launcher.log", "a") as f:
            f.write(line + "\n")
    except OSError:
        pass
