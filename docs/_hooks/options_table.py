"""mkdocs hook: the run-option table of ``docs/training.md``, rendered from the code.

The page holds the marker ``<!-- run-options -->``; at build time it becomes one row per
option of :mod:`hyper_parallel.train.arguments` (flag, ``TrainConfig`` field, the commands
that take it, its help with the default), so the page cannot drift from the flags.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- run-options -->"
COMMANDS = ("train", "demo", "plan", "validate", "suggest")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_table() -> str:
    """The run options as a Markdown table, in the table's order."""
    from hyper_parallel.train.arguments import (
        COMMAND_OPTIONS,
        option_fields,
        option_flag,
        option_kwargs,
    )

    lines = [
        "| flag | `TrainConfig` field | commands | what (default) |",
        "| --- | --- | --- | --- |",
    ]
    for dest in option_fields():
        kwargs = option_kwargs(dest)
        flag = option_flag(dest)
        metavar = kwargs.get("metavar")
        if metavar is None and kwargs.get("choices"):
            metavar = "{" + ",".join(str(c) for c in kwargs["choices"]) + "}"
        if metavar is None and kwargs.get("action") not in ("store_true", "store_false"):
            metavar = dest.upper()
        shown = f"`{flag} {metavar}`" if metavar else f"`{flag}`"
        takes = [
            c
            for c in COMMANDS
            if COMMAND_OPTIONS[c].fields is None or dest in COMMAND_OPTIONS[c].fields
        ]
        lines.append(
            f"| {shown} | `{dest}` | {', '.join(takes)} | {_cell(str(kwargs.get('help', '')))} |"
        )
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, options_table())
    return markdown
