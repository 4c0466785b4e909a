"""Every private PyTorch API hyper_parallel uses, imported here and nowhere else.

Private names (``torch._...``, ``torch.distributed._...``, ``..._internal``) move
between torch releases without notice. Importing them in one module makes a move a
one-file fix, and :func:`missing` (run by the unit tests) names what moved and the
torch version it moved in. Attributes read on objects (``DTensor._local_tensor``,
``DeviceMesh._flatten``) cannot be imported; they are listed in :data:`ATTRIBUTES`
and checked the same way.

Example::

    from hyper_parallel._torch_private import missing
    assert not missing(), missing()
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import (
    _get_shard_size_and_offsets as get_shard_size_and_offsets,
)
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Also here, public names torch renamed: 2.13 deprecates all_gather_into_tensor /
# reduce_scatter_tensor (a FutureWarning in every run that calls them) for *_single, which
# older torch lacks. The same c10d ops either way (_allgather_base_, _reduce_scatter_base_).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "ATTRIBUTES",
    "MODULES",
    "DTensorSpec",
    "FakeTensorMode",
    "StridedShard",
    "TensorMeta",
    "TorchDispatchMode",
    "all_gather_single",
    "c10d_functional",
    "compute_global_tensor_info",
    "dynamo_config",
    "fake_store",
    "funcol",
    "functorch_config",
    "get_schedule_ops",
    "get_shard_size_and_offsets",
    "is_fake",
    "mark_unbacked",
    "missing",
    "pytree",
    "reduce_scatter_single",
    "resolve_process_group",
    "saved_tensors_hooks_enabled",
    "strided_shard_sizes_concrete",
    "top_saved_tensors_hooks",
    "unbox_process_group",
]

MODULES: dict[str, tuple[str, ...]] = {
    "torch._dynamo.config": ("capture_scalar_outputs",),
    "torch._dynamo.decorators": ("mark_unbacked",),
    "torch._functorch.config": ("donated_buffer",),
    "torch._subclasses.fake_tensor": ("FakeTensorMode", "is_fake"),
    "torch.distributed._functional_collectives": ("all_to_all_single", "all_gather_tensor"),
    "torch.distributed.pipelining._schedule_visualizer": ("get_schedule_ops",),
    "torch.distributed.pipelining.schedules": ("_PipelineScheduleRuntime",),
    "torch.distributed.tensor._dtensor_spec": ("DTensorSpec", "TensorMeta"),
    "torch.distributed.tensor._utils": (
        "compute_global_tensor_info",
        "_get_shard_size_and_offsets",
    ),
    "torch.distributed.tensor.placement_types": ("_StridedShard",),
    "torch.distributed.distributed_c10d": ("_resolve_process_group",),
    "torch.testing._internal.distributed.fake_pg": ("FakeStore",),
    "torch.utils._pytree": ("tree_map", "tree_flatten", "tree_leaves"),
    "torch.utils._python_dispatch": ("TorchDispatchMode", "_disable_current_modes"),
}
"""Private modules and the names read from each (the imports above, and the fake store)."""

ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "torch.distributed.tensor.DTensor": ("_local_tensor", "_spec"),
    "torch.distributed.device_mesh.DeviceMesh": ("_flatten",),
    "torch.Tensor": ("_is_view", "_version"),
    "torch.distributed.pipelining.schedules._PipelineScheduleRuntime": (
        "_prepare_schedule_with_comms",
        "_validate_and_set_stage_mapping",
    ),
    "torch.ops": ("_c10d_functional",),
    "torch": ("_grouped_mm",),
    "torch._C._distributed_c10d.ProcessGroup": ("unbox",),
    "torch._C._autograd": ("_saved_tensors_hooks_is_enabled", "_top_saved_tensors_default_hooks"),
    "torch.distributed.tensor.placement_types._StridedShard": ("local_shard_size_and_offset",),
}
"""Private attributes read on torch objects (hot paths read them directly)."""


c10d_functional = torch.ops._c10d_functional
"""The functional collectives' ops (``torch.ops._c10d_functional``)."""


