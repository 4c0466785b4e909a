"""Dry run: one training step of a sharded model at any scale, in one process.

:func:`dry_run` builds the model with fake tensors (shapes, no storage), applies
its plan on the model-parallel axes, wraps each layer and the root with FSDP2's
``fully_shard`` over ``dp`` (by default), and runs one forward and backward pass
over PyTorch's fake process group at the full world size, under ``CommDebugMode``
and a recorder of every collective's kind, axis and size. Nothing is computed and
no data moves; the sharding, the per-rank memory and the collectives are those of
the real run.

A model whose config holds a list of identical layers is traced at two depths and
extrapolated linearly to its real depth (exact: everything but the number of
layers is the same in both runs); the report says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.precision import check_dtype
from hyper_parallel.dmodule._boundary import parallelize_entries
from hyper_parallel.dmodule._checks import PlanEntry
from hyper_parallel.dmodule.sharding import ShardingConfig

from ._format import human_bytes, layer_pattern, placement_text, table
from ._model import TRACE_DEPTHS, Target, default_inputs, default_loss, resolve_target
from ._world import MeshShape, fake_world, format_mesh, mesh_shape
from .collectives import (
    Collective,
    CollectiveRecorder,
    CollectiveStat,
    axis_groups,
    summarize,
    wire_bytes,
)
from .memory import SavedActivations, StateBytes, ddp_num_buckets, state_bytes

__all__ = ["DryRunReport", "ModuleShards", "ParamShard", "dry_run"]

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ParamShard:
    """One parameter: its global shape, placement per mesh axis and rank 0's local shard."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: dict[str, str]
    dtype: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "global_shape": list(self.global_shape),
            "local_shape": list(self.local_shape),
            "placements": dict(self.placements),
            "dtype": self.dtype,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class ModuleShards:
    """The parameters a module holds itself."""

    path: str
    type: str
    params: tuple[ParamShard, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "type": self.type, "params": [p.to_dict() for p in self.params]}


