"""Tracing one training step of a layout on fake tensors over the fake process group:
the model built and sharded as the trainer does, one forward and backward under a
collective recorder, and what that step measured (:class:`_Run`: parameter shards,
collectives, states, saved activations per block)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel._torch_private import FakeTensorMode
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import AC_MODES
from hyper_parallel.distributed.axes import (
    declared_axes,
)
from hyper_parallel.distributed.builder import apply_run_plan
from hyper_parallel.distributed.context_parallel import positions as cp_positions
from hyper_parallel.distributed.fsdp import fsdp_mesh_dims
from hyper_parallel.distributed.layout import (
    DATA_AXES,
    DENSE_AXES,
    LayoutError,
    MeshLayout,
    ParallelMesh,
)
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.dmodule.findings import Finding

from .._format import placement_text
from .._model import (
    Target,
    cp_inputs,
    default_inputs,
    fake_trace,
)
from ..collectives import (
    Collective,
    CollectiveRecorder,
    CollectiveStat,
    axis_groups,
    summarize,
)
from ..memory import SavedActivations
from ._report import DryRunReport, LossFn, ModuleShards, ParamShard

__all__: list[str] = []


@dataclass
class _Run:
    """What one traced step at one depth measured."""

    depth: int | None
    num_params: int
    modules: list[ModuleShards]
    param_bytes: int
    grad_bytes: int
    trainable_numel: int
    records: list[Collective]
    comm_counts: dict[str, int]
    fsdp_units: list[str]
    comm_debug_total: int
    plan_axes: tuple[str, ...] = ()
    expert_bytes: tuple[int, int, int] | None = None  # params, grads, trainable numel
    expert_numel: int = 0  # global elements of the routed experts
    activation_bytes: int = 0
    activations_by_ac: dict[str, int] = field(default_factory=dict)
    held_by_ac: dict[str, int] = field(default_factory=dict)
    activations_outside_blocks: tuple[int, int] = (0, 0)
    block_bytes: tuple[int, int, int] | None = None  # the last block's (saved, kept, recomputed)
    op_block_bytes: tuple[int, int, int] | None = None  # the same under ``op`` checkpointing
    unsharded_grad_bytes: int = 0  # the gradients as FSDP2 accumulates them (unsharded)


def _declared_blocks(model: nn.Module) -> str | None:
    """The attribute holding ``model``'s blocks, as its family (or, for a pipeline stage,
    its family's pipeline description) declares it; ``None`` when none does."""
    from hyper_parallel.dmodule.model_spec import family_of, get_spec, list_specs

    family = family_of(model)
    if family is not None:
        return family.blocks
    for name in list_specs():
        layout = get_spec(name).family.pipeline
        if layout is not None and isinstance(model, layout.stage):
            return layout.layers
    return None


