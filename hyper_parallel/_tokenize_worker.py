"""The ``tokenize`` command's worker processes: imports ``tokenizers`` only.

A top-level module (not under ``hyper_parallel.train``, whose package imports
torch) so that each spawned worker starts in a fraction of a second.
"""

from __future__ import annotations

from typing import Any

__all__ = ["encode", "init"]

_STATE: dict[str, Any] = {}


def init(tokenizer_path: str) -> None:
    """Load the tokenizer once per worker."""
    from tokenizers import Tokenizer

    _STATE["tokenizer"] = Tokenizer.from_file(tokenizer_path)


def encode(documents: list[str]) -> list[list[int]]:
    """Token ids of each document, no special tokens added."""
    encodings = _STATE["tokenizer"].encode_batch(documents, add_special_tokens=False)
    return [e.ids for e in encodings]