@dataclass
class DryRunReport:
    """What one training step costs each rank.

    Attributes:
        model: The model's class name.
        mesh: Axis → size.
        world_size: Number of ranks.
        num_params: Parameters of the whole model.
        batch_size: Per-rank batch of the traced step.
        seq_len: Sequence length of the traced step.
        param_dtype: Parameter dtype, e.g. ``"float32"``.
        fsdp: Whether FSDP2 shards over ``dp_axis``.
        dp_axis: The data-parallel axis.
        modules: Per module, its parameters' placements and rank 0's shards.
        per_rank: Bytes per rank of parameters, gradients and AdamW state.
        collectives: Per (kind, axis, phase): count and bytes per rank per step.
        collectives_per_layer: The same for one layer, when layers were extrapolated.
        comm_debug_counts: ``CommDebugMode``'s count per collective op (per step).
        num_layers: Layers of the model, when it has a list of identical layers.
        traced_layers: The depths actually traced (``None``: the full model).
        assumptions: How the numbers were obtained; read them with the numbers.
        elapsed_s: Wall time of the dry run.
        ac: Activation checkpointing assumed for ``per_rank.activations``.
        dtype: Compute precision assumed for ``per_rank.activations``.
    """

    model: str
    mesh: MeshShape
    world_size: int
    num_params: int
    batch_size: int
    seq_len: int
    param_dtype: str
    fsdp: bool
    dp_axis: str
    modules: list[ModuleShards]
    per_rank: StateBytes
    collectives: list[CollectiveStat]
    collectives_per_layer: list[CollectiveStat] | None = None
    comm_debug_counts: dict[str, int] = field(default_factory=dict)
    num_layers: int | None = None
    traced_layers: tuple[int, ...] | None = None
    assumptions: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    ac: str = "none"
    dtype: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the CLI's ``--format json``)."""
        per_layer = self.collectives_per_layer
        return {
            "model": self.model,
            "world_size": self.world_size,
            "mesh": dict(self.mesh),
            "num_params": self.num_params,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "param_dtype": self.param_dtype,
            "fsdp": self.fsdp,
            "dp_axis": self.dp_axis,
            "ac": self.ac,
            "dtype": self.dtype,
            "per_rank_bytes": self.per_rank.to_dict(),
            "collectives": [c.to_dict() for c in self.collectives],
            "collectives_per_layer": None
            if per_layer is None
            else [c.to_dict() for c in per_layer],
            "comm_debug_counts": dict(self.comm_debug_counts),
            "num_layers": self.num_layers,
            "traced_layers": None if self.traced_layers is None else list(self.traced_layers),
            "modules": [m.to_dict() for m in self.modules],
            "assumptions": list(self.assumptions),
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def to_table(self) -> str:
        """The report for people: parameters, memory, collectives, assumptions, summary."""
        axes = list(self.mesh)
        out = [
            f"plan: {self.model} on {format_mesh(self.mesh)} ({self.world_size:,} ranks); "
            f"batch {self.batch_size} x seq {self.seq_len}; {self.param_dtype} parameters; "
            + (f"FSDP2 over {self.dp_axis}" if self.fsdp else "no FSDP"),
            "",
            "Parameters (rank 0's shard; numbered layers folded into '*'):",
        ]
        rows = []
        for (path, name), (p, count) in _fold_params(self.modules).items():
            rows.append(
                (
                    path + (f" (x{count})" if count > 1 else ""),
                    name,
                    _shape(p.global_shape),
                    *(p.placements.get(a, "Replicate()") for a in axes),
                    _shape(p.local_shape),
                    human_bytes(p.bytes),
                )
            )
        right = (len(axes) + 4,)
        out.append(table(["module", "param", "global", *axes, "local", "bytes"], rows, right))
        m = self.per_rank
        out += [
            "",
            "Memory per rank (training states, plus one micro-batch's activations):",
            table(
                ["state", "bytes"],
                [
                    ("parameters", human_bytes(m.params)),
                    ("gradients", human_bytes(m.grads)),
                    ("AdamW moments", human_bytes(m.optimizer)),
                    (f"activations (ac={self.ac}, {self.dtype})", human_bytes(m.activations)),
                    ("total", human_bytes(m.total)),
                ],
                right=(1,),
            ),
            "",
            "Collectives per training step (per rank):",
            _collective_table(self.collectives),
        ]
        if self.collectives_per_layer is not None:
            out += ["", "Of which one layer:", _collective_table(self.collectives_per_layer)]
        out += ["", "Assumptions:"] + [f"  - {a}" for a in self.assumptions]
        num_calls = sum(c.count for c in self.collectives)
        moved = sum(c.bytes for c in self.collectives)
        out += [
            "",
            f"Summary: {_count(self.num_params)} parameters on {self.world_size:,} ranks: "
            f"{human_bytes(m.total)} per rank with activations; {num_calls:,} collectives per "
            f"step over {human_bytes(moved)} of buffers per rank ({self.elapsed_s:.1f} s).",
        ]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_table()


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n:,}"


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


def _fold_params(modules: Sequence[ModuleShards]) -> dict[tuple[str, str], tuple[ParamShard, int]]:
    folded: dict[tuple[str, str], tuple[ParamShard, int]] = {}
    for m in modules:
        for p in m.params:
            key = (layer_pattern(m.path), p.name)
            first, count = folded.get(key, (p, 0))
            folded[key] = (first, count + 1)
    return folded


def _collective_table(stats: Sequence[CollectiveStat]) -> str:
    if not stats:
        return "  (none)"
    rows = [
        (
            s.phase,
            s.kind if s.traced else f"{s.kind} (computed)",
            s.axis,
            f"{s.count:,}",
            human_bytes(s.bytes),
            human_bytes(s.wire_bytes),
        )
        for s in stats
    ]
    return table(["phase", "kind", "axis", "count", "bytes", "wire bytes"], rows, right=(3, 4, 5))


