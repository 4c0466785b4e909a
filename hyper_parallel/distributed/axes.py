"""Which axes a plan uses, where it is applied, and the checks every entry point shares.

A sharding plan *declares* the mesh axes its placements name (today ``tp``; ``cp``
and ``tp`` for context parallelism). The trainer, the dry run and ``validate`` all
apply it on the same submesh: :func:`plan_mesh` — the dense mesh sliced to those
axes, size-1 axes included, so every name the plan uses resolves. Data axes
(``dp_replicate``, ``dp_shard`` and their views) belong to FSDP and the data loader,
not to a plan.

The checks: :func:`axis_support_findings` (an axis a tool does not handle, e.g.
``pp`` for the dry run, which traces one pipeline's ranks) and
:func:`plan_axis_findings` (a ``cp`` axis the plan does not declare, the ``dp``
synonym used in a placement, a plan placing states on a data axis) return
:class:`~hyper_parallel.dmodule.Finding`\\ s. The run plan
(:class:`~hyper_parallel.distributed.run_plan.RunPlan`) gathers them with every
other check of a run, once, for the trainer, ``validate``, ``plan`` and the demo.

Example::

    layout = MeshLayout.parse("dp_shard=2,tp=2")
    axes = declared_axes(m.sharding_config for m in model.modules() if ...)  # ("tp",)
    errors = plan_axis_findings(layout, axes, fsdp=True)
    model.parallelize(plan_mesh(mesh, axes))
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.distributed.layout import (
    ALIASES,
    DATA_AXES,
    DENSE_AXES,
    USER_AXES,
    MeshLayout,
    ParallelMesh,
)
from hyper_parallel.dmodule.findings import Finding, PlanEntry, named_placements
from hyper_parallel.dmodule.sharding import ShardingConfig

__all__ = [
    "AXIS_MEANING",
    "MODEL_AXES",
    "apply_model_axes",
    "axis_support_findings",
    "declared_axes",
    "fsdp_shards_over_cp",
    "plan_axis_findings",
    "plan_mesh",
    "states_on_axes",
]

AXIS_MEANING = {
    "pp": "pipeline parallelism",
    "dp_replicate": "replicated data parallelism (HSDP)",
    "dp_shard": "sharded data parallelism (FSDP2)",
    "cp": "context parallelism",
    "tp": "tensor parallelism",
    "ep": "expert parallelism",
}


MODEL_AXES = ("tp", "cp", "ep")
"""Axes a registered model's own sharding functions handle, in the order they are applied."""


def apply_model_axes(
    spec: Any, config: Any, layout: MeshLayout, *, sequence_parallel: bool = False
) -> Any:
    """``config`` with the spec's sharding for every model axis of size > 1 in ``layout``.

    For each axis of :data:`MODEL_AXES` the spec's sharding function
    (:meth:`~hyper_parallel.dmodule.ModelSpec.sharding`: its family's ``tp``, ``tp_sp``
    for tp with ``sequence_parallel``, ``cp``, ``ep``) is applied, with
    ``<axis>_size=`` when it takes one; so the config declares exactly the active model
    axes, as the trainer, the dry run and ``validate`` expect.

    Raises:
        ValueError: The model does not support an active axis (the message names the
            model and the axis), or the function refuses the size (e.g. heads not
            divisible by tp).
    """
    for axis in MODEL_AXES:
        size = layout.size(axis)
        if size == 1:
            continue
        fn = spec.sharding(axis, sequence_parallel=sequence_parallel)
        kwargs = {}
        if f"{axis}_size" in inspect.signature(fn).parameters:
            kwargs[f"{axis}_size"] = size
        config = fn(config, **kwargs)
    return config


def declared_axes(configs: Iterable[ShardingConfig | PlanEntry | None]) -> tuple[str, ...]:
    """Every axis name the configs' placements use: dense axes in layout order, then others.

    Args:
        configs: ``ShardingConfig``s (or plan entries); ``None`` entries are skipped.
    """
    names: set[str] = set()
    for item in configs:
        config = item.config if isinstance(item, PlanEntry) else item
        if config is None:
            continue
        for _, named in named_placements(config):
            names.update(str(getattr(a, "value", a)) for a in (named or {}))
    dense = tuple(a for a in DENSE_AXES if a in names)
    return dense + tuple(sorted(names - set(dense)))


def plan_mesh(mesh: ParallelMesh, axes: Iterable[str]) -> DeviceMesh | None:
    """The submesh a plan declaring ``axes`` is applied on (``None`` when it declares none).

    Only dense axes are kept (:func:`plan_axis_findings` reports the others); the
    submesh keeps size-1 axes, so a plan's every placement resolves. When FSDP2 shards
    over ``cp`` too (:func:`fsdp_shards_over_cp`), the data axes of size > 1 join it
    (the plan's tensors are ``Replicate`` on them): FSDP2's SPMD form takes states on
    one mesh holding every data axis it uses
    (:func:`~hyper_parallel.distributed.fsdp.fsdp_mesh_for`).
    """
    dense = [a for a in axes if a in DENSE_AXES]
    if fsdp_shards_over_cp(mesh.layout, dense):
        dense += [a for a in ("dp_replicate", "dp_shard") if mesh.layout.size(a) > 1]
    return mesh.submesh(dense) if dense else None


