"""The fast boundary path: compute on local shards, then exactly the collective a config fixes.

A :class:`ShardingConfig` tells, at ``parallelize`` time, where a module's inputs
arrive and where its output must go. For the standard tensor-parallel layouts that
pins down the one collective the module needs, so the forward can run on local
tensors with a plain ``torch.nn.functional`` call and that collective, instead of
DTensor's per-op sharding propagation. The collectives and their gradients are
Megatron-LM's (Shoeybi et al., 2019, §3; Korthikanti et al., 2022, §4.2.2):

============================  ======================  ========================
pattern                       forward                 backward
============================  ======================  ========================
column-wise, input replicated identity (``f``)        all-reduce
column-wise, input Shard(seq) all-gather              reduce-scatter
row-wise, output replicated   all-reduce (``g``)      identity
row-wise, output Shard(seq)   reduce-scatter          all-gather
vocab-parallel embedding      masked lookup + ``g``   identity
                              or reduce-scatter       or all-gather
sequence-parallel norm        none (token-wise)       none (weight grad Partial)
``local_map`` region          none                    as ``in_grad_placements``
============================  ======================  ========================

Parameters stay DTensors (for checkpoints, FSDP, optimizers); each call takes a
local view with ``to_local`` so gradients land on the DTensor parameter with the
placements the DTensor path gives them. A module's result is what the DTensor path
returns: a DTensor with the output placements, or the local tensor with
``use_local_output``. Anything not recognised keeps the DTensor path, and so does a
single call whose arguments the fast path cannot take (a DTensor input in another
layout, a sequence not divisible by the axis size, a keyword it does not know).

Scope: configs whose non-``Replicate`` placements are all on one mesh axis (so every
1-D mesh, and N-D meshes where the other axes are replicated); ``nn.Linear`` and
``nn.Embedding`` whose sharded dims divide evenly; ``nn.LayerNorm`` and ``nn.RMSNorm``
(and subclasses that keep torch's forward or declare theirs token-wise with
:func:`tokenwise_norm`), which normalize the trailing ``normalized_shape``. Everything
else — other norms whatever their class name, 2-D placements, uneven shards, other module types, transposed (Conv1D) weights, gathered
column outputs — runs on DTensor.

Under ``torch.compile`` (per block or whole model, ``fullgraph=True``) the same
patterns trace without a graph break: the collectives become functional collectives
on the group's name, parameters are viewed with ``DTensor.to_local`` and outputs
wrapped with ``DTensor.from_local`` (both traceable), and nothing is cached while
tracing, so a second call of the same shapes meets the same guards.

Choose the path with :func:`set_fast_path`, the :func:`fast_path` context manager or
``HYPER_PARALLEL_FAST_PATH=0|1``; the choice is made when a model is parallelized.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# DTensor's spec types and global-shape helper are private to torch; they are what
# DTensor.from_local builds per call, and the fast path builds them once per shape.
from hyper_parallel._torch_private import (
    DTensorSpec,
    TensorMeta,
    all_gather_single,
    compute_global_tensor_info,
    funcol,
    reduce_scatter_single,
)
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.dmodule import _regather
from hyper_parallel.dmodule._checks import implicit_state_slots, region_output_problem
from hyper_parallel.dmodule._placements import ArgumentBinder, has_dtensor, normalize_placements
from hyper_parallel.dmodule.sharding import ShardingConfig, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement

__all__ = [
    "ENV_VAR",
    "FastPath",
    "explain_fast_path",
    "fast_path",
    "fast_path_enabled",
    "select_fast_path",
    "set_fast_path",
]

ENV_VAR = "HYPER_PARALLEL_FAST_PATH"
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
_forced: list[bool | None] = [None]  # set_fast_path / fast_path(); None follows ENV_VAR


# --------------------------------------------------------------------------- the switch


def set_fast_path(enabled: bool | None) -> None:
    """Choose the boundary path for models parallelized from now on.

    Args:
        enabled: ``True`` to use the fast path wherever a config fixes the collective,
            ``False`` to run every module through DTensor, ``None`` to follow the
            ``HYPER_PARALLEL_FAST_PATH`` environment variable (default: on).

    Example::

        from hyper_parallel.dmodule import set_fast_path

        set_fast_path(False)  # every module through DTensor dispatch
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_fast_path: expected True, False or None, got {enabled!r}.")
    _forced[0] = enabled


@contextlib.contextmanager
def fast_path(enabled: bool) -> Iterator[None]:
    """Within the block, parallelize with the fast path on (``True``) or off (``False``).

    Example::

        with fast_path(False):
            parallelize_module(model, mesh, plan)  # DTensor path throughout
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fast_path: expected True or False, got {enabled!r}.")
    previous = _forced[0]
    _forced[0] = enabled
    try:
        yield
    finally:
        _forced[0] = previous


def fast_path_enabled() -> bool:
    """Whether ``parallelize`` takes the fast path now (switch, else environment).

    Raises:
        ValueError: ``HYPER_PARALLEL_FAST_PATH`` is set to something other than 0/1.
    """
    if _forced[0] is not None:
        return _forced[0]
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR}={value!r}: set it to 1 (fast path) or 0 (DTensor path).")


# --------------------------------------------------------------------------- collectives


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and torch.is_grad_enabled()


# Each collective takes a ``ProcessGroup`` in eager mode (c10d's in-place ops, the
# fastest eager path) or the group's name under ``torch.compile``: there the functional
# collectives (``torch.distributed._functional_collectives``) are what dynamo traces,
# so the same autograd functions compile with ``fullgraph=True``. A group name is a
# string constant to dynamo, which a ``ProcessGroup`` object is not.
Group = dist.ProcessGroup | str


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over ranks: in place in eager mode, out of place (functional) under compile."""
    if isinstance(group, str):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one all-gather into one tensor)."""
    if isinstance(group, str):
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), dim, group))
    front = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous() if dim else out


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk of ``dim`` (one ``reduce_scatter``)."""
    if isinstance(group, str):
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))
    front = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous() if dim else out


