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

This module is the entry (:func:`dry_run`); the step is traced in ``_trace``, the traced
depths are combined into the report (and the checkpointed peak composed) in ``_combine``,
and the report itself, as a table or JSON, is ``_report``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.axes import axis_support_findings
from hyper_parallel.distributed.layout import as_layout
from hyper_parallel.distributed.precision import PARAM_DTYPES, check_dtype
from hyper_parallel.dmodule.sharding import ShardingConfig

from .._model import TRACE_DEPTHS, check_sizes, default_loss, resolve_target
from .._world import fake_world
from ._combine import (
    _assumptions,
    _combine,
    _ddp_all_reduce,
    checkpointed_held,
    checkpointed_peak,
)
from ._report import ANALYSIS_AXES, DryRunReport, LossFn, ModuleShards, ParamShard
from ._trace import (
    _accumulate,
    _data_axis,
    _fsdp_axes,
    _placement_columns,
    _raise_errors,
    _trace_step,
)

__all__ = [
    "ANALYSIS_AXES",
    "DryRunReport",
    "ModuleShards",
    "ParamShard",
    "checkpointed_held",
    "checkpointed_peak",
    "dry_run",
]


def dry_run(
    model_or_config: Any,
    mesh: DeviceMesh | Mapping[str, int],
    plan: Mapping[str, ShardingConfig] | str | Path | None = None,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    fsdp: bool = True,
    param_dtype: torch.dtype | None = None,
    inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: LossFn | None = None,
    ac: str = "none",
    dtype: str = "fp32",
    num_microbatches: int = 1,
    reduce_each_microbatch: bool = False,
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
        param_dtype: Parameter dtype, which is also the gradients' and the AdamW
            moments' (torch keeps them in it); ``None``: ``dtype``'s — float32 under
            ``"fp32"`` and ``"bf16"`` (its master weights), bfloat16 under
            ``"bf16-true"``. Another dtype with ``dtype="fp32"`` plans low-precision
            parameters with fp32 activations.
        inputs: Example inputs (only shapes and dtypes are used); by default token
            ids ``(batch_size, seq_len)`` or features, see
            :func:`~hyper_parallel.analysis.validate`. Under context parallelism they
            are rank 0's part of the sequence (``seq_len / cp`` tokens), and the model
            also gets that part's global ``positions`` (as for the default inputs).
        loss_fn: ``loss_fn(output, *inputs) -> scalar``; default: sum of the outputs.
        ac: Activation checkpointing of the blocks (``"none"``, ``"full"``,
            ``"selective"``, ``"op"``; see
            :mod:`hyper_parallel.distributed.activation_checkpoint`) for the activation
            bytes.
        dtype: The trainer's precision (``--dtype`` in every command): ``"fp32"``;
            ``"bf16"`` mixed precision — fp32 parameters, gradients and AdamW state, bf16
            compute (FSDP2's ``MixedPrecisionPolicy``: bf16 all-gathers, fp32
            reduce-scatters; autocast without FSDP); or ``"bf16-true"`` — bf16
            parameters, gradients and AdamW state. It sets the activations' dtype.
        num_microbatches: Micro-batches per step (gradient accumulation, the trainer's
            ``--microbatches`` at pp=1): the rank's batch is ``batch_size`` x this;
            collectives of the forward and backward counted once per micro-batch,
            FSDP2's gradient reductions once per step, and the gradients held as
            FSDP2 accumulates them (unsharded) before the last micro-batch.
        reduce_each_microbatch: With ``num_microbatches`` > 1, the trainer's
            ``--reduce-each-microbatch``: FSDP2's reductions once per micro-batch, the
            gradients sharded.

    Returns:
        A :class:`DryRunReport`.

    Raises:
        ValueError: For a bad mesh (``LayoutError``, every problem at once), a ``pp``
            axis (the dry run traces one pipeline's ranks; ``hyper-parallel plan`` cuts
            the model into stages first), the run plan's errors (the trainer's and
            ``validate``'s: a ``cp`` axis the plan does not declare, experts that do
            not split over ``ep``, ...), a plan that ``parallelize`` refuses (run
            :func:`validate` for the full list; a plan placing states on a data axis
            FSDP shards over is one of the run plan's), or a ``param_dtype`` that
            contradicts ``dtype`` (``"bf16"`` keeps fp32 master weights, ``"bf16-true"``
            bf16 ones).
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
    if param_dtype is None:
        param_dtype = PARAM_DTYPES[dtype]
    elif dtype != "fp32" and param_dtype != PARAM_DTYPES[dtype]:
        held = "fp32 master weights" if dtype == "bf16" else "bf16 weights"
        raise ValueError(
            f"dry_run: dtype={dtype!r} keeps {held}, gradients and AdamW state; "
            f"param_dtype={param_dtype} contradicts it. Leave param_dtype out (it follows "
            "dtype), or plan other parameters with dtype='fp32'."
        )
    check_sizes("dry_run", batch_size=batch_size, seq_len=seq_len)  # micro-batches: the run plan
    layout = as_layout(mesh)
    # The dry run traces one pipeline's ranks; `plan` cuts a pp mesh into stages first.
    unsupported = axis_support_findings(layout, ANALYSIS_AXES, "the dry run")
    unsupported = [
        dataclasses.replace(
            f,
            fix=f"{f.fix[:-1]}; or run 'hyper-parallel plan' (or validate), which cuts the "
            "model into pipeline stages and traces each.",
        )
        if f.field == "pp"
        else f
        for f in unsupported
    ]
    _raise_errors([f for f in layout.findings() if f.severity == "error"] + unsupported)
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
        _accumulate(report, runs, target, num_microbatches, use_fsdp, reduce_each_microbatch)
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
            "micro-batch; "
            + (
                "FSDP2's reduce-scatter and HSDP's all-reduce once per micro-batch too "
                "(--reduce-each-microbatch): the gradients accumulate sharded."
                if reduce_each_microbatch
                else "FSDP2's reduce-scatter and HSDP's all-reduce once per step (the "
                "trainer's set_requires_gradient_sync(False) before the last micro-batch)"
                + (
                    ", so gradients are held unsharded (fp32 accumulators of each FSDP2 unit) "
                    "until the last backward: counted as the gradients' bytes."
                    if use_fsdp
                    else "."
                )
            )
        )
    report.elapsed_s = time.perf_counter() - start
    return report
