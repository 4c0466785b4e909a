"""Pipeline parallelism on the ``pp`` axis with ``torch.distributed.pipelining``.

A model family describes how it is cut (a :class:`PipelineLayout`: the config fields
of its first unit, its repeated blocks, its last unit, the modules every stage
shares, and the module class that runs a stage). The model is then a list of
*units* — the embedding, each block, the norm + output head — and a stage is a
contiguous run of units. As in torchtitan, the embedding and the head each count as
a unit a stage may hold alone, so a 2-layer model runs 4 stages.

The split is data (:class:`PipelineSplit`): units per stage, explicit lists, or —
when neither is given — a split that balances stages by parameter count or by
forward FLOPs (:func:`count_unit_flops`).
:func:`plan_pipeline` checks everything before a process group exists and returns a
:class:`PipelinePlan` (stages, the rank of each stage, the schedule);
:func:`~hyper_parallel.distributed.builder.build_stages` builds this rank's stages
of a :class:`~hyper_parallel.distributed.run_plan.RunPlan` on the meta device through
the one builder (the model's plan, compile, activation checkpointing and FSDP2 with
the dtype's policy inside each stage), materializes and initializes them unit by unit
(:func:`init_states_by_unit`); :func:`build_schedule` wraps them in torch's
``PipelineStage`` and schedule.

Initialization is per unit: each unit is initialized under its own seed derived
from the run's seed and the unit's name (:func:`init_states_by_unit`). A one-device
model initialized the same way equals the union of the stages at any split.

The package is split by role: :mod:`.units` (how a model is cut), :mod:`.plan`
(schedules, the split and its checks), :mod:`.stages` (per-unit initialization),
:mod:`.schedule` (torch's schedule and one step).

Example::

    from hyper_parallel.dmodule import get_spec
    spec = get_spec("llama3-debug")
    layout, config = spec.pipeline(), spec.config()
    plan = plan_pipeline(layout.units(config), pp=2, schedule="1F1B", num_microbatches=4)
    # on each rank of a mesh with a pp axis:
    # modules = build_stages(run, mesh, "cpu", seed=0)  # hyper_parallel.distributed.builder
    # schedule = build_schedule(modules, plan, mesh["pp"], "cpu", loss_fn)
    # loss = pipeline_step(schedule, plan, mesh["pp"], tokens, targets)
"""

from __future__ import annotations

from hyper_parallel.distributed.pipeline.plan import BALANCE as BALANCE
from hyper_parallel.distributed.pipeline.plan import (
    DEFAULT_STAGES_PER_RANK as DEFAULT_STAGES_PER_RANK,
)
from hyper_parallel.distributed.pipeline.plan import MULTI_STAGE_SCHEDULES as MULTI_STAGE_SCHEDULES
from hyper_parallel.distributed.pipeline.plan import SCHEDULES as SCHEDULES
from hyper_parallel.distributed.pipeline.plan import (
    SPLIT_BACKWARD_SCHEDULES as SPLIT_BACKWARD_SCHEDULES,
)
from hyper_parallel.distributed.pipeline.plan import PipelineError as PipelineError
from hyper_parallel.distributed.pipeline.plan import PipelinePlan as PipelinePlan
from hyper_parallel.distributed.pipeline.plan import PipelineSplit as PipelineSplit
from hyper_parallel.distributed.pipeline.plan import balanced_split as balanced_split
from hyper_parallel.distributed.pipeline.plan import check_pipeline as check_pipeline
from hyper_parallel.distributed.pipeline.plan import pipeline_findings as pipeline_findings
from hyper_parallel.distributed.pipeline.plan import plan_pipeline as plan_pipeline
from hyper_parallel.distributed.pipeline.plan import schedule_actions as schedule_actions
from hyper_parallel.distributed.pipeline.plan import stage_ranks as stage_ranks
from hyper_parallel.distributed.pipeline.plan import stages_per_rank_of as stages_per_rank_of
from hyper_parallel.distributed.pipeline.plan import (
    tied_parameter_findings as tied_parameter_findings,
)
from hyper_parallel.distributed.pipeline.schedule import build_schedule as build_schedule
from hyper_parallel.distributed.pipeline.schedule import pipeline_step as pipeline_step
from hyper_parallel.distributed.pipeline.stages import init_states_by_unit as init_states_by_unit
from hyper_parallel.distributed.pipeline.stages import unit_seed as unit_seed
from hyper_parallel.distributed.pipeline.units import PipelineLayout as PipelineLayout
from hyper_parallel.distributed.pipeline.units import PipelineUnit as PipelineUnit
from hyper_parallel.distributed.pipeline.units import count_unit_flops as count_unit_flops

__all__ = [
    "BALANCE",
    "DEFAULT_STAGES_PER_RANK",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "PipelineError",
    "PipelineLayout",
    "PipelinePlan",
    "PipelineSplit",
    "PipelineUnit",
    "balanced_split",
    "build_schedule",
    "check_pipeline",
    "count_unit_flops",
    "init_states_by_unit",
    "pipeline_findings",
    "pipeline_step",
    "plan_pipeline",
    "schedule_actions",
    "stage_ranks",
    "stages_per_rank_of",
    "tied_parameter_findings",
    "unit_seed",
]
