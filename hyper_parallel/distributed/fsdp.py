"""FSDP2 over the data axes: FSDP on ``fsdp`` = dp_shard x cp, HSDP with ``dp_replicate``.

:func:`apply_fsdp` wraps each unit (every element of the model's top-level
``ModuleList``\\ s: the transformer blocks) and then the root with torch's
``fully_shard`` on :meth:`ParallelMesh.fsdp_mesh`: a 1-D ``fsdp`` mesh (placement
``Shard(0)``), or for HSDP the 2-D ``(dp_replicate, fsdp)`` mesh (placements
``(Replicate(), Shard(0))``: states sharded within a replica group, gradients
reduce-scattered there and all-reduced across replicas). Either way FSDP2 averages
gradients over every data rank, which is the gradient of the global-batch mean.

:func:`fsdp_mesh_findings` is the check for a mesh someone is about to hand to
``fully_shard``: FSDP2 reads any 2-D mesh as HSDP (dim 0 replicated, dim 1 sharded),
so a 2-D slice such as ``mesh["dp", "tp"]`` silently becomes HSDP over the wrong axes.

Example::

    mesh = MeshLayout.parse("dp_replicate=2,dp_shard=2").build("cpu")
    apply_fsdp(model, mesh.fsdp_mesh())  # HSDP: (Replicate(), Shard(0))
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.distributed.layout import ParallelMesh
from hyper_parallel.dmodule._checks import Finding

__all__ = ["apply_fsdp", "fsdp_mesh_findings", "fsdp_mesh_for", "fsdp_units"]

_SHARD_DIMS = ("fsdp", "dp_shard", "dp")


def fsdp_mesh_for(mesh: ParallelMesh, plan_axes: tuple[str, ...] | list[str]) -> DeviceMesh | None:
    """The mesh FSDP2 shards dense states over, given the axes the plan declares.

    Normally :meth:`ParallelMesh.fsdp_mesh`: ``fsdp`` = dp_shard x cp (2-D with
    ``dp_replicate`` for HSDP). When the plan itself places states on ``cp`` (a
    context-parallel layout keeps every state a DTensor on its ``(cp, tp)`` submesh),
    FSDP2 cannot shard over ``cp`` as well (torch refuses overlapping meshes), so it
    shards over ``dp_shard`` alone (``(dp_replicate, dp_shard)`` for HSDP); the states
    stay replicated over ``cp`` and their ``cp``-partial gradients are reduced by DTensor.

    Returns:
        The mesh, or ``None`` when there is no data axis to shard over.
    """
    layout = mesh.layout
    if "cp" not in plan_axes:
        return mesh.fsdp_mesh()
    if layout.dp_replicate > 1:
        return mesh.submesh(("dp_replicate", "dp_shard"))
    return mesh["dp_shard"] if layout.dp_shard > 1 else None


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each element of the model's top-level ModuleLists/ModuleDicts.

    For a decoder that is each transformer block (``layers.0``, ``layers.1``, ...);
    containers nested inside a unit are part of that unit.
    """
    units: list[tuple[str, nn.Module]] = []
    lists: list[str] = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            continue
        if any(path == p or path.startswith(f"{p}.") for p in lists):
            continue
        if any(path.startswith(f"{u}.") for u, _ in units):
            continue
        lists.append(path)
        children = m.items() if isinstance(m, nn.ModuleDict) else enumerate(m)
        units += [(f"{path}.{key}" if path else str(key), child) for key, child in children]
    return units


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    units: list[tuple[str, nn.Module]] | None = None,
    **fully_shard_kwargs: Any,
) -> list[str]:
    """``fully_shard`` each unit, then the root, over ``mesh``; returns the units' paths.

    Args:
        model: The model, already parallelized on its model-parallel axes.
        mesh: :meth:`ParallelMesh.fsdp_mesh` (1-D ``fsdp`` or 2-D ``(dp_replicate, fsdp)``).
        units: The units to wrap; default :func:`fsdp_units`.
        fully_shard_kwargs: Passed on to every ``fully_shard`` call.

    Raises:
        ValueError: For a mesh :func:`fsdp_mesh_findings` refuses.
    """
    errors = [f for f in fsdp_mesh_findings(mesh) if f.severity == "error"]
    if errors:
        raise ValueError(" ".join(str(f) for f in errors))
    units = fsdp_units(model) if units is None else units
    for _, unit in units:
        fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return [p for p, _ in units]


def fsdp_mesh_findings(mesh: DeviceMesh, path: str = "") -> list[Finding]:
    """Problems of ``mesh`` as the mesh handed to ``fully_shard``.

    Returns:
        An error for a mesh of more than two dims or without dim names; a warning
        (the HSDP trap) for a 2-D mesh that is not ``(dp_replicate, <shard axis>)``:
        FSDP2 replicates over its first dim and shards over its second, whatever
        they are called.
    """
    names = mesh.mesh_dim_names
    if names is None:
        return [
            Finding(
                "error",
                path,
                "fsdp mesh",
                "the mesh handed to fully_shard has no dim names.",
                "use ParallelMesh.fsdp_mesh() (named 'fsdp', or ('dp_replicate', 'fsdp')).",
            )
        ]
    if mesh.ndim > 2:
        return [
            Finding(
                "error",
                path,
                "fsdp mesh",
                f"fully_shard takes a 1-D (FSDP) or 2-D (HSDP) mesh, got {mesh.ndim}-D {names}.",
                "use ParallelMesh.fsdp_mesh(); other axes (tp, cp) belong to the plan.",
            )
        ]
    if mesh.ndim == 2 and (names[0] != "dp_replicate" or names[1] not in _SHARD_DIMS):
        return [
            Finding(
                "warning",
                path,
                "fsdp mesh",
                f"a 2-D mesh {names} handed to fully_shard silently becomes HSDP: states "
                f"are replicated over {names[0]!r} and sharded over {names[1]!r}, which is "
                "not FSDP over the data-parallel ranks.",
                "hand fully_shard the 1-D fsdp mesh, or ('dp_replicate', 'fsdp') for HSDP: "
                "ParallelMesh.fsdp_mesh() gives the right one.",
            )
        ]
    return []