# ---------------------------------------------------------------------- dry run


def dry_run(
    model_or_config: Any,
    mesh: DeviceMesh | Mapping[str, int],
    plan: Mapping[str, ShardingConfig] | str | Path | None = None,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    fsdp: bool = True,
    dp_axis: str = "dp",
    param_dtype: torch.dtype = torch.float32,
    inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: LossFn | None = None,
    ac: str = "none",
    dtype: str = "fp32",
) -> DryRunReport:
    """Trace one training step of the sharded model at full scale, in this process.

    Args:
        model_or_config: A model ``Config``, a model built from ``Module`` configs, or
            any ``nn.Module`` together with ``plan``.
        mesh: Axis sizes in mesh order (``{"dp": 128, "tp": 8}``) or a DeviceMesh.
        plan: Module path pattern → ShardingConfig, or a plan file.
        batch_size: Per-rank batch size of the traced step.
        seq_len: Sequence length of the traced step.
        fsdp: Shard parameters, gradients and optimizer state over ``dp_axis`` with
            FSDP2 (each element of the model's top-level ``ModuleList``s and the root
            is one ``fully_shard`` unit). Ignored, with a note, when the mesh has no
            such axis.
        dp_axis: The data-parallel axis.
        param_dtype: Parameter (and gradient) dtype.
        inputs: Example inputs (only shapes and dtypes are used); by default token
            ids ``(batch_size, seq_len)`` or features, see
            :func:`~hyper_parallel.analysis.validate`.
        loss_fn: ``loss_fn(output, *inputs) -> scalar``; default: sum of the outputs.
        ac: Activation checkpointing of the blocks (``"none"``, ``"full"``,
            ``"selective"``; see :mod:`hyper_parallel.distributed.activation_checkpoint`)
            for the activation bytes.
        dtype: Compute precision, ``"fp32"`` or ``"bf16"`` (fp32 master weights; FSDP2's
            mixed-precision policy, or autocast without FSDP): the activations' dtype.

    Returns:
        A :class:`DryRunReport`.

    Raises:
        ValueError: For a malformed mesh, a plan that ``parallelize`` refuses
            (run :func:`validate` for the full list), or a plan that places states
            on ``dp_axis`` while FSDP uses it.
        RuntimeError: When a real process group already exists.

    Example::

        from hyper_parallel.analysis import dry_run
        from hyper_parallel.dmodule import get_spec

        spec = get_spec("llama3-70b")
        report = dry_run(spec.extras["tp"](spec.config()), {"dp": 128, "tp": 8})
        print(report.per_rank.total, report.collectives)
    """
    start = time.perf_counter()
    check_ac_mode(ac)
    check_dtype(dtype)
    shape = mesh_shape(mesh)
    target = resolve_target(model_or_config, plan)
    use_fsdp = fsdp and dp_axis in shape
    loss = loss_fn or default_loss
    depths: tuple[int | None, ...] = TRACE_DEPTHS if target.layers_field else (None,)
    with fake_world(shape) as world:
        runs = [
            _trace_step(
                target,
                world,
                shape,
                depth,
                use_fsdp=use_fsdp,
                dp_axis=dp_axis,
                param_dtype=param_dtype,
                inputs=inputs,
                batch_size=batch_size,
                seq_len=seq_len,
                loss_fn=loss,
                ac=ac,
                dtype=dtype,
            )
            for depth in depths
        ]
    settings = dict(
        batch_size=batch_size,
        seq_len=seq_len,
        param_dtype=str(param_dtype).removeprefix("torch."),
        fsdp=use_fsdp,
        dp_axis=dp_axis,
        ac=ac,
        dtype=dtype,
    )
    report = _combine(target, runs, shape, settings)
    if not use_fsdp and shape.get(dp_axis, 1) > 1:
        report.collectives.append(_ddp_all_reduce(report.per_rank.grads, dp_axis, shape[dp_axis]))
        phases = {"forward": 0, "backward": 1, "optimizer": 2}
        report.collectives.sort(key=lambda c: (phases.get(c.phase, 3), c.axis, c.kind))
    report.assumptions = _assumptions(target, runs, shape, use_fsdp, dp_axis, loss)
    report.elapsed_s = time.perf_counter() - start
    return report


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
    activation_bytes: int = 0


