"""FSDP2 over the data axes: FSDP on ``fsdp`` = dp_shard x cp, HSDP with ``dp_replicate``.

:func:`apply_fsdp` wraps each unit (every element of the model's top-level
``ModuleList``\\ s: the transformer blocks) and then the root with torch's
``fully_shard`` on the mesh :func:`fsdp_mesh_for` gives:

- without context parallelism, :meth:`ParallelMesh.fsdp_mesh`: a 1-D ``fsdp`` mesh
  (placement ``Shard(0)``), or for HSDP the 2-D ``(dp_replicate, fsdp)`` mesh
  (placements ``(Replicate(), Shard(0))``: states sharded within a replica group,
  gradients reduce-scattered there and all-reduced across replicas);
- with ``cp`` > 1, the model's own mesh (the plan's axes plus the data axes, see
  :func:`~hyper_parallel.distributed.plan_mesh`) in FSDP2's SPMD form
  (``DataParallelMeshDims``): states are sharded over dp_shard x cp (flattened) and,
  for HSDP, replicated over ``dp_replicate``. The plan already keeps every state a
  DTensor on ``cp`` (replicated there), and torch refuses to add a separate data mesh
  that overlaps it; the SPMD form shards over ``cp`` on the states' own mesh instead
  (:func:`~hyper_parallel.distributed.axes.fsdp_shards_over_cp`), 2-D or 3-D alike.

Either way FSDP2 averages gradients over every data rank (dp_replicate x dp_shard x
cp), which, with each rank's loss the mean over its own tokens, is the gradient of the
global mean.

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
from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule, fully_shard

from hyper_parallel._torch_private import DTensorSpec
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed.axes import fsdp_shards_over_cp, plan_mesh
from hyper_parallel.distributed.layout import MeshLayout, ParallelMesh
from hyper_parallel.dmodule.findings import Finding

__all__ = [
    "apply_fsdp",
    "fsdp_mesh_dims",
    "fsdp_mesh_findings",
    "fsdp_mesh_for",
    "fsdp_units",
    "shards_dense_states",
]

_SHARD_DIMS = ("fsdp", "dp_shard", "dp")
# The dims of a model mesh FSDP2's SPMD form may find there: data axes and model axes.
_SPMD_DATA = ("dp_replicate", "dp_shard", "cp")
_SPMD_DIMS = (*_SPMD_DATA, "tp")


def fsdp_mesh_for(mesh: ParallelMesh, plan_axes: tuple[str, ...] | list[str]) -> DeviceMesh | None:
    """The mesh ``fully_shard`` takes for dense states, given the axes the plan declares.

    Without ``cp`` in the plan: :meth:`ParallelMesh.fsdp_mesh` (1-D ``fsdp`` =
    dp_shard x cp, or 2-D ``(dp_replicate, fsdp)`` for HSDP). With ``cp`` > 1 in the
    plan (:func:`~hyper_parallel.distributed.axes.fsdp_shards_over_cp`): the model's
    mesh, :func:`~hyper_parallel.distributed.plan_mesh` (e.g. ``(dp_shard, cp)``,
    ``(cp, tp)`` or ``(dp_shard, cp, tp)``), on which :func:`apply_fsdp` runs FSDP2's
    SPMD form (:func:`fsdp_mesh_dims`): shard over dp_shard x cp, replicate over
    dp_replicate.

    Returns:
        The mesh, or ``None`` when there is no data axis to shard over.
    """
    layout = mesh.layout
    if "cp" not in plan_axes or layout.cp < 2:
        return mesh.fsdp_mesh()
    if fsdp_shards_over_cp(layout, plan_axes):
        return plan_mesh(mesh, plan_axes)
    if layout.dp_replicate > 1:
        return mesh.submesh(("dp_replicate", "dp_shard"))
    return mesh["dp_shard"] if layout.dp_shard > 1 else None


def shards_dense_states(layout: MeshLayout, plan_axes: tuple[str, ...] | list[str]) -> bool:
    """Whether :func:`fsdp_mesh_for` gives a mesh for ``layout``, from the layout alone.

    No process group is needed: the one-process reference of a run asks whether the
    run's dense blocks compute under FSDP2's mixed-precision policy (see
    :func:`~hyper_parallel.distributed.precision.fsdp_policy`) or under autocast.
    """
    if "cp" not in plan_axes or layout.cp < 2:
        return layout.dp_replicate > 1 or layout.fsdp > 1
    if fsdp_shards_over_cp(layout, plan_axes):
        return True
    return layout.dp_replicate > 1 or layout.dp_shard > 1


def fsdp_mesh_dims(mesh: DeviceMesh) -> DataParallelMeshDims | None:
    """FSDP2's SPMD form for a model mesh holding ``cp``; ``None`` for a plain FSDP mesh.

    On a mesh whose dims include ``cp`` (the model's mesh under context parallelism)
    FSDP2 shards over its ``dp_shard`` and ``cp`` dims (flattened, in that order) and
    replicates over ``dp_replicate`` (HSDP); ``tp`` stays the plan's.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" not in names:
        return None
    shard = tuple(a for a in ("dp_shard", "cp") if a in names)
    replicate = "dp_replicate" if "dp_replicate" in names else None
    return DataParallelMeshDims(shard=shard if len(shard) > 1 else shard[0], replicate=replicate)


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
        mesh: :func:`fsdp_mesh_for`: 1-D ``fsdp``, 2-D ``(dp_replicate, fsdp)``, or under
            context parallelism the model's mesh (FSDP2's SPMD form, :func:`fsdp_mesh_dims`).
        units: The units to wrap; default :func:`fsdp_units`.
        fully_shard_kwargs: Passed on to every ``fully_shard`` call.

    Raises:
        ValueError: For a mesh :func:`fsdp_mesh_findings` refuses.
    """
    errors = [f for f in fsdp_mesh_findings(mesh) if f.severity == "error"]
    if errors:
        raise ValueError(" ".join(str(f) for f in errors))
    dims = fsdp_mesh_dims(mesh)
    if dims is not None:
        mesh = _states_on_one_mesh(model, mesh)
        fully_shard_kwargs = {**fully_shard_kwargs, "dp_mesh_dims": dims}
    units = fsdp_units(model) if units is None else units
    for _, unit in units:
        fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return [p for p, _ in units]


def _states_on_one_mesh(model: nn.Module, mesh: DeviceMesh) -> DeviceMesh:
    """The one mesh object, equal to ``mesh``, that every parameter of ``model`` carries.

    FSDP2's SPMD form compares the parameters' mesh with the one it is given by
    identity. DTensor caches sharding decisions by mesh *equality*, so the parameters
    may carry an equal object built earlier in the process rather than ``mesh``
    itself (in the dry run, one of an earlier fake world, whose groups are gone): any
    parameter on another (equal) object is re-wrapped on ``mesh`` (same local data,
    placements and shape).

    Raises:
        ValueError: A parameter is not a DTensor on a mesh equal to ``mesh``.
    """
    target = mesh
    # States a module already fully_shard'ed on a mesh of its own manages (routed experts
    # over efsdp) are not this call's: FSDP2 leaves them to that module.
    own = {
        id(p)
        for m in model.modules()
        if m is not model and isinstance(m, FSDPModule)
        for p in m.parameters()
    }
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in own:
                continue
            if not isinstance(p, DTensor) or p.device_mesh != mesh:
                where = f"{type(module).__name__}.{name}"
                got = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else "a plain tensor"
                raise ValueError(
                    f"apply_fsdp: FSDP2 shards over cp on the model's mesh "
                    f"{mesh.mesh_dim_names}, so every parameter must be a DTensor on it; "
                    f"{where} is on {got}. Parallelize the whole model on "
                    "plan_mesh(mesh, axes) (the trainer does) before apply_fsdp."
                )
            if p.device_mesh is target:
                continue
            spec = DTensorSpec(target, p.placements, tensor_meta=p._spec.tensor_meta)
            same = DTensor(p._local_tensor, spec, requires_grad=p.requires_grad)
            param = nn.Parameter(same, requires_grad=p.requires_grad)
            # nn.Parameter detaches, and DTensor's cached propagation may hand back an
            # equal spec on the object cached first (another fake world's mesh).
            param._spec = spec
            module.register_parameter(name, param)
    return target


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
    if "cp" in names:
        return _spmd_mesh_findings(names, path)
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


def _spmd_mesh_findings(names: tuple[str, ...], path: str) -> list[Finding]:
    """A model mesh holding ``cp``: only data axes and ``tp`` (FSDP2's SPMD form)."""
    other = [n for n in names if n not in _SPMD_DIMS]
    if not other:
        return []
    return [
        Finding(
            "error",
            path,
            "fsdp mesh",
            f"under context parallelism fully_shard takes the model's mesh, with dims among "
            f"{_SPMD_DIMS}; got {names} (unexpected: {other}).",
            "use fsdp_mesh_for(mesh, plan_axes), the model's plan_mesh(mesh, plan_axes).",
        )
    ]
