"""One run plan: every decision about a run, made once (the builder applies it).

A run is a model, a mesh layout and the switches (sequence parallel, compile,
activation checkpointing, dtype, pipeline schedule, micro-batches, stage split).
:class:`RunPlan` decides, once and before any process group exists:

- its **findings** — every problem of the mesh, the model's sharding over it, context
  and expert parallelism, the switches, the pipeline plan — which are the *only*
  checks: the trainer's gate (:func:`~hyper_parallel.train.trainer.check_config`),
  ``validate``, ``plan`` (the dry run), ``suggest --mesh`` and the demo all ask this
  object;
- the **submesh** each plan applies to (:meth:`RunPlan.plan_mesh`, the dense mesh for
  a plan naming no axis), the FSDP2 / HSDP mesh of the dense states
  (:meth:`RunPlan.fsdp_mesh`), whether the routed experts are an FSDP2 unit of their
  own over ``efsdp`` (:meth:`RunPlan.shards_experts`) and whether FSDP2 reshards
  parameters after forward (:attr:`RunPlan.reshard_after_forward`: not under ``pp``);
- the **gradient convention** under ``cp`` and ``ep`` (:attr:`RunPlan.loss_divisor`,
  :attr:`RunPlan.gradient_divide_factor`, :meth:`RunPlan.finish_gradients`): each
  rank's loss is divided by ``cp``, the ``cp`` ranks' gradients are *summed* (FSDP2
  divides by the data-parallel ranks only), and expert gradients are brought to the
  dense convention after backward;
- the **micro-batch count** (:func:`default_num_microbatches`), one meaning with and
  without ``pp``: each data-parallel rank's batch is split into that many equal
  micro-batches, run one after the other, and the gradients are reduced once per
  step. Under ``pp`` the schedule runs them (unless given, as many as the schedule
  has stages, ``pp`` x stages per rank — the fewest every schedule runs, known
  without the batch size, so the trainer, ``validate``, ``plan`` and the pipeline
  cost model describe the same run); at ``pp=1`` they are gradient accumulation
  (default 1): FSDP2 skips its reduction on all but the last micro-batch
  (:attr:`RunPlan.accumulation_steps`, :meth:`RunPlan.finish_gradients`).

It builds nothing: :mod:`hyper_parallel.distributed.builder` applies a plan
(:func:`~hyper_parallel.distributed.builder.build_model`,
:func:`~hyper_parallel.distributed.builder.build_stages`,
:func:`~hyper_parallel.distributed.builder.apply_run_plan`).

Example::

    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.run_plan import RunPlan

    run = RunPlan.for_model("llama3-debug", MeshLayout.parse("pp=2,dp_shard=2"), batch_size=4)
    print(run.num_microbatches, [str(f) for f in run.errors])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.contract import ModelFamily, PipelineLayoutProtocol
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.axes import (
    MODEL_AXES,
    declared_axes,
    plan_mesh,
    states_on_axes,
)
from hyper_parallel.distributed.compile import BACKENDS
from hyper_parallel.distributed.expert_parallel import (
    ep_layout_findings,
    rescale_expert_grads,
)
from hyper_parallel.distributed.fsdp import fsdp_mesh_for, shards_dense_states
from hyper_parallel.distributed.layout import DATA_AXES, DENSE_AXES, MeshLayout, ParallelMesh
from hyper_parallel.distributed.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelinePlan,
    PipelineSplit,
    stages_per_rank_of,
)
from hyper_parallel.distributed.run_checks import (
    accumulation_findings as accumulation_findings,
)
from hyper_parallel.distributed.run_checks import checkpoint_findings as checkpoint_findings
from hyper_parallel.distributed.run_checks import compile_findings as compile_findings
from hyper_parallel.distributed.run_checks import (
    model_findings,
    pipeline_plan_findings,
    position_findings,
    sharded_subject,
    unused_switch_findings,
)
from hyper_parallel.distributed.run_checks import raise_findings as raise_findings
from hyper_parallel.distributed.run_checks import schedule_findings as schedule_findings
from hyper_parallel.distributed.run_checks import switch_findings as switch_findings
from hyper_parallel.dmodule.findings import Finding, PlanEntry
from hyper_parallel.dmodule.module import Module

__all__ = [
    "RUN_AXES",
    "PlanCache",
    "RunPlan",
    "accumulation_findings",
    "checkpoint_findings",
    "compile_findings",
    "default_num_microbatches",
    "module_entries",
    "raise_findings",
    "schedule_findings",
    "switch_findings",
]

RUN_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
"""User axes a run composes (every axis of :class:`~hyper_parallel.distributed.MeshLayout`)."""


def module_entries(model: nn.Module) -> list[PlanEntry]:
    """The plan of a Module tree: every ``sharding_config`` with its path."""
    return [
        PlanEntry(path, m, m.sharding_config)
        for path, m in model.named_modules()
        if isinstance(m, Module) and m.sharding_config is not None
    ]


def default_num_microbatches(pp: int, schedule: str, stages_per_rank: int | None = None) -> int:
    """The one rule for the micro-batch count when none is given: one per stage.

    ``pp`` x stages per rank (2 for the interleaved schedules unless given, 1 for GPipe
    and 1F1B): the fewest micro-batches every schedule runs (torch's own minimum), and
    known without the batch size, so every entry point agrees. At ``pp=1`` it is 1
    (one forward of the whole batch); a larger count given there is gradient
    accumulation. Each data-parallel rank's batch must split into that many equal
    micro-batches (a finding otherwise).

    Example:
        >>> default_num_microbatches(2, "1F1B"), default_num_microbatches(2, "Interleaved1F1B")
        (2, 4)
    """
    if pp <= 1:
        return 1
    return pp * stages_per_rank_of(schedule, stages_per_rank)


class PlanCache:
    """What :meth:`RunPlan.for_model` builds that many plans of one model share.

    A search over layouts (``hyper-parallel suggest``) asks for thousands of run plans
    of one model; building the sharded model on the meta device and replaying the
    pipeline schedule for each would take seconds per hundred. With a cache, each is
    done once per key of everything it reads, so every plan's findings are those of an
    uncached call:

    - ``structures``: per model, overrides, the model axes' sizes (tp, cp, ep: all
      :func:`~hyper_parallel.distributed.apply_model_axes` reads) and sequence
      parallelism — the sharded config, its family, what refused it, its meta build
      and plan entries (``axes``: the axes those entries declare, and those they
      place states on among the data axes);
    - ``pipelines``: per structure, pp, cp on or off, ep, schedule, micro-batches,
      split, stages per rank, batch size and sequence — the pipeline plan and its
      findings (``memos``: per structure, the model's pipeline units, its tied-weight
      findings per stage assignment and its MoE layers, shared by those keys).

    Example::

        cache = PlanCache()
        runs = [RunPlan.for_model("llama3-debug", {"dp_shard": n}, cache=cache) for n in (2, 4)]
    """

    def __init__(self) -> None:
        self.structures: dict[Any, tuple[Any, ...]] = {}
        self.pipelines: dict[Any, tuple[PipelinePlan | None, list[Finding]]] = {}
        self.axes: dict[Any, tuple[tuple[str, ...], Any]] = {}
        self.memos: dict[Any, dict[Any, Any]] = {}


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RunPlan:
    """Every decision about a run, made once (module docstring); build with a constructor.

    Attributes:
        name: The model's name (a registered name, or its class name).
        layout: The mesh.
        subject: The model config sharded for the active model axes (or the model
            itself for an unregistered model); ``None`` when the sharding was refused.
        family: The model's :class:`~hyper_parallel.dmodule.ModelFamily` (``None`` for
            an unregistered model): what the builder needs of it (blocks, experts).
        blocks_field: The attribute holding the model's repeated blocks.
        entries: The sharding configs the plan applies (built on the meta device), as
            plan entries; routed experts are those with a ``dispatch``.
        plan_axes: Every axis the plan's placements declare.
        sequence_parallel, compile, ac, dtype: The switches.
        compile_backend: ``torch.compile``'s backend when ``compile``.
        fsdp: Whether FSDP2 shards states over the data axes (always in training).
        schedule: The pipeline schedule (torch's name), when ``pp > 1``.
        num_microbatches: Micro-batches per step (resolved): the pipeline's under
            ``pp``, gradient accumulation at ``pp=1`` (default 1).
        batch_size: Sequences per data-parallel rank per step, when known.
        seq_len: Tokens per sequence, when known.
        pipeline_split: The stage split (``None``: balanced by parameters).
        stages_per_rank: Stages per rank (interleaved schedules), when given.
        pipeline_layout: How the model is cut into stages, when it declares it.
        pipeline: The checked pipeline plan (``pp > 1`` and no pipeline errors).
        num_blocks: The model's repeated blocks (activation checkpointing counts them
            across stages).
        findings: Every problem, errors and warnings, each with its fix.
        pipeline_findings: Those of :attr:`findings` that concern the pipeline plan.
    """

    name: str
    layout: MeshLayout
    subject: Any
    family: ModelFamily | None = None
    blocks_field: str | None = None
    entries: tuple[PlanEntry, ...] = ()
    plan_axes: tuple[str, ...] = ()
    sequence_parallel: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    ac: str = "none"
    dtype: str = "fp32"
    fsdp: bool = True
    schedule: str = "1F1B"
    num_microbatches: int = 1
    batch_size: int | None = None
    seq_len: int | None = None
    pipeline_split: PipelineSplit | None = None
    stages_per_rank: int | None = None
    pipeline_layout: PipelineLayoutProtocol | None = None
    pipeline: PipelinePlan | None = None
    num_blocks: int | None = None
    findings: tuple[Finding, ...] = ()
    pipeline_findings: tuple[Finding, ...] = ()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def for_model(
        cls,
        model: str,
        layout: MeshLayout | Mapping[str, int],
        *,
        model_overrides: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        cache: PlanCache | None = None,
        **switches: Any,
    ) -> RunPlan:
        """The run of a registered model: its sharding for every active model axis.

        Args:
            model: A registered model name (``hyper_parallel.dmodule.get_spec``).
            layout: The mesh (a layout or axis sizes).
            model_overrides: Keyword overrides of the model's config.
            world_size: The ranks the job has, when known (checked against the mesh).
            cache: Reuse what an earlier plan of the same model and local structure
                built (:class:`PlanCache`: for searches over many layouts); the
                findings are those of an uncached call.
            switches: ``sequence_parallel``, ``compile``, ``compile_backend``, ``ac``,
                ``dtype``, ``fsdp``, ``schedule``, ``num_microbatches``,
                ``batch_size`` (sequences per data-parallel rank), ``seq_len``,
                ``global_batch_size`` (sequences per step over all data ranks),
                ``pipeline_split`` (a split or its dict form), ``stages_per_rank``,
                ``reduce_each_microbatch`` (a warning where the run would not use it).

        Raises:
            ValueError: A switch with a bad value (a choice error); problems of the run
                itself — an unknown model included — are findings.
        """
        layout = MeshLayout.from_sizes(layout) if not isinstance(layout, MeshLayout) else layout
        sp = bool(switches.get("sequence_parallel", False))
        if cache is None:
            subject, family, findings = sharded_subject(model, model_overrides, layout, sp)
            return cls._decide(
                name=model,
                layout=layout,
                subject=subject,
                family=family,
                pipeline_layout=family.pipeline if family is not None else None,
                world_size=world_size,
                early=findings,
                **switches,
            )
        key = (
            model,
            _frozen(model_overrides or {}),
            *(layout.size(a) for a in MODEL_AXES),
            sp,
        )
        if key not in cache.structures:
            subject, family, findings = sharded_subject(model, model_overrides, layout, sp)
            built = _meta_build(subject) if subject is not None else None
            entries = tuple(module_entries(built)) if built is not None else ()
            cache.structures[key] = (subject, family, tuple(findings), built, entries)
        subject, family, findings, built, entries = cache.structures[key]
        return cls._decide(
            name=model,
            layout=layout,
            subject=subject,
            family=family,
            pipeline_layout=family.pipeline if family is not None else None,
            world_size=world_size,
            early=findings,
            entries=entries if subject is not None else None,
            model=built,
            cache=cache,
            structure=key,
            **switches,
        )

    @classmethod
    def for_subject(
        cls,
        subject: Any,
        layout: MeshLayout,
        *,
        name: str,
        entries: Sequence[PlanEntry] | None = None,
        model: nn.Module | None = None,
        pipeline_layout: PipelineLayoutProtocol | None = None,
        world_size: int | None = None,
        **switches: Any,
    ) -> RunPlan:
        """The run of a model config, or of any model with its plan entries (``validate``,
        the dry run): the same decisions as :meth:`for_model`.

        Args:
            subject: A model config (with ``build()``) or a model (meta is enough).
            layout: The mesh.
            name: The model's name, for messages.
            entries: The plan's entries on a meta build of ``subject``; default: the
                ``sharding_config`` of every :class:`~hyper_parallel.dmodule.Module`.
            model: The meta build to check (the dry run passes one of fewer identical
                layers); default: ``subject`` built on the meta device.
            pipeline_layout: How the model is cut into stages (``pp > 1``); default:
                that of the registered model of the same config class.
            world_size: The ranks the job has, when known.
            switches: As :meth:`for_model`.
        """
        from hyper_parallel.dmodule.model_spec import family_of

        family = family_of(subject)
        if pipeline_layout is None and family is not None:
            pipeline_layout = family.pipeline
        return cls._decide(
            name=name,
            layout=layout,
            subject=subject,
            family=family,
            entries=entries,
            model=model,
            pipeline_layout=pipeline_layout,
            world_size=world_size,
            **switches,
        )

    @classmethod
    def _decide(
        cls,
        *,
        name: str,
        layout: MeshLayout,
        subject: Any,
        family: ModelFamily | None,
        pipeline_layout: PipelineLayoutProtocol | None,
        world_size: int | None,
        entries: Sequence[PlanEntry] | None = None,
        model: nn.Module | None = None,
        early: Sequence[Finding] = (),
        cache: PlanCache | None = None,
        structure: Any = None,
        sequence_parallel: bool = False,
        compile: bool = False,
        compile_backend: str = "inductor",
        ac: str = "none",
        dtype: str = "fp32",
        fsdp: bool = True,
        schedule: str = "1F1B",
        num_microbatches: int | None = None,
        batch_size: int | None = None,
        seq_len: int | None = None,
        pipeline_split: PipelineSplit | Mapping[str, Any] | None = None,
        stages_per_rank: int | None = None,
        global_batch_size: int | None = None,
        reduce_each_microbatch: bool = False,
    ) -> RunPlan:
        check_ac_mode(ac)
        precision.check_dtype(dtype)
        if compile_backend not in BACKENDS:
            raise ValueError(
                f"RunPlan: compile backend {compile_backend!r} is not one of {list(BACKENDS)}."
            )
        findings = [*layout.findings(world_size), *early]
        findings += switch_findings(
            layout,
            sequence_parallel=sequence_parallel,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            heads=_query_heads(subject),
        )
        findings += ep_layout_findings(layout)
        if subject is not None and model is None:
            model = subject if isinstance(subject, nn.Module) else _meta_build(subject)
        if entries is None and model is not None:
            entries = module_entries(model)
        entries = tuple(entries or ())
        if cache is not None and structure is not None:
            if structure not in cache.axes:
                cache.axes[structure] = (
                    declared_axes(entries),
                    states_on_axes(entries, DATA_AXES),
                )
            axes, on_data = cache.axes[structure]
        else:
            axes, on_data = declared_axes(entries), states_on_axes(entries, DATA_AXES)
        if subject is not None:
            findings += position_findings(name, subject, family, seq_len)
        if subject is not None:
            assert model is not None
            memo = None
            if cache is not None and structure is not None:
                memo = cache.memos.setdefault(structure, {})
            findings += model_findings(
                layout, subject, model, entries, axes, on_data, fsdp, seq_len, memo=memo
            )
        split, plan, pipeline_found = None, None, []
        if isinstance(pipeline_split, Mapping):
            try:
                split = PipelineSplit.from_dict(dict(pipeline_split))
            except ValueError as e:
                findings.append(
                    Finding(
                        "error",
                        "pipeline",
                        "pipeline_split",
                        str(e),
                        "give {'units_per_stage': n}, {'stages': [[unit, ...], ...]} or "
                        "{'balance': 'params' | 'flops'}.",
                    )
                )
        elif pipeline_split is None or isinstance(pipeline_split, PipelineSplit):
            split = pipeline_split
        else:  # a job file's array, a number: refused here, never read as a split
            findings.append(
                Finding(
                    "error",
                    "pipeline",
                    "pipeline_split",
                    f"is {type(pipeline_split).__name__} {pipeline_split!r}; the split is a "
                    "dict (or a PipelineSplit).",
                    "give {'units_per_stage': n} or {'stages': [[unit, ...], ...]} (a job "
                    'file: pipeline_split = {stages = [["tok_embeddings", "layers.0"], '
                    '["layers.1", "norm+output"]]}).',
                )
            )
        if num_microbatches is None:
            num_microbatches = default_num_microbatches(layout.pp, schedule, stages_per_rank)
        findings += compile_findings(
            layout,
            compile=compile,
            fsdp=fsdp,
            microbatch_size=None if batch_size is None else batch_size // max(1, num_microbatches),
        )
        findings += checkpoint_findings(layout, ac=ac, fsdp=fsdp, schedule=schedule)
        if layout.pp > 1 and (subject is not None or family is not None):
            args = dict(
                schedule=schedule,
                num_microbatches=num_microbatches,
                split=split,
                stages_per_rank=stages_per_rank,
                batch_size=batch_size,
                seq_len=seq_len,
            )
            # What pipeline_plan_findings reads of the layout: pp, whether cp is on, and ep.
            key = (
                structure,
                layout.pp,
                layout.cp > 1,
                layout.ep,
                repr(split),
                *(v for k, v in args.items() if k != "split"),
            )
            if cache is None or structure is None or key not in cache.pipelines:
                memo = None
                if cache is not None and structure is not None:
                    memo = cache.memos.setdefault(structure, {})
                found_plan = pipeline_plan_findings(
                    name, layout, model, family, pipeline_layout, memo=memo, **args
                )
                if cache is not None and structure is not None:
                    cache.pipelines[key] = found_plan
            else:
                found_plan = cache.pipelines[key]
            plan, found = found_plan
            pipeline_found = found
            findings += found
        elif layout.pp == 1:
            findings += accumulation_findings(num_microbatches, batch_size, layout)
        findings += unused_switch_findings(
            layout,
            schedule=schedule,
            stages_per_rank=stages_per_rank,
            pipeline_split=pipeline_split,
            num_microbatches=num_microbatches,
            reduce_each_microbatch=reduce_each_microbatch,
        )
        num_blocks = None
        field = _blocks_field(family, pipeline_layout)
        if model is not None and field is not None:
            blocks = getattr(model, field, None)
            num_blocks = len(blocks) if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) else None
        return cls(
            name=name,
            layout=layout,
            subject=subject,
            family=family,
            blocks_field=field,
            entries=entries,
            plan_axes=axes,
            sequence_parallel=sequence_parallel,
            compile=compile,
            compile_backend=compile_backend,
            ac=ac,
            dtype=dtype,
            fsdp=fsdp,
            schedule=schedule,
            num_microbatches=num_microbatches,
            batch_size=batch_size,
            seq_len=seq_len,
            pipeline_split=split,
            stages_per_rank=stages_per_rank,
            pipeline_layout=pipeline_layout,
            pipeline=plan,
            num_blocks=num_blocks,
            findings=tuple(_unique(findings)),
            pipeline_findings=tuple(pipeline_found),
        )

    # ------------------------------------------------------------------ findings

    @property
    def errors(self) -> list[Finding]:
        """The findings that stop the run."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        """Whether the run can start."""
        return not self.errors

    def raise_for_errors(self, where: str) -> None:
        """Raise one ``ValueError`` listing every error (:func:`raise_findings`)."""
        raise_findings(self.findings, where)

    # ------------------------------------------------------------------ meshes

    @property
    def dense_plan_axes(self) -> tuple[str, ...]:
        """The dense axes (no ``pp``) the plan declares: what its submesh is made of."""
        return tuple(a for a in self.plan_axes if a in DENSE_AXES)

    def plan_mesh(self, mesh: ParallelMesh) -> DeviceMesh:
        """The submesh the dense plan is applied on (:func:`~hyper_parallel.distributed.plan_mesh`).

        A plan that names no mesh axis (every placement the default, ``Replicate``) is
        checked and applied on the dense mesh (every dense axis): the one fallback, which
        the builder and ``validate``'s trace both take from here.
        """
        sub = plan_mesh(mesh, self.dense_plan_axes)
        return sub if sub is not None else mesh.dense

    def fsdp_mesh(self, mesh: ParallelMesh) -> DeviceMesh | None:
        """The mesh FSDP2 shards dense states over (``None``: no FSDP)."""
        return fsdp_mesh_for(mesh, self.dense_plan_axes) if self.fsdp else None

    @property
    def casts_as_fsdp(self) -> bool:
        """Whether FSDP2 wraps the dense states (:meth:`fsdp_mesh` is not ``None``), so
        that under ``bf16`` they compute under FSDP2's policy — bf16 parameters and a bf16
        stream between units — rather than under autocast (fp32 between matmuls)."""
        return self.fsdp and shards_dense_states(self.layout, self.dense_plan_axes)

    def shards_experts(self, mesh: ParallelMesh) -> bool:
        """Whether the routed experts are an FSDP2 unit of their own over ``efsdp``.

        Under ``ep``, with FSDP: when the dense states have an FSDP mesh, and also when
        they have none (cp on the plan, dp_shard = 1) but ``efsdp`` spans ranks.
        """
        layout = self.layout
        return (
            layout.ep > 1 and self.fsdp and (self.fsdp_mesh(mesh) is not None or layout.efsdp > 1)
        )

    @property
    def reshard_after_forward(self) -> bool:
        """Whether FSDP2 frees gathered parameters after each forward.

        Not under ``pp``: a stage runs several micro-batches' forwards and backwards per
        step, and keeping its parameters gathered between them (as torchtitan does)
        gathers them once per step — what the planner's pipeline cost model assumes —
        instead of once per micro-batch.
        """
        return self.layout.pp == 1

    @property
    def mp_policy(self) -> Any:
        """FSDP2's mixed-precision policy for :attr:`dtype` (every FSDP2 unit takes it)."""
        return precision.fsdp_policy(self.dtype)

    # ------------------------------------------------------------------ gradients

    @property
    def loss_divisor(self) -> int:
        """What each rank's loss is divided by before backward: ``cp``.

        Under context parallelism each rank holds part of every sequence; its loss is
        divided by ``cp`` and the cp ranks' gradients are summed (FSDP2 divides by the
        data-parallel ranks only: :attr:`gradient_divide_factor`), so every gradient is
        the global-batch one — also gradients a model sends at a fixed size (the MoE
        balance loss's).
        """
        return self.layout.cp

    @property
    def gradient_divide_factor(self) -> float | None:
        """What FSDP2 divides reduced gradients by instead of its mesh size: the
        data-parallel ranks (dp_replicate x dp_shard) under ``cp``; ``None`` otherwise."""
        return float(self.layout.size("batch")) if self.layout.cp > 1 else None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss as backward takes it (:attr:`loss_divisor`)."""
        return loss if self.loss_divisor == 1 else loss / self.loss_divisor

    @property
    def accumulation_steps(self) -> int:
        """Forward and backward passes per step at ``pp=1`` (gradient accumulation):
        :attr:`num_microbatches`; 1 under ``pp``, whose schedule runs the micro-batches.

        Each micro-batch's backward takes :meth:`scale_loss` of its own mean loss; the
        summed gradients are divided by the count once, after the last one
        (:meth:`finish_gradients`), as torch's pipeline schedule does (``scale_grads``).
        Scaling the gradients rather than each loss keeps exact what a model sends in
        backward at a fixed size (the MoE balance loss's gradient): its mean over equal
        micro-batches is the whole batch's.
        """
        return self.num_microbatches if self.layout.pp == 1 else 1

    def finish_gradients(self, modules: Iterable[nn.Module], accumulated: int = 1) -> None:
        """After the step's last backward: average the gradients of ``accumulated``
        micro-batches (their sum divided by it), reduce gradients left ``Partial`` over
        ``cp`` (states the plan replicates over cp), and bring routed-expert gradients
        to the dense convention
        (:func:`~hyper_parallel.distributed.expert_parallel.rescale_expert_grads`).

        Args:
            modules: The model (or this rank's pipeline stages).
            accumulated: Backward passes whose gradients were summed
                (:attr:`accumulation_steps` at ``pp=1``; 1 after a pipeline schedule,
                which scales its own).
        """
        modules = list(modules)
        if accumulated > 1:
            with torch.no_grad():
                for module in modules:
                    for p in module.parameters():
                        if p.grad is not None:
                            p.grad.div_(accumulated)
        for module in modules:
            if self.layout.cp > 1:
                for p in module.parameters():
                    grad = p.grad
                    if isinstance(grad, DTensor) and any(x.is_partial() for x in grad.placements):
                        p.grad = grad.redistribute(grad.device_mesh, p.placements)
            if self.layout.ep > 1:
                rescale_expert_grads(module, self.layout)

    # ------------------------------------------------------------------ pipeline

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits each backward (input, then weight gradients)."""
        return self.layout.pp > 1 and self.schedule in SPLIT_BACKWARD_SCHEDULES


# ---------------------------------------------------------------------------- helpers


def _frozen(value: Any) -> Any:
    """A hashable form of config overrides (dicts and lists inside)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _meta_build(config: Any) -> nn.Module:
    with torch.device("meta"):
        return config.build()


def _unique(findings: Iterable[Finding]) -> list[Finding]:
    out: list[Finding] = []
    for f in findings:
        if f not in out:
            out.append(f)
    return out


def _blocks_field(
    family: ModelFamily | None, pipeline_layout: PipelineLayoutProtocol | None
) -> str | None:
    """The attribute holding the repeated blocks: the family's, or its pipeline's."""
    if family is not None and family.blocks is not None:
        return family.blocks
    return pipeline_layout.layers if pipeline_layout is not None else "layers"


def _query_heads(subject: Any) -> int | None:
    """The query heads of a decoder config's first block (``None`` when it has no such
    attention): tp must divide them, so a fix that offers tp sizes offers only those."""
    try:
        attention = subject.layers[0].attention
        return int(attention.wq.out_features // attention.head_dim)
    except (AttributeError, IndexError, TypeError, KeyError):
        return None
