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

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.axes import (
    MODEL_AXES,
    apply_model_axes,
    declared_axes,
    plan_axis_findings,
    plan_mesh,
    states_on_axes,
)
from hyper_parallel.distributed.builder import module_entries
from hyper_parallel.distributed.compile import BACKENDS
from hyper_parallel.distributed.context_parallel import cp_findings
from hyper_parallel.distributed.expert_parallel import (
    ep_findings,
    ep_layout_findings,
    ep_plan_findings,
    moe_layers,
    rescale_expert_grads,
)
from hyper_parallel.distributed.fsdp import fsdp_mesh_for
from hyper_parallel.distributed.layout import DATA_AXES, DENSE_AXES, MeshLayout, ParallelMesh
from hyper_parallel.distributed.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelineLayout,
    PipelinePlan,
    PipelineSplit,
    check_pipeline,
    count_unit_flops,
    stages_per_rank_of,
)
from hyper_parallel.dmodule.findings import Finding, PlanEntry

__all__ = [
    "RUN_AXES",
    "PlanCache",
    "RunPlan",
    "accumulation_findings",
    "compile_findings",
    "default_num_microbatches",
    "raise_findings",
    "schedule_findings",
    "switch_findings",
]

RUN_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
"""User axes a run composes (every axis of :class:`~hyper_parallel.distributed.MeshLayout`)."""


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


def accumulation_findings(
    num_microbatches: int, batch_size: int | None, layout: MeshLayout
) -> list[Finding]:
    """What refuses gradient accumulation at ``pp=1``: a count below 1, or a batch per
    data-parallel rank that does not split into that many equal micro-batches.

    Equal micro-batches make the step's loss the mean of theirs, so the accumulated
    gradient is exactly the one of one forward over the whole batch.

    Args:
        num_microbatches: Micro-batches per step (``--microbatches``).
        batch_size: Sequences per data-parallel rank per step, when known.
        layout: The mesh (its data-parallel size names the global batch in the fix).

    Example:
        >>> from hyper_parallel.distributed import MeshLayout
        >>> [f.field for f in accumulation_findings(3, 4, MeshLayout(dp_shard=2))]
        ['num_microbatches']
    """
    if num_microbatches < 1:
        return [
            Finding(
                "error",
                "",
                "num_microbatches",
                f"--microbatches {num_microbatches}: a step needs at least one micro-batch.",
                "give --microbatches >= 1 (1: one forward of the whole batch).",
            )
        ]
    if batch_size is None or batch_size % num_microbatches == 0:
        return []
    dp = layout.size("batch")
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    shown = ", ".join(str(d) for d in divisors[:8]) + (", ..." if len(divisors) > 8 else "")
    return [
        Finding(
            "error",
            "",
            "num_microbatches",
            f"--microbatches {num_microbatches} does not divide the batch of {batch_size} "
            f"sequences per data-parallel rank (global batch {batch_size * dp} over "
            f"dp_replicate x dp_shard = {dp}): the micro-batches would be unequal.",
            f"use --microbatches among {shown} (divisors of {batch_size}), or a global batch "
            f"that is a multiple of {dp * num_microbatches} (dp x micro-batches).",
        )
    ]


def switch_findings(
    layout: MeshLayout,
    *,
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
) -> list[Finding]:
    """What the switches ask of the mesh: sequence parallelism needs ``tp > 1`` and a
    sequence divisible by ``tp``; the global batch splits evenly over the data ranks.

    ``TrainConfig`` raises these at construction with the same text
    (:func:`raise_findings`); ``validate``, ``plan`` and the demo report them as
    findings of the run plan.
    """
    out: list[Finding] = []
    tp = layout.tp
    if sequence_parallel and (tp == 1 or (seq_len is not None and seq_len % tp)):
        out.append(
            Finding(
                "error",
                "switches",
                "sequence_parallel",
                f"sequence_parallel needs tp > 1 and seq_len divisible by tp (got tp={tp}, "
                f"seq_len={seq_len}): it shards each sequence over the tp axis.",
                "set a tp axis dividing seq_len (e.g. tp=2), or drop sequence_parallel.",
            )
        )
    dp = layout.size("batch")
    if global_batch_size is not None and global_batch_size % dp:
        out.append(
            Finding(
                "error",
                "switches",
                "global_batch_size",
                f"global_batch_size={global_batch_size} is not divisible by dp_replicate x "
                f"dp_shard = {dp}; each data-parallel rank takes an equal slice of the "
                "global batch.",
                f"make global_batch_size a multiple of {dp}, or change the data axes.",
            )
        )
    return out


