"""What travels with a Hugging Face export: the tokenizer files, and the model record the
trainer keeps in its checkpoints (which model, its overrides, its ``config.json``).

Read by the trainer (to write them) and by ``export-hf`` (to read them back).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["MODEL_KEY", "TOKENIZER_FILES", "model_record", "tokenizer_files"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
"""Files of a Hugging Face checkpoint that travel with its weights (whichever are present)."""


def tokenizer_files(tokenizer: str | None, folders: Iterable[str | None] = ()) -> dict[str, str]:
    """``{name: source}`` of the tokenizer files to put next to exported weights.

    ``tokenizer`` (a ``tokenizer.json``, under any name) is copied as ``tokenizer.json``
    and the other :data:`TOKENIZER_FILES` found beside it come along; then those of
    ``folders`` (the Hugging Face checkpoint the run started from) fill the gaps.
    """
    found: dict[str, str] = {}
    dirs = [os.path.dirname(os.path.abspath(tokenizer))] if tokenizer else []
    if tokenizer:
        found["tokenizer.json"] = tokenizer
    for folder in [*dirs, *(f for f in folders if f)]:
        for name in TOKENIZER_FILES:
            candidate = os.path.join(folder, name)
            if name not in found and os.path.isfile(candidate):
                found[name] = candidate
    return found


MODEL_KEY = "model_json"
"""The key of the model record in a checkpoint's ``train`` state."""


def model_record(
    model: str,
    model_overrides: dict[str, Any],
    hf_config: dict[str, Any] | None,
    tokenizer: str | None = None,
    generation_config: dict[str, Any] | None = None,
) -> str:
    """The JSON the trainer stores under ``train.model_json`` (``tokenizer``: the run's).

    ``generation_config``: the ``generation_config.json`` the run's Hugging Face export
    carries (``None``: none), which ``generate --checkpoint`` stops by and ``export-hf``
    writes. Always recorded (``null`` for none), so a record without the key is one
    written before it was.
    """
    record: dict[str, Any] = {
        "model": model,
        "model_overrides": model_overrides,
        "hf_config": hf_config,
        "generation_config": generation_config,
    }
    if tokenizer is not None:
        record["tokenizer"] = os.path.abspath(tokenizer)
    return json.dumps(record, sort_keys=True)