class _CopyToGroup(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The incoming gradient may be shared or expanded: reduce a private copy.
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward (in place on a fresh result), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        if isinstance(group, str):  # functional (out of place) under compile
            return _all_reduce(x, group)
        if x.is_contiguous():
            ctx.mark_dirty(x)  # callers pass a tensor no backward formula saves
            return _all_reduce(x, group)
        return _all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
        ctx.args = (dim, group, size)
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter(grad, *ctx.args), None, None, None


class _ScatterToGroup(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
        ctx.args = (dim, group, size)
        return _reduce_scatter(x, dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_gather(grad, *ctx.args), None, None, None


class _ScatterAddBias(torch.autograd.Function):
    """Reduce-scatter along ``dim``, then add a replicated bias; backward all-gathers.

    The bias gradient is summed from the gathered (full) output gradient, so it is the
    same on every rank (``Replicate``), as on the DTensor path.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        bias: torch.Tensor,
        dim: int,
        group: Group,
        size: int,
    ) -> torch.Tensor:
        ctx.args = (dim, group, size)
        return _reduce_scatter(x, dim, group, size) + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full = _all_gather(grad, *ctx.args)
        grad_bias = full.reshape(-1, full.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return full, grad_bias, None, None, None


class _ParamView(torch.autograd.Function):
    """``DTensor.to_local`` for one or more parameters, with their gradients' specs given.

    ``to_local``'s backward recomputes the global shape and goes through
    ``DTensor.from_local`` for every gradient; a parameter's gradient spec never
    changes, so it is made once per parameter and reused. Several parameters read
    together (an experts module's stacked weights) share one node: one Python autograd
    call forward and one backward instead of one per parameter. A parameter whose view
    gets no gradient gets ``None``, not zeros.

    ``_ParamView.apply(grad_specs, *params)`` returns the local views, in order.
    """

    @staticmethod
    def forward(ctx: Any, grad_specs: tuple[DTensorSpec, ...], *params: DTensor) -> Any:
        ctx.grad_specs = grad_specs
        ctx.set_materialize_grads(False)
        return tuple(p._local_tensor.view_as(p._local_tensor) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:
        # The specs' strides are the contiguous ones.
        wrapped = [
            None if g is None else DTensor(g.contiguous(), spec, requires_grad=False)
            for g, spec in zip(grads, ctx.grad_specs, strict=True)
        ]
        return (None, *wrapped)


def _placement_key(p: Placement) -> tuple[type, int | None]:
    """What a parameter's placement is (type and shard dim), without its identity."""
    return type(p), getattr(p, "dim", None)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class _ToDTensor(torch.autograd.Function):
    """``DTensor.from_local`` with a spec built once per shape (no global-shape work per call)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
        ctx.spec = spec
        # A detached inner tensor, as DTensor ops produce: a compiled consumer then sees
        # the same inner tensor whichever path made its input.
        return DTensor(local.detach(), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None]:
        spec = ctx.spec
        if grad.placements != spec.placements:  # as from_local: bring it to the forward layout
            grad = grad.redistribute(spec.mesh, spec.placements)
        return grad.to_local(), None


# --------------------------------------------------------------------------- the fast path

_FALLBACK = object()  # a call the fast path declines: the DTensor boundary runs it
_MISSING = object()

Shard1D = int | None  # a placement on the active axis: a shard dim, or None for Replicate


def _unattached(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("FastPath.attach(boundary) must run before the module is called")


class _Reject(Exception):
    """Why a module keeps the DTensor path (raised only while selecting)."""


class FastPath:
    """A module's forward on local shards with the collective its config fixes.

    Installed as ``module.forward`` in place of the DTensor boundary, which it keeps
    as ``fallback`` for calls it cannot take. ``kind`` names the pattern
    (``"colwise"``, ``"rowwise"``, ``"vocab_embedding"``, ...).
    """

    kind = "fast"

    def __init__(self, module: nn.Module, view: _ConfigView) -> None:
        self.module = module
        self.mesh = view.mesh
        self.axis = view.axis
        self.group = view.mesh.get_group(view.axis)
        self.group_name = self.group.group_name
        self.size = view.mesh.size(view.axis)
        self.use_local_output = view.config.use_local_output
        self.fallback: Callable[..., Any] = _unattached
        self.path = ""  # the module's path in the model, from the boundary it falls back to
        self._placements_by_dim: dict[Shard1D, tuple[Placement, ...]] = {}
        self._partial_grad = self._with_axis(Partial())
        self._specs: dict[tuple[Any, ...], DTensorSpec] = {}
        # (parameter name, placements it must have, placements of its gradient or None)
        self._params: list[tuple[str, tuple[Placement, ...], tuple[Placement, ...] | None]] = []
        self._grad_specs: dict[str, tuple[TensorMeta, DTensorSpec]] = {}
        self._param_keys: dict[str, tuple[tuple[type, int | None], ...]] = {}

    def attach(self, fallback: Callable[..., Any]) -> FastPath:
        """Set the DTensor boundary that runs the calls this path declines; returns ``self``."""
        self.fallback = fallback
        self.path = getattr(fallback, "path", "")
        self._param_keys = {
            name: tuple(_placement_key(x) for x in placements)
            for name, placements, _ in self._params
        }
        return self

    def __repr__(self) -> str:
        return f"FastPath(kind={self.kind!r}, module={type(self.module).__name__})"

    # -- helpers used per call

    @property
    def comm(self) -> Group:
        """The group the collectives run on: the object in eager mode, its name under compile."""
        return self.group_name if torch.compiler.is_compiling() else self.group

    def _with_axis(self, on_axis: Placement) -> tuple[Placement, ...]:
        """Full mesh placements: ``on_axis`` on the sharded axis, ``Replicate()`` elsewhere."""
        return tuple(on_axis if i == self.axis else Replicate() for i in range(self.mesh.ndim))

    def _placements(self, dim: Shard1D) -> tuple[Placement, ...]:
        cached = self._placements_by_dim.get(dim)
        if cached is None:
            cached = self._with_axis(Replicate() if dim is None else Shard(dim))
            if not torch.compiler.is_compiling():  # a cache filled while tracing fails a guard
                self._placements_by_dim[dim] = cached
        return cached

    def _local_params(self) -> list[torch.Tensor] | None:
        """Local views of the module's DTensor parameters, or ``None`` if one is not as expected.

        Checked per call, since FSDP or a user may have swapped a parameter since
        ``parallelize``.
        """
        store = self.module._parameters
        mesh = self.mesh
        compiling = torch.compiler.is_compiling()
        out = []
        for name, placements, grad_placements in self._params:
            p = store[name]
            if not isinstance(p, DTensor):
                return None
            if compiling:
                # Compared by type and dim: reading this path's own placement objects next
                # to the parameter's makes dynamo guard on whether they are the same
                # objects, which differs from block to block (a recompile per block).
                same = tuple(_placement_key(a) for a in p.placements) == self._param_keys[name]
            else:
                same = p.placements == placements
            if not same or (p.device_mesh is not mesh and p.device_mesh != mesh):
                return None
            out.append(self._param_view(name, p, grad_placements))
        return out

    def _param_view(
        self, name: str, p: DTensor, grad_placements: tuple[Placement, ...] | None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # DTensor's own to_local traces; the cached spec below is an object dynamo
            # cannot pass to an autograd.Function.
            return p.to_local(grad_placements=grad_placements)
        if not _needs_grad(p):
            return p._local_tensor
        meta = p._spec.tensor_meta
        cached = self._grad_specs.get(name)
        if cached is None or not (cached[0] is meta or cached[0] == meta):
            assert meta is not None, "a DTensor parameter carries its tensor meta"
            grad_meta = TensorMeta(meta.shape, _contiguous_stride(meta.shape), meta.dtype)
            spec = DTensorSpec(p.device_mesh, grad_placements or p.placements, grad_meta)
            cached = self._grad_specs[name] = (meta, spec)
        return _ParamView.apply((cached[1],), p)[0]

    def _local_input(self, x: torch.Tensor, src: Shard1D) -> tuple[torch.Tensor, Shard1D, bool]:
        """``(local, layout on the axis, arrived as DTensor)``; layout ``_FALLBACK`` to decline."""
        if not isinstance(x, DTensor):
            if src is not None:
                ndim = x.ndim
                if not -ndim <= src < ndim:  # the DTensor path names the field
                    return x, _FALLBACK, False  # type: ignore[return-value]
                if src < 0:
                    src += ndim
            return x, src, False
        if x.device_mesh is not self.mesh and x.device_mesh != self.mesh:
            return x, _FALLBACK, True  # type: ignore[return-value]
        layout: Shard1D = None
        for i, p in enumerate(x.placements):
            if i == self.axis:
                if p.is_shard():
                    layout = p.dim  # type: ignore[attr-defined]
                elif not p.is_replicate():
                    return x, _FALLBACK, True  # type: ignore[return-value]
            elif not p.is_replicate():
                return x, _FALLBACK, True  # type: ignore[return-value]
        return x, layout, True

    def _output(self, y: torch.Tensor, dim: Shard1D) -> torch.Tensor:
        if self.use_local_output:
            return y
        placements = self._placements(dim)
        if torch.compiler.is_compiling():
            # Every fast-path output is evenly sharded (uneven calls fall back), which is
            # the global shape from_local infers.
            return DTensor.from_local(y, self.mesh, placements, run_check=False)
        key = (y.shape, y.stride(), y.dtype, dim)
        spec = self._specs.get(key)
        if spec is None:
            shape, stride = compute_global_tensor_info(y, self.mesh, list(placements))
            spec = DTensorSpec(
                self.mesh, placements, TensorMeta(torch.Size(shape), tuple(stride), y.dtype)
            )
            if len(self._specs) > 64:  # many sequence lengths: keep the cache bounded
                self._specs.clear()
            self._specs[key] = spec
        if _needs_grad(y):
            return _ToDTensor.apply(y, spec)
        return DTensor(y, spec, requires_grad=False)

    def _single_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(args) == 1 and not kwargs:
            return args[0]
        if not args and len(kwargs) == 1:
            return kwargs.get(self._arg_name, _MISSING)
        return _MISSING

    _arg_name = "input"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = self._single_input(args, kwargs)
        if isinstance(x, torch.Tensor):
            out = self._forward(x)
            if out is not _FALLBACK:
                return out
        return self.fallback(*args, **kwargs)

    def _forward(self, x: torch.Tensor) -> Any:
        raise AssertionError("each pattern defines _forward")


def _entry_to_replicate(
    path: FastPath, x: torch.Tensor, layout: Shard1D, as_dtensor: bool
) -> torch.Tensor:
    """The full input of a column-wise op, with the gradient the DTensor path gives it.

    A replicated DTensor hands back a Partial gradient (DTensor sums the partial input
    gradients of several consumers before one reduction); a plain replicated tensor is
    ``f`` (its gradient is reduced here, as ``from_local``'s backward would); a
    sequence shard is all-gathered (its gradient reduce-scattered).
    """
    if layout is None:
        if as_dtensor:
            return x.to_local(grad_placements=path._partial_grad)
        return _CopyToGroup.apply(x, path.comm) if _needs_grad(x) else x
    local = x.to_local() if as_dtensor else x
    if _needs_grad(local):
        return _GatherFromGroup.apply(local, layout, path.comm, path.size)
    return _all_gather(local, layout, path.comm, path.size)


def _exit_reduce(path: FastPath, y: torch.Tensor, scatter: Shard1D) -> torch.Tensor:
    """Sum partial results: all-reduce (``scatter is None``) or reduce-scatter along a dim."""
    if scatter is None:
        return _ReduceFromGroup.apply(y, path.comm) if _needs_grad(y) else _all_reduce(y, path.comm)
    if _needs_grad(y):
        return _ScatterToGroup.apply(y, scatter, path.comm, path.size)
    return _reduce_scatter(y, scatter, path.comm, path.size)


def _norm_dim(dim: Shard1D, ndim: int) -> Shard1D:
    return dim + ndim if dim is not None and dim < 0 else dim


class _LinearPath(FastPath):
    """An ``nn.Linear`` on local weight shards; subclasses differ in where they reduce."""

    def __init__(self, module: nn.Linear, view: _ConfigView) -> None:
        super().__init__(module, view)
        self._params = [("weight", view.state("weight"), None)]
        self._has_bias = module.bias is not None
        if self._has_bias:
            self._params.append(("bias", view.state("bias"), None))
        self._src = view.in_src["input"]


class _ColwiseLinear(_LinearPath):
    kind = "colwise"

    def __init__(self, module: nn.Linear, view: _ConfigView) -> None:
        super().__init__(module, view)
        self._out = view.out_dst_dim
        if self._src is not None:
            self.kind = "colwise_sequence_parallel"

    def _forward(self, x: torch.Tensor) -> Any:
        params = self._local_params()
        if params is None:
            return _FALLBACK
        x, layout, as_dtensor = self._local_input(x, self._src)
        ndim = x.ndim
        if layout is _FALLBACK or layout == ndim - 1:
            return _FALLBACK
        if self._out is not None and _norm_dim(self._out, ndim) != ndim - 1:
            return _FALLBACK
        if layout is not None and as_dtensor and x.shape[layout] % self.size:
            return _FALLBACK  # uneven sequence shards: DTensor gathers them correctly
        local = _entry_to_replicate(self, x, layout, as_dtensor)
        if layout is not None and _needs_grad(local) and _regather.applies():
            # Keep the shard for the weight gradient, gathered again in backward (as the
            # DTensor path does: dmodule/_regather.py).
            shard = x._local_tensor if as_dtensor else x  # _entry_to_replicate's input
            gather = functools.partial(_all_gather, dim=layout, group=self.comm, size=self.size)
            with _regather.in_backward([(shard, local, gather)]):
                y = F.linear(local, *params)
        else:
            y = F.linear(local, *params)
        return self._output(y, ndim - 1)


class _RowwiseLinear(_LinearPath):
    kind = "rowwise"

    def __init__(self, module: nn.Linear, view: _ConfigView) -> None:
        super().__init__(module, view)
        self._scatter = view.out_dst_dim
        if self._scatter is not None:
            self.kind = "rowwise_sequence_parallel"

    def _forward(self, x: torch.Tensor) -> Any:
        params = self._local_params()
        if params is None:
            return _FALLBACK
        x, layout, as_dtensor = self._local_input(x, self._src)
        ndim = x.ndim
        if layout is _FALLBACK or layout != ndim - 1:
            return _FALLBACK
        scatter = self._scatter
        if scatter is not None:
            if not -ndim <= scatter < ndim:  # the DTensor path names the field
                return _FALLBACK
            if scatter < 0:
                scatter += ndim
        if scatter is not None and (scatter == ndim - 1 or x.shape[scatter] % self.size):
            return _FALLBACK
        local = x.to_local() if as_dtensor else x
        y = F.linear(local, params[0])
        if not self._has_bias:
            return self._output(_exit_reduce(self, y, scatter), scatter)
        bias = params[1]
        if bias.dtype != y.dtype:  # autocast: F.linear would cast its bias like the matmul
            bias = bias.to(y.dtype)
        if scatter is not None and (_needs_grad(y) or _needs_grad(bias)):
            y = _ScatterAddBias.apply(y, bias, scatter, self.comm, self.size)
        else:
            y = _exit_reduce(self, y, scatter) + bias
        return self._output(y, scatter)


class _VocabEmbedding(FastPath):
    kind = "vocab_embedding"

    def __init__(self, module: nn.Embedding, view: _ConfigView) -> None:
        super().__init__(module, view)
        self._params = [("weight", view.state("weight"), None)]
        num_rows = module.num_embeddings
        # torch.chunk layout, as DTensor shards: ceil(V / n) rows per rank, the last fewer.
        rows = -(-num_rows // self.size)
        self._start = min(view.mesh.get_local_rank(view.axis) * rows, num_rows)
        self._end = min(self._start + rows, num_rows)
        pad = module.padding_idx
        self._padding_idx = (
            pad - self._start if pad is not None and self._start <= pad < self._end else None
        )
        self._scatter = view.out_dst_dim
        if self._scatter is not None:
            self.kind = "vocab_embedding_sequence_parallel"

    def _forward(self, ids: torch.Tensor) -> Any:
        params = self._local_params()
        if params is None:
            return _FALLBACK
        ids, layout, as_dtensor = self._local_input(ids, None)
        if layout is not None:  # _FALLBACK or sharded ids: let DTensor replicate them
            return _FALLBACK
        out_ndim = ids.ndim + 1
        scatter = self._scatter
        if scatter is not None:
            if not -out_ndim <= scatter < out_ndim:  # the DTensor path names the field
                return _FALLBACK
            if scatter < 0:
                scatter += out_ndim
        if scatter is not None and (scatter == out_ndim - 1 or ids.shape[scatter] % self.size):
            return _FALLBACK
        if as_dtensor:
            ids = ids.to_local()
        outside = (ids < self._start) | (ids >= self._end)
        local_ids = (ids - self._start).masked_fill_(outside, 0)
        y = F.embedding(local_ids, params[0], self._padding_idx)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._output(_exit_reduce(self, y, scatter), scatter)


class _TokenwiseNorm(FastPath):
    kind = "norm"

    def __init__(self, module: nn.Module, view: _ConfigView, num_norm_dims: int) -> None:
        super().__init__(module, view)
        self._arg_name = view.single_input
        self._forward_fn = module.forward
        self._num_norm_dims = num_norm_dims
        self._src = view.in_src[self._arg_name]
        # Replicated weights used on sequence shards: their gradients are partial sums,
        # left Partial as the DTensor path leaves them.
        grad = self._partial_grad if self._src is not None else None
        self._params = [
            (n, view.state(n), grad) for n, p in module._parameters.items() if p is not None
        ]
        if self._src is not None:
            self.kind = "sequence_parallel_norm"

    def _forward(self, x: torch.Tensor) -> Any:
        params = self._local_params()
        if params is None:
            return _FALLBACK
        x, layout, as_dtensor = self._local_input(x, self._src)
        ndim = x.ndim
        if layout is _FALLBACK or (layout is not None and layout >= ndim - self._num_norm_dims):
            return _FALLBACK
        if layout != _norm_dim(self._src, ndim):  # a DTensor in another layout: redistribute
            return _FALLBACK
        store = self.module._parameters
        saved = [(name, store[name]) for name, _, _ in self._params]
        try:
            for (name, _, _), p in zip(self._params, params):
                store[name] = p  # type: ignore[assignment]
            y = self._forward_fn(x.to_local() if as_dtensor else x)
        finally:
            for name, p in saved:
                store[name] = p
        if as_dtensor and torch.compiler.is_compiling():
            return self._compiled_output(x, y)
        local_in = x._local_tensor if as_dtensor else None
        if local_in is not None and not self.use_local_output and y.shape == local_in.shape:
            # Same layout as the input DTensor: keep its global shape, which may be
            # uneven across ranks (an even split cannot be assumed from the local size).
            if y.stride() == local_in.stride() and y.dtype == x.dtype:
                spec = x._spec
            else:
                y = y.contiguous()
                meta = TensorMeta(x.shape, _contiguous_stride(x.shape), y.dtype)
                spec = DTensorSpec(self.mesh, x.placements, meta)
            if _needs_grad(y):
                return _ToDTensor.apply(y, spec)
            return DTensor(y, spec, requires_grad=False)
        return self._output(y, layout)

    def _compiled_output(self, x: DTensor, y: torch.Tensor) -> torch.Tensor:
        """The norm's output under compile: ``x``'s layout and global shape, through from_local."""
        if self.use_local_output:
            return y
        y = y.contiguous()
        return DTensor.from_local(
            y, self.mesh, x.placements, run_check=False, shape=x.shape, stride=_global_stride(x)
        )


def _global_stride(x: DTensor) -> tuple[int, ...]:
    """Contiguous strides of ``x``'s global shape (works on symbolic sizes)."""
    if x.is_contiguous():
        return x.stride()
    return _contiguous_stride(x.shape)


class _LocalMapRegion(FastPath):
    """A ``local_map`` region called with local tensors: run the body directly."""

    kind = "local_map"

    def __init__(self, module: nn.Module, view: _ConfigView) -> None:
        super().__init__(module, view)
        config = view.config
        assert config.local_map is not None
        self._forward_fn = module.forward
        self._signature = inspect.signature(module.forward)
        self._binder = ArgumentBinder(self._signature)
        names = [n for n in self._signature.parameters if n in view.in_dst]
        extra = [n for n in view.in_dst if n not in names]
        if extra:
            raise _Reject(f"local_map inputs {extra} are not named forward arguments")
        grads = config.local_map.in_grad_placements
        if len(grads) != len(names):
            raise _Reject("in_grad_placements does not give one placement per input")
        self._inputs: list[tuple[str, Shard1D, tuple[Placement, ...], bool]] = []
        for name, named in zip(names, grads):
            src, dst = view.in_src[name], view.in_dst[name]
            if src != dst:
                raise _Reject(f"input {name!r} is redistributed on the way in")
            grad = view.resolve(named, f"in_grad_placements for {name!r}")
            grad_on_axis = grad[view.axis]
            if _on_axis(grad_on_axis) == src and not grad_on_axis.is_partial():
                reduce = False
            elif src is None and grad_on_axis.is_partial() and type(grad_on_axis) is Partial:
                reduce = grad_on_axis.reduce_op == "sum"
                if not reduce:
                    raise _Reject(f"input {name!r} has a non-sum Partial gradient")
            else:
                raise _Reject(f"input {name!r}: gradient layout {grad} needs a redistribution")
            self._inputs.append((name, src, grad, reduce))
        self._declared = frozenset(names)
        self._states = view.all_states()
        out = config.out_src_shardings or config.out_dst_shardings
        if out is None:
            raise _Reject("no output placement")
        self._out_field = "out_src_shardings" if config.out_src_shardings else "out_dst_shardings"
        if isinstance(out, tuple):
            if config.out_dst_shardings is not None:
                raise _Reject("tuple outputs are redistributed to out_dst")
            self._out: Shard1D | tuple[Shard1D, ...] = tuple(
                view.on_axis(n, "out_src_shardings") for n in out
            )
        else:
            self._out = view.on_axis(out, "out_src_shardings")
            if view.out_dst is not None and view.out_dst_dim != self._out:
                raise _Reject("the output is redistributed to out_dst")
        # As on the DTensor path: where the region's output is split, each rank's
        # gradient of a replicated state covers only its part, so it is Partial.
        outs = self._out if isinstance(self._out, tuple) else (self._out,)
        split = any(d is not None for d in outs)
        self._state_grads = [
            self._with_axis(Partial()) if split and placements[self.axis].is_replicate() else None
            for _, _, _, placements in self._states
        ]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self._binder.bind(args, kwargs)
        if arguments is None:  # a signature or call that needs Python's full binding rules
            return self.fallback(*args, **kwargs)
        for name, value in arguments.items():
            if name not in self._declared and has_dtensor(value):
                return self.fallback(*args, **kwargs)  # which names the undeclared argument
        locals_: list[torch.Tensor] = []
        for name, src, _, _ in self._inputs:
            x = arguments.get(name)
            if not isinstance(x, torch.Tensor):
                return self.fallback(*args, **kwargs)
            if src is not None and not -x.ndim <= src < x.ndim:
                return self.fallback(*args, **kwargs)
            if isinstance(x, DTensor):
                want = self._placements(_norm_dim(src, x.ndim))
                if x.placements != want or (
                    x.device_mesh is not self.mesh and x.device_mesh != self.mesh
                ):
                    return self.fallback(*args, **kwargs)
            locals_.append(x)
        states = []
        for owner, leaf, is_param, placements in self._states:
            value = (owner._parameters if is_param else owner._buffers)[leaf]
            if not isinstance(value, DTensor) or value.placements != placements:
                return self.fallback(*args, **kwargs)
            states.append(value)
        for (name, _, grad, reduce), x in zip(self._inputs, locals_):
            if isinstance(x, DTensor):
                arguments[name] = x.to_local(grad_placements=normalize_placements(grad, x.ndim))
            elif reduce and _needs_grad(x):
                arguments[name] = _CopyToGroup.apply(x, self.comm)
        saved = []
        try:
            for i, ((owner, leaf, is_param, _), value) in enumerate(zip(self._states, states)):
                store = owner._parameters if is_param else owner._buffers
                saved.append((store, leaf, value))
                store[leaf] = self._param_view(str(i), value, self._state_grads[i])
            out = self._forward_fn(**arguments)
        finally:
            for store, leaf, value in saved:
                store[leaf] = value
        declared = self._out if isinstance(self._out, tuple) else (self._out,)
        single = not isinstance(self._out, tuple)
        # What the DTensor path's region checks (region_output_problem), inline: no call
        # per step when the output fits.
        fits = (
            isinstance(out, torch.Tensor)
            if single
            else (isinstance(out, (tuple, list)) and len(out) == len(declared))
        )
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if fits and not single:
            for v in outs:
                if not isinstance(v, torch.Tensor):
                    fits = False
        if not fits:  # the same error as the DTensor path's
            problem = region_output_problem(out, None if single else len(declared), self._out_field)
            raise ValueError(f"{self.path or '<root>'}: {problem}")
        for v, d in zip(outs, declared):  # a loop, not any(): no generator call per step
            if d is not None and not -v.ndim <= d < v.ndim:
                # The DTensor path names the field (the region runs again there, then raises).
                return self.fallback(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return self._output(out, _norm_dim(self._out, out.ndim))  # type: ignore[arg-type]
        wrapped = [self._output(v, _norm_dim(d, v.ndim)) for v, d in zip(out, self._out)]
        return type(out)(wrapped)


# --------------------------------------------------------------------------- selection


def _on_axis(p: Placement) -> Shard1D:
    return p.dim if isinstance(p, Shard) else None  # type: ignore[return-value]


class _ConfigView:
    """A config resolved against the mesh, reduced to its one sharded axis."""

    def __init__(
        self, module: nn.Module, config: ShardingConfig, axes: tuple[str, ...], mesh: DeviceMesh
    ) -> None:
        self.module, self.config, self.axes, self.mesh = module, config, axes, mesh
        named: list[tuple[str, NamedPlacement]] = [
            *((f"state_shardings[{k!r}]", v) for k, v in config.state_shardings.items()),
            *((f"in_src_shardings[{k!r}]", v) for k, v in (config.in_src_shardings or {}).items()),
            *((f"in_dst_shardings[{k!r}]", v) for k, v in (config.in_dst_shardings or {}).items()),
        ]
        out_src = config.out_src_shardings
        for i, n in enumerate(out_src if isinstance(out_src, tuple) else (out_src,)):
            if n is not None:
                named.append((f"out_src_shardings[{i}]", n))
        if config.out_dst_shardings is not None:
            named.append(("out_dst_shardings", config.out_dst_shardings))
        if config.local_map is not None:
            for i, n in enumerate(config.local_map.in_grad_placements):
                named.append((f"in_grad_placements[{i}]", n))
        sharded_axes = set()
        self._resolved: dict[str, tuple[Placement, ...]] = {}
        for where, n in named:
            placements = self.resolve(n, where)
            self._resolved[where] = placements
            sharded_axes.update(i for i, p in enumerate(placements) if not p.is_replicate())
        if len(sharded_axes) > 1:
            found = sorted(axes[i] for i in sharded_axes)
            raise _Reject(f"placements on more than one mesh axis {found}")
        # Nothing sharded (a replicated norm under plain TP): any axis serves, no
        # collective is issued.
        self.axis = sharded_axes.pop() if sharded_axes else 0
        for where, placements in self._resolved.items():
            p = placements[self.axis]
            if p.is_partial() and not where.startswith("in_grad_placements"):
                raise _Reject(f"{where} is Partial")
            if not (p.is_partial() or type(p) in (Shard, Replicate)):
                raise _Reject(f"{where} is {p!r}")
        src = config.in_src_shardings or {}
        dst = config.in_dst_shardings or {}
        self.in_src: dict[str, Shard1D] = {}
        self.in_dst: dict[str, Shard1D] = {}
        for name in [*dst, *(k for k in src if k not in dst)]:
            s, d = src.get(name), dst.get(name)
            self.in_src[name] = self.on_axis(s if s is not None else d, name)  # type: ignore[arg-type]
            self.in_dst[name] = self.on_axis(d if d is not None else s, name)  # type: ignore[arg-type]
        self.out_dst = config.out_dst_shardings
        self.out_dst_dim: Shard1D = (
            None if self.out_dst is None else self.on_axis(self.out_dst, "out_dst_shardings")
        )

    def resolve(self, named: NamedPlacement, where: str) -> tuple[Placement, ...]:
        try:
            return tuple(resolve_placements(named, self.axes))
        except ValueError as e:  # parallelize reports it; the fast path just steps aside
            raise _Reject(f"{where}: {e}") from None

    def on_axis(self, named: NamedPlacement, where: str) -> Shard1D:
        return _on_axis(self.resolve(named, where)[self.axis])

    def state(self, name: str) -> tuple[Placement, ...]:
        """Full placements of a parameter of the module (a state the config omits is replicated)."""
        named = self.config.state_shardings.get(name)
        if named is None:
            return tuple(Replicate() for _ in self.axes)
        return self.resolve(named, f"state_shardings[{name!r}]")

    def all_states(self) -> list[tuple[nn.Module, str, bool, tuple[Placement, ...]]]:
        """Every state the boundary distributes: named ones, then those it replicates
        without naming (:func:`implicit_state_slots`)."""
        out = []
        for key in self.config.state_shardings:
            owner: nn.Module = self.module
            *path, leaf = key.split(".")
            for part in path:
                owner = getattr(owner, part)
            is_param = leaf in owner._parameters
            out.append((owner, leaf, is_param, self.state(key)))
        replicated = tuple(Replicate() for _ in self.axes)
        for owner, leaf, is_param in implicit_state_slots(self.module, self.config):
            out.append((owner, leaf, is_param, replicated))
        return out

    @property
    def single_input(self) -> str:
        names = list(self.in_dst)
        if len(names) != 1:
            raise _Reject(f"expects one configured input, config names {names}")
        return names[0]


def _class_forward(module: nn.Module) -> Any:
    """The function ``module.forward`` runs, if it is its class's own (not patched per instance)."""
    bound = module.forward
    if getattr(bound, "__self__", None) is not module:
        return None
    return getattr(bound, "__func__", None)


def _select_linear(module: nn.Linear, view: _ConfigView) -> FastPath:
    if view.config.local_map is not None or view.config.out_src_shardings is not None:
        raise _Reject("Linear with local_map or out_src_shardings")
    if list(view.in_dst) != ["input"]:
        raise _Reject(f"Linear inputs configured as {list(view.in_dst)}, expected ['input']")
    if set(view.config.state_shardings) - {"weight", "bias"}:
        raise _Reject("states other than weight/bias")
    weight = _on_axis(view.state("weight")[view.axis])
    bias = None if module.bias is None else _on_axis(view.state("bias")[view.axis])
    src, dst = view.in_src["input"], view.in_dst["input"]
    if weight in (0, -2):
        if module.bias is not None and bias not in (0, -1):
            raise _Reject("column-wise weight with a bias that is not Shard(0)")
        if dst is not None:
            raise _Reject(f"column-wise input must be Replicate, config gives Shard({dst})")
        if src == -1:
            raise _Reject("column-wise input arriving sharded on the feature dim")
        if view.out_dst is not None and view.out_dst_dim is None:
            raise _Reject("column-wise output gathered to Replicate")
        if view.out_dst_dim is not None and view.out_dst_dim < -1:
            raise _Reject(f"column-wise output redistributed to Shard({view.out_dst_dim})")
        if module.out_features % view.mesh.size(view.axis):
            raise _Reject("out_features not divisible by the axis size")
        return _ColwiseLinear(module, view)
    if weight in (1, -1):
        if module.bias is not None and bias is not None:
            raise _Reject("row-wise weight with a sharded bias")
        if dst is None or src != dst:
            raise _Reject("row-wise input must arrive and stay Shard(-1)")
        if view.out_dst is None:
            raise _Reject("row-wise output left Partial (no out_dst_shardings)")
        if view.out_dst_dim == -1:
            raise _Reject("row-wise output scattered on the feature dim")
        if module.in_features % view.mesh.size(view.axis):
            raise _Reject("in_features not divisible by the axis size")
        return _RowwiseLinear(module, view)
    raise _Reject(
        f"Linear weight placement {view.state('weight')} is neither Shard(0) nor Shard(1)"
    )


def _select_embedding(module: nn.Embedding, view: _ConfigView) -> FastPath:
    if view.config.local_map is not None or view.config.out_src_shardings is not None:
        raise _Reject("Embedding with local_map or out_src_shardings")
    if list(view.in_dst) != ["input"] or view.in_src["input"] is not None:
        raise _Reject("Embedding ids must arrive and stay Replicate")
    if view.in_dst["input"] is not None or set(view.config.state_shardings) != {"weight"}:
        raise _Reject("Embedding config other than a Shard(0) weight")
    if _on_axis(view.state("weight")[view.axis]) != 0:
        raise _Reject("Embedding weight is not Shard(0) (vocab-parallel)")
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise _Reject("Embedding with max_norm, scale_grad_by_freq or sparse")
    if view.out_dst is None:
        raise _Reject("Embedding output left Partial (no out_dst_shardings)")
    return _VocabEmbedding(module, view)


_TOKENWISE_NORM_FORWARDS: set[Callable[..., Any]] = {nn.LayerNorm.forward, nn.RMSNorm.forward}


def tokenwise_norm(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Declare a norm's ``forward`` token-wise, as torch's ``nn.RMSNorm.forward`` is.

    For a subclass of ``nn.LayerNorm`` / ``nn.RMSNorm`` whose forward computes the same
    function another way (e.g. saving less for backward): it normalizes each token over
    the trailing ``normalized_shape`` only, so the fast path may run it on sequence shards.
    """
    _TOKENWISE_NORM_FORWARDS.add(forward)
    return forward


def _num_norm_dims(module: nn.Module) -> int | None:
    """Trailing dims a norm normalizes over, if ``module`` is known to be token-wise.

    Known by contract only: torch's ``nn.LayerNorm`` / ``nn.RMSNorm`` forward, which
    normalizes the trailing ``normalized_shape``, or a forward declared the same with
    :func:`tokenwise_norm`. A module that merely looks like a norm (a class name, 1-D
    states) may normalize another dim (channels-first norms normalize dim 1), so it keeps
    the DTensor path.
    """
    if type(module).forward in _TOKENWISE_NORM_FORWARDS:
        return len(module.normalized_shape)  # type: ignore[arg-type]
    return None


def _select_norm(module: nn.Module, view: _ConfigView, num_norm_dims: int) -> FastPath:
    if view.config.local_map is not None or view.config.out_src_shardings is not None:
        raise _Reject("norm with local_map or out_src_shardings")
    if any(True for _ in module.children()) or any(b is not None for b in module._buffers.values()):
        raise _Reject("norm with submodules or buffers")
    name = view.single_input
    if view.in_src[name] != view.in_dst[name]:
        raise _Reject("norm input redistributed on the way in")
    if view.out_dst is not None and view.out_dst_dim != view.in_dst[name]:
        raise _Reject("norm output redistributed on the way out")
    for key in view.config.state_shardings:
        if "." in key or _on_axis(view.state(key)[view.axis]) is not None:
            raise _Reject(f"norm state {key!r} is sharded")
    src = view.in_src[name]
    if src is not None and src < 0 and -src <= num_norm_dims:
        raise _Reject("norm input sharded on a normalized dim")
    return _TokenwiseNorm(module, view, num_norm_dims)


def _select(
    module: nn.Module, config: ShardingConfig, axes: Sequence[str], mesh: DeviceMesh
) -> FastPath:
    if not isinstance(config, ShardingConfig):
        raise _Reject("no ShardingConfig")
    view = _ConfigView(module, config, tuple(axes), mesh)
    if config.local_map is not None:
        return _LocalMapRegion(module, view)
    fn = _class_forward(module)
    if fn is None:
        raise _Reject("forward is patched on the instance")
    if fn is nn.Linear.forward:
        return _select_linear(module, view)  # type: ignore[arg-type]
    if fn is nn.Embedding.forward:
        return _select_embedding(module, view)  # type: ignore[arg-type]
    num_norm_dims = _num_norm_dims(module)
    if num_norm_dims is not None:
        return _select_norm(module, view, num_norm_dims)
    raise _Reject(f"{type(module).__name__} is not a pattern the fast path knows")


def select_fast_path(
    module: nn.Module, config: ShardingConfig, axes: Sequence[str], mesh: DeviceMesh
) -> FastPath | None:
    """The fast path for ``module`` under ``config`` on ``mesh``, or ``None`` to keep DTensor.

    Called at ``parallelize`` time, before anything changes (states are still plain).

    Args:
        module: The module being parallelized (its ``forward`` not yet replaced).
        config: Its sharding config.
        axes: The mesh's axis names.
        mesh: The device mesh.

    Returns:
        A :class:`FastPath` to install as ``forward`` (after ``attach``-ing the DTensor
        boundary as its fallback), or ``None``.

    Example::

        fast = select_fast_path(linear, colwise(), ("tp",), mesh)
        fast.kind  # "colwise"
    """
    try:
        return _select(module, config, axes, mesh)
    except _Reject:
        return None


def explain_fast_path(
    module: nn.Module, config: ShardingConfig, axes: Sequence[str], mesh: DeviceMesh
) -> str:
    """The fast-path pattern ``module`` gets (``"colwise"``, ...) or why it keeps DTensor.

    Returns:
        The pattern's kind, or ``"dtensor: <reason>"``.
    """
    try:
        return _select(module, config, axes, mesh).kind
    except _Reject as e:
        return f"dtensor: {e}"