def fsdp_shards_over_cp(layout: MeshLayout, axes: Iterable[str]) -> bool:
    """Whether FSDP2 shards dense states over ``cp`` as well as the data axes.

    It does whenever the plan runs on ``cp`` (size > 1): FSDP2 then shards over
    dp_shard x cp (replicating over dp_replicate) on the model's mesh, whatever its
    number of dims. (Linear layers fold a sequence-sharded input token dim first, so
    DTensor never plans a ``_StridedShard`` fold of ``(batch, seq)`` on such a mesh.)
    """
    dense = {a for a in axes if a in DENSE_AXES}
    return "cp" in dense and layout.cp >= 2


def axis_support_findings(layout: MeshLayout, supported: Iterable[str], who: str) -> list[Finding]:
    """An error for each axis of size > 1 that ``who`` does not run (never ignored).

    Args:
        layout: The mesh.
        supported: The user axes ``who`` implements.
        who: Names the refusing party in the message, e.g. ``"the trainer"``.
    """
    allowed = set(supported)
    out = []
    for axis, size in layout.active().items():
        if axis in allowed:
            continue
        out.append(
            Finding(
                "error",
                "mesh",
                axis,
                f"{axis}={size}: {AXIS_MEANING.get(axis, axis)} is not run by {who} for this "
                f"model; it runs {', '.join(a for a in USER_AXES if a in allowed)}.",
                f"leave {axis} out of the mesh (size 1) and give its ranks to "
                f"{'dp_shard' if 'dp_shard' in allowed else sorted(allowed)[0]} instead.",
            )
        )
    return out


def plan_axis_findings(
    layout: MeshLayout,
    axes: Iterable[str],
    *,
    fsdp: bool,
    states_on_data: Iterable[str] = (),
) -> list[Finding]:
    """Problems between a mesh and the axes a plan declares.

    Args:
        layout: The mesh.
        axes: The plan's axes (:func:`declared_axes`).
        fsdp: Whether FSDP2 shards dense states over the data axes.
        states_on_data: Module paths whose configs place *states* on a data axis
            (:func:`states_on_axes`).

    Returns:
        Errors: ``cp`` > 1 that the plan does not declare (each rank's sequence shard
        would be read as the whole sequence), ``dp`` used in a placement (a size
        synonym only), states placed on a data axis FSDP2 shards over (the HSDP
        trap). Warnings: a plan placing only activations on a data axis.
    """
    axes = tuple(axes)
    out = []
    if layout.cp > 1 and "cp" not in axes:
        out.append(
            Finding(
                "error",
                "mesh",
                "cp",
                f"the mesh has cp={layout.cp} but the model's sharding declares no 'cp' "
                f"placement (it uses {list(axes) or 'no axis'}): every rank would read its "
                "shard of the sequence as the whole sequence, silently.",
                "shard the model for context parallelism (Llama: apply_cp, registered as "
                "the 'cp' sharding of its ModelSpec), or leave cp out of the mesh.",
            )
        )
    for alias, canonical in ALIASES.items():
        if alias in axes:
            out.append(
                Finding(
                    "error",
                    "plan",
                    alias,
                    f"a placement names {alias!r}, which is only a mesh-size synonym of "
                    f"{canonical!r}; the mesh's axis is called {canonical!r}.",
                    f"write {canonical!r} in the placements.",
                )
            )
    data = [a for a in axes if a in DATA_AXES]
    if data and fsdp:
        paths = sorted(states_on_data)
        where = f" ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})" if paths else ""
        model_axes = [a for a in axes if a not in DATA_AXES]
        # States (not only activations) there, and FSDP2 has ranks to shard them over:
        # the builder would hand fully_shard states already on a data axis. Refused
        # (the trainer, the dry run, validate and plan alike); activations alone warn.
        shards = layout.dp_replicate > 1 or layout.fsdp > 1
        out.append(
            Finding(
                "error" if paths and shards else "warning",
                "plan",
                data[0],
                f"the plan places {'states' if paths else 'tensors'} on the data axis "
                f"{data[0]!r}{where}, which FSDP2 also shards over. Those states end up on a "
                f"mesh of {tuple(data + model_axes)}: a 2-D slice like that handed to "
                f"fully_shard silently becomes HSDP (replicate over {data[0]!r}, shard over "
                "the second axis), not FSDP over the data ranks.",
                "leave data axes to FSDP (drop them from the plan; FSDP2 runs on "
                "ParallelMesh.fsdp_mesh()), or turn FSDP off (fsdp=False; CLI: --no-fsdp) "
                "to place states yourself.",
            )
        )
    return out


def states_on_axes(entries: Iterable[PlanEntry], axes: Iterable[str]) -> list[str]:
    """Paths of the entries whose ``state_shardings`` name any of ``axes``."""
    wanted = set(axes)
    return sorted(
        {
            e.path or "<root>"
            for e in entries
            for named in e.config.state_shardings.values()
            if any(str(getattr(a, "value", a)) in wanted for a in named)
        }
    )
