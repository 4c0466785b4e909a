"""Dry run: one training step of a sharded model at any scale, in one process.

:func:`dry_run` builds the N-D mesh of a
:class:`~hyper_parallel.distributed.MeshLayout` over PyTorch's fake process group at
the full world size (the same :class:`~hyper_parallel.distributed.ParallelMesh` the
trainer builds), builds the model with fake tensors (shapes, no storage), applies
its plan on the submesh of the axes the plan declares (as the trainer does), wraps
each layer and the root with FSDP2's ``fully_shard`` over ``fsdp`` = dp_shard x cp
(HSDP on ``(dp_replicate, fsdp)`` when dp_replicate > 1), and runs one forward and
backward pass under ``CommDebugMode`` and a recorder of every collective's kind,
axis and size. Nothing is computed and no data moves; the sharding, the per-rank
memory and the collectives are those of the real run.

A model whose config holds a list of identical layers is traced at two depths and
extrapolated linearly to its real depth (exact: everything but the number of
layers is the same in both runs); the report says so.

With gradient accumulation (``num_microbatches`` > 1 at pp=1) the traced step is one
micro-batch: its activations are the per-rank peak; the collectives of the forward and
backward repeat once per micro-batch, FSDP2's gradient reductions (reduce-scatter,
HSDP's all-reduce) run once per step, and until then each rank holds its FSDP units'
unsharded gradients (what the trainer's ``set_requires_gradient_sync(False)`` keeps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel._torch_private import FakeTensorMode
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.activation_checkpoint import checkpointed_blocks
from hyper_parallel.distributed.axes import (
    axis_support_findings,
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
    as_layout,
)
from hyper_parallel.distributed.precision import check_dtype
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.dmodule.findings import Finding
from hyper_parallel.dmodule.sharding import ShardingConfig

from ._format import human_bytes, layer_pattern, placement_text, table
from ._model import (
    TRACE_DEPTHS,
    Target,
    cp_inputs,
    default_inputs,
    default_loss,
    resolve_target,
)
from ._world import MeshShape, fake_world
from .collectives import (
    Collective,
    CollectiveRecorder,
    CollectiveStat,
    axis_groups,
    summarize,
    wire_bytes,
)
from .memory import SavedActivations, StateBytes, ddp_num_buckets, state_bytes

__all__ = ["ANALYSIS_AXES", "DryRunReport", "ModuleShards", "ParamShard", "dry_run"]

ANALYSIS_AXES = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
"""User axes the dry run and ``validate`` trace; others of size > 1 are refused, by name."""

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
        mesh: The active axes (size > 1) → size.
        world_size: Number of ranks.
        num_params: Parameters of the whole model.
        num_expert_params: Of those, the routed experts' (the modules an ``ep`` plan
            entry dispatches to; 0 for a dense model).
        batch_size: Per-rank batch of the traced step (one micro-batch).
        num_microbatches: Micro-batches per step (gradient accumulation at pp=1): the
            collectives are a whole step's, the activations one micro-batch's.
        seq_len: Sequence length of the traced step.
        param_dtype: Parameter dtype, e.g. ``"float32"``.
        fsdp: Whether FSDP2 shards dense states over the data axes.
        fsdp_axes: The dims of the mesh FSDP2 runs on: ``("fsdp",)``, or
            ``("dp_replicate", "fsdp")`` for HSDP; ``()`` without FSDP.
        plan_axes: The axes the plan declares: the submesh it is applied on.
        columns: The placement columns of the parameter table (each active axis;
            ``fsdp`` stands for dp_shard x cp when FSDP shards over it).
        layout: The full mesh layout (every axis, derived sizes).
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
    fsdp_axes: tuple[str, ...]
    plan_axes: tuple[str, ...]
    columns: tuple[str, ...]
    layout: MeshLayout
    modules: list[ModuleShards]
    per_rank: StateBytes
    collectives: list[CollectiveStat]
    collectives_per_layer: list[CollectiveStat] | None = None
    comm_debug_counts: dict[str, int] = field(default_factory=dict)
    num_layers: int | None = None
    traced_layers: tuple[int, ...] | None = None
    assumptions: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    per_rank_experts: StateBytes | None = None
    num_expert_params: int = 0
    num_microbatches: int = 1

    def _per_rank_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.per_rank.to_dict()
        e = self.per_rank_experts
        if e is not None:  # routed experts (split over ep x efsdp) and the rest, apart
            out["experts"] = e.to_dict()
            out["dense"] = state_bytes(
                self.per_rank.params - e.params,
                self.per_rank.grads - e.grads,
                0,
            ).to_dict() | {"optimizer": self.per_rank.optimizer - e.optimizer}
            out["dense"]["total"] = sum(out["dense"][k] for k in ("params", "grads", "optimizer"))
        return out

    ac: str = "none"
    dtype: str = "fp32"
    activations_by_ac: dict[str, int] = field(default_factory=dict)
    """Peak saved bytes under each checkpointing mode, from the same trace (one forward
    records what every mode keeps); ``selective`` extrapolated like the rest (linear in
    the depth from the traced depths)."""
    activations_outside_blocks: tuple[int, int] = (0, 0)
    """Saved bytes before the first block (embedding) and after the last (final norm,
    output projection, loss) of one micro-batch."""
    activations_per_block: tuple[int, int, int] | None = None
    """``(saved, kept, recomputed)`` of one block: what it adds to the ``none`` peak
    (everything it saves) and to the ``full`` peak (the input a checkpointed block
    keeps), the slopes between the two traced depths (a model traced whole: its last
    block's); and what it holds while backward recomputes it (its input and what it
    saves again). ``None`` for a model without blocks."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the CLI's ``--format json``)."""
        per_layer = self.collectives_per_layer
        return {
            "model": self.model,
            "world_size": self.world_size,
            "mesh": self.layout.to_dict(derived=True),
            "num_params": self.num_params,
            "num_expert_params": self.num_expert_params,
            "batch_size": self.batch_size,
            "num_microbatches": self.num_microbatches,
            "seq_len": self.seq_len,
            "param_dtype": self.param_dtype,
            "fsdp": self.fsdp,
            "fsdp_axes": list(self.fsdp_axes),
            "plan_axes": list(self.plan_axes),
            "placement_axes": list(self.columns),
            "ac": self.ac,
            "dtype": self.dtype,
            "per_rank_bytes": self._per_rank_dict(),
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

    def _precision(self) -> str:
        """``float32 parameters`` or, under ``dtype="bf16"``, the mixed precision's split."""
        if self.dtype == "bf16":
            return (
                f"{self.param_dtype} parameters, gradients and AdamW state, bfloat16 compute "
                "(mixed precision)"
            )
        return f"{self.param_dtype} parameters"

    def to_table(self) -> str:
        """The report for people: parameters, memory, collectives, assumptions, summary."""
        axes = list(self.columns)
        fsdp_text = "no FSDP"
        if self.fsdp:
            kind = "HSDP" if "dp_replicate" in self.fsdp_axes else "FSDP2"
            fsdp_text = f"{kind} over {' x '.join(self.fsdp_axes)}"
            if "fsdp" in self.fsdp_axes:
                fsdp_text += " (fsdp = dp_shard x cp)"
        out = [
            f"plan: {self.model} on {self.layout.describe()} ({self.world_size:,} ranks); "
            f"batch {self.batch_size} x seq {self.seq_len}"
            + (f" x {self.num_microbatches} micro-batches" if self.num_microbatches > 1 else "")
            + f"; {self._precision()}; "
            f"{fsdp_text}; plan on {' x '.join(self.plan_axes) or 'no axis'}",
            "",
            "Parameters (rank 0's shard; one placement column per mesh axis; numbered layers "
            "folded into '*'):",
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
        memory = self._per_rank_dict()
        activations_label = f"activations (ac={self.ac}, {self.dtype})"
        if "experts" in memory:
            e, d = memory["experts"], memory["dense"]
            rows = [
                (label, human_bytes(d[k]), human_bytes(e[k]), human_bytes(memory[k]))
                for label, k in (
                    ("parameters", "params"),
                    ("gradients", "grads"),
                    ("AdamW moments", "optimizer"),
                )
            ]
            rows.append((activations_label, "", "", human_bytes(m.activations)))
            rows.append(("total", "", "", human_bytes(m.total)))
            memory_table = table(["state", "dense", "experts", "bytes"], rows, right=(1, 2, 3))
        else:
            memory_table = table(
                ["state", "bytes"],
                [
                    ("parameters", human_bytes(m.params)),
                    ("gradients", human_bytes(m.grads)),
                    ("AdamW moments", human_bytes(m.optimizer)),
                    (f"activations (ac={self.ac}, {self.dtype})", human_bytes(m.activations)),
                    ("total", human_bytes(m.total)),
                ],
                right=(1,),
            )
        out += [
            "",
            "Memory per rank (training states, plus one micro-batch's activations):",
            memory_table,
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
    param_dtype: torch.dtype = torch.float32,
    inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: LossFn | None = None,
    ac: str = "none",
    dtype: str = "fp32",
    num_microbatches: int = 1,
) -> DryRunReport:
    """Trace one training step of the sharded model at full scale, in this process.

    Args:
        model_or_config: A model ``Config``, a model built from ``Module`` configs, or
            any ``nn.Module`` together with ``plan``.
        mesh: A :class:`~hyper_parallel.distributed.MeshLayout`, axis sizes over
            ``pp, dp_replicate, dp_shard`` (alias ``dp``), ``cp, tp, ep``
            (``{"dp": 128, "tp": 8}``), or a DeviceMesh with those dim names.
        plan: Module path pattern → ShardingConfig, or a plan file. It is applied on
            the submesh of the axes it declares, as the trainer applies it.
        batch_size: Per-rank batch size of the traced step: one micro-batch.
        seq_len: Sequence length of the traced step (global: under context parallelism
            each rank traces its ``seq_len / cp`` tokens, head-tail, with their positions).
        fsdp: Shard parameters, gradients and optimizer state with FSDP2 over
            ``fsdp`` = dp_shard x cp (HSDP over ``(dp_replicate, fsdp)`` when
            dp_replicate > 1); each element of the model's top-level ``ModuleList``s
            and the root is one ``fully_shard`` unit. Ignored, with a note, when the
            mesh has no data axis.
        param_dtype: Parameter (and gradient) dtype: ``torch.float32`` (the default, and
            the master weights of ``dtype="bf16"``), or pure low-precision parameters
            (e.g. ``torch.bfloat16`` with ``dtype="fp32"``: no fp32 master copy; the AdamW
            moments are still counted in fp32).
        inputs: Example inputs (only shapes and dtypes are used); by default token
            ids ``(batch_size, seq_len)`` or features, see
            :func:`~hyper_parallel.analysis.validate`. Under context parallelism they
            are rank 0's part of the sequence (``seq_len / cp`` tokens), and the model
            also gets that part's global ``positions`` (as for the default inputs).
        loss_fn: ``loss_fn(output, *inputs) -> scalar``; default: sum of the outputs.
        ac: Activation checkpointing of the blocks (``"none"``, ``"full"``,
            ``"selective"``; see :mod:`hyper_parallel.distributed.activation_checkpoint`)
            for the activation bytes.
        dtype: The trainer's precision (``--dtype`` in every command): ``"fp32"``, or
            ``"bf16"`` mixed precision — fp32 parameters, gradients and AdamW state, bf16
            compute (FSDP2's ``MixedPrecisionPolicy``: bf16 all-gathers, fp32
            reduce-scatters; autocast without FSDP). It sets the activations' dtype.
        num_microbatches: Micro-batches per step (gradient accumulation, the trainer's
            ``--microbatches`` at pp=1): the rank's batch is ``batch_size`` x this;
            collectives of the forward and backward counted once per micro-batch,
            FSDP2's gradient reductions once per step, and the gradients held as
            FSDP2 accumulates them (unsharded) before the last micro-batch.

    Returns:
        A :class:`DryRunReport`.

    Raises:
        ValueError: For a bad mesh (``LayoutError``, every problem at once), a ``pp``
            axis (the dry run traces one pipeline's ranks; ``hyper-parallel plan`` cuts
            the model into stages first), the run plan's errors (the trainer's and
            ``validate``'s: a ``cp`` axis the plan does not declare, experts that do
            not split over ``ep``, ...), a plan that ``parallelize`` refuses (run
            :func:`validate` for the full list; a plan placing states on a data axis
            FSDP shards over is one of the run plan's), or ``dtype="bf16"`` with a
            ``param_dtype`` other than fp32 (mixed precision keeps fp32 master weights).
        RuntimeError: When a real process group already exists.

    Example::

        from hyper_parallel.analysis import dry_run
        from hyper_parallel.dmodule import get_spec

        spec = get_spec("llama3-70b")
        report = dry_run(spec.sharding("tp")(spec.config()), {"dp_shard": 128, "tp": 8})
        print(report.per_rank.total, report.collectives)
    """
    start = time.perf_counter()
    check_ac_mode(ac)
    check_dtype(dtype)
    if dtype == "bf16" and param_dtype != torch.float32:
        raise ValueError(
            f"dry_run: dtype='bf16' is mixed precision with fp32 master weights, gradients and "
            f"AdamW state; param_dtype={param_dtype} contradicts it. Leave param_dtype at "
            "torch.float32, or plan pure low-precision parameters with dtype='fp32'."
        )
    layout = as_layout(mesh)
    # The dry run traces one pipeline's ranks; `plan` cuts a pp mesh into stages first.
    _raise_errors(
        [f for f in layout.findings() if f.severity == "error"]
        + axis_support_findings(layout, ANALYSIS_AXES, "the dry run")
    )
    target = resolve_target(model_or_config, plan)
    # The run plan decides where the plan runs and what FSDP shards over, and checks
    # the run: the trainer's and validate's gate (on a meta build of one layer).
    meta = target.build_meta(1 if target.layers_field else None)
    entries, _ = target.entries(meta)
    run = target.run_plan(
        layout,
        meta,
        entries,
        fsdp=fsdp,
        ac=ac,
        dtype=dtype,
        seq_len=seq_len,
        num_microbatches=num_microbatches,
        batch_size=batch_size * num_microbatches,
    )
    _raise_errors(run.errors)
    loss = loss_fn or default_loss
    depths: tuple[int | None, ...] = TRACE_DEPTHS if target.layers_field else (None,)
    with fake_world(layout) as world:
        fsdp_mesh = run.fsdp_mesh(world)
        use_fsdp = fsdp_mesh is not None
        runs = [
            _trace_step(
                target,
                world,
                depth,
                run=run,
                param_dtype=param_dtype,
                inputs=inputs,
                batch_size=batch_size,
                seq_len=seq_len,
                loss_fn=loss,
            )
            for depth in depths
        ]
        fsdp_axes = _fsdp_axes(fsdp_mesh)
    plan_axes = runs[-1].plan_axes
    settings = dict(
        batch_size=batch_size,
        seq_len=seq_len,
        param_dtype=str(param_dtype).removeprefix("torch."),
        fsdp=use_fsdp,
        fsdp_axes=fsdp_axes,
        plan_axes=plan_axes,
        columns=_placement_columns(layout, fsdp_axes, plan_axes),
        layout=layout,
        ac=ac,
        dtype=dtype,
    )
    report = _combine(target, runs, layout, settings)
    if num_microbatches > 1:
        _accumulate(report, runs, target, num_microbatches, use_fsdp)
    data_axis, data_size = _data_axis(layout, plan_axes)
    if not use_fsdp and data_size > 1:
        report.collectives.append(_ddp_all_reduce(report.per_rank.grads, data_axis, data_size))
        phases = {"forward": 0, "backward": 1, "optimizer": 2}
        report.collectives.sort(key=lambda c: (phases.get(c.phase, 3), c.axis, c.kind))
    report.assumptions = _assumptions(target, runs, layout, fsdp_axes, loss)
    if num_microbatches > 1:
        report.assumptions.append(
            f"Gradient accumulation: {num_microbatches} micro-batches of {batch_size} "
            "sequence(s) per step, run one after the other. Activations are one "
            "micro-batch's; forward and backward collectives (FSDP2's all-gathers "
            "included: each micro-batch gathers its units again) count once per "
            "micro-batch; FSDP2's reduce-scatter and HSDP's all-reduce once per step (the "
            "trainer's set_requires_gradient_sync(False) before the last micro-batch)"
            + (
                ", so gradients are held unsharded (fp32 accumulators of each FSDP2 unit) "
                "until the last backward: counted as the gradients' bytes."
                if use_fsdp
                else "."
            )
        )
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
    plan_axes: tuple[str, ...] = ()
    expert_bytes: tuple[int, int, int] | None = None  # params, grads, trainable numel
    expert_numel: int = 0  # global elements of the routed experts
    activation_bytes: int = 0
    activations_by_ac: dict[str, int] = field(default_factory=dict)
    activations_outside_blocks: tuple[int, int] = (0, 0)
    block_bytes: tuple[int, int, int] | None = None  # the last block's (saved, kept, recomputed)
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
    modules = _module_shards(model, types, _fsdp_dim_names(fsdp_mesh))
    recorder = CollectiveRecorder(*_recorder_groups(world, fsdp_mesh))
    comm = CommDebugMode()
    blocks = getattr(model, field, None) if field else None
    if isinstance(blocks, nn.ModuleDict):
        blocks = nn.ModuleList(blocks.values())
    saved = SavedActivations(model, list(blocks) if isinstance(blocks, nn.ModuleList) else [])
    with mode, comm, recorder:
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
        activations_by_ac={m: saved.peak_bytes(m) for m in ("none", "selective", "full")},
        activations_outside_blocks=saved.outside_blocks(),
        block_bytes=saved.block_bytes(len(saved.blocks) - 1) if saved.blocks else None,
        unsharded_grad_bytes=sum(_unsharded_bytes(g, fsdp_mesh) for g in grads),
    )


_FSDP_SHARD_DIMS = frozenset({"fsdp", "dp_shard", "efsdp"})
"""Mesh dims over which FSDP2 shards states (besides the flattened dim of its SPMD form)."""
_GRADIENT_REDUCTIONS = frozenset(
    {("reduce_scatter", "fsdp"), ("reduce_scatter", "efsdp"), ("all_reduce", "dp_replicate")}
    | {("all_reduce", "edp_replicate")}
)
"""FSDP2's gradient reductions in backward, as the recorder names them: once per step
under gradient accumulation."""


def _unsharded_bytes(grad: torch.Tensor, fsdp_mesh: DeviceMesh | None) -> int:
    """``grad``'s bytes before FSDP2's reduce-scatter: its local shard times the sizes of
    the mesh dims FSDP2 shards it over (tp and ep shards stay)."""
    size = _local_bytes(grad)
    if not isinstance(grad, DTensor) or fsdp_mesh is None:
        return size
    flat = _fsdp_flat_name(fsdp_mesh)
    names = grad.device_mesh.mesh_dim_names or ()
    for i, (name, placement) in enumerate(zip(names, grad.placements)):
        # FSDP2 shards a tp-sharded dim strided (_StridedShard, not a Shard subclass).
        sharded = placement.is_shard() or type(placement).__name__ == "_StridedShard"
        if sharded and (name in _FSDP_SHARD_DIMS or name == flat):
            size *= grad.device_mesh.size(i)
    return size


def _accumulate(
    report: DryRunReport, runs: Sequence[_Run], target: Target, microbatches: int, fsdp: bool
) -> None:
    """A step of ``microbatches`` micro-batches from the trace of one: forward and
    backward collectives repeated, FSDP2's gradient reductions (and the optimizer
    phase's) once, gradients held unsharded under FSDP2 until the last backward."""

    def repeat(stats: list[CollectiveStat] | None) -> list[CollectiveStat] | None:
        if stats is None:
            return None
        out = []
        for c in stats:
            once = c.phase == "optimizer" or (
                c.phase == "backward" and (c.kind, c.axis) in _GRADIENT_REDUCTIONS
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
    if fsdp:
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


def _combine(
    target: Target, runs: Sequence[_Run], layout: MeshLayout, settings: Mapping[str, Any]
) -> DryRunReport:
    """One run as is; two runs (depths d and d + 1) extrapolated to the real depth."""
    last = runs[-1]
    columns = settings["columns"]
    for r in runs:
        r.modules = [_in_columns(m, columns) for m in r.modules]
    common = dict(model=target.name, mesh=layout.active(), world_size=layout.world_size, **settings)
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
            per_rank_experts=None if last.expert_bytes is None else state_bytes(*last.expert_bytes),
            num_expert_params=last.expert_numel,
            activations_per_block=last.block_bytes,
            activations_by_ac=dict(last.activations_by_ac),
            activations_outside_blocks=last.activations_outside_blocks,
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
    by_ac = _activations_by_ac(a, b, target.num_layers, ext)
    activations = by_ac.get(settings.get("ac", "none"), ext(a.activation_bytes, b.activation_bytes))
    return DryRunReport(
        **common,
        num_params=ext(a.num_params, b.num_params),
        modules=_expand_layers(b.modules, target.layers_field, b.depth, target.num_layers),
        per_rank=state_bytes(
            ext(a.param_bytes, b.param_bytes),
            ext(a.grad_bytes, b.grad_bytes),
            ext(a.trainable_numel, b.trainable_numel),
            activations,
        ),
        collectives=collectives,
        collectives_per_layer=per_layer,
        comm_debug_counts=dict(sorted(counts.items())),
        num_layers=target.num_layers,
        traced_layers=tuple(r.depth for r in runs if r.depth is not None),
        per_rank_experts=None
        if a.expert_bytes is None or b.expert_bytes is None
        else state_bytes(*(ext(x, y) for x, y in zip(a.expert_bytes, b.expert_bytes))),
        num_expert_params=ext(a.expert_numel, b.expert_numel),
        activations_by_ac=by_ac,
        activations_per_block=_block_slopes(a, b),
        activations_outside_blocks=b.activations_outside_blocks,
    )


def _block_slopes(a: _Run, b: _Run) -> tuple[int, int, int] | None:
    """``(saved, kept, recomputed)`` of one block: the ``none`` and ``full`` slopes
    between the depths, and what the deeper trace's last block holds recomputed."""
    none, full = (b.activations_by_ac.get(m) for m in ("none", "full"))
    if none is None or full is None:
        return None
    if b.block_bytes is None:
        return None
    saved = none - a.activations_by_ac["none"]
    return saved, full - a.activations_by_ac["full"], b.block_bytes[2]


def _activations_by_ac(
    a: _Run, b: _Run, num_layers: int, ext: Callable[[int, int], int]
) -> dict[str, int]:
    """Peak activation bytes per checkpointing mode at the real depth, from two traces.

    ``none`` and ``full`` treat every block alike, so the traces at depths d and d + 1
    extrapolate linearly. ``selective`` checkpoints every second block, which two
    consecutive depths cannot show (the added block is checkpointed in one and not the
    other), so it is composed from per-block quantities of the traces, following
    :meth:`~hyper_parallel.analysis.memory.SavedActivations.peak_bytes`: a block saves
    ``S`` (the per-block slope of ``none``) and a checkpointed one keeps only its input
    ``I`` (the slope of ``full``). At the end of the forward the ``none`` peak is less
    ``S - I`` per checkpointed block; recomputing the last checkpointed block holds
    everything kept before it plus its recomputed ``S`` (its input is among them), i.e.
    the end-of-forward peak less its own ``I``, the ``S`` of each block after it and the
    bytes saved after the last block ``T``, plus ``S``. The peak is the larger of the
    two (equal to a trace at the full depth: ``tests/unit/test_dry_run.py``).
    """
    by_ac = {
        m: ext(a.activations_by_ac[m], b.activations_by_ac[m])
        for m in b.activations_by_ac
        if m != "selective"
    }
    slopes = _block_slopes(a, b)
    if slopes is not None and "selective" in b.activations_by_ac:
        saved, kept, recomputed = slopes
        tail = b.activations_outside_blocks[1]
        by_ac["selective"] = checkpointed_peak(
            by_ac["none"], num_layers, saved, kept, recomputed, tail, "selective"
        )
    return by_ac


def checkpointed_peak(
    none: int, blocks: int, saved: int, kept: int, recomputed: int, tail: int, ac: str
) -> int:
    """Peak saved bytes of ``blocks`` identical blocks (plus what surrounds them) when
    ``ac`` checkpoints some, from the peak without checkpointing.

    Following :meth:`~hyper_parallel.analysis.memory.SavedActivations.peak_bytes`: a
    block saves ``saved`` and a checkpointed one keeps only its input, ``kept``. At the
    end of the forward the ``none`` peak is less ``saved - kept`` per checkpointed block;
    recomputing the last checkpointed block holds everything kept before it plus what
    it holds recomputed, ``recomputed`` (its input and what it saves again), i.e. the
    end-of-forward peak less its own ``kept``, the ``saved`` of each block after it and
    the bytes saved after the blocks, ``tail`` (consumed by then), plus ``recomputed``.
    The peak is the larger of the two (equal to a trace at the full depth:
    ``tests/unit/test_dry_run.py``).

    Args:
        none: The peak without checkpointing.
        blocks: Number of blocks.
        saved: Bytes one block saves.
        kept: Bytes one checkpointed block keeps (its input).
        recomputed: Bytes one block holds while backward recomputes it.
        tail: Bytes saved after the last block (0 on a pipeline stage without it).
        ac: ``"none"``, ``"selective"`` or ``"full"``.
    """
    chosen = checkpointed_blocks(blocks, ac)
    end_of_forward = none - len(chosen) * (saved - kept)
    if not chosen:
        return end_of_forward
    after = blocks - 1 - chosen[-1]
    return max(end_of_forward, end_of_forward - kept - after * saved - tail + recomputed)


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


def _in_columns(module: ModuleShards, columns: Sequence[str]) -> ModuleShards:
    """Each parameter's placements over the report's columns (absent: ``Replicate()``)."""
    params = tuple(
        replace(p, placements={c: p.placements.get(c, "Replicate()") for c in columns})
        for p in module.params
    )
    return replace(module, params=params)


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
    layout: MeshLayout,
    fsdp_axes: tuple[str, ...],
    loss_fn: LossFn,
) -> list[str]:
    last = runs[-1]
    plan_axes = " x ".join(last.plan_axes) or "no axis"
    notes = [
        "Traced on fake tensors (shapes and dtypes, no storage) over PyTorch's fake process "
        f"group of {layout.world_size:,} ranks: one forward and one backward pass.",
        f"The mesh is the trainer's: {layout.describe()}; the plan is applied on the submesh "
        f"of the axes it declares ({plan_axes}), as in training.",
        "Per-rank figures are rank 0's, whose shard is the largest when a dim does not divide "
        "(FSDP2 pads every rank's shard to that size).",
        "Memory is the steady state between steps: parameters; gradients with the dtype and "
        "sharding of their parameters; AdamW's two moments at 4 bytes (fp32) per local element "
        "(torch.optim.AdamW keeps them in the parameter dtype: exact for fp32 parameters). "
        "Under bf16 (the trainer's mixed precision) all three stay fp32 and only the compute "
        "is bf16: FSDP2 gathers bf16 copies of the parameters and reduce-scatters gradients "
        "in fp32. "
        "Activations and transient buffers (FSDP's unsharded units, collective buffers) are "
        "not included.",
        "Collective bytes are the per-rank buffer (all_gather: gathered output; "
        "reduce_scatter: full input; all_reduce: the tensor; all_to_all: the input); wire bytes "
        "are what a ring sends per rank (nccl-tests bus-bandwidth factors).",
        "Shard(i) -> Shard(j) counts as all_to_all (DTensor emulates it on a CPU mesh with "
        "all_gather + chunk; NCCL issues all_to_all).",
        f"Loss: {getattr(loss_fn, '__qualname__', repr(loss_fn))}; collectives of a different "
        "loss (e.g. loss-parallel cross entropy) differ.",
        "Attention's activations are what the fused kernels keep (FlashAttention, "
        "memory-efficient SDPA): queries, keys, values, the output and the log-sum-exp per "
        "query row, never the seq x seq probabilities. The trace's fake tensors are on the CPU, "
        "where scaled_dot_product_attention takes torch's fused CPU kernel, which keeps the same.",
    ]
    if layout.cp > 1:
        notes.append(
            f"Under cp={layout.cp} attention runs by chunks, without a mask: each rank's two "
            "query chunks (head-tail) against the keys and values all-gathered over cp, the "
            "diagonal block causal, earlier blocks in full, merged by log-sum-exp; backward keeps "
            "the rank's queries, the gathered keys and values, the output and the log-sum-exp."
        )
    if last.expert_bytes is not None:
        notes.append(
            f"Routed experts: weights Shard(0) over ep={layout.ep} (whole experts per rank), "
            f"FSDP2 over efsdp={layout.efsdp}; listed apart from the dense states. Their "
            "all_to_all bytes assume uniform routing (each rank's (token, choice) pairs split "
            "evenly over the ep ranks): counts exchange (num_experts int64), dispatch and "
            "combine forward (tokens x top_k x dim each), their two transposes backward. "
            "Real routing is data-dependent; skew moves more bytes to some ranks."
        )
    num_units = len(last.fsdp_units)
    if len(runs) == 2 and target.num_layers is not None and last.depth is not None:
        num_units += (target.num_layers - last.depth) * (num_units - len(runs[0].fsdp_units))
    data_axis, data_size = _data_axis(layout, last.plan_axes)
    if fsdp_axes:
        hsdp = (
            " (HSDP: states sharded within each dp_replicate group, gradients all-reduced "
            "across the groups)"
            if "dp_replicate" in fsdp_axes
            else ""
        )
        notes.append(
            f"FSDP2 fully_shard over {' x '.join(fsdp_axes)}{hsdp} on {num_units} unit(s) "
            "(each element of the top-level ModuleLists) and the root, default "
            "reshard_after_forward (the root keeps its parameters gathered between forward and "
            "backward); gradients are reduce-scattered in backward. Traced, not computed."
        )
        if layout.cp > 1 and "fsdp" not in fsdp_axes:
            notes.append(
                f"States are replicated over cp={layout.cp}: FSDP2 shards over cp as well "
                "only when the plan runs on cp; see "
                "hyper_parallel.distributed.axes.fsdp_shards_over_cp."
            )
    elif data_size == 1:
        notes.append(
            f"FSDP off: the mesh ({layout.describe()}) has no data axis FSDP can shard "
            "over (dp_replicate, dp_shard, cp)."
        )
    else:
        notes.append(
            f"FSDP off (fsdp=False): parameters, gradients and optimizer states are replicated "
            f"over {data_axis!r}. The gradient all-reduce over {data_axis!r} is computed, not "
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
