"""Token dispatches: data-dependent exchanges a plan names with ``DispatchConfig``.

A dispatch is registered under a kind with :func:`register_dispatch` and provides
two things: ``check(path, module, config, mesh_axes, axis_sizes) -> list[Finding]``
(run with every other check, before anything changes) and
``build(path, module, mesh, config, forward) -> callable`` (run once at parallelize
time; the callable becomes the module's ``forward``, with ``forward`` the module's
own). The axis-specific code lives beside its axis in :mod:`hyper_parallel.distributed`
(``"routed_experts"``: :mod:`hyper_parallel.distributed.expert_parallel`); this module
only holds the registry, so ``dmodule`` does not depend on any axis.

Example::

    from hyper_parallel.dmodule.dispatch import get_dispatch

    routed = get_dispatch("routed_experts")   # imports the built-in on first use
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dmodule.sharding import DispatchConfig as DispatchConfig

__all__ = ["Dispatch", "DispatchConfig", "get_dispatch", "list_dispatches", "register_dispatch"]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A registered token dispatch.

    Args:
        kind: The name a ``DispatchConfig`` uses.
        check: ``(path, module, config, mesh_axes, axis_sizes) -> list[Finding]``.
        build: ``(path, module, mesh, config, forward) -> new forward``.
    """

    kind: str
    check: Callable[[str, nn.Module, Any, Sequence[str], Mapping[str, int] | None], list]
    build: Callable[[str, nn.Module, DeviceMesh, Any, Callable[..., Any]], Callable[..., Any]]


_REGISTRY: dict[str, Dispatch] = {}
# Built-in kinds and the module that registers each on import.
_BUILTINS = {"routed_experts": "hyper_parallel.distributed.expert_parallel"}


def register_dispatch(dispatch: Dispatch) -> Dispatch:
    """Register a dispatch under ``dispatch.kind``.

    Raises:
        ValueError: If the kind is already registered.
    """
    if dispatch.kind in _REGISTRY:
        raise ValueError(
            f"register_dispatch: a dispatch of kind {dispatch.kind!r} is already registered; "
            "choose another kind."
        )
    _REGISTRY[dispatch.kind] = dispatch
    return dispatch


def get_dispatch(kind: str) -> Dispatch | None:
    """The dispatch registered as ``kind`` (built-ins are imported on demand), or ``None``."""
    if kind not in _REGISTRY and kind in _BUILTINS:
        importlib.import_module(_BUILTINS[kind])
    return _REGISTRY.get(kind)


def list_dispatches() -> list[str]:
    """Every dispatch kind, built-ins included."""
    return sorted({*_REGISTRY, *_BUILTINS})
