"""Chat templates shipped with verl-async, and the loader a config key names one by.

``chat_template(value, key)`` gives a template's text: ``value`` is the name of one shipped in
``templates/`` (``chatml_tools``) or the path of a ``.jinja`` file. The text is what
``tokenizer.chat_template`` (or ``apply_chat_template(..., chat_template=...)``) takes.

``chatml_tools``: ChatML with tools in the hermes convention (Qwen2.5's), for models whose own
template has none, SmolLM2-Instruct's among them. Without tools it renders exactly as
SmolLM2's template does; with ``tools=`` it lists their schemas in the system turn and asks
for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, which the ``hermes``
parser reads (parsers.py); tool results come back as one user turn of ``<tool_response>``
blocks.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from verl_async.config_base import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def shipped_templates() -> list[str]:
    """The names of the templates shipped in ``templates/``."""
    folder = resources.files("verl_async.tools") / "templates"
    return sorted(
        p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja")
    )


def chat_template(value: str, key: str = "chat_template") -> str:
    """The text of the shipped template named ``value``, or of the file at that path;
    anything else raises ConfigError naming ``key``."""
    if _NAME.match(value):
        shipped = resources.files("verl_async.tools") / "templates" / f"{value}.jinja"
        if shipped.is_file():
            return shipped.read_text(encoding="utf-8")
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(
        f"bad value for '{key}': {value!r} is neither a template shipped here "
        f"({', '.join(shipped_templates())}) nor a file"
    )


def tool_template(value: str) -> str | None:
    """``multiturn.tool_template``'s text, or None when it is empty (the tokenizer's own)."""
    return chat_template(value, "multiturn.tool_template") if value else None
