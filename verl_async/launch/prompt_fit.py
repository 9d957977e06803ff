"""Does at least one prompt fit the run's length limit? Asked before any role starts, so
that a limit every prompt exceeds is a config error naming the key that set it
(``config.prompt_limit``), not a buffer that dies at start-up.

The buffer renders every prompt with the model's tokenizer and skips those over the limit
(``data.render_prompts``). transformers, which it renders with, takes seconds to import,
and the roles start only after this check; so the question is answered without it where
it can be:

    tiny model (no model.path)   the tokenizer the tiny model saves, built in memory with
                                 ``tokenizers`` (``tiny_model.tiny_tokenizer``): exact counts
    a model directory            its ``tokenizer.json`` with ``tokenizers``, the chat template
                                 rendered with jinja2 as transformers renders it: an estimate,
                                 trusted only to say that a prompt fits with ``MARGIN`` to spare
    otherwise                    transformers' tokenizer through ``data.render_prompts``, as
                                 the buffer renders, prompt by prompt until one fits

"Otherwise" is a directory without ``tokenizer.json``, a template that does not render
here, message prompts without a template (render_prompts' own error then), and prompts
that all miss the limit by the estimate: the exact count decides, and names the shortest.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from verl_async.config import prompt_limit
from verl_async.data import PromptRecord, as_messages
from verl_async.schema import RunConfig

MARGIN = 16  # tokens an estimate may be short by (special tokens a tokenizer class adds)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")

Count = Callable[[PromptRecord], int | None]  # a prompt's tokens; None: cannot tell here


def check_prompt_fit(cfg: RunConfig, prompts: dict[str, list[PromptRecord]]) -> None:
    """Each list of ``prompts`` (by what names its file, e.g. ``data.path (FILE)``) holds a
    prompt within ``prompt_limit(cfg)``; else the limit's ``ConfigError``, naming the
    shortest prompt's length. A ``model.path`` that is no model directory is left to
    ``prepare``, which says so."""
    limit = prompt_limit(cfg)
    model = Path(cfg.model.path).resolve() if cfg.model.path else None
    if model is not None and not (model / "config.json").is_file():
        return
    quick = _tokenizers_count(cfg, model)
    exact: list[Count] = []  # transformers' count, made once if needed

    def slow(record: PromptRecord) -> int:
        if not exact:
            exact.append(_transformers_count(cfg, model))
        return exact[0](record)

    for what, records in prompts.items():
        shortest = _shortest_over(records, limit.tokens, quick, model is None, slow)
        if shortest is not None:
            raise limit.too_low(what, shortest)


def _shortest_over(
    records: list[PromptRecord],
    tokens: int,
    quick: Count | None,
    quick_exact: bool,
    slow: Callable[[PromptRecord], int],
) -> int | None:
    """None when a record fits in ``tokens``; else the shortest record's length."""
    if quick is not None:
        counts = [quick(r) for r in records]
        spare = 0 if quick_exact else MARGIN
        if any(n is not None and n + spare <= tokens for n in counts):
            return None
        if quick_exact and None not in counts:
            return min(counts, default=None)
    shortest = None
    for record in records:
        n = slow(record)
        if n <= tokens:
            return None
        shortest = n if shortest is None else min(shortest, n)
    return shortest


def _tokenizers_count(cfg: RunConfig, model: Path | None) -> Count | None:
    """The quick count (module docstring); None where there is none."""
    if model is None:
        from verl_async.launch.tiny_model import tiny_tokenizer, vocabulary

        tok = tiny_tokenizer(vocabulary(cfg.model.tiny))  # no chat template
        return lambda r: len(tok.encode(r.prompt).ids) if isinstance(r.prompt, str) else None
    if not (model / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    config = _read_json(model / "tokenizer_config.json")
    template = _chat_template(model, config) if cfg.data.chat_template else None
    if template is None:
        return lambda r: len(tok.encode(r.prompt).ids) if isinstance(r.prompt, str) else None
    render = _renderer(template, config)
    if render is None:
        return None

    def count(record: PromptRecord) -> int | None:
        try:
            text = render(as_messages(record.prompt))
        except Exception:  # a template that needs what transformers alone passes
            return None
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count


def _transformers_count(cfg: RunConfig, model: Path | None) -> Count:
    """A prompt's tokens exactly as the buffer renders it."""
    from verl_async.data import render_prompts

    if model is None:
        from verl_async.launch.tiny_model import tiny_fast_tokenizer, vocabulary

        tokenizer = tiny_fast_tokenizer(vocabulary(cfg.model.tiny))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)

    def count(record: PromptRecord) -> int:
        kept, _ = render_prompts([record], tokenizer, cfg.data.chat_template, sys.maxsize)
        return len(kept[0].prompt_ids)

    return count


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _chat_template(model: Path, config: dict[str, Any]) -> str | None:
    """The directory's chat template (``chat_template.jinja``, else the tokenizer config's)
    if it is one string; a list of named templates counts as none here (the slow path)."""
    path = model / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _renderer(template: str, config: dict[str, Any]) -> Callable[[list[dict]], str] | None:
    """``template`` compiled as transformers compiles chat templates (a sandbox, trimmed
    blocks, ``tojson``, ``raise_exception``, ``strftime_now``); None if it does not
    compile here (``{% generation %}`` needs transformers' own extension)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, **kw: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, **kw
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError:
        return None
    specials = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
    return lambda messages: compiled.render(
        messages=messages, add_generation_prompt=True, tools=None, documents=None, **specials
    )


def _token_text(token: Any) -> str:
    """A special token as the tokenizer config holds it: a string or {"content": ...}."""
    return token.get("content", "") if isinstance(token, dict) else str(token)
