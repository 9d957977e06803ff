"""Prompt datasets (JSONL or Parquet, read with pyarrow), rendering, and the epoch order.

Two layouts are read, told apart by their columns:

- verl's: ``prompt`` is a list of chat messages ``{"role", "content"}``, ``data_source``
  routes rewards, ``reward_model.ground_truth`` is the reference answer and ``extra_info``
  is handed to reward functions as it is;
- plain: ``prompt`` is a string and ``answer`` the reference (``data_source`` and
  ``extra_info`` optional here too).

``render_prompts`` turns records into the token ids the engine receives: message lists go
through the tokenizer's chat template with the generation prompt appended, which is what
``apply_chat_template(messages, add_generation_prompt=True)`` gives; prompts longer than
the limit are skipped and counted, never truncated (a cut prompt asks another question).
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_async.config import ConfigError, prompt_limit

log = logging.getLogger("verl_async.data")

DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | list[dict[str, str]]  # a string, or chat messages
    ground_truth: str
    data_source: str = DEFAULT_SOURCE
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()  # filled by render_prompts


def load_prompts(path: str | Path, key: str = "data.path") -> list[PromptRecord]:
    """Read a prompt file; one clear error naming ``key`` for anything a user must fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"bad value for '{key}': file '{path}' does not exist")
    table = _read_table(path, key)
    columns = table.column_names
    if "prompt" not in columns:
        raise ConfigError(f"bad value for '{key}': '{path}' has no 'prompt' column")
    if "reward_model" in columns:
        truths = [_ground_truth(rm, path, key) for rm in table.column("reward_model").to_pylist()]
    elif "answer" in columns:
        truths = table.column("answer").to_pylist()
    else:
        raise ConfigError(
            f"bad value for '{key}': '{path}' has neither 'reward_model' (verl layout) nor "
            "'answer' (plain layout) for the reference answers"
        )
    if table.num_rows == 0:
        raise ConfigError(f"bad value for '{key}': '{path}' holds no prompts")
    n = table.num_rows
    sources = table.column("data_source").to_pylist() if "data_source" in columns else [None] * n
    extras = table.column("extra_info").to_pylist() if "extra_info" in columns else [None] * n
    records = []
    for i, (prompt, truth, source, extra) in enumerate(
        zip(table.column("prompt").to_pylist(), truths, sources, extras, strict=True)
    ):
        records.append(
            PromptRecord(
                prompt=_prompt(prompt, i, path, key),
                ground_truth="" if truth is None else str(truth),
                data_source=str(source) if source else DEFAULT_SOURCE,
                extra_info=extra if isinstance(extra, dict) else {},
            )
        )
    return records


def _read_table(path: Path, key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        if not path.read_bytes().strip():
            raise ConfigError(f"bad value for '{key}': '{path}' is empty")
        return _read_jsonl(path)
    except pa.ArrowInvalid as exc:
        what = _bad_jsonl_line(path) if path.suffix != ".parquet" else None
        what = what or f"'{path}' cannot be read ({_one_line(exc)})"
        raise ConfigError(f"bad value for '{key}': {what}") from None
    except OSError as exc:
        raise ConfigError(f"bad value for '{key}': '{path}' cannot be read ({exc})") from None


def _read_jsonl(path: Path):
    import pyarrow.json as pj

    try:
        return pj.read_json(path)
    except Exception as exc:
        if "straddl" not in str(exc):
            raise
    # A line longer than pyarrow's block (1 MiB by default): read the file as one block.
    size = min(path.stat().st_size + 1, 2**31 - 1)
    return pj.read_json(path, read_options=pj.ReadOptions(block_size=size))


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _bad_jsonl_line(path: Path) -> str | None:
    """What makes pyarrow refuse a JSONL file, with its line number: a line that is not
    JSON, not an object, or gives a column a type other than earlier lines gave it
    (pyarrow's own row numbers count from the start of a block, not of the file)."""
    import json

    kinds: dict[str, tuple[str, int]] = {}  # column -> (JSON type, first line with it)
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"line {number} of '{path}'"
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                return f"{where} is not valid JSON ({exc.msg}, column {exc.colno})"
            if not isinstance(row, dict):
                return f"{where} is not a JSON object"
            for column, value in row.items():
                kind = _json_kind(value)
                seen = kinds.setdefault(column, (kind, number)) if kind else None
                if seen and seen[0] != kind:
                    return (
                        f"{where}: '{column}' is {kind}, but line {seen[1]} has {seen[0]} "
                        "(a column holds one type)"
                    )
    return None


def _json_kind(value: Any) -> str | None:
    """The JSON type of ``value`` as the columns see it (None: null fits any column)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _ground_truth(reward_model: Any, path: Path, key: str) -> str | None:
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    raise ConfigError(
        f"bad value for '{key}': '{path}' has a 'reward_model' column without 'ground_truth'"
    )


def _prompt(value: Any, row: int, path: Path, key: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(
        f"bad value for '{key}': {_row_name(path, row)} of '{path}' has a prompt that is "
        "neither a string nor a non-empty list of {role, content} messages"
    )


def _row_name(path: Path, row: int) -> str:
    """Row ``row`` (0-based) as a user finds it: 'line N' of a JSONL file (blank lines
    hold no row), 'row N' of a Parquet file."""
    if path.suffix == ".parquet":
        return f"row {row}"
    with open(path, encoding="utf-8", errors="replace") as f:
        filled = (n for n, line in enumerate(f, start=1) if line.strip())
        return f"line {next(itertools.islice(filled, row, None), row + 1)}"


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    )


def as_messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """A prompt as chat messages (a string becomes one user message)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def render_prompts(
    records: list[PromptRecord], tokenizer, chat_template: bool, max_length: int
) -> tuple[list[PromptRecord], int]:
    """Token ids for every record; returns (records that fit, number skipped as too long).

    With ``chat_template`` and a tokenizer that has one, every prompt is rendered as chat
    messages with the generation prompt appended. Otherwise strings are tokenized as they
    are, and message lists are an error (they only make sense through a template).
    """
    templated = chat_template and getattr(tokenizer, "chat_template", None)
    if chat_template and not templated:
        log.info("the tokenizer has no chat template: string prompts go in as they are")
    kept, skipped = [], 0
    for rec in records:
        if templated:
            ids = tokenizer.apply_chat_template(
                as_messages(rec.prompt), add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        elif isinstance(rec.prompt, str):
            ids = tokenizer(rec.prompt)["input_ids"]
        else:
            raise ConfigError(
                "bad value for 'data.chat_template': the prompts are chat messages, which need "
                "a tokenizer with a chat template and data.chat_template=true"
            )
        if len(ids) > max_length:
            skipped += 1
            continue
        kept.append(replace(rec, prompt_ids=tuple(int(t) for t in ids)))
    return kept, skipped


def epoch_order(num_prompts: int, epoch: int, seed: int) -> list[int]:
    """Prompt indices in the order epoch ``epoch`` issues them (deterministic)."""
    order = list(range(num_prompts))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def max_prompt_tokens(cfg) -> int:
    """The most tokens a prompt may have (``verl_async.config.prompt_limit``)."""
    return prompt_limit(cfg).tokens
