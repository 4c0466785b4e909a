"""YAML and JSON read as plain data, refusing a key a mapping holds twice.

``yaml.safe_load`` and ``json.loads`` keep the last of two equal keys silently, so a
plan file naming one module twice, or a hardware file giving one field twice, lost
the earlier entry without a word. These readers raise instead, naming the key (and,
for YAML, both lines).

Example::

    from hyper_parallel.config.data_files import DuplicateKeyError, load_json

    try:
        load_json('{"tp": 1, "tp": 2}')
    except DuplicateKeyError as e:
        assert "'tp'" in str(e)
"""

from __future__ import annotations

import json
from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load_json", "load_yaml"]


class DuplicateKeyError(ValueError):
    """A mapping of the file holds one key twice (the message names it)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python tags) that refuses a key given twice in a mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, tuple[int, int]] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            at = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first is not None:
                where = (
                    f"lines {first[0]} and {at[0]}"
                    if first[0] != at[0]
                    else f"line {at[0]}, columns {first[1]} and {at[1]}"
                )
                raise DuplicateKeyError(
                    f"key {key!r} is given twice in one mapping ({where}); the second would "
                    "silently replace the first: keep one."
                )
            seen[key] = at
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing a duplicate key (:class:`DuplicateKeyError`)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no Python tags


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(
                f"key {key!r} is given twice in one object; the second would silently "
                "replace the first: keep one."
            )
        out[key] = value
    return out


def load_json(text: str) -> Any:
    """``json.loads(text)``, refusing a duplicate key (:class:`DuplicateKeyError`)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)
