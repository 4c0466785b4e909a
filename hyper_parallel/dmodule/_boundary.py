"""The module boundary: states distributed once, activations adapted on every call.

:func:`parallelize_entries` is the one implementation behind both
:meth:`Module.parallelize` and :func:`parallelize_module`: it checks the whole
plan, resolves every placement once, distributes the states, then installs a
:class:`Boundary` as each module's ``forward``. The per-call work is a lookup per
argument, a placement comparison and, where needed, one DTensor call.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor, local_map
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.dmodule import _fast, _regather
from hyper_parallel.dmodule._checks import (
    BOUNDARY_ATTR,
    KWARGS_ONLY,
    Finding,
    ParallelizeError,
    PlanEntry,
    check_entries,
    check_mesh,
    describe,
    errors_of,
    implicit_state_slots,
    region_output_problem,
    state_owner,
)
from hyper_parallel.dmodule._placements import has_dtensor, normalize_placements
from hyper_parallel.dmodule.sharding import ShardingConfig, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement

__all__ = ["Boundary", "installed_forward", "parallelize_entries"]

Placements = tuple[Placement, ...]


class _Layout:
    """Resolved placements with negative shard dims normalized per tensor rank (cached).

    ``where`` (``"path: field"``) and ``axes`` name a ``Shard(d)`` that is out of range
    for a tensor of the call: checked once per tensor rank, then read from the cache.
    """

    __slots__ = ("_by_ndim", "_last", "_last_ndim", "axes", "placements", "where")

    def __init__(
        self, placements: Sequence[Placement], where: str = "", axes: Sequence[str] = ()
    ) -> None:
        self.placements: Placements = tuple(placements)
        self.where = where
        self.axes = tuple(axes)
        self._by_ndim: dict[int, Placements] = {}
        # The last rank asked, answered without a call (the per-call path's common case).
        self._last_ndim = -1
        self._last: Placements = self.placements

    def for_ndim(self, ndim: int) -> Placements:
        if ndim == self._last_ndim:
            return self._last
        cached = self._by_ndim.get(ndim)
        if cached is None:
            for i, p in enumerate(self.placements):
                if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                    self._out_of_range(i, p.dim, ndim)
            cached = normalize_placements(self.placements, ndim)
            if torch.compiler.is_compiling():  # a cache filled while tracing fails a guard
                return cached
            self._by_ndim[ndim] = cached
        self._last_ndim, self._last = ndim, cached
        return cached

    def _out_of_range(self, i: int, dim: int, ndim: int) -> None:
        axis = f" on axis {self.axes[i]!r}" if i < len(self.axes) else ""
        dims = f"dims {-ndim}..{ndim - 1}" if ndim else "no dims"
        raise ValueError(
            f"{self.where or 'a placement'}: Shard({dim}){axis} is out of range for the "
            f"{ndim}-d tensor of this call ({dims}); name a dim the tensor has."
        )

    def __repr__(self) -> str:
        return repr(list(self.placements))


def _layout(named: NamedPlacement | None, axes: tuple[str, ...], where: str = "") -> _Layout | None:
    return None if named is None else _Layout(resolve_placements(named, axes), where, axes)


class _InputSpec:
    __slots__ = ("dst", "name", "src")

    def __init__(self, name: str, src: _Layout | None, dst: _Layout | None) -> None:
        self.name = name
        self.src = src if src is not None else dst  # a plain tensor is wrapped with src, else dst
        self.dst = dst


class Boundary:
    """A parallelized module's forward: adapt inputs → run the body → adapt outputs.

    Built at ``parallelize`` time with every placement resolved; installed as the
    module's ``forward``. ``original_forward`` is the module's own forward.
    """

    def __init__(
        self,
        path: str,
        module: nn.Module,
        mesh: DeviceMesh,
        config: ShardingConfig,
        axes: tuple[str, ...],
    ) -> None:
        self.path = path
        self.mesh = mesh
        self.config = config
        self.original_forward: Callable[..., Any] = module.forward
        self.module = module
        # torch's own Linear acts token-wise on the last dim; only meshes of 3+ dims need
        # its sharded token dim moved first (see _tokens_first), decided here, not per call.
        self._token_wise = (
            mesh.ndim >= 3
            and isinstance(module, nn.Linear)
            and type(module).forward is nn.Linear.forward
        )
        self.signature = inspect.signature(self.original_forward)
        self.states: list[tuple[nn.Module, str, bool, _Layout]] = []
        for key, named in config.state_shardings.items():
            found = state_owner(module, key)
            assert found is not None, "state paths are checked before boundaries are built"
            owner, leaf = found
            self.states.append((owner, leaf, leaf in owner._parameters, _layout(named, axes)))
        # The states the config does not name are replicated (see implicit_state_slots).
        replicated = _Layout([Replicate()] * len(axes))
        self.implicit_states: list[tuple[nn.Module, str, bool, _Layout]] = [
            (owner, name, is_param, replicated)
            for owner, name, is_param in implicit_state_slots(module, config)
        ]

        self._inputs = self._resolve_inputs(config, axes, path or "<root>")
        self._positional: list[_InputSpec | None] = []
        self._var_positional: _InputSpec | None = None
        self._by_keyword: dict[str, _InputSpec] = {}
        for p in self.signature.parameters.values():
            spec = self._inputs.get(p.name)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self._positional.append(spec)
            elif p.kind is p.VAR_POSITIONAL:
                self._var_positional = spec
            if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD) and spec:
                self._by_keyword[p.name] = spec
        # Where each argument binds, for the local_map region (resolved here so a call
        # does not run inspect's binding, which torch.compile cannot trace).
        params = list(self.signature.parameters.values())
        self._positional_names = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self._var_positional_name = next(
            (p.name for p in params if p.kind is p.VAR_POSITIONAL), None
        )
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())
        if has_var_kw:  # names that are not parameters bind into **kwargs
            for name, spec in self._inputs.items():
                if name not in self.signature.parameters:
                    self._by_keyword[name] = spec

        out_src = config.out_src_shardings
        self._out_src: _Layout | tuple[_Layout, ...] | None
        at = path or "<root>"
        if isinstance(out_src, tuple):
            self._out_src = tuple(
                _Layout(resolve_placements(n, axes), f"{at}: out_src_shardings[{i}]", axes)
                for i, n in enumerate(out_src)
            )
        else:
            self._out_src = _layout(out_src, axes, f"{at}: out_src_shardings")
        self._out_dst = _layout(config.out_dst_shardings, axes, f"{at}: out_dst_shardings")
        self._use_local_output = config.use_local_output
        self._adapts_output = bool(
            out_src is not None or self._out_dst is not None or self._use_local_output
        )
        self._local_map_grads: tuple[_Layout, ...] | None = None
        self._all_states = [*self.states, *self.implicit_states]
        if config.local_map is not None:
            self._local_map_grads = tuple(
                _Layout(resolve_placements(n, axes)) for n in config.local_map.in_grad_placements
            )
            # local_map region inputs, in forward-argument order.
            self._local_map_inputs = [n for n in self.signature.parameters if n in self._inputs]
            self._local_map_inputs += [n for n in self._inputs if n not in self._local_map_inputs]
            self._local_map_state_grads = self._state_grad_layouts(axes)
            # Everything about the region that does not depend on the call's tensors.
            self._local_map_slots = [
                (owner, leaf, is_param) for owner, leaf, is_param, _ in self._all_states
            ]
            self._local_map_in_layouts = [
                self._inputs[n].dst or self._inputs[n].src for n in self._local_map_inputs
            ]
            self._local_map_state_layouts = [lay for *_, lay in self._all_states]
            src = self._out_src if self._out_src is not None else self._out_dst
            # local_map reads a tuple as one placement list per output, so a single
            # output's placements go in as a list.
            self._local_map_out_placements: Any = (
                tuple(list(s.placements) for s in src)
                if isinstance(src, tuple)
                else list(src.placements)  # type: ignore[union-attr]  # checked: out_* set
            )
            self._local_map_num_outputs = len(src) if isinstance(src, tuple) else None
            self._local_map_out_field = (
                "out_src_shardings" if config.out_src_shardings is not None else "out_dst_shardings"
            )
        # Inputs gathered at this boundary are kept as shards for backward (_regather);
        # not inside a local_map region, nor where no input is adapted.
        self._keeps_shards = bool(self._inputs) and self._local_map_grads is None
        self.wraps_forward = bool(
            self._inputs
            or out_src is not None
            or self._out_dst is not None
            or self._use_local_output
            or self._local_map_grads is not None
        )

    def _state_grad_layouts(self, axes: tuple[str, ...]) -> list[_Layout]:
        """Gradient placements of the states a local_map region reads, in region order.

        On an axis where the region's output is split (not ``Replicate``), each rank's
        gradient of a replicated state covers only its own part of the output, so the
        gradient is ``Partial``; declaring it ``Replicate`` would keep one rank's piece.
        Sharded states keep their placements.
        """
        src = self._out_src if self._out_src is not None else self._out_dst
        outs = src if isinstance(src, tuple) else () if src is None else (src,)
        split = [any(not o.placements[i].is_replicate() for o in outs) for i in range(len(axes))]
        return [
            _Layout(
                [
                    Partial() if p.is_replicate() and split[i] else p
                    for i, p in enumerate(lay.placements)
                ]
            )
            for *_, lay in self._all_states
        ]

    @staticmethod
    def _resolve_inputs(
        config: ShardingConfig, axes: tuple[str, ...], path: str
    ) -> dict[str, _InputSpec]:
        src = config.in_src_shardings or {}
        dst = config.in_dst_shardings or {}
        return {
            name: _InputSpec(
                name,
                _layout(src.get(name), axes, f"{path}: in_src_shardings[{name!r}]"),
                _layout(dst.get(name), axes, f"{path}: in_dst_shardings[{name!r}]"),
            )
            for name in [*dst, *(k for k in src if k not in dst)]
        }

    # ------------------------------------------------------------------ per call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        gathered: list[_regather.Gathered] | None = [] if self._keeps_shards else None
        args, kwargs = self._adapt_inputs(args, kwargs, gathered)
        if gathered:  # inputs all-gathered on the way in: kept as shards for backward
            with _regather.in_backward(gathered):
                return self._adapt_outputs(self._run(args, kwargs))
        return self._adapt_outputs(self._run(args, kwargs))

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._local_map_grads is not None:
            return self._run_local_map(args, kwargs)
        try:  # no cost per call unless it raises
            if self._token_wise and len(args) == 1 and not kwargs:
                return _tokens_first(self.original_forward, args[0])
            return self.original_forward(*args, **kwargs)
        except RuntimeError as e:
            if _MIXED not in str(e) or torch.compiler.is_compiling():
                raise
            self._raise_mixed(e)

    def _raise_mixed(self, error: RuntimeError) -> NoReturn:
        """torch's "got mixed torch.Tensor and DTensor" inside this module's forward, said
        with the module's path and the submodules that hold plain parameters."""
        plain = [
            f"{path} ({type(m).__name__})"
            for path, m in self.module.named_modules()
            if path
            and getattr(m, BOUNDARY_ATTR, None) is None
            and any(p is not None and not isinstance(p, DTensor) for p in m._parameters.values())
        ]
        where = (
            f"submodule(s) {', '.join(plain)} hold plain parameters that no config places"
            if plain
            else "a plain tensor met them (one made inside forward, or an argument the "
            "config does not name)"
        )
        fix = (
            "give each of them a config of its own, or name their states in this config's "
            "state_shardings (e.g. {'" + plain[0].split(" ")[0] + ".weight': {...}})"
            if plain
            else "name that argument in in_dst_shardings, or make the tensor a DTensor"
        )
        raise ValueError(
            f"{self.path or '<root>'}: this config makes forward run on DTensors, and "
            f"{where} (torch: {str(error).splitlines()[0]}); {fix}."
        ) from error

    def _adapt_inputs(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        gathered: list[_regather.Gathered] | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._inputs:
            if args:
                positional = self._positional
                num_positional = len(positional)
                new_args = list(args)
                for i, x in enumerate(args):
                    spec = positional[i] if i < num_positional else self._var_positional
                    if spec is not None:
                        new_args[i] = self._adapt_input(x, spec, gathered)
                args = tuple(new_args)
            if kwargs:
                kwargs = {
                    k: self._adapt_input(v, spec, gathered)
                    if (spec := self._by_keyword.get(k))
                    else v
                    for k, v in kwargs.items()
                }
        return args, kwargs

    def _adapt_input(
        self, x: Any, spec: _InputSpec, gathered: list[_regather.Gathered] | None = None
    ) -> Any:
        """``x`` in its declared layout; an all-gather among the redistributions is
        recorded in ``gathered`` (see :mod:`._regather`)."""
        if isinstance(x, DTensor):
            if spec.dst is not None:
                dst = spec.dst.for_ndim(x.ndim)
                if x.placements != dst:
                    shard, x = x, _redistribute(x, dst)
                    if gathered is not None and _regather.kept(shard.placements, dst):
                        gathered.append((shard, x._local_tensor, _regather.redistribute_to(dst)))
            return x
        if isinstance(x, torch.Tensor):
            src = spec.src.for_ndim(x.ndim)  # type: ignore[union-attr]  # src falls back to dst
            x = DTensor.from_local(x, self.mesh, src, run_check=False)
            if spec.dst is not None:
                dst = spec.dst.for_ndim(x.ndim)
                if dst != src:
                    shard, x = x, x.redistribute(self.mesh, dst)
                    if gathered is not None and _regather.kept(src, dst):
                        gathered.append((shard, x._local_tensor, _regather.redistribute_to(dst)))
        return x

    def _adapt_outputs(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            src = self._out_src
            if isinstance(src, tuple):
                self._raise(
                    f"out_src_shardings has {len(src)} entries but forward returned one tensor; "
                    "use a single NamedPlacement for a single output."
                )
            return self._adapt_output(out, src)
        if isinstance(out, (tuple, list)):
            src = self._out_src
            if isinstance(src, tuple) and len(src) != len(out):
                self._raise(
                    f"out_src_shardings has {len(src)} entries but forward returned "
                    f"{len(out)} values ({', '.join(describe(v) for v in out)}); give one "
                    "NamedPlacement per output."
                )
            adapted = [
                self._adapt_output(v, src[i] if isinstance(src, tuple) else src)
                if isinstance(v, torch.Tensor)
                else v
                for i, v in enumerate(out)
            ]
            return type(out)(adapted) if type(out) in (tuple, list) else type(out)(*adapted)
        if self._adapts_output:
            # An output config that cannot be applied must not be dropped silently.
            self._raise(
                f"forward returned {describe(out)}, but out_src_shardings, out_dst_shardings "
                "and use_local_output apply only to a tensor or a tuple/list of tensors; "
                "configure the submodule that produces the tensor, or drop the out_* fields "
                "and use_local_output from this config."
            )
        return out

    def _adapt_output(self, x: torch.Tensor, src: _Layout | None) -> torch.Tensor:
        if not isinstance(x, DTensor):
            # Like inputs: a plain tensor is laid out as out_src, else as out_dst.
            layout = src if src is not None else self._out_dst
            if layout is None:
                return x
            x = DTensor.from_local(x, self.mesh, layout.for_ndim(x.ndim), run_check=False)
        if self._out_dst is not None:
            dst = self._out_dst.for_ndim(x.ndim)
            if x.placements != dst:
                x = x.redistribute(x.device_mesh, dst)
            if x.requires_grad and torch.is_grad_enabled():
                x = _gradient_as_output(x)
        if self._use_local_output:
            if self._out_dst is None and any(p.is_partial() for p in x.placements):
                self._partial_local_output(x)
            return x.to_local()
        return x

    def _partial_local_output(self, x: DTensor) -> None:
        """Refuse handing a ``Partial`` output on as local tensors no out_dst asked for:
        each rank would get its own unreduced sum (torch's RowwiseParallel reduces first)."""
        axes = self.mesh.mesh_dim_names or ()
        partial = [f"{a!r}" for a, p in zip(axes, x.placements) if p.is_partial()]
        self._raise(
            f"forward's output is Partial over {', '.join(partial)} (each rank holds an "
            "unreduced sum) and use_local_output would hand each rank its own part; give "
            f"out_dst_shardings={{{partial[0]}: Replicate()}} (all-reduce, as torch's "
            "RowwiseParallel does) or Shard(d) (reduce-scatter), or Partial() to hand the "
            "partial sums on on purpose."
        )

    def _run_local_map(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Each argument's name and place: (True, index in args) or (False, keyword).
        where: dict[str, tuple[bool, Any]] = {}
        num_named = len(self._positional_names)
        for i, value in enumerate(args):
            name = self._positional_names[i] if i < num_named else self._var_positional_name
            if name is None:
                self._raise(
                    f"forward takes {num_named} positional argument(s) but {len(args)} were "
                    "given; pass the extra ones by keyword or drop them."
                )
            if i < num_named:
                where[name] = (True, i)
            self._check_region_argument(name, value)
        for key, value in kwargs.items():
            where[key] = (False, key)
            self._check_region_argument(key, value)
        inputs = []
        locations = []
        for name in self._local_map_inputs:
            loc = where.get(name)
            value = None if loc is None else args[loc[1]] if loc[0] else kwargs[loc[1]]
            if not isinstance(value, DTensor):
                self._raise(
                    f"local_map input {name!r} is {describe(value)}; every input named in "
                    "in_dst/in_src_shardings must be a tensor when the region runs."
                )
            inputs.append(value)
            locations.append(loc)
        slots = self._local_map_slots
        # States are read on every call: FSDP and checkpoint loading swap them.
        values = [
            owner._parameters[leaf] if is_param else owner._buffers[leaf]
            for owner, leaf, is_param in slots
        ]
        in_placements = tuple(
            lay.for_ndim(x.ndim)  # type: ignore[union-attr]
            for lay, x in zip(self._local_map_in_layouts, inputs)
        ) + tuple(lay.for_ndim(v.ndim) for lay, v in zip(self._local_map_state_layouts, values))
        grads = self._local_map_grads or ()
        in_grads = tuple(g.for_ndim(x.ndim) for g, x in zip(grads, inputs)) + tuple(
            g.for_ndim(v.ndim) for g, v in zip(self._local_map_state_grads, values)
        )
        names = self._local_map_inputs

        def region(*local: torch.Tensor) -> Any:
            call_args, call_kwargs = list(args), dict(kwargs)
            for (positional, key), value in zip(locations, local):
                if positional:
                    call_args[key] = value
                else:
                    call_kwargs[key] = value
            saved = []
            for (owner, leaf, is_param), value in zip(slots, local[len(names) :]):
                store = owner._parameters if is_param else owner._buffers
                saved.append((store, leaf, store[leaf]))
                store[leaf] = value
            try:
                out = self.original_forward(*call_args, **call_kwargs)
            finally:
                for store, leaf, value in saved:
                    store[leaf] = value
            num = self._local_map_num_outputs
            if not _fits(out, num):
                problem = region_output_problem(out, num, self._local_map_out_field)
                assert problem is not None, "region_output_problem agrees with _fits"
                self._raise(problem)
            return out

        fn = local_map(
            region,
            out_placements=self._local_map_out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grads,
            device_mesh=self.mesh,
        )
        return fn(*inputs, *values)

    def _check_region_argument(self, name: str | None, value: Any) -> None:
        if name not in self._inputs and has_dtensor(value):
            # The region runs on local tensors; a DTensor would meet them there.
            self._raise(
                f"local_map argument {name!r} is a DTensor but has no in_dst/in_src "
                f"entry, so it cannot be made local; add in_dst_shardings[{name!r}] "
                "(and its in_grad_placements entry), or pass a plain tensor."
            )

    def _raise(self, message: str) -> None:
        raise ValueError(f"{self.path or '<root>'}: {message}")

    # ------------------------------------------------------------------ installation

    def select_path(self, module: nn.Module, fast_enabled: bool) -> _fast.FastPath | None:
        """The fast path to install for ``module`` (``None``: this DTensor boundary).

        Selection reads only the module, its config and the mesh, so it runs before
        anything changes and an error in it leaves the model as it was.
        """
        if not (self.wraps_forward and fast_enabled):
            return None
        axes = tuple(self.mesh.mesh_dim_names or ())
        return _fast.select_fast_path(module, self.config, axes, self.mesh)

    def install(self, module: nn.Module, fast: _fast.FastPath | None = None) -> None:
        setattr(module, BOUNDARY_ATTR, self)
        if self.config.dispatch is not None:
            # A registered token dispatch (checked to exist) takes over forward.
            from hyper_parallel.dmodule.dispatch import get_dispatch

            found = get_dispatch(self.config.dispatch.kind)
            assert found is not None, "dispatch kinds are checked before boundaries are built"
            module.forward = found.build(  # type: ignore[method-assign]
                self.path, module, self.mesh, self.config, self.original_forward
            )
            return
        if self.wraps_forward:
            # Where the config fixes the one collective, run on local shards instead
            # (dmodule/_fast.py); this boundary stays as the fallback for other calls.
            module.__dict__[FORWARD_ATTR] = self if fast is None else fast.attach(self)
            module.forward = types.MethodType(_parallel_forward, module)  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"Boundary(path={self.path!r}, config={self.config!r})"


def _fits(out: Any, num_outputs: int | None) -> bool:
    """Whether a local_map region's output is a tensor (``num_outputs`` ``None``) or a
    tuple/list of ``num_outputs`` tensors; inlined where the fast path calls it per step."""
    if num_outputs is None:
        return isinstance(out, torch.Tensor)
    if not isinstance(out, (tuple, list)) or len(out) != num_outputs:
        return False
    return all(isinstance(v, torch.Tensor) for v in out)


FORWARD_ATTR = "_hp_forward"
_MIXED = "got mixed torch.Tensor and DTensor"  # torch's error for a plain tensor among DTensors


def _tokens_first(linear: Callable[[Any], Any], x: Any) -> Any:
    """``linear(x)`` with ``x``'s one sharded token dim moved to the front for the call.

    A linear layer folds every leading dim of its input into one row dim. When ``x``
    is sharded on a token dim other than the first (the sequence under context
    parallelism) and the dims before it hold more than one row, that fold makes the
    row dim a ``_StridedShard``; DTensor then plans every candidate strategy of the
    ``mm`` (and of its backward) with a graph search over redistribution states,
    which grows with the mesh's dims: minutes per op on a 3-D mesh (seconds on a 2-D
    one, left as it is). With the sharded dim first the fold gives a plain ``Shard(0)``. The layer is token-wise, so the
    result is the same; it is made contiguous again in the caller's dim order.
    """
    if not isinstance(x, DTensor) or x.ndim < 3 or x.device_mesh.ndim < 3:
        return linear(x)  # on 1-D and 2-D meshes DTensor plans the fold in seconds
    if any(isinstance(p, Shard) and type(p) is not Shard for p in x.placements):
        return linear(x)
    dims = {p.dim for p in x.placements if isinstance(p, Shard)} - {x.ndim - 1}
    if len(dims) != 1:
        return linear(x)
    dim = dims.pop()
    if dim == 0 or x.shape[:dim].numel() == 1:
        return linear(x)
    y = linear(x.movedim(dim, 0))
    # The gradient arrives in the caller's layout (e.g. sequence-parallel: the tokens
    # split on a second axis), which the backward's fold would stride again; it is
    # brought to the layout the layer produced (Partial read as Replicate) first.
    grad_placements = tuple(Replicate() if p.is_partial() else p for p in y.placements)
    return _GradPlacements.apply(y, grad_placements).movedim(0, dim).contiguous()


class _GradPlacements(torch.autograd.Function):
    """Identity forward; the backward redistributes the gradient to given placements."""

    @staticmethod
    def forward(ctx: Any, y: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.placements = placements
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(grad.device_mesh, ctx.placements)
        return grad, None


def _parallel_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A parallelized module's ``forward``: its fast path, else its DTensor boundary.

    Installed as a bound method of one shared function (not the callable object
    itself), so ``torch.compile`` sees the same code in every block and compiles one
    graph for all of them rather than one per block.
    """
    forward = module.__dict__[FORWARD_ATTR]
    # Only these: other exceptions pass untouched (activation checkpointing stops its
    # recomputation by raising one of its own through the module's forward).
    try:  # free unless it raises (no call added per forward: the op-count budgets)
        return forward(*args, **kwargs)
    except _REBUILT as e:
        error = e
    if type(error) in _REBUILT and isinstance(forward, _fast.FastPath):
        # A call the fast path fails steps aside to the DTensor boundary: the result, or
        # the error, is the one the DTensor path gives (the same errors on both paths).
        # Not for a subclass (out of memory, a collective's failure): that is no mistake.
        try:
            return forward.fallback(*args, **kwargs)
        except _REBUILT as e:
            error = e
    located = _located(module, forward, args, kwargs, error)
    if located is None:
        raise error
    raise located from error


# The exception types a call's error is rebuilt in (same type, the module named first);
# any other (a subclass such as torch's DistBackendError included) gets a note instead.
_REBUILT = (RuntimeError, ValueError, TypeError, IndexError)


def _located(
    module: nn.Module, forward: Any, args: Any, kwargs: Any, error: Exception
) -> Exception | None:
    """``error`` of a parallelized module's call, naming the module, its placements and the
    inputs it got (torch's own message says none of them: "mat1 and mat2 shapes cannot be
    multiplied" from deep in a model). The same type, the original message kept in full
    and chained as the cause; ``None`` (re-raise as is) when an inner module named itself.
    The fast path and the DTensor boundary name the same module, placements and inputs."""
    if getattr(error, "_hp_located", False):
        return None
    boundary = forward if isinstance(forward, Boundary) else getattr(forward, "fallback", None)
    path = getattr(boundary, "path", None)
    config = getattr(boundary, "config", None)
    if path is None or config is None or str(error).startswith(f"{path or '<root>'}: "):
        return None  # not ours, or the boundary's own error, which names the module first
    layouts = [f"{key} {_placements_text(named)}" for key, named in config.state_shardings.items()]
    for field in ("in_src_shardings", "in_dst_shardings"):
        for name, named in (getattr(config, field) or {}).items():
            layouts.append(f"{field}[{name!r}] {_placements_text(named)}")
    inputs = ", ".join(_value_text(a) for a in (*args, *kwargs.values()))
    message = (
        f"the call of parallelized module {path or '<root>'!r} ({type(module).__name__}"
        f"{'; ' + '; '.join(layouts) if layouts else ''}) on inputs [{inputs}] failed: "
        f"{type(error).__name__}: {error}\n"
        "If the plan is at fault, hyper_parallel.analysis.validate(model, mesh, plan) (or "
        "`hyper-parallel validate`) traces every module's boundaries and names the mismatch."
    )
    if type(error) in _REBUILT:
        located: Exception = type(error)(message)
    else:
        error.add_note(message)
        located = error
    located._hp_located = True  # type: ignore[attr-defined]
    return located


def _placements_text(named: Any) -> str:
    if isinstance(named, dict):
        return ", ".join(f"{p} on {axis}" for axis, p in named.items()) or "replicated"
    return str(named)


def _value_text(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"DTensor{tuple(value.shape)} {tuple(value.placements)}"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return type(value).__name__


def installed_forward(module: nn.Module) -> Boundary | _fast.FastPath | None:
    """What runs a parallelized module's calls: its :class:`FastPath` or :class:`Boundary`."""
    return module.__dict__.get(FORWARD_ATTR)


def _gradient_as_output(x: DTensor) -> DTensor:
    """``x`` unchanged, but the gradient reaching it is first brought to ``x``'s placements.

    An output placed by ``out_dst_shardings`` receives, in backward, the sum of its
    consumers' gradients as DTensor computed them — often ``Partial`` (every
    column-parallel consumer of a replicated activation gives one). Left alone, that
    ``Partial`` flows into this module's backward, where DTensor resolves it with extra
    gathers of activation gradients (or, for a vocab-parallel embedding's masked
    partial, cannot resolve it at all). ``from_local``'s backward reduces it here, once
    per output however many consumers read it: Megatron-LM's one all-reduce per block.
    """
    if any(p.is_partial() for p in x.placements):
        return x
    return DTensor.from_local(
        x.to_local(),
        x.device_mesh,
        x.placements,
        run_check=False,
        shape=x.shape,
        stride=x.stride(),
    )


def _redistribute(x: DTensor, dst: Placements) -> DTensor:
    """``x.redistribute`` to ``dst``, with a backward that accepts any gradient layout.

    Reducing a masked partial (the output of a vocab-parallel embedding) records a
    backward that must turn the incoming gradient back into that mask, which torch
    cannot do from a ``Partial`` gradient (as a column-parallel consumer produces).
    :func:`_gradient_as_output` makes the backward first bring the gradient to
    ``dst``, so the masked backward only ever sees a replicated gradient.
    """
    out = x.redistribute(x.device_mesh, dst)
    if any(p.is_partial() and type(p) is not Partial for p in x.placements):
        out = _gradient_as_output(out)
    return out


def _distribute_states(root: nn.Module, boundaries: Sequence[Boundary], mesh: DeviceMesh) -> None:
    """Replace each configured state by a DTensor; tied states stay tied.

    Named states go first, so a tied state named by one config and implicitly
    replicated by another keeps the named placement.
    """
    converted: dict[int, torch.Tensor] = {}
    keep_alive: list[torch.Tensor] = []  # old tensors stay alive so their ids stay unique
    slots = [s for b in boundaries for s in b.states]
    slots += [s for b in boundaries for s in b.implicit_states]
    for owner, leaf, is_param, layout in slots:
        old = owner._parameters[leaf] if is_param else owner._buffers[leaf]
        assert old is not None
        new = converted.get(id(old))
        if new is None:
            if isinstance(old, DTensor):
                new = old
            else:
                dt = distribute_tensor(old.detach(), mesh, layout.placements)
                new = nn.Parameter(dt, requires_grad=old.requires_grad) if is_param else dt
            converted[id(old)] = new
            keep_alive.append(old)
        if is_param:
            owner._parameters[leaf] = new  # type: ignore[assignment]
        else:
            owner._buffers[leaf] = new
    for m in root.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None and id(t) in converted and converted[id(t)] is not t:
                    store[name] = converted[id(t)]  # type: ignore[assignment]


def mesh_axes_of(mesh: DeviceMesh) -> tuple[str, ...] | None:
    names = mesh.mesh_dim_names
    return None if names is None else tuple(names)


def parallelize_entries(
    root: nn.Module,
    mesh: DeviceMesh,
    entries: Sequence[PlanEntry],
    extra_findings: Sequence[Finding] = (),
) -> list[Boundary]:
    """Check all entries, then distribute states and install boundaries.

    Raises:
        ParallelizeError: Listing every problem; the model is left unchanged.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"parallelize: expected a DeviceMesh, got {type(mesh).__name__}; create one with "
            "init_device_mesh('cpu', (2,), mesh_dim_names=('tp',))."
        )
    axes = mesh_axes_of(mesh)
    sizes = dict(zip(axes, mesh.shape)) if axes is not None else None
    mesh_findings = check_mesh(
        axes or (),
        mesh_size=mesh.size(),
        rank_in_mesh=mesh.get_coordinate() is not None,
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else None,
    )
    findings = [*extra_findings, *mesh_findings, *check_entries(entries, axes, sizes, root)]
    errors = errors_of(findings)
    if errors:
        raise ParallelizeError(errors)
    for f in findings:
        if f.severity == "warning" and KWARGS_ONLY in f.message:
            warnings.warn(f"parallelize: {f}", UserWarning, stacklevel=3)
    assert axes is not None
    # Everything that can fail — boundaries, the path switch, path selection — runs
    # before the first state is distributed: on error the model is left as it was.
    boundaries = [Boundary(e.path, e.module, mesh, e.config, axes) for e in entries]
    fast_enabled = _fast.fast_path_enabled()
    paths = [b.select_path(e.module, fast_enabled) for e, b in zip(entries, boundaries)]
    _distribute_states(root, boundaries, mesh)
    for e, b, fast in zip(entries, boundaries, paths):
        b.install(e.module, fast)
    return boundaries
