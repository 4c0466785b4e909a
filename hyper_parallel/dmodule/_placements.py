"""Small placement helpers shared by the checks, the DTensor boundary and the fast path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Shard


def normalize_placements(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """``Shard(-1)`` → ``Shard(ndim - 1)``, as DTensor stores it; others unchanged."""
    return tuple(
        Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements
    )


def has_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, or a tuple/list/dict holding one directly."""
    if isinstance(value, DTensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, DTensor) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, DTensor) for v in value.values())
    return False
