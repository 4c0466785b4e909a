"""Small placement helpers shared by the checks, the DTensor boundary and the fast path."""

from __future__ import annotations

import inspect
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


class ArgumentBinder:
    """Binds a call's arguments to ``forward``'s parameter names as Python would.

    ``inspect.Signature.bind`` per call is slow and is a graph break under
    ``torch.compile``; for the usual ``forward`` (named parameters, no ``*args`` or
    ``**kwargs``) a dict of names is all the boundary needs. Other signatures, and
    calls this cannot bind without Python's full rules, get ``None`` back (the caller
    then uses ``inspect``).
    """

    __slots__ = ("_names", "_positional", "simple")

    def __init__(self, signature: inspect.Signature) -> None:
        params = list(signature.parameters.values())
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.simple = all(p.kind in kinds for p in params)
        self._positional = tuple(
            p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        self._names = frozenset(p.name for p in params)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """``{name: value}`` for the passed arguments (defaults not filled in), or ``None``."""
        if not self.simple or len(args) > len(self._positional):
            return None
        arguments = dict(zip(self._positional, args))
        for name, value in kwargs.items():
            if name in arguments or name not in self._names:
                return None
            arguments[name] = value
        return arguments
