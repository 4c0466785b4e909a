"""Gradients across the mesh: the global norm and its clipping over DTensor gradients on
several meshes and pipeline stages (:func:`clip_grad_norm_`), FSDP2's gradient sync
switched for accumulation (:func:`set_gradient_sync`) and the schedule's scaled loss
(:class:`ScaledLoss`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed.process_group import default_device as default_device
from hyper_parallel.distributed.run_plan import RunPlan

__all__ = ["ScaledLoss", "clip_grad_norm_", "set_gradient_sync"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip gradients to a global norm, for plain, DTensor and mixed-mesh gradients.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, which fails when
    DTensor gradients live on different meshes (e.g. FSDP-only parameters on
    ``dp`` next to TP x FSDP ones on ``(dp, tp)``), and returns a DTensor norm. Here
    the gradients are grouped by mesh; each group's norm is computed by torch and
    made full with ``full_tensor()`` (the DTensor norm of a shard is partial: its
    reduction adds the other shards' contributions and counts replicas once); the
    groups' norms are then combined.

    Args:
        parameters: Parameters whose ``.grad`` to clip (those without are skipped).
        max_norm: Largest allowed total norm (``inf``: only measure it).
        norm_type: The p of the p-norm (``inf`` for the max norm).
        group: Ranks holding the model's *other* parameters (the pipeline stages'
            ``pp`` group): their norms are combined into the total.

    Returns:
        The total norm before clipping, a plain scalar tensor (same on every rank).
    """
    params = [p for p in parameters if p.grad is not None]
    if group is not None:
        return _clip_across(params, max_norm, norm_type, group)
    if not params:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    group_norms = []
    for group in groups.values():
        with _quiet_redistribute_hints():
            norm = _total_norm([p.grad for p in group], norm_type)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        group_norms.append(norm)
    total = torch.linalg.vector_norm(torch.stack(group_norms), norm_type)
    if math.isfinite(max_norm):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The p-norm of ``grads``, in fp32 when they are bf16 or fp16 (bf16-true).

    torch's ``get_total_norm`` returns each tensor's norm, and their total, in the
    gradients' dtype: under bf16 the total carries bf16's 3 significant digits, and
    the clip factor with it. Here each norm is accumulated and returned in fp32.
    """
    if not any(g.dtype in (torch.bfloat16, torch.float16) for g in grads):
        return torch.nn.utils.get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _clip_across(
    params: list[torch.Tensor], max_norm: float, norm_type: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """The norm over every rank of ``group`` (each holding other parameters), then clip."""
    local = clip_grad_norm_(params, math.inf, norm_type).detach().reshape(())
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        powered = local**norm_type
        dist.all_reduce(powered, group=group)
        total = powered ** (1.0 / norm_type)
    if math.isfinite(max_norm) and params:
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
        for members in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total)
    return total


@contextlib.contextmanager
def _quiet_redistribute_hints() -> Iterator[None]:
    """Mute DTensor's hint that a 2-D partial reduction takes two all-reduces.

    For one scalar per mesh the second all-reduce costs nothing worth a warning on
    every rank, and every rank runs the same reductions in the same order.
    """
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether FSDP2 reduces gradients in the next backward, for every FSDP2 unit of
    ``model`` (its blocks, the routed experts' own unit, the root; HSDP's all-reduce
    too). Without FSDP2 (one device, no data axis) there is nothing to defer."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)


class ScaledLoss:
    """The schedule's loss: ``loss_fn`` scaled as the run plan says (``1 / cp``)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], run: RunPlan) -> None:
        self.loss_fn, self.run = loss_fn, run

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.run.scale_loss(self.loss_fn(*args, **kwargs))