def unbox_process_group(boxed: Any) -> Any:
    """The ``ProcessGroup`` behind a boxed script object (an op's group argument)."""
    return torch._C._distributed_c10d.ProcessGroup.unbox(boxed)


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be pushed now (torch disables them in some regions)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The ``(pack, unpack)`` saved-tensor hooks in force now (the innermost), if any."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def dynamo_config() -> Any:
    """``torch._dynamo.config`` (imported on first use: importing dynamo takes ~1 s)."""
    import torch._dynamo.config as config

    return config


def mark_unbacked(t: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.decorators.mark_unbacked``: ``t.shape[dim]`` is data-dependent."""
    from torch._dynamo.decorators import mark_unbacked as mark

    mark(t, dim)


def get_schedule_ops(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int) -> Any:
    """torch's action list of a pipeline schedule on stand-in stages (no process group).

    The compute actions torch's schedule class computes (its ``pipeline_order``), with
    what its constructor refuses raised as the constructor raises it. The runtime
    schedules' constructors also lower the order to one with communication actions
    (unshard/reshard, gradient reduction, send/recv), which this list does not hold and
    which refuses nothing (its passes raise only on broken internal invariants); that
    lowering is skipped here, keeping the validation of the order that precedes it. At
    pp=32 with 256 micro-batches it takes ~3 s of the ~3 s torch spends.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops as ops
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(schedule)
    return ops(_compute_only(cls), pp, num_microbatches, stages_per_rank)


@functools.cache
def _compute_only(cls: type) -> type:
    """``cls``, or for a runtime schedule a subclass that validates its compute order
    (stage-to-rank mapping) but does not lower it to communication actions."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    if not issubclass(cls, _PipelineScheduleRuntime):
        return cls

    def _prepare_schedule_with_comms(self: Any, actions: Any, format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)

    return type(
        cls.__name__,
        (cls,),
        {
            "_prepare_schedule_with_comms": _prepare_schedule_with_comms,
            "__qualname__": cls.__qualname__,
            "__module__": __name__,
        },
    )


@contextlib.contextmanager
def strided_shard_sizes_concrete() -> Iterator[None]:
    """Within: ``_StridedShard`` shard sizes of integer dims are computed on real tensors.

    torch's ``_StridedShard.local_shard_size_and_offset`` splits a ``torch.arange`` of the
    dim and reads its offsets with ``.tolist()``; under ``FakeTensorMode`` that arange is
    fake and ``.tolist()`` raises ``DataDependentOutputException``. DTensor asks it when it
    prices redistributions of a ``_StridedShard`` of split factor > 1 — a ``(batch, seq)``
    activation sharded on seq (cp) flattened to ``(batch * seq, dim)`` for a matmul, batch
    > 1 — so a fake-tensor trace of such a plan failed where the real run does not. Its
    arguments are integers (the dim's size, chunks, rank): with the dispatch modes off
    (the fake mode, and the trace's counters, which would count the arange) the answer is
    the real run's. Symbolic sizes go to torch's own function unchanged.
    """
    original = StridedShard.local_shard_size_and_offset

    def concrete(self: Any, curr_local_size: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(curr_local_size, int):
            return original(self, curr_local_size, *args, **kwargs)
        with _disable_current_modes():
            return original(self, curr_local_size, *args, **kwargs)

    StridedShard.local_shard_size_and_offset = concrete  # type: ignore[method-assign]
    try:
        yield
    finally:
        StridedShard.local_shard_size_and_offset = original  # type: ignore[method-assign]


def fake_store() -> Any:
    """torch's in-memory store for the ``fake`` process group (the dry run's world)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def missing() -> list[str]:
    """Every private name of :data:`MODULES` and :data:`ATTRIBUTES` this torch lacks.

    Returns:
        One line per missing name, naming the torch version; empty when all resolve.
    """
    out = []
    for table in (MODULES, ATTRIBUTES):
        for owner, names in table.items():
            try:
                obj = _resolve(owner)
            except (ImportError, AttributeError) as e:
                out.append(f"torch {torch.__version__}: {owner} is gone ({e}).")
                continue
            out += [
                f"torch {torch.__version__}: {owner}.{n} is gone; update "
                "hyper_parallel/_torch_private.py."
                for n in names
                if not hasattr(obj, n)
            ]
    return out
