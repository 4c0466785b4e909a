"""Running the stages: torch's ``PipelineStage`` and schedule, and one training step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel._torch_private import functorch_config
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.pipeline.plan import (
    MULTI_STAGE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    PipelinePlan,
)

__all__ = ["build_schedule", "pipeline_step"]


def build_schedule(
    modules: Sequence[nn.Module],
    plan: PipelinePlan,
    pp_mesh: Any,
    device: torch.device | str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """Wrap this rank's stage modules in ``PipelineStage``s and torch's schedule.

    ``loss_fn`` is the per-micro-batch mean; torch divides the summed gradients by
    the number of micro-batches (``scale_grads=True``), so with equal micro-batches
    the gradient is that of the global-batch mean.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    group = pp_mesh.get_group()
    pp_rank = pp_mesh.get_local_rank()
    for module in modules:
        module.register_forward_hook(_own_storage)
    stages = [
        PipelineStage(m, s, plan.num_stages, torch.device(device), group=group)
        for m, s in zip(modules, plan.stages_of_rank(pp_rank), strict=True)
    ]
    cls = get_schedule_class(plan.schedule)
    target = stages if plan.schedule in MULTI_STAGE_SCHEDULES else stages[0]
    return cls(target, plan.num_microbatches, loss_fn=_FloatLoss(loss_fn), scale_grads=True)


class _FloatLoss:
    """The loss from float32 logits (bf16 stages hand on bf16 logits), as at pp=1."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(precision.loss_logits(logits), target)


def _own_storage(module: nn.Module, args: Any, output: Any) -> Any:
    """A stage output that is a view (a local shard handed on by a tensor-parallel
    boundary) is copied: the zero-bubble schedules detach stage outputs in place,
    which autograd refuses for views."""
    if isinstance(output, torch.Tensor) and output._is_view():
        return output.clone()
    return output


def pipeline_step(
    schedule: Any,
    plan: PipelinePlan,
    pp_mesh: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """One forward + backward of the whole batch; returns the batch's mean loss on every pp rank.

    The first stage's rank feeds ``inputs``, the last stage's rank ``targets``; the
    loss (mean over micro-batches of each micro-batch's mean, i.e. the batch mean)
    is broadcast from the last stage's rank over the pp group.
    """
    from hyper_parallel.core.dtensor.dtensor import DTensor

    pp_rank = pp_mesh.get_local_rank()
    local = plan.stages_of_rank(pp_rank)
    last = plan.num_stages - 1
    args = (inputs,) if 0 in local else ()
    losses: list[torch.Tensor] = []
    kwargs = {"target": targets, "losses": losses} if last in local else {}
    with _split_backward_config(plan.schedule):
        schedule.step(*args, return_outputs=False, **kwargs)
    loss = torch.zeros((), dtype=torch.float32, device=inputs.device)
    if losses:
        values = [
            (v.full_tensor() if isinstance(v, DTensor) else v).detach().float() for v in losses
        ]
        loss = torch.stack(values).mean()
    src = dist.get_global_rank(pp_mesh.get_group(), plan.ranks[last])
    dist.broadcast(loss, src=src, group=pp_mesh.get_group())
    return loss


def _split_backward_config(schedule: str) -> Any:
    """For the step of a split-backward schedule: AOTAutograd without donated buffers.

    The zero-bubble schedules run a block's backward in two steps (input, then weight
    gradients) over one retained graph; a compiled backward with donated buffers
    allows one backward only and refuses the second (``donated_buffer`` needs
    ``retain_graph=False``). Torch reads the flag when it compiles, lazily, inside the
    schedule's step, so it is patched around the step and restored after (donated
    buffers only save memory).
    """
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return contextlib.nullcontext()
    return functorch_config.patch(donated_buffer=False)