def _trace_step(
    target: Target,
    world: ParallelMesh,
    depth: int | None,
    *,
    run: RunPlan,
    param_dtype: torch.dtype,
    inputs: Sequence[torch.Tensor] | None,
    batch_size: int,
    seq_len: int,
    loss_fn: LossFn,
) -> _Run:
    mode = FakeTensorMode()
    model = target.build_fake(mode, depth, param_dtype)
    types = {path: type(m).__name__ for path, m in model.named_modules()}
    entries, findings = target.entries(model)
    axes = declared_axes(entries)
    fsdp_mesh = run.fsdp_mesh(world)
    kwargs: dict[str, torch.Tensor] = {}
    if "cp" in axes and world.layout.cp > 1 and inputs is None:
        args, kwargs = cp_inputs(model, batch_size, seq_len, world.layout.cp, mode)
    else:
        args = _inputs(model, inputs, batch_size, seq_len, mode)
        if "cp" in axes and world.layout.cp > 1:  # given inputs: rank 0's part of the sequence
            kwargs = {"positions": mode.from_tensor(cp_positions(seq_len, 0, world.layout.cp))}
    experts = [e for e in entries if e.config.dispatch is not None]
    # The one builder, as the trainer applies it (plan on its submesh, experts on ep
    # and FSDP2 over efsdp, FSDP2 with the dtype's policy); a fake model: nothing
    # compiled, activation checkpointing estimated below rather than applied.
    # The blocks activation checkpointing applies to: the list of identical layers (the
    # family's blocks; a pipeline stage keys its blocks by their index in a dict). Asked
    # before FSDP2 swaps the model's class for its own subclass.
    field = target.layers_field or _declared_blocks(model)
    units = apply_run_plan(model, run, world, entries=entries, plan_findings=findings, trace=True)
    # The trainer's model ties again when materialized (to_empty), after FSDP2 gave a
    # tied DTensor (cp) one parameter per module; the fake model is not materialized.
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    modules = _module_shards(model, types, _fsdp_dim_names(fsdp_mesh))
    recorder = CollectiveRecorder(*_recorder_groups(world, fsdp_mesh))
    comm = CommDebugMode()
    blocks = getattr(model, field, None) if field else None
    if isinstance(blocks, nn.ModuleDict):
        blocks = nn.ModuleList(blocks.values())
    saved = SavedActivations(model, list(blocks) if isinstance(blocks, nn.ModuleList) else [])
    with mode, comm, recorder, fake_trace():
        with saved:
            out = model(*args, **kwargs)
            loss = loss_fn(out, *args)
        recorder.phase = "backward"
        loss.backward()
    params = _unique_params(model)
    grads = [p.grad for p in params if p.grad is not None]
    expert_bytes, expert_numel = None, 0
    if experts:
        eparams = [p for e in experts for p in e.module.parameters()]
        expert_numel = sum(p.numel() for p in {id(p): p for p in eparams}.values())
        expert_bytes = (
            sum(_local_bytes(p) for p in eparams),
            sum(_local_bytes(p.grad) for p in eparams if p.grad is not None),
            sum(_local(p).numel() for p in eparams if p.requires_grad),
        )
    pending = _pending_reductions(grads)
    return _Run(
        depth=depth,
        num_params=sum(p.numel() for p in params),
        modules=modules,
        param_bytes=sum(_local_bytes(p) for p in params),
        grad_bytes=sum(_local_bytes(g) for g in grads),
        trainable_numel=sum(_local(p).numel() for p in params if p.requires_grad),
        records=recorder.records + pending,
        comm_counts={str(op): n for op, n in comm.get_comm_counts().items()},
        fsdp_units=units,
        comm_debug_total=comm.get_total_counts(),
        expert_bytes=expert_bytes,
        expert_numel=expert_numel,
        plan_axes=tuple(a for a in axes if a in DENSE_AXES),
        activation_bytes=saved.peak_bytes(run.ac),
        activations_by_ac={m: saved.peak_bytes(m) for m in AC_MODES},
        held_by_ac={m: saved.held_bytes(m) for m in AC_MODES},
        activations_outside_blocks=saved.outside_blocks(),
        block_bytes=saved.block_bytes(len(saved.blocks) - 1) if saved.blocks else None,
        op_block_bytes=saved.block_bytes(len(saved.blocks) - 1, "op") if saved.blocks else None,
        unsharded_grad_bytes=sum(_unsharded_bytes(g, fsdp_mesh, run.dtype) for g in grads),
    )


_FSDP_SHARD_DIMS = frozenset({"fsdp", "dp_shard", "efsdp"})
"""Mesh dims over which FSDP2 shards states (besides the flattened dim of its SPMD form)."""
_GRADIENT_REDUCTIONS = frozenset(
    {("reduce_scatter", "fsdp"), ("reduce_scatter", "efsdp"), ("all_reduce", "dp_replicate")}
    | {("all_reduce", "edp_replicate")}
)
"""FSDP2's gradient reductions in backward, as the recorder names them: once per step
under gradient accumulation."""


def _unsharded_bytes(grad: torch.Tensor, fsdp_mesh: DeviceMesh | None, dtype: str) -> int:
    """``grad``'s bytes before FSDP2's reduce-scatter: its local shard times the sizes of
    the mesh dims FSDP2 shards it over (tp and ep shards stay), at the reduce dtype of
    ``dtype``'s policy: FSDP2 accumulates unsharded gradients in it (bf16-true's bf16
    gradients are held in fp32 between micro-batches)."""
    size = _local_bytes(grad)
    if not isinstance(grad, DTensor) or fsdp_mesh is None:
        return size
    reduce = precision.fsdp_policy(dtype).reduce_dtype
    if reduce is not None and reduce != grad.dtype:
        size = size // grad.element_size() * reduce.itemsize
    flat = _fsdp_flat_name(fsdp_mesh)
    names = grad.device_mesh.mesh_dim_names or ()
    for i, (name, placement) in enumerate(zip(names, grad.placements)):
        # FSDP2 shards a tp-sharded dim strided (_StridedShard, not a Shard subclass).
        sharded = placement.is_shard() or type(placement).__name__ == "_StridedShard"
        if sharded and (name in _FSDP_SHARD_DIMS or name == flat):
            size *= grad.device_mesh.size(i)
    return size