def compile_findings(
    layout: MeshLayout, *, compile: bool, fsdp: bool, microbatch_size: int | None
) -> list[Finding]:
    """What ``torch.compile`` does not trace: cp on a states mesh of several axes with
    more than one sequence per micro-batch.

    Under context parallelism a block's input is a sequence shard; each linear layer
    flattens (batch, sequence) into rows, so a batch of several sequences becomes a
    strided shard of the rows. On a states mesh of more than one axis (tp, or FSDP2's
    data axes next to cp) torch 2.13 propagates that sharding through the matmul with a
    data-dependent size, which dynamo's fake tensors cannot give: every rank stops
    with ``PendingUnbackedSymbolNotFound`` (found by the configuration matrix at
    dp_shard=2 x cp=2, dp_replicate=2 x cp=2 and cp=2 x tp=2 with 4 sequences per
    rank). Eager runs it, and one sequence per micro-batch compiles (dp_shard=2 x cp=2,
    and cp alone with 2 sequences, match eager).
    """
    if not compile or layout.cp == 1 or microbatch_size is None or microbatch_size <= 1:
        return []
    others = [a for a in ("dp_replicate", "dp_shard") if fsdp and layout.size(a) > 1]
    others += ["tp"] if layout.tp > 1 else []
    if not others:
        return []
    return [
        Finding(
            "error",
            "switches",
            "compile",
            f"compile with cp={layout.cp} next to {' x '.join(others)} and "
            f"{microbatch_size} sequences per micro-batch: dynamo cannot trace the linear "
            "layers on a sequence shard flattened with the batch over a states mesh of "
            "several axes (torch's strided-shard propagation needs a data-dependent size; "
            "every rank would stop).",
            "give each rank one sequence per micro-batch (a global batch of data-parallel "
            "ranks x micro-batches), or leave compile off with cp.",
        )
    ]


