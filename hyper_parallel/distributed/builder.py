"""The builder: a :class:`~hyper_parallel.distributed.run_plan.RunPlan` decides, this builds.

:func:`apply_run_plan` applies a run plan to a module — the trainer's whole model
(``pp=1``, :func:`build_model`), each of this rank's pipeline stages (``pp>1``,
:func:`build_stages`) and the dry run's fake model (``trace=True``: nothing compiled,
checkpointing estimated rather than applied, nothing materialized). Every mesh,
switch and decision comes from the plan (the submesh of the plan's axes, the FSDP2
mesh, whether the routed experts are an FSDP2 unit of their own, whether FSDP2
reshards after forward, the cp gradient divisor); the order is written once, in
:func:`apply_parallelism`: plan (dense states on the plan's submesh, routed experts
on ``ep``) → the experts' FSDP2 unit over ``efsdp`` → ``torch.compile`` per block →
activation checkpointing → FSDP2 (with the dtype's mixed-precision policy) → bf16
autocast where FSDP2 does not cast. Why this order:
:mod:`hyper_parallel.distributed.compile` (AC outside the compiled blocks, FSDP2
outside both); the routed experts are their own FSDP2 unit over ``efsdp`` before the
blocks take the rest (:mod:`hyper_parallel.distributed.expert_parallel`).

Example::

    from hyper_parallel.distributed.run_plan import RunPlan

    run = RunPlan.for_model("llama3-debug", {"dp_shard": 2}, batch_size=4)
    model = build_model(run, mesh, "cpu", seed=0)  # mesh: run.layout.build("cpu")
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.contract import ModelFamily
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import (
    _Checkpointed,
    checkpointed_blocks,
    op_context,
)
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.distributed.expert_parallel import shard_experts as shard_experts_over_efsdp
from hyper_parallel.distributed.fsdp import apply_fsdp, fsdp_units
from hyper_parallel.distributed.layout import ParallelMesh
from hyper_parallel.distributed.pipeline.stages import init_states_by_unit
from hyper_parallel.distributed.run_plan import RunPlan, module_entries
from hyper_parallel.dmodule.entries import check_entries, errors_of, parallelize_entries
from hyper_parallel.dmodule.findings import Finding, ParallelizeError, PlanEntry

__all__ = ["apply_parallelism", "apply_run_plan", "build_model", "build_stages"]


def apply_parallelism(
    module: nn.Module,
    *,
    mesh: ParallelMesh | None,
    dense_mesh: DeviceMesh | None,
    fsdp_mesh: DeviceMesh | None,
    shard_experts: bool = False,
    entries: Sequence[PlanEntry] | None = None,
    plan_findings: Sequence[Finding] = (),
    dtype: str = "fp32",
    gradient_divide_factor: float | None = None,
    compile_backend: str | None = None,
    checkpointed: Collection[int] = (),
    per_op: bool = False,
    blocks_field: str = "layers",
    family: ModelFamily | None = None,
    split_backward: bool = False,
    reshard_after_forward: bool = True,
    device_type: str = "cpu",
    who: str = "apply_parallelism",
) -> list[str]:
    """Parallelize ``module`` in place, in the one order every build uses.

    1. The plan: dense entries on ``dense_mesh``, routed experts (entries with a
       dispatch) on ``mesh["ep"]``; both sets are checked before either is applied.
    2. ``shard_experts``: each routed-experts module an FSDP2 unit over ``efsdp`` with
       ``dtype``'s mixed-precision policy, before the blocks take the rest.
    3. ``compile_backend``: ``torch.compile`` each block (``fullgraph=True``).
    4. Activation checkpointing of the blocks whose index in the *whole* model is in
       ``checkpointed`` (a pipeline stage keys its blocks by that index).
    5. FSDP2 over ``fsdp_mesh``: each block, then the root (the root alone when
       ``split_backward``: nested units would reduce their gradients before the
       weight-gradient step), with ``dtype``'s policy; under ``gradient_divide_factor``
       the reduced gradients are summed, then divided by it.
    6. No FSDP2 and ``dtype="bf16"``: the forward under bf16 autocast.

    Args:
        module: Built on the meta device (or on fake tensors).
        mesh: The run's mesh (its ``ep`` and ``efsdp`` views); ``None``: every entry
            goes on ``dense_mesh``.
        dense_mesh: The submesh of the plan's dense axes
            (:meth:`~hyper_parallel.distributed.run_plan.RunPlan.plan_mesh`); ``None``
            only without ``mesh``.
        fsdp_mesh: What FSDP2 shards dense states over, or ``None``.
        shard_experts: Make the routed experts FSDP2 units over ``efsdp``.
        entries: The plan's entries; default the Modules' own sharding configs.
        plan_findings: Problems already found in the plan, refused with the rest.
        dtype: ``"fp32"``, ``"bf16"`` or ``"bf16-true"`` (the parameters' dtype is the
            caller's: :func:`~hyper_parallel.distributed.precision.cast_parameters`).
        gradient_divide_factor: FSDP2's divisor of reduced gradients (the run plan's
            cp convention), or ``None`` for its mean over the mesh.
        compile_backend: A ``torch.compile`` backend, or ``None`` (eager).
        checkpointed: Indices of the blocks to checkpoint.
        per_op: Checkpoint them per operator (``ac="op"``:
            :class:`~hyper_parallel.distributed.activation_checkpoint.OpPolicy`).
        blocks_field: The attribute holding the blocks (a ModuleList or ModuleDict; the
            family's :attr:`~hyper_parallel.dmodule.ModelFamily.blocks`).
        family: The model's :class:`~hyper_parallel.dmodule.ModelFamily`: its routed
            experts and their ``compile_experts`` hook, for ``compile_backend``.
        split_backward: The schedule splits the backward (zero-bubble schedules).
        reshard_after_forward: ``False``: every FSDP2 unit keeps its parameters
            gathered after forward (the run plan's
            :attr:`~hyper_parallel.distributed.run_plan.RunPlan.reshard_after_forward`
            under ``pp``); ``True``: FSDP2's default (blocks reshard, the root does not).
        device_type: Where the module computes (bf16 autocast).
        who: Names the caller in errors.

    Returns:
        The paths of the blocks FSDP2 wrapped (the root is wrapped too).

    Raises:
        ParallelizeError: The plan is refused; the module is left unchanged.
        ValueError: FSDP2 is to shard a module without a blocks container (a pipeline
            stage whose container is empty is one FSDP2 unit, its root).
    """
    precision.check_dtype(dtype)
    assert mesh is None or dense_mesh is not None, "the run plan's plan_mesh(mesh)"
    entries = module_entries(module) if entries is None else list(entries)
    experts = [e for e in entries if e.config.dispatch is not None] if mesh is not None else []
    _apply_plan(module, mesh, dense_mesh, entries, experts, plan_findings)
    mp_policy = precision.fsdp_policy(dtype)
    # FSDP2's own default unless the plan keeps parameters gathered: an explicit True
    # would reshard the root too, which then gathers again in backward.
    kept = {} if reshard_after_forward else {"reshard_after_forward": False}
    if mesh is not None and shard_experts:
        shard_experts_over_efsdp(
            module,
            mesh,
            experts=experts,
            mp_policy=mp_policy,
            **kept,
        )
    blocks = _blocks(module, blocks_field)
    if compile_backend is not None and blocks:
        apply_compile(
            module,
            backend=compile_backend,
            blocks=blocks_field,
            experts=[m for _, m in family.expert_modules(module)] if family else (),
            compile_experts=family.compile_experts if family else None,
        )
    chosen = set(checkpointed)
    for index, block in blocks:
        if index in chosen:
            block.forward = _Checkpointed(  # type: ignore[method-assign]
                block.forward, op_context if per_op else None
            )
    paths: list[str] = []
    if fsdp_mesh is not None:
        units = [] if split_backward else fsdp_units(module)
        # A pipeline stage may hold no block (the embedding or the head alone, when a
        # schedule has as many stages as units): its root is its one FSDP2 unit, as
        # every stage is under split_backward. A model with no blocks at all is refused.
        if not units and not split_backward and not _holds_empty_blocks(module, blocks_field):
            raise ValueError(
                f"{who}: {type(module).__name__} has no ModuleList (or ModuleDict) of blocks "
                "to wrap with fully_shard; FSDP2 shards each block and then the root."
            )
        paths = apply_fsdp(
            module,
            fsdp_mesh,
            units,
            mp_policy=mp_policy,
            **kept,
        )
        if gradient_divide_factor is not None:
            for path in [*paths, ""]:
                unit = module.get_submodule(path)
                unit.set_gradient_divide_factor(gradient_divide_factor)  # type: ignore[operator]
                # A custom factor is a PREMUL_SUM reduction, which gloo lacks: sum, then divide.
                unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    elif precision.uses_autocast(dtype):
        module.forward = _Autocast(module.forward, device_type)  # type: ignore[method-assign]
    return paths


def apply_run_plan(
    module: nn.Module,
    run: RunPlan,
    mesh: ParallelMesh | None,
    *,
    entries: Sequence[PlanEntry] | None = None,
    plan_findings: Sequence[Finding] = (),
    trace: bool = False,
    device_type: str = "cpu",
    one_rank_fsdp: DeviceMesh | None = None,
) -> list[str]:
    """Apply ``run`` to ``module``: the whole model, one pipeline stage, or a fake model.

    The meshes, switches and gradient convention come from ``run``; the sequence
    (plan → experts' FSDP2 → compile → activation checkpointing → FSDP2 → autocast)
    is :func:`apply_parallelism`.

    Args:
        module: Built on the meta device (or fake tensors for the dry run).
        run: The run plan.
        mesh: The run's mesh; ``None`` for one device.
        entries: The plan's entries on ``module``; default its Modules' sharding configs.
        plan_findings: Problems already found in the plan (refused with the rest).
        trace: The dry run's fake model: nothing compiled and no checkpoint wrappers
            (the dry run estimates ``run.ac`` from the saved activations).
        device_type: Where the module computes (for bf16 autocast without FSDP2).
        one_rank_fsdp: With ``mesh`` ``None``: FSDP2 over this one-rank mesh, so one
            device computes under FSDP2's policy as a data-parallel run does
            (:func:`build_model`).

    Returns:
        The paths of the blocks FSDP2 wrapped (the root is wrapped too).
    """
    field = run.blocks_field or "layers"
    blocks = getattr(module, field, None)
    num_blocks = run.num_blocks
    if num_blocks is None:
        num_blocks = len(blocks) if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) else 0
    return apply_parallelism(
        module,
        mesh=mesh,
        dense_mesh=run.plan_mesh(mesh) if mesh is not None else None,
        fsdp_mesh=run.fsdp_mesh(mesh) if mesh is not None else one_rank_fsdp,
        shard_experts=mesh is not None and run.shards_experts(mesh),
        entries=entries,
        plan_findings=plan_findings,
        dtype=run.dtype,
        gradient_divide_factor=run.gradient_divide_factor,
        compile_backend=run.compile_backend if run.compile and not trace else None,
        checkpointed=() if trace else checkpointed_blocks(num_blocks, run.ac),
        per_op=run.ac == "op",
        blocks_field=field,
        family=run.family,
        split_backward=run.split_backward,
        reshard_after_forward=run.reshard_after_forward,
        device_type=device_type,
        who=run.name,
    )


def build_model(
    run: RunPlan,
    mesh: ParallelMesh | None,
    device: torch.device | str,
    seed: int,
    *,
    one_rank_fsdp: DeviceMesh | None = None,
) -> nn.Module:
    """The whole model of ``run`` (``pp=1``): built on meta, :func:`apply_run_plan`,
    materialized on ``device`` and initialized (the same values at any mesh).

    ``one_rank_fsdp``: a one-rank mesh, for a one-device run (``mesh`` ``None``) that
    computes as FSDP2 makes a data-parallel run compute (its mixed-precision policy: under
    ``bf16``, bf16 parameters and a bf16 stream between units instead of autocast) — the
    one-device reference of such a run.
    """
    _require(run, "build_model")
    with torch.device("meta"):
        module = run.subject.build()
    precision.cast_parameters(module, run.dtype)
    apply_run_plan(
        module, run, mesh, device_type=torch.device(device).type, one_rank_fsdp=one_rank_fsdp
    )
    _materialize(module, run, device, seed)
    return module


def build_stages(
    run: RunPlan, mesh: ParallelMesh, device: torch.device | str, seed: int
) -> list[nn.Module]:
    """This rank's pipeline stages of ``run`` (``pp>1``), each through :func:`apply_run_plan`.

    Each stage is built on meta from the sharded config's units it holds
    (:meth:`~hyper_parallel.distributed.pipeline.PipelineLayout.stage_config`); the
    ``ep`` and ``efsdp`` meshes are this pp rank's.
    """
    _require(run, "build_stages")
    assert run.pipeline is not None and run.pipeline_layout is not None
    modules = []
    for s in run.pipeline.stages_of_rank(mesh["pp"].get_local_rank()):
        with torch.device("meta"):
            stage = run.pipeline_layout.stage_config(run.subject, run.pipeline.stages[s]).build()
        precision.cast_parameters(stage, run.dtype)
        apply_run_plan(stage, run, mesh, device_type=torch.device(device).type)
        _materialize(stage, run, device, seed)
        modules.append(stage)
    return modules


def _require(run: RunPlan, who: str) -> None:
    run.raise_for_errors(f"{who} ({run.name} on {run.layout.describe()})")
    if run.subject is None or isinstance(run.subject, nn.Module):
        raise ValueError(f"{who}: the run plan of {run.name} holds no model config to build.")


def _materialize(module: nn.Module, run: RunPlan, device: torch.device | str, seed: int) -> None:
    """``to_empty`` on ``device`` and initialize: per pipeline unit when the model is cut
    into units (the same values at any pp), else the whole model under ``seed``."""
    module.to_empty(device=device)
    if run.pipeline_layout is not None:
        init_states_by_unit(module, run.pipeline_layout, seed)
    else:
        torch.manual_seed(seed)
        module.init_states()  # type: ignore[operator]


def _apply_plan(
    module: nn.Module,
    mesh: ParallelMesh | None,
    dense_mesh: DeviceMesh | None,
    entries: Sequence[PlanEntry],
    experts: Sequence[PlanEntry],
    plan_findings: Sequence[Finding],
) -> None:
    """Dense entries on ``dense_mesh``, routed experts on ``mesh["ep"]``; checked first."""
    dense = [e for e in entries if not any(e is x for x in experts)]
    findings = list(plan_findings)
    if experts:
        assert mesh is not None
        findings += check_entries(experts, ("ep",), {"ep": mesh["ep"].size()})
    if dense and dense_mesh is not None:
        axes = tuple(dense_mesh.mesh_dim_names or ())
        findings += check_entries(dense, axes, dict(zip(axes, dense_mesh.shape)), module)
    if errors_of(findings):
        raise ParallelizeError(errors_of(findings))
    if dense_mesh is not None and (dense or plan_findings):
        parallelize_entries(module, dense_mesh, dense)
        module._hp_parallelized = True  # type: ignore[assignment]
    if experts:
        assert mesh is not None
        parallelize_entries(module, mesh["ep"], experts)


def _holds_empty_blocks(module: nn.Module, field: str) -> bool:
    """Whether ``module`` has its blocks container, and it is empty (a stage without blocks)."""
    blocks = getattr(module, field, None)
    return isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) and len(blocks) == 0


def _blocks(module: nn.Module, field: str) -> list[tuple[int, nn.Module]]:
    """``(index in the whole model, block)`` of the module's repeated blocks."""
    blocks = getattr(module, field, None)
    if isinstance(blocks, nn.ModuleDict):
        return [(int(k), b) for k, b in blocks.items()]
    if isinstance(blocks, nn.ModuleList):
        return list(enumerate(blocks))
    return []


class _Autocast:
    """A module's ``forward`` under bf16 autocast (the module is not FSDP-sharded)."""

    def __init__(self, forward: Callable[..., Any], device_type: str) -> None:
        self.forward, self.device_type = forward, device_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.forward(*args, **kwargs)