def _trace_step(
    target: Target,
    world: DeviceMesh,
    shape: MeshShape,
    depth: int | None,
    *,
    use_fsdp: bool,
    dp_axis: str,
    param_dtype: torch.dtype,
    inputs: Sequence[torch.Tensor] | None,
    batch_size: int,
    seq_len: int,
    loss_fn: LossFn,
    ac: str = "none",
    dtype: str = "fp32",
) -> _Run:
    mode = FakeTensorMode()
    model = target.build_fake(mode, depth, param_dtype)
    types = {path: type(m).__name__ for path, m in model.named_modules()}
    args = _inputs(model, inputs, batch_size, seq_len, mode)
    entries, findings = target.entries(model)
    if entries or findings:  # a plan whose patterns all match nothing is refused too
        on_dp = _paths_placing_on(entries, dp_axis)
        if use_fsdp and on_dp:
            raise ValueError(
                f"dry_run: the plan places states on {dp_axis!r} ({', '.join(on_dp)}), which "
                f"FSDP also shards over; pass fsdp=False (CLI: --no-fsdp) to place them "
                f"yourself, or drop {dp_axis!r} from those configs."
            )
        # The plan runs on the model-parallel axes (torchtitan's mesh["tp"]) unless it
        # places states on the data-parallel axis itself.
        model_axes = tuple(a for a in shape if a != dp_axis or on_dp)
        sub = world if len(model_axes) in (0, len(shape)) else world[model_axes]
        parallelize_entries(model, sub, entries, findings)
    units: list[str] = []
    if use_fsdp:
        units = _apply_fsdp(model, world[dp_axis], precision.fsdp_policy(dtype))
    modules = _module_shards(model, types, tuple(shape))
    recorder = CollectiveRecorder(axis_groups(world))
    comm = CommDebugMode()
    # The blocks activation checkpointing applies to: the list of identical layers (the
    # trainer's model.layers).
    blocks = getattr(model, target.layers_field or "layers", None)
    saved = SavedActivations(model, list(blocks) if isinstance(blocks, nn.ModuleList) else [])
    with mode, comm, recorder:
        with saved, precision.autocast(dtype, "cpu", sharded=use_fsdp):
            out = model(*args)
            loss = loss_fn(out, *args)
        recorder.phase = "backward"
        loss.backward()
    params = _unique_params(model)
    grads = [p.grad for p in params if p.grad is not None]
    pending = _pending_reductions(grads, world)
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
        activation_bytes=saved.peak_bytes(ac),
    )


def _pending_reductions(grads: Sequence[torch.Tensor], world: DeviceMesh) -> list[Collective]:
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
                size = world[axis].size()
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


def _paths_placing_on(entries: Sequence[PlanEntry], axis: str) -> list[str]:
    return sorted(
        {
            e.path or "<root>"
            for e in entries
            for named in e.config.state_shardings.values()
            if any(str(a) == axis for a in named)
        }
    )


def _apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> list[str]:
    """``fully_shard`` each element of the top-level ModuleLists, then the root."""
    units: list[tuple[str, nn.Module]] = []
    lists: list[str] = []
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(path.startswith(f"{p}.") for p in lists):
            lists.append(path)
            units += [(f"{path}.{i}", child) for i, child in enumerate(m)]
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for _, unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return [p for p, _ in units]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    return list({id(p): p for p in model.parameters()}.values())


def _module_shards(
    model: nn.Module, types: Mapping[str, str], axes: tuple[str, ...]
) -> list[ModuleShards]:
    seen: set[int] = set()
    modules = []
    for path, m in model.named_modules():
        params = []
        for name, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            placements = {a: "Replicate()" for a in axes}
            if isinstance(p, DTensor):
                names = p.device_mesh.mesh_dim_names or ()
                placements.update({a: placement_text(q) for a, q in zip(names, p.placements)})
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