def raise_findings(findings: Iterable[Finding], where: str) -> None:
    """Raise one ``ValueError`` listing every error of ``findings`` (none: return).

    Args:
        findings: Findings of any severity; only errors are raised.
        where: Who refuses, e.g. ``"Trainer (mesh pp=2)"``.
    """
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        lines = "\n".join(f"  {f}" for f in errors)
        raise ValueError(f"{where}: {len(errors)} problem(s):\n{lines}")


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
    family: Any = None
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
    pipeline_layout: PipelineLayout | None = None
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
                ``pipeline_split`` (a split or its dict form), ``stages_per_rank``.

        Raises:
            ValueError: A switch with a bad value (a choice error); problems of the run
                itself — an unknown model included — are findings.
        """
        layout = MeshLayout.from_sizes(layout) if not isinstance(layout, MeshLayout) else layout
        sp = bool(switches.get("sequence_parallel", False))
        if cache is None:
            subject, family, findings = _sharded_subject(model, model_overrides, layout, sp)
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
            subject, family, findings = _sharded_subject(model, model_overrides, layout, sp)
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
        pipeline_layout: PipelineLayout | None = None,
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
        family: Any,
        pipeline_layout: PipelineLayout | None,
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
            findings += _position_findings(name, subject, family, seq_len)
        if subject is not None:
            assert model is not None
            memo = None
            if cache is not None and structure is not None:
                memo = cache.memos.setdefault(structure, {})
            findings += _model_findings(
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
        else:
            split = pipeline_split
        if num_microbatches is None:
            num_microbatches = default_num_microbatches(layout.pp, schedule, stages_per_rank)
        findings += compile_findings(
            layout,
            compile=compile,
            fsdp=fsdp,
            microbatch_size=None if batch_size is None else batch_size // max(1, num_microbatches),
        )
        if layout.pp > 1 and (subject is not None or family is not None):
            args = dict(
                schedule=schedule,
                num_microbatches=num_microbatches,
                split=split,
                stages_per_rank=stages_per_rank,
                batch_size=batch_size,
                seq_len=seq_len,
            )
            # What _pipeline reads of the layout: pp, whether cp is on, and ep.
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
                found_plan = _pipeline(
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


def _sharded_subject(
    model: str, overrides: Mapping[str, Any] | None, layout: MeshLayout, sp: bool
) -> tuple[Any, Any, list[Finding]]:
    """The registered model's config sharded for the layout's model axes, its family, and
    what refused it (an unknown name, overrides, or axis sizes the model does not take)."""
    from hyper_parallel.dmodule.model_spec import get_spec

    findings: list[Finding] = []
    subject, family = None, None
    try:
        spec = get_spec(model)
        family = spec.family
        config = spec.config(**dict(overrides or {}))
    except (ValueError, TypeError) as e:  # unknown name, or overrides it refuses
        findings.append(
            Finding("error", "model", model, str(e), "name a registered model and its fields.")
        )
    else:
        try:
            subject = apply_model_axes(spec, config, layout, sequence_parallel=sp)
        except ValueError as e:
            findings.append(
                Finding("error", "model", model, str(e), "pick axis sizes the model supports.")
            )
    return subject, family, findings


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


def _model_findings(
    layout: MeshLayout,
    subject: Any,
    model: nn.Module,
    entries: Sequence[PlanEntry],
    axes: Sequence[str],
    states_on_data: Any,
    fsdp: bool,
    seq_len: int | None,
    memo: dict[Any, Any] | None = None,
) -> list[Finding]:
    """The model's sharding against the mesh: experts over ``ep``, the plan's axes against
    the data axes and ``cp``, context parallelism against the sequence and the heads.
    ``memo`` (per model structure, from a :class:`PlanCache`) keeps the model's MoE
    layers, found once by walking its modules."""
    out: list[Finding] = []
    if layout.ep > 1:
        out += ep_plan_findings(layout, entries)
        layers = None
        if memo is not None:
            if "moe_layers" not in memo:
                memo["moe_layers"] = moe_layers(model)
            layers = memo["moe_layers"]
        out += ep_findings(model, layout, layers=layers)
    out += plan_axis_findings(layout, axes, fsdp=fsdp, states_on_data=states_on_data)
    if layout.cp > 1:
        found = cp_findings(model if isinstance(subject, nn.Module) else subject, layout, seq_len)
        # The sequence against the positions is _position_findings' (at every cp size).
        out += [f for f in found if (f.path, f.field) != ("rope", "max_seq_len")]
    return out


def _position_findings(
    name: str | None, subject: Any, family: Any, seq_len: int | None
) -> list[Finding]:
    """A sequence longer than the model's rotary positions (``rope.max_seq_len``), refused
    with the fix: a registered model of the same family and size that takes it (Llama
    3.1's scaled rope for Llama 3), a shorter sequence, or ``max_seq_len`` overridden.

    The positions are what the model's rope covers: a Llama 3 rope was trained on 8,192,
    Llama 3.1's is scaled to 131,072; a longer table than that is the user's explicit
    override, never a silent one.
    """
    limit = getattr(getattr(subject, "rope", None), "max_seq_len", None)
    if seq_len is None or not isinstance(limit, int) or seq_len <= limit:
        return []
    who = name or "the model"
    longer = _longer_models(name, subject, family, seq_len)
    instead = f"use {longer} instead, " if longer else ""
    return [
        Finding(
            "error",
            "rope",
            "max_seq_len",
            f"seq_len {seq_len:,} exceeds {who}'s {limit:,} positions (rope.max_seq_len="
            f"{limit}); the rotary embedding has no angle for the positions past them.",
            f"{instead}shorten the sequence to at most {limit:,} tokens, or set "
            f"--model-overrides '{{\"max_seq_len\": {seq_len}}}' (positions the rope was "
            "not trained on).",
        )
    ]


def _longer_models(name: str | None, subject: Any, family: Any, seq_len: int) -> str | None:
    """Registered models of ``subject``'s family and parameter count whose positions
    cover ``seq_len`` (``"llama3.1-8b (131,072 positions)"``), or ``None``."""
    from hyper_parallel.dmodule.model_spec import get_spec, list_specs

    count = getattr(family, "num_params", None)
    if family is None or count is None or isinstance(subject, nn.Module):
        return None
    try:
        size = count(subject)
    except (AttributeError, TypeError, ValueError):
        return None
    found = []
    for other in list_specs():
        spec = get_spec(other)
        if other == name or spec.family is None or spec.family.name != family.name:
            continue
        try:
            config = spec.config()
        except (ValueError, TypeError):  # a spec sized by a file (the *-hf ones)
            continue
        positions = getattr(getattr(config, "rope", None), "max_seq_len", 0)
        if positions >= seq_len and count(config) == size:
            found.append(f"{other} ({positions:,} positions)")
    return " or ".join(found) or None


def _unique(findings: Iterable[Finding]) -> list[Finding]:
    out: list[Finding] = []
    for f in findings:
        if f not in out:
            out.append(f)
    return out


def _blocks_field(family: Any, pipeline_layout: PipelineLayout | None) -> str | None:
    """The attribute holding the repeated blocks: the family's, or its pipeline's."""
    if family is not None and family.blocks is not None:
        return family.blocks
    return pipeline_layout.layers if pipeline_layout is not None else "layers"


def _pipeline(
    name: str,
    layout: MeshLayout,
    model: nn.Module | None,
    family: Any,
    pipeline_layout: PipelineLayout | None,
    *,
    schedule: str,
    num_microbatches: int,
    split: PipelineSplit | None,
    stages_per_rank: int | None,
    batch_size: int | None,
    seq_len: int | None,
    memo: dict[Any, Any] | None = None,
) -> tuple[PipelinePlan | None, list[Finding]]:
    """The pipeline plan and its findings (``pp > 1``), each on path ``pipeline``.

    ``memo`` (one per model structure, from a :class:`PlanCache`) keeps the model's
    units and its tied-weight findings per stage assignment.
    """
    if pipeline_layout is None:
        return None, [
            Finding(
                "error",
                "mesh",
                "pp",
                f"pp={layout.pp}, but {name} declares no pipeline stages (no PipelineLayout "
                "registered with the model).",
                "leave pp out of the mesh, register the model's PipelineLayout, or pass "
                "validate(..., pipeline=PipelineLayout(...)) describing its units.",
            )
        ]
    if layout.cp > 1 and family is not None and family.set_positions is None:
        return None, [
            Finding(
                "error",
                "mesh",
                "cp",
                f"model {name!r} with pp and cp: its family declares no set_positions "
                "hook to hand each pipeline stage its tokens' positions.",
                "leave cp or pp out of the mesh, or declare ModelFamily.set_positions.",
            )
        ]
    if model is None:  # the model's sharding was refused: reported already
        return None, []
    flops = split is not None and split.balance == "flops"
    units_key = ("units", seq_len or 2048) if flops else ("units",)
    try:
        if memo is not None and units_key in memo:
            units = memo[units_key]
        elif flops:
            with torch.device("meta"):
                units = count_unit_flops(pipeline_layout, model, seq_len or 2048)
        else:
            units = pipeline_layout.units_of_model(model)
        if memo is not None:
            memo[units_key] = units
    except ValueError as e:  # the model refuses the sequence it is counted on
        return None, [
            Finding(
                "error",
                "pipeline",
                "split.balance",
                f"counting each unit's FLOPs on a sequence of {seq_len or 2048} tokens failed: {e}",
                "use a sequence length the model takes, or balance by 'params'.",
            )
        ]
    except AttributeError as e:
        return None, [
            Finding(
                "error",
                "pipeline",
                "layout",
                f"the pipeline description does not fit {type(model).__name__}: {e}",
                "pass the PipelineLayout of this model family.",
            )
        ]
    plan, found = check_pipeline(
        units,
        pp=layout.pp,
        schedule=schedule,
        num_microbatches=num_microbatches,
        split=split,
        stages_per_rank=stages_per_rank,
        batch_size=batch_size,
        model=model,
        tied_memo=memo.setdefault("tied", {}) if memo is not None else None,
    )
    found = [dataclasses.replace(f, path=f.path or "pipeline") for f in found]
    found += schedule_findings(layout, schedule)
    if any(f.severity == "error" for f in found):
        plan = None
    return plan, found


def schedule_findings(layout: MeshLayout, schedule: str) -> list[Finding]:
    """What a pipeline schedule does not run with the other axes: ``ep`` with a schedule
    that splits the backward.

    Inside a pipeline stage the routed experts are an FSDP2 unit of their own (over
    ``efsdp``, a mesh apart from the dense states'). The zero-bubble schedules
    (``InterleavedZeroBubble``, ``ZBVZeroBubble``) run each backward as an
    input-gradient and a later weight-gradient step, and FSDP2 units nested in a stage
    then reduce their gradients before the weight step has accumulated them (the
    reason a stage is one FSDP2 unit under those schedules): measured 9.5e-4 and
    2.3e-3 off one device after 5 steps of the debug MoE at pp=2 x dp_shard=2 x ep=2.
    1F1B, GPipe and Interleaved1F1B run the full backward and match one device.
    """
    if layout.ep == 1 or layout.pp == 1 or schedule not in SPLIT_BACKWARD_SCHEDULES:
        return []
    return [
        Finding(
            "error",
            "mesh",
            "ep",
            f"ep={layout.ep} with pp={layout.pp} and {schedule}: the schedule splits each "
            "backward into input- and weight-gradient steps, and the routed experts' own "
            "FSDP2 unit (over efsdp) inside each stage would reduce its gradients before "
            "the weight step (wrong gradients).",
            "use 1F1B, GPipe or Interleaved1F1B with ep, or leave ep out of the mesh for "
            f"{schedule}.",
        )
    ]
