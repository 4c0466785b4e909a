"""Collectives: which one a redistribution costs, and a recorder of those a run issues.

:func:`redistribution_collectives` names the collective DTensor issues to move a
tensor from one placement to another on each mesh axis. :class:`CollectiveRecorder`
is a ``TorchDispatchMode`` that logs every collective (functional and in-place
``c10d`` ops alike) with its kind, mesh axis, phase and buffer size.

Sizes: ``bytes`` is the per-rank buffer the collective fills or reduces — the
gathered output of an all-gather, the full input of a reduce-scatter, the tensor
of an all-reduce, the input of an all-to-all (the "size" column of NCCL's
nccl-tests). ``wire_bytes`` is what a ring algorithm sends per rank, from
nccl-tests' bus-bandwidth factors (https://github.com/NVIDIA/nccl-tests,
``doc/PERFORMANCE.md``): all-reduce ``2 (n-1)/n``, all-gather, reduce-scatter and
all-to-all ``(n-1)/n`` of ``bytes``, broadcast ``bytes``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel._torch_private import (
    TorchDispatchMode,
    c10d_functional,
    pytree,
    resolve_process_group,
    unbox_process_group,
)
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.distributed.layout import ParallelMesh

__all__ = [
    "Collective",
    "CollectiveRecorder",
    "CollectiveStat",
    "axis_groups",
    "redistribution_collectives",
    "summarize",
    "wire_bytes",
]

ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
)
BROADCAST = "broadcast"


def _ops(namespace: Any, names: Iterable[str], kind: str) -> dict[Any, str]:
    return {getattr(namespace, n): kind for n in names if hasattr(namespace, n)}


_funcol = c10d_functional
_c10d = torch.ops.c10d
# Op packet → kind; the functional ops DTensor issues and the in-place ones FSDP2 issues.
_KINDS: dict[Any, str] = {
    **_ops(
        _funcol,
        (
            "all_gather_into_tensor",
            "all_gather_into_tensor_out",
            "all_gather_into_tensor_coalesced",
        ),
        ALL_GATHER,
    ),
    **_ops(_funcol, ("all_reduce", "all_reduce_", "all_reduce_coalesced"), ALL_REDUCE),
    **_ops(_funcol, ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"), REDUCE_SCATTER),
    **_ops(_funcol, ("all_to_all_single",), ALL_TO_ALL),
    **_ops(_funcol, ("broadcast", "broadcast_"), BROADCAST),
    **_ops(
        _c10d,
        (
            "_allgather_base_",
            "allgather_",
            "allgather_coalesced_",
            "allgather_into_tensor_coalesced_",
        ),
        ALL_GATHER,
    ),
    **_ops(_c10d, ("allreduce_", "allreduce_coalesced_"), ALL_REDUCE),
    **_ops(
        _c10d,
        ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"),
        REDUCE_SCATTER,
    ),
    **_ops(_c10d, ("alltoall_", "alltoall_base_"), ALL_TO_ALL),
    **_ops(_c10d, ("broadcast_",), BROADCAST),
    **_ops(_c10d, ("scatter_",), "scatter"),
    **_ops(_c10d, ("gather_",), "gather"),
    **_ops(_c10d, ("reduce_",), "reduce"),
}
if hasattr(torch.ops, "_dtensor") and hasattr(torch.ops._dtensor, "shard_dim_alltoall"):
    _KINDS[torch.ops._dtensor.shard_dim_alltoall] = ALL_TO_ALL

# Bytes each rank sends in a ring, as a multiple of ``bytes`` (nccl-tests PERFORMANCE.md).
_RING_FACTOR = {
    ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    ALL_GATHER: lambda n: (n - 1) / n,
    REDUCE_SCATTER: lambda n: (n - 1) / n,
    ALL_TO_ALL: lambda n: (n - 1) / n,
    BROADCAST: lambda n: 1.0 if n > 1 else 0.0,
}


def wire_bytes(kind: str, num_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective of ``num_bytes`` over ``group_size`` ranks (ring)."""
    factor = _RING_FACTOR.get(kind, lambda n: (n - 1) / n)
    return round(num_bytes * factor(group_size))


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued (``traced=False``: one it will issue, computed)."""

    kind: str
    axis: str
    phase: str
    bytes: int
    group_size: int
    traced: bool = True


@dataclass(frozen=True)
class CollectiveStat:
    """Collectives of one kind on one axis in one phase: how many, and their bytes per rank.

    ``traced`` is ``False`` for figures computed from a formula rather than observed.
    """

    kind: str
    axis: str
    phase: str
    count: int
    bytes: int
    wire_bytes: int
    traced: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axis": self.axis,
            "phase": self.phase,
            "count": self.count,
            "bytes": self.bytes,
            "wire_bytes": self.wire_bytes,
            "traced": self.traced,
        }


_PHASE_ORDER = {"forward": 0, "backward": 1, "optimizer": 2}


def summarize(records: Iterable[Collective]) -> list[CollectiveStat]:
    """Group records by (kind, axis, phase, traced); sorted by phase, axis, kind."""
    groups: dict[tuple[str, str, str, bool], list[Collective]] = {}
    for r in records:
        groups.setdefault((r.kind, r.axis, r.phase, r.traced), []).append(r)
    stats = [
        CollectiveStat(
            kind,
            axis,
            phase,
            len(rs),
            sum(r.bytes for r in rs),
            sum(wire_bytes(r.kind, r.bytes, r.group_size) for r in rs),
            traced,
        )
        for (kind, axis, phase, traced), rs in groups.items()
    ]
    return sorted(stats, key=lambda s: (_PHASE_ORDER.get(s.phase, 9), s.axis, s.kind))


def axis_groups(mesh: DeviceMesh | ParallelMesh) -> dict[str, str]:
    """Process-group name → mesh axis name, for every axis of ``mesh``.

    For a :class:`~hyper_parallel.distributed.ParallelMesh` every named view counts
    (user axes, ``fsdp``, the HSDP dims, ``batch``, ``loss``); where two views are the
    same group, the one :meth:`ParallelMesh.axis_meshes` lists last names it.
    """
    if isinstance(mesh, ParallelMesh):
        return {m.get_group().group_name: axis for axis, m in mesh.axis_meshes()}
    names = mesh.mesh_dim_names or ()
    return {mesh.get_group(axis).group_name: axis for axis in names}


def _tensor_bytes(value: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    )


def _group_of(args: Sequence[Any]) -> tuple[str | None, int]:
    """(group name, group size) of a collective from its arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().name().endswith("ProcessGroup"):
            pg = unbox_process_group(a)
            return pg.group_name, pg.size()
    # Functional collectives take the group's name as their last string argument.
    name = next((a for a in reversed(args) if isinstance(a, str)), None)
    if name is None:
        return None, 1
    try:
        return name, resolve_process_group(name).size()
    except (RuntimeError, ValueError, KeyError):
        return name, 1