def _combine(
    target: Target, runs: Sequence[_Run], shape: MeshShape, settings: Mapping[str, Any]
) -> DryRunReport:
    """One run as is; two runs (depths d and d + 1) extrapolated to the real depth."""
    world_size = math.prod(shape.values())
    last = runs[-1]
    common = dict(model=target.name, mesh=dict(shape), world_size=world_size, **settings)
    if len(runs) == 1:
        return DryRunReport(
            **common,
            num_params=last.num_params,
            modules=last.modules,
            per_rank=state_bytes(
                last.param_bytes, last.grad_bytes, last.trainable_numel, last.activation_bytes
            ),
            collectives=summarize(last.records),
            comm_debug_counts=last.comm_counts,
        )
    a, b = runs
    assert a.depth is not None and b.depth == a.depth + 1
    assert target.num_layers is not None and target.layers_field is not None
    extra = target.num_layers - a.depth

    def ext(x: int, y: int) -> int:
        return x + extra * (y - x)

    stats_a, stats_b = _stat_map(a.records), _stat_map(b.records)
    zero = CollectiveStat("", "", "", 0, 0, 0)
    phases = {"forward": 0, "backward": 1, "optimizer": 2}
    collectives, per_layer = [], []
    for key in sorted(
        stats_a.keys() | stats_b.keys(),
        key=lambda k: (phases.get(k[2], 3), k[1], k[0]),
    ):
        sa, sb = stats_a.get(key, zero), stats_b.get(key, zero)
        kind, axis, phase, traced = key
        collectives.append(
            CollectiveStat(
                kind,
                axis,
                phase,
                ext(sa.count, sb.count),
                ext(sa.bytes, sb.bytes),
                ext(sa.wire_bytes, sb.wire_bytes),
                traced,
            )
        )
        if sb.count != sa.count or sb.bytes != sa.bytes:
            per_layer.append(
                CollectiveStat(
                    kind,
                    axis,
                    phase,
                    sb.count - sa.count,
                    sb.bytes - sa.bytes,
                    sb.wire_bytes - sa.wire_bytes,
                    traced,
                )
            )
    counts = {
        op: ext(a.comm_counts.get(op, 0), b.comm_counts.get(op, 0))
        for op in a.comm_counts.keys() | b.comm_counts.keys()
    }
    return DryRunReport(
        **common,
        num_params=ext(a.num_params, b.num_params),
        modules=_expand_layers(b.modules, target.layers_field, b.depth, target.num_layers),
        per_rank=state_bytes(
            ext(a.param_bytes, b.param_bytes),
            ext(a.grad_bytes, b.grad_bytes),
            ext(a.trainable_numel, b.trainable_numel),
            ext(a.activation_bytes, b.activation_bytes),
        ),
        collectives=collectives,
        collectives_per_layer=per_layer,
        comm_debug_counts=dict(sorted(counts.items())),
        num_layers=target.num_layers,
        traced_layers=tuple(r.depth for r in runs if r.depth is not None),
    )


def _expand_layers(
    modules: Sequence[ModuleShards], field_name: str, depth: int, num_layers: int
) -> list[ModuleShards]:
    """Rows of the last traced layer repeated for every layer the trace left out."""
    template = f"{field_name}.{depth - 1}"

    def in_template(path: str) -> bool:
        return path == template or path.startswith(f"{template}.")

    rows = [m for m in modules if in_template(m.path)]
    out: list[ModuleShards] = []
    for i, m in enumerate(modules):
        out.append(m)
        ends_template = in_template(m.path) and (
            i + 1 == len(modules) or not in_template(modules[i + 1].path)
        )
        if ends_template:
            for layer in range(depth, num_layers):
                prefix = f"{field_name}.{layer}"
                out += [
                    ModuleShards(prefix + r.path[len(template) :], r.type, r.params) for r in rows
                ]
    return out


