"""Text helpers shared by the reports: placements, sizes, tables."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.placement_types import Placement, Shard

__all__ = ["human_bytes", "layer_pattern", "placement_text", "table"]


def placement_text(p: Placement) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``; sharded subclasses read as ``Shard``."""
    # FSDP2 on a tensor-parallel shard places dp as a _StridedShard of the same dim: a
    # shard of that dim taken within each tp shard.
    if isinstance(p, Shard) or type(p).__name__ == "_StridedShard":
        return f"Shard({p.dim})"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    return "Replicate()"


def human_bytes(num: float) -> str:
    """``1536`` → ``"1.50 KiB"`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def layer_pattern(path: str) -> str:
    """``layers.3.attention.wq`` → ``layers.*.attention.wq`` (numeric segments become ``*``)."""
    return _INDEX.sub("*", path)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain-text table; columns in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