def _accumulate(
    report: DryRunReport,
    runs: Sequence[_Run],
    target: Target,
    microbatches: int,
    fsdp: bool,
    reduce_each: bool = False,
) -> None:
    """A step of ``microbatches`` micro-batches from the trace of one: forward and
    backward collectives repeated, FSDP2's gradient reductions (and the optimizer
    phase's) once, gradients held unsharded under FSDP2 until the last backward; with
    ``reduce_each`` the reductions repeat too and the gradients stay sharded."""

    def repeat(stats: list[CollectiveStat] | None) -> list[CollectiveStat] | None:
        if stats is None:
            return None
        out = []
        for c in stats:
            once = c.phase == "optimizer" or (
                not reduce_each
                and c.phase == "backward"
                and (c.kind, c.axis) in _GRADIENT_REDUCTIONS
            )
            k = 1 if once else microbatches
            out.append(
                replace(c, count=c.count * k, bytes=c.bytes * k, wire_bytes=c.wire_bytes * k)
            )
        return out

    report.collectives = repeat(report.collectives) or []
    report.collectives_per_layer = repeat(report.collectives_per_layer)
    report.comm_debug_counts = {}  # one micro-batch's trace: not the step's
    report.num_microbatches = microbatches
    if fsdp and not reduce_each:
        a, b = runs[0], runs[-1]
        grads = b.unsharded_grad_bytes
        if len(runs) == 2 and target.num_layers is not None and a.depth is not None:
            extra = target.num_layers - a.depth
            grads = a.unsharded_grad_bytes + extra * (
                b.unsharded_grad_bytes - a.unsharded_grad_bytes
            )
        report.per_rank = replace(report.per_rank, grads=grads)


def _raise_errors(findings: Sequence[Finding]) -> None:
    if findings:
        raise LayoutError(findings)


def _placement_columns(
    layout: MeshLayout, fsdp_axes: Sequence[str], plan_axes: Sequence[str]
) -> tuple[str, ...]:
    """One column per active axis, named as the states' meshes name it: FSDP's shard
    dim (``fsdp`` = dp_shard x cp) and the plan's."""
    cols = []
    if layout.dp_replicate > 1:
        cols.append("dp_replicate")
    shard = [a for a in fsdp_axes if a != "dp_replicate"]
    if shard and layout.size(shard[0]) > 1:
        cols.append(shard[0])
    elif layout.dp_shard > 1:
        cols.append("dp_shard")
    covered = set(cols) | ({"dp_shard", "cp"} if "fsdp" in cols else set())
    cols += [a for a in ("cp", "tp") if (layout.size(a) > 1 or a in plan_axes) and a not in covered]
    return tuple(cols)


def _data_axis(layout: MeshLayout, plan_axes: Sequence[str]) -> tuple[str, int]:
    """The axis over which gradients are averaged without FSDP, and its size.

    A ``cp`` the plan declares is not one: its gradients come back ``Partial`` on ``cp``
    and are reduced as DTensors (listed with the optimizer's pending reductions).
    """
    axes = ("dp_replicate", "dp_shard") + (() if "cp" in plan_axes else ("cp",))
    active = [a for a in axes if layout.size(a) > 1]
    if len(active) == 1:
        return active[0], layout.size(active[0])
    size = math.prod(layout.size(a) for a in active)
    return ("loss" if "cp" in active else "batch"), size


def _pending_reductions(grads: Sequence[torch.Tensor]) -> list[Collective]:
    """All-reduces still owed by gradients that backward left ``Partial`` (computed).

    DTensor reduces a partial sum only when it is read: such a gradient is reduced when
    the optimizer step (or gradient clipping) first touches it, once per partial axis.
    """
    out = []
    for g in grads:
        if not isinstance(g, DTensor):
            continue
        names = g.device_mesh.mesh_dim_names or ()
        for axis, p in zip(names, g.placements):
            if p.is_partial():
                size = g.device_mesh[axis].size()
                out.append(
                    Collective("all_reduce", axis, "optimizer", _local_bytes(g), size, False)
                )
    return out