def _ddp_all_reduce(grad_bytes: int, dp_axis: str, dp_size: int) -> CollectiveStat:
    """Data-parallel gradient all-reduce without FSDP, computed from DDP's default buckets."""
    return CollectiveStat(
        "all_reduce",
        dp_axis,
        "backward",
        ddp_num_buckets(grad_bytes),
        grad_bytes,
        wire_bytes("all_reduce", grad_bytes, dp_size),
        traced=False,
    )


def _assumptions(
    target: Target,
    runs: Sequence[_Run],
    shape: MeshShape,
    use_fsdp: bool,
    dp_axis: str,
    loss_fn: LossFn,
) -> list[str]:
    last = runs[-1]
    notes = [
        "Traced on fake tensors (shapes and dtypes, no storage) over PyTorch's fake process "
        f"group of {math.prod(shape.values()):,} ranks: one forward and one backward pass.",
        "Per-rank figures are rank 0's, whose shard is the largest when a dim does not divide "
        "(FSDP2 pads every rank's shard to that size).",
        "Memory is the steady state between steps: parameters; gradients with the dtype and "
        "sharding of their parameters; AdamW's two moments at 4 bytes (fp32) per local element "
        "(torch.optim.AdamW keeps them in the parameter dtype: exact for fp32 parameters). "
        "Activations and transient buffers (FSDP's unsharded units, collective buffers) are "
        "not included.",
        "Collective bytes are the per-rank buffer (all_gather: gathered output; "
        "reduce_scatter: full input; all_reduce: the tensor; all_to_all: the input); wire bytes "
        "are what a ring sends per rank (nccl-tests bus-bandwidth factors).",
        "Shard(i) -> Shard(j) counts as all_to_all (DTensor emulates it on a CPU mesh with "
        "all_gather + chunk; NCCL issues all_to_all).",
        f"Loss: {getattr(loss_fn, '__qualname__', repr(loss_fn))}; collectives of a different "
        "loss (e.g. loss-parallel cross entropy) differ.",
    ]
    num_units = len(last.fsdp_units)
    if len(runs) == 2 and target.num_layers is not None and last.depth is not None:
        num_units += (target.num_layers - last.depth) * (num_units - len(runs[0].fsdp_units))
    if use_fsdp:
        notes.append(
            f"FSDP2 fully_shard over {dp_axis!r} on {num_units} unit(s) (each element "
            "of the top-level ModuleLists) and the root, default reshard_after_forward (the "
            "root keeps its parameters gathered between forward and backward); gradients are "
            "reduce-scattered in backward. Traced, not computed."
        )
    elif dp_axis not in shape:
        notes.append(
            f"FSDP off: the mesh has no {dp_axis!r} axis (axes: {list(shape)}), so there is no "
            "data parallelism to shard over."
        )
    else:
        notes.append(
            f"FSDP off (fsdp=False): parameters, gradients and optimizer states are replicated "
            f"over {dp_axis!r}. The gradient all-reduce over {dp_axis!r} is computed, not "
            "traced: all gradient bytes, in DDP's default buckets (1 MiB, then 25 MiB)."
        )
    if len(runs) > 1:
        notes.append(target.depth_note([r.depth for r in runs if r.depth is not None]))
    if any(r.records and not r.records[-1].traced for r in runs):
        notes.append(
            "Gradients that backward leaves Partial (DTensor reduces a partial sum when it is "
            "read) owe one all_reduce each per partial axis when the optimizer step reads them: "
            "listed in phase 'optimizer', computed from their shards, not traced."
        )
    traced = [sum(c.traced for c in r.records) for r in runs]
    if any(r.comm_debug_total != n for r, n in zip(runs, traced)):
        notes.append(
            "CommDebugMode and the recorder disagree on the number of collectives: "
            + "; ".join(f"{r.comm_debug_total} vs {n}" for r, n in zip(runs, traced))
        )
    return notes
