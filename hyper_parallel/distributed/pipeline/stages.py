"""A rank's stages: built, parallelized, materialized and initialized unit by unit.

Initialization is per unit: each unit is initialized under its own seed derived from
the run's seed and the unit's name (:func:`init_states_by_unit`), so a one-device model
initialized the same way equals the union of the stages at any split.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from hyper_parallel.contract import ModelFamily
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import checkpointed_blocks
from hyper_parallel.distributed.builder import apply_parallelism
from hyper_parallel.distributed.pipeline.plan import SPLIT_BACKWARD_SCHEDULES, PipelinePlan
from hyper_parallel.distributed.pipeline.units import PipelineLayout

__all__ = ["build_stage_modules", "init_states_by_unit", "unit_seed"]


def unit_seed(seed: int, unit: str) -> int:
    """The seed unit ``unit`` is initialized with: a stable mix of the run seed and its name."""
    return (seed * 1_000_003 + zlib.crc32(unit.encode())) % (2**63)


def init_states_by_unit(model: nn.Module, layout: PipelineLayout, seed: int) -> None:
    """Initialize a full model or a stage unit by unit, each under :func:`unit_seed`.

    The same unit gets the same values whichever stage holds it and whatever the
    tensor or data parallel sharding (``init_states`` is shard-consistent), so the
    stages of a pipeline equal a one-device model initialized this way.

    Args:
        model: A model or a stage built from ``layout`` (after ``to_empty``).
        layout: The model's pipeline description.
        seed: The run's seed.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []

    def seeded(name: str, modules: list[nn.Module]) -> None:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(unit_seed(seed, name))
            for m in modules:
                m.init_states()

    first = [getattr(model, f) for f in layout.first if hasattr(model, f)]
    if first:
        seeded(layout.first_name, first)
    blocks = getattr(model, layout.layers)
    items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    for key, block in items:
        seeded(f"{layout.layers}.{key}", [block])
    last = [getattr(model, f) for f in layout.last if hasattr(model, f)]
    if last:
        seeded(layout.last_name, last)
    for f in layout.shared:
        seeded(f, [getattr(model, f)])


def build_stage_modules(
    config: Any,
    layout: PipelineLayout,
    plan: PipelinePlan,
    pp_rank: int,
    *,
    device: torch.device | str,
    seed: int,
    tp_mesh: Any = None,
    fsdp_mesh: Any = None,
    expert_mesh: Any = None,
    gradient_divide_factor: float | None = None,
    compile_backend: str | None = None,
    ac: str = "none",
    dtype: str = "fp32",
    family: ModelFamily | None = None,
) -> list[nn.Module]:
    """Build, shard, materialize and initialize the stages ``pp_rank`` runs, on given meshes.

    The trainer builds its stages from a run plan
    (:func:`~hyper_parallel.distributed.run_plan.build_stages`), which decides these
    meshes; this is the same build with the meshes spelled out. Each stage is built on
    the meta device from ``config`` (already carrying the model's sharding configs) and
    goes through :func:`~hyper_parallel.distributed.builder.apply_parallelism`, the
    sequence the whole model takes at pp=1; then ``to_empty`` on ``device`` and
    :func:`init_states_by_unit`.

    Under the zero-bubble schedules (backward split into input- and weight-gradient
    steps) a stage is one FSDP2 unit: per-block units reduce-scatter their
    gradients when the input-gradient step passes them, before the weight-gradient
    step has accumulated, and the gradients come out wrong (measured: 2.7e-3 off
    one device on the 2-layer model with torch 2.13); the whole-stage unit is
    reduced once, after both (torch's ``REDUCE_GRAD`` action).

    Args:
        config: The model config, with its sharding.
        layout: The model's pipeline description.
        plan: The checked plan.
        pp_rank: This rank's coordinate on the pp axis.
        device: Where the stages live.
        seed: The run's seed (:func:`init_states_by_unit`).
        tp_mesh: The submesh the model's dense sharding is applied on, or ``None``.
        fsdp_mesh: The FSDP2 mesh, or ``None``.
        expert_mesh: With expert parallelism, the run's
            :class:`~hyper_parallel.distributed.ParallelMesh` (its ``ep`` and ``efsdp``
            views are this pp rank's): routed experts on ``ep``, each an FSDP2 unit over
            ``efsdp`` (with ``dtype``'s policy) when there is an FSDP mesh or ``efsdp``
            spans ranks, as at pp=1.
        gradient_divide_factor: What FSDP2 divides reduced gradients by instead of its
            mesh size (the run plan's convention under ``cp``); ``None``: the mean.
        compile_backend: ``torch.compile`` each block with this backend; ``None``: eager.
        ac: Activation checkpointing: ``"none"``, ``"full"`` or ``"selective"`` (the
            model's blocks 1, 3, 5, ... by their index in the model, as at pp=1).
        dtype: ``"fp32"`` or ``"bf16"``: FSDP2's mixed-precision policy, or without
            FSDP the stage's forward under bf16 autocast (fp32 master weights).
        family: The model's :class:`~hyper_parallel.dmodule.ModelFamily`: its routed
            experts and their ``compile_experts`` hook, for ``compile_backend``.

    Returns:
        One module per local stage, in pipeline order.
    """
    precision.check_dtype(dtype)
    checkpointed = checkpointed_blocks(len(getattr(config, layout.layers)), ac)
    shard_experts = expert_mesh is not None and (
        fsdp_mesh is not None or expert_mesh.layout.efsdp > 1
    )
    modules = []
    for s in plan.stages_of_rank(pp_rank):
        with torch.device("meta"):
            module = layout.stage_config(config, plan.stages[s]).build()
        apply_parallelism(
            module,
            mesh=expert_mesh,
            dense_mesh=tp_mesh,
            fsdp_mesh=fsdp_mesh,
            shard_experts=shard_experts,
            dtype=dtype,
            gradient_divide_factor=gradient_divide_factor,
            compile_backend=compile_backend,
            checkpointed=checkpointed,
            blocks_field=layout.layers,
            family=family,
            split_backward=plan.schedule in SPLIT_BACKWARD_SCHEDULES,
            device_type=torch.device(device).type,
            who="build_stage_modules",
        )
        module.to_empty(device=device)
        init_states_by_unit(module, layout, seed)
        modules.append(module)
    return modules