def _inputs(
    model: nn.Module,
    inputs: Sequence[torch.Tensor] | None,
    batch_size: int,
    seq_len: int,
    mode: FakeTensorMode,
) -> tuple[torch.Tensor, ...]:
    if inputs is None:
        return default_inputs(model, batch_size, seq_len, mode)
    out = []
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"dry_run: inputs must be tensors, got {type(t).__name__}.")
        with mode:
            out.append(torch.zeros(t.shape, dtype=t.dtype))
    return tuple(out)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    return list({id(p): p for p in model.parameters()}.values())


def _fsdp_axes(fsdp_mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The dims FSDP2 shards and replicates over, as the report names them."""
    if fsdp_mesh is None:
        return ()
    dims = fsdp_mesh_dims(fsdp_mesh)
    if dims is None:
        return tuple(fsdp_mesh.mesh_dim_names or ())
    # The SPMD form on the model's mesh: shard over dp_shard x cp (= fsdp).
    return ("dp_replicate", "fsdp") if dims.replicate else ("fsdp",)


def _fsdp_flat_name(fsdp_mesh: DeviceMesh | None) -> str | None:
    """The dim name FSDP2's SPMD form gives its shard dim on the sharded states' mesh."""
    dims = fsdp_mesh_dims(fsdp_mesh) if fsdp_mesh is not None else None
    return None if dims is None else "_".join(dims.shard_names)


def _fsdp_dim_names(fsdp_mesh: DeviceMesh | None) -> dict[str, str]:
    """Sharded states' mesh dim → report column: FSDP2's flattened shard dim is ``fsdp``."""
    flat = _fsdp_flat_name(fsdp_mesh)
    return {} if flat is None else {flat: "fsdp"}


def _recorder_groups(
    world: ParallelMesh, fsdp_mesh: DeviceMesh | None
) -> tuple[dict[str, str], dict[str, str]]:
    """Group name → axis for the model's collectives, and for FSDP2's.

    Where FSDP2 shards over the very group of a model axis (over cp alone when
    dp_shard is 1), the model's collectives on it keep that axis's name.
    """
    groups = axis_groups(world)
    fsdp = _fsdp_group_names(fsdp_mesh)
    for axis in DENSE_AXES:
        if axis not in DATA_AXES and world.layout.size(axis) > 1:
            name = world.dense[axis].get_group().group_name
            if name in fsdp:
                groups[name] = axis
    return groups, fsdp


def _fsdp_group_names(fsdp_mesh: DeviceMesh | None) -> dict[str, str]:
    """Process-group name → ``fsdp`` for the shard group FSDP2's SPMD form flattens.

    torch flattens ``(dp_shard, cp)`` into a group of its own (the same ranks as the
    ``fsdp`` view of the mesh), named here so its collectives are reported on ``fsdp``.
    """
    dims = fsdp_mesh_dims(fsdp_mesh) if fsdp_mesh is not None else None
    if fsdp_mesh is None or dims is None:
        return {}
    names = dims.shard_names
    flat = fsdp_mesh[names[0]] if len(names) == 1 else fsdp_mesh[names]._flatten("_".join(names))
    return {flat.get_group().group_name: "fsdp"}


def _module_shards(
    model: nn.Module, types: Mapping[str, str], rename: Mapping[str, str] | None = None
) -> list[ModuleShards]:
    """Each module's parameters: shapes, bytes, and placements by mesh dim (``rename``d)."""
    rename = rename or {}
    seen: set[int] = set()
    modules = []
    for path, m in model.named_modules():
        params = []
        for name, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            # The placement on each dim of the parameter's own mesh; the report lays
            # them out in one column per mesh axis (absent: Replicate()).
            placements = {}
            if isinstance(p, DTensor):
                names = p.device_mesh.mesh_dim_names or ()
                placements = {
                    rename.get(a, a): placement_text(q) for a, q in zip(names, p.placements)
                }
            local = _local(p)
            params.append(
                ParamShard(
                    name=name,
                    global_shape=tuple(p.shape),
                    local_shape=tuple(local.shape),
                    placements=placements,
                    dtype=str(p.dtype).removeprefix("torch."),
                    bytes=local.numel() * local.element_size(),
                )
            )
        if params:
            modules.append(ModuleShards(path, types.get(path, type(m).__name__), tuple(params)))
    return modules


# ---------------------------------------------------------------------- combine


Key = tuple[str, str, str, bool]


def _stat_map(records: Sequence[Collective]) -> dict[Key, CollectiveStat]:
    return {(s.kind, s.axis, s.phase, s.traced): s for s in summarize(records)}