def _inside_cpu_alltoall_fallback() -> bool:
    """Whether the current all-gather is DTensor's CPU stand-in for an all-to-all.

    On a CPU mesh, torch (``torch/distributed/tensor/_collective_utils.py``,
    ``shard_dim_alltoall``) moves ``Shard(i) -> Shard(j)`` with an all-gather and a
    local chunk because gloo has no all-to-all; NCCL meshes issue ``all_to_all``.
    """
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_name == "shard_dim_alltoall":
            return True
        frame = frame.f_back
    return False


_FSDP2_SOURCE = "torch/distributed/fsdp/"


def _issued_by_fsdp() -> bool:
    """Whether the current collective comes from FSDP2's own code (its gathers and
    gradient reductions), rather than from the model's forward or backward."""
    frame = sys._getframe(2)
    while frame is not None:
        if _FSDP2_SOURCE in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective issued while active: kind, mesh axis, phase, bytes.

    Set :attr:`phase` (``"forward"``, ``"backward"``) as the run progresses.

    Args:
        groups: Process-group name → mesh axis (:func:`axis_groups`).
        fsdp_groups: Process-group name → axis of the groups FSDP2 shards over. A
            group in both (FSDP2 over ``cp`` alone, when ``dp_shard`` is 1) is one
            process group for two jobs: FSDP2's own collectives are reported on the
            FSDP axis, the model's (context parallelism's key/value gathers) on its
            mesh axis.

    Example::

        recorder = CollectiveRecorder(axis_groups(mesh))
        with recorder:
            loss = model(x).sum()
            recorder.phase = "backward"
            loss.backward()
        summarize(recorder.records)
    """

    def __init__(
        self, groups: Mapping[str, str], fsdp_groups: Mapping[str, str] | None = None
    ) -> None:
        super().__init__()
        self.groups = dict(groups)
        self.fsdp_groups = dict(fsdp_groups or {})
        self.phase = "forward"
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Let DTensor (and other subclasses) desugar into plain ops first.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _KINDS.get(getattr(func, "_overloadpacket", None))
        if kind is not None:
            self._record(kind, args, kwargs, out)
        return out

    def _record(self, kind: str, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> None:
        flat_args = [*args, *kwargs.values()]
        name, size = _group_of(flat_args)
        fsdp_axis, model_axis = self.fsdp_groups.get(name), self.groups.get(name)
        # One group for two jobs (FSDP2 over cp alone): ask who issued the collective.
        if fsdp_axis is not None and (model_axis in (None, fsdp_axis) or _issued_by_fsdp()):
            axis = fsdp_axis
        else:
            axis = model_axis or (f"group {name}" if name is not None else "?")
        num_bytes = max(
            [_tensor_bytes(a) for a in flat_args] + [_tensor_bytes(out)],
            default=0,
        )
        if kind == ALL_GATHER and _inside_cpu_alltoall_fallback():
            kind = ALL_TO_ALL
            num_bytes = _tensor_bytes(args[0])  # the local shard is what an all-to-all moves
        self.records.append(Collective(kind, axis, self.phase, num_bytes, size))


def redistribution_collectives(
    src: Sequence[Placement], dst: Sequence[Placement], axes: Sequence[str]
) -> list[tuple[str, str]]:
    """The collectives DTensor issues to redistribute ``src`` to ``dst``, per mesh axis.

    Per axis (placements normalized to non-negative dims by the caller):
    ``Shard → Replicate`` all-gather; ``Partial → Replicate`` all-reduce;
    ``Partial → Shard`` reduce-scatter; ``Shard(i) → Shard(j)`` all-to-all;
    ``Shard → Partial`` all-gather (DTensor goes through ``Replicate``);
    ``Replicate → Shard`` and ``Replicate → Partial`` are local (no collective).

    Returns:
        ``[(kind, axis), ...]`` for the axes whose placement changes and need communication.

    Example::

        redistribution_collectives([Shard(2)], [Replicate()], ["tp"])  # [("all_gather", "tp")]
    """
    out = []
    for s, d, axis in zip(src, dst, axes):
        if s == d:
            continue
        if s.is_partial():
            kind = REDUCE_SCATTER if isinstance(d, Shard) else ALL_REDUCE
            if d.is_partial():
                continue  # a different reduce op: no collective until it is reduced
        elif isinstance(s, Shard):
            kind = ALL_TO_ALL if isinstance(d, Shard) else ALL_GATHER
        else:
            assert isinstance(s, Replicate), f"unexpected placement {s!r}"
            continue
        out.append((kind, axis))
    return out
