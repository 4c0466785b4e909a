"""Whole-plan checks: everything that can be known about a plan before it is applied.

One pass over every (module path, module, config) entry collects :class:`Finding`s;
:func:`~hyper_parallel.dmodule._boundary.parallelize_entries` refuses to change
anything while an error remains, and the validator reports the same findings.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Shard
from hyper_parallel.dmodule._placements import normalize_placements
from hyper_parallel.dmodule.findings import Finding, ParallelizeError, PlanEntry, named_placements
from hyper_parallel.dmodule.sharding import ShardingConfig, placement_to_str, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement

__all__ = [
    "Finding",
    "ParallelizeError",
    "PlanEntry",
    "check_entries",
    "check_mesh",
    "implicit_state_slots",
    "region_output_problem",
]

# Attribute set on a module once its boundary is installed.
BOUNDARY_ATTR = "_hp_boundary"


def state_owner(module: nn.Module, state_path: str) -> tuple[nn.Module, str] | None:
    """The submodule that holds ``state_path`` and the state's own name, or ``None``."""
    prefix, _, leaf = state_path.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    if leaf in owner._parameters or leaf in owner._buffers:
        return owner, leaf
    return None


def implicit_state_slots(
    module: nn.Module, config: ShardingConfig
) -> list[tuple[nn.Module, str, bool]]:
    """``(owner, name, is_param)`` of the states a config replicates without naming them.

    A boundary replicates its module's own unnamed parameters and buffers, so its
    forward never mixes plain tensors with DTensors. A ``local_map`` region also runs
    its submodules (they cannot have configs of their own there) on the region's local
    tensors: their unnamed states are replicated too, so that their gradients, like
    the module's own, are summed over the ranks that split the region's output (left
    plain, each rank would keep the gradient of its own part only).
    """
    named = set()
    for key in config.state_shardings:
        found = state_owner(module, key)
        if found is not None:
            named.add((id(found[0]), found[1]))
    owners = module.modules() if config.local_map is not None else (module,)
    return [
        (owner, name, is_param)
        for owner in owners
        for is_param, store in ((True, owner._parameters), (False, owner._buffers))
        for name, t in store.items()
        if t is not None and (id(owner), name) not in named
    ]


def get_state(module: nn.Module, state_path: str) -> torch.Tensor | None:
    found = state_owner(module, state_path)
    if found is None:
        return None
    owner, leaf = found
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _state_names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]


def forward_signature(module: nn.Module) -> inspect.Signature:
    """Signature of the module's ``forward`` (the original one if a boundary is installed)."""
    boundary = getattr(module, BOUNDARY_ATTR, None)
    forward = boundary.original_forward if boundary is not None else module.forward
    return inspect.signature(forward)


_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD
KWARGS_ONLY = "through **kwargs"
"""Marks the warning for an input key that ``forward`` takes only through ``**kwargs``:
``parallelize`` says it (warnings.warn), since a misspelled key there configures nothing."""


class _Collector:
    def __init__(self, path: str) -> None:
        self.path = path
        self.findings: list[Finding] = []

    def error(self, field: str, message: str, fix: str) -> None:
        self.findings.append(Finding("error", self.path, field, message, fix))

    def warning(self, field: str, message: str, fix: str) -> None:
        self.findings.append(Finding("warning", self.path, field, message, fix))


_named_fields = named_placements


def _check_axes(
    c: _Collector,
    config: ShardingConfig,
    axes: tuple[str, ...],
    axis_sizes: Mapping[str, int] | None = None,
) -> None:
    idle: dict[str, list[str]] = {}
    for field, named in _named_fields(config):
        try:
            resolve_placements(named, axes)
        except ValueError as e:
            c.error(field, str(e), f"name only the mesh's axes {list(axes)} (case-sensitive).")
            continue
        except TypeError as e:  # a value that is no Placement (a dict changed after checks)
            c.error(field, str(e), "give each axis a Shard(d), Replicate() or Partial().")
            continue
        for axis, p in named.items():
            if axis_sizes is not None and axis_sizes.get(str(axis)) == 1 and not p.is_replicate():
                idle.setdefault(str(axis), []).append(field)
    for axis, fields in idle.items():
        c.warning(
            ", ".join(fields),
            f"axis {axis!r} has size 1, so these placements on it do nothing (every rank "
            "holds whole tensors on it).",
            f"drop {axis!r} from these placements, or give the axis more than one rank.",
        )


def _shard_divisor(named: NamedPlacement, dim: int, ndim: int, sizes: Mapping[str, int]) -> int:
    divisor = 1
    for axis, p in named.items():
        if isinstance(p, Shard) and p.dim % ndim == dim % ndim:
            divisor *= sizes.get(str(axis), 1)
    return divisor


def _check_states(
    c: _Collector,
    module: nn.Module,
    config: ShardingConfig,
    axis_sizes: Mapping[str, int] | None,
) -> None:
    for key, named in config.state_shardings.items():
        field = f"state_shardings[{key!r}]"
        tensor = get_state(module, key)
        if tensor is None:
            names = _state_names(module)
            has = ", ".join(names) or "none"
            if state_owner(module, key) is not None:  # registered, but set to None
                c.error(
                    field,
                    f"names {key!r}, which is None in {type(module).__name__} (has: {has}).",
                    f"drop {key!r} from state_shardings (presets: colwise(bias=False)), or "
                    "build the module with it.",
                )
                continue
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            c.error(
                field,
                f"names {key!r}, which is not a parameter or buffer of "
                f"{type(module).__name__} (has: {has}).",
                f"{hint}use one of the listed names (dotted paths reach into submodules).",
            )
            continue
        ndim = tensor.dim()
        for axis, p in named.items():
            if isinstance(p, Partial):
                c.error(
                    field,
                    f"axis {str(axis)!r} is {p}, but a parameter or buffer cannot be Partial.",
                    "use Shard(dim) or Replicate() for states.",
                )
            elif isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                c.error(
                    field,
                    f"axis {str(axis)!r} is {p}, out of range for {key!r} with {ndim} dim(s) "
                    f"(shape {tuple(tensor.shape)}).",
                    f"use a dim in [{-ndim}, {ndim - 1}].",
                )
            elif isinstance(p, Shard) and axis_sizes is not None:
                divisor = _shard_divisor(named, p.dim, ndim, axis_sizes)
                size = tensor.shape[p.dim]
                if divisor > 1 and size == 1:
                    c.error(
                        field,
                        f"axis {str(axis)!r} shards dim {p.dim} of {key!r}, which has size 1 "
                        f"(shape {tuple(tensor.shape)}): one rank would hold it and the other "
                        f"{divisor - 1} an empty shard.",
                        f"make {key!r} Replicate() on {str(axis)!r}, or shard a dim larger than 1.",
                    )
                elif divisor > 1 and size % divisor:
                    if isinstance(module, nn.Embedding) and key == "weight" and p.dim % 2 == 0:
                        _vocab_warning(c, field, str(axis), size, divisor)
                    else:
                        c.warning(
                            field,
                            f"dim {p.dim} of {key!r} has size {size}, not divisible by "
                            f"{divisor} (axis {str(axis)!r}); shards will be uneven.",
                            "choose sizes divisible by the axis size, or accept uneven shards.",
                        )


def _vocab_warning(c: _Collector, field: str, axis: str, vocab: int, divisor: int) -> None:
    rows = -(-vocab // divisor)  # DTensor's chunks: ceil(V / n) rows, the last ranks fewer
    padded = rows * divisor
    c.warning(
        field,
        f"the vocabulary of {vocab} rows does not divide by {divisor} (axis {axis!r}): "
        f"ranks hold {rows} rows, the last {vocab - rows * (divisor - 1)} (uneven shards, "
        "and a vocab-parallel loss over them).",
        f"pad the vocabulary to {padded} rows (+{padded - vocab}), a multiple of {divisor}, "
        "and never predict the padding ids.",
    )


def _head_dim_of(root: nn.Module | None, path: str) -> tuple[str, int] | None:
    """The nearest ancestor of ``path`` that declares an integer ``head_dim`` (attention)."""
    if root is None or not path:
        return None
    parts = path.split(".")
    for end in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:end])
        try:
            owner = root.get_submodule(prefix) if prefix else root
        except AttributeError:
            return None
        head_dim = getattr(owner, "head_dim", None)
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
            return prefix, head_dim
    return None


def _check_heads(
    c: _Collector,
    root: nn.Module | None,
    module: nn.Module,
    config: ShardingConfig,
    axis_sizes: Mapping[str, int] | None,
) -> None:
    """A projection inside an attention module must be split into whole heads.

    Attention views q/k/v as ``(..., heads, head_dim)``: a rank holding part of a head
    (more ranks than key/value heads, or a count that does not divide) computes the
    wrong attention or fails deep in the forward.
    """
    if not isinstance(module, nn.Linear) or axis_sizes is None:
        return
    found = _head_dim_of(root, c.path)
    named = config.state_shardings.get("weight")
    if found is None or named is None:
        return
    owner, head_dim = found
    for dim, features in ((0, module.out_features), (1, module.in_features)):
        divisor = _shard_divisor(named, dim, 2, axis_sizes)
        if divisor == 1 or features % head_dim:
            continue
        num_heads = features // head_dim
        if num_heads % divisor == 0:
            continue
        axes = [str(a) for a, p in named.items() if isinstance(p, Shard) and p.dim % 2 == dim]
        what = "is larger than" if divisor > num_heads else "does not divide"
        sizes = ", ".join(str(n) for n in range(num_heads, 0, -1) if num_heads % n == 0)
        c.error(
            "state_shardings['weight']",
            f"{num_heads} heads ({features} features / head_dim {head_dim} of "
            f"{owner or '<root>'}) are split over axis {'x'.join(axes)!r} of size {divisor}, "
            f"which {what} the head count: a rank would hold part of a head.",
            f"use a {'x'.join(axes)!r} size that divides {num_heads} ({sizes}), or a model "
            "with more heads.",
        )


def check_mesh(
    axes: Sequence[str],
    *,
    world_size: int | None = None,
    mesh_size: int | None = None,
    rank_in_mesh: bool = True,
    rank: int | None = None,
) -> list[Finding]:
    """Mesh-level problems: an axis named twice, a size that is not the job's, this rank outside.

    Args:
        axes: The mesh's axis names in order.
        world_size: Ranks in the job, when the mesh must cover all of them.
        mesh_size: Ranks in the mesh (the product of the axis sizes).
        rank_in_mesh: Whether this process is one of the mesh's ranks.
        rank: This process's rank, for the message.
    """
    findings = []
    repeated = sorted({a for a in axes if list(axes).count(a) > 1})
    if repeated:
        findings.append(
            Finding(
                "error",
                "",
                "mesh",
                f"axis {repeated[0]!r} appears more than once in the mesh's axis names "
                f"{tuple(axes)}, so a placement on it is ambiguous.",
                "name each mesh axis once (e.g. ('dp', 'tp')).",
            )
        )
    if world_size is not None and mesh_size is not None and mesh_size != world_size:
        effect = (
            "ranks would sit idle" if mesh_size < world_size else "it needs ranks that do not exist"
        )
        findings.append(
            Finding(
                "error",
                "",
                "mesh",
                f"the mesh has {mesh_size} ranks but the job has {world_size} (world size): "
                f"{effect}.",
                f"choose axis sizes whose product is {world_size}.",
            )
        )
    if not rank_in_mesh:
        findings.append(
            Finding(
                "error",
                "",
                "mesh",
                f"this process (rank {rank}) is not one of the mesh's {mesh_size} ranks, so it "
                "would hold no shards and take part in no collective.",
                "build the mesh over every rank that calls parallelize (init_device_mesh uses "
                "the whole world), or call parallelize only on the mesh's ranks.",
            )
        )
    return findings


def _check_inputs(c: _Collector, module: nn.Module, config: ShardingConfig) -> None:
    try:
        sig = forward_signature(module)
    except (TypeError, ValueError):
        sig = None
    names = list(sig.parameters) if sig is not None else []
    has_var_kw = sig is not None and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
    )
    for field_name in ("in_src_shardings", "in_dst_shardings"):
        for key in getattr(config, field_name) or {}:
            if sig is not None and key not in names and not has_var_kw:
                c.error(
                    f"{field_name}[{key!r}]",
                    f"names {key!r}, which is not an argument of "
                    f"{type(module).__name__}.forward{sig}.",
                    f"key inputs by forward argument name: one of {names}.",
                )
            elif sig is not None and key not in names:
                named = [n for n in names if sig.parameters[n].kind is not _VAR_KEYWORD]
                c.warning(
                    f"{field_name}[{key!r}]",
                    f"names {key!r}, which is no named argument of "
                    f"{type(module).__name__}.forward (named: {named}); it arrives only "
                    f"{KWARGS_ONLY}, so the config applies only to calls that pass {key}=... "
                    "(a misspelled name applies to none).",
                    f"key inputs by forward argument name: one of {named}, unless callers pass "
                    f"{key}= by keyword.",
                )


def _check_local_map_input_grads(
    c: _Collector,
    config: ShardingConfig,
    inputs: Sequence[str],
    axes: tuple[str, ...],
    axis_sizes: Mapping[str, int] | None,
) -> None:
    """Each input's declared gradient placement must fit how the input enters the region.

    - Each rank's gradient of an input has the shape of its own piece of the input, so
      a sharded input's gradient is sharded the same way and a replicated input's is
      not sharded (any other declaration fails in backward, inside torch:
      "returned an invalid gradient", "narrow unexpectedly changed concrete size").
    - Where the output is split over an axis (sharded, or partial sums), each rank's
      region computes its own part from the whole of a replicated input, so its
      gradient of that input covers only that part: the sum over the ranks is the
      gradient (torch's ColwiseParallel input). Declared ``Replicate``, local_map keeps
      each rank's piece as the whole: every gradient upstream of the region is wrong,
      silently. The region's unnamed states follow this rule on their own (``Boundary``).

    Axes of size 1 are skipped: every piece there is the whole.
    """
    lm = config.local_map
    assert lm is not None
    out = config.out_src_shardings
    out = config.out_dst_shardings if out is None else out
    outs = out if isinstance(out, tuple) else () if out is None else (out,)
    src, dst = config.in_src_shardings or {}, config.in_dst_shardings or {}
    try:
        out_placements = [resolve_placements(o, axes) for o in outs]
        resolved = [
            (
                resolve_placements(
                    (dst.get(name) if dst.get(name) is not None else src.get(name)) or {}, axes
                ),
                resolve_placements(grad, axes),
            )
            for name, grad in zip(inputs, lm.in_grad_placements)
        ]
    except (ValueError, TypeError):  # an axis not on the mesh: reported by _check_axes
        return
    for i, (name, (placed, grads)) in enumerate(zip(inputs, resolved)):
        field = f"local_map.in_grad_placements[{i}]"
        for j, axis in enumerate(axes):
            if axis_sizes is not None and axis_sizes.get(axis) == 1:
                continue
            p, g = placed[j], grads[j]
            ps, gs = placement_to_str(p), placement_to_str(g)
            split = any(not o[j].is_replicate() for o in out_placements)
            if p.is_shard() and not _same_shard(p, g):
                c.error(
                    field,
                    f"declares the gradient of input {name!r} {gs} on axis {axis!r}, where "
                    f"{name!r} enters the region {ps}: each rank's gradient has the shape of "
                    "its own piece of the input (torch fails in backward: 'returned an "
                    "invalid gradient').",
                    f"declare it {ps} on {axis!r}, as the input is placed.",
                )
            elif p.is_replicate() and g.is_shard():
                c.error(
                    field,
                    f"declares the gradient of input {name!r} {gs} on axis {axis!r}, where "
                    f"{name!r} enters the region replicated: each rank's gradient has the "
                    "input's whole shape (torch fails in backward).",
                    f"declare it {'Partial()' if split else 'Replicate()'} on {axis!r}"
                    + (" (the region's output is split there)." if split else "."),
                )
            elif p.is_replicate() and g.is_replicate() and split:
                c.error(
                    field,
                    f"declares the gradient of input {name!r} Replicate() on axis "
                    f"{axis!r}, where {name!r} enters the region replicated and the "
                    "region's output is split: each rank's gradient covers only its own "
                    "part of the output, so every gradient upstream would be wrong.",
                    f"declare it Partial() on {axis!r} (summed over the ranks), e.g. "
                    f"in_grad_placements[{i}] = {{{axis!r}: Partial()}}.",
                )


def _same_shard(p: Placement, g: Placement) -> bool:
    """Whether gradient placement ``g`` is input placement ``p``'s ``Shard`` (a dim of
    the other sign may name the same dim: the tensor's rank is not known here)."""
    if not isinstance(g, Shard) or type(g) is not type(p):
        return False
    d, e = p.dim, g.dim  # type: ignore[attr-defined]
    return d == e or (d < 0) != (e < 0)


def _check_local_map(
    c: _Collector,
    module: nn.Module,
    config: ShardingConfig,
    axes: tuple[str, ...],
    axis_sizes: Mapping[str, int] | None,
) -> None:
    lm = config.local_map
    if lm is None:
        return
    declared = set(config.in_dst_shardings or {}) | set(config.in_src_shardings or {})
    try:
        params = forward_signature(module).parameters
    except (TypeError, ValueError):
        params = {}
    order = list(params)
    for name in order:
        kind = params[name].kind
        if name in declared and kind in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD):
            star = "*" if kind is kind.VAR_POSITIONAL else "**"
            c.error(
                f"in_dst/in_src_shardings[{name!r}]",
                f"names forward's {star}{name}, but a local_map region takes each input as "
                "one named tensor argument with one placement and one in_grad_placements "
                f"entry (a call's {star}{name} reached the region as no tensor).",
                "give forward named tensor arguments (def forward(self, a, b)) and key "
                "them, or drop local_map (a boundary places each element of *args).",
            )
    # In forward-argument order, the order in_grad_placements follows.
    inputs = [n for n in order if n in declared] + sorted(declared.difference(order))
    if len(lm.in_grad_placements) != len(inputs):
        c.error(
            "local_map.in_grad_placements",
            f"has {len(lm.in_grad_placements)} entr(ies) but the config declares "
            f"{len(inputs)} input(s) {inputs}.",
            "give one in_grad_placements entry per input named in in_dst/in_src_shardings, "
            "in forward-argument order.",
        )
    if config.out_src_shardings is None and config.out_dst_shardings is None:
        c.error(
            "local_map",
            "a local_map region needs the placement of its output(s).",
            "set out_src_shardings (or out_dst_shardings).",
        )
    elif len(lm.in_grad_placements) == len(inputs):
        _check_local_map_input_grads(c, config, inputs, axes, axis_sizes)


def _check_dispatch(
    c: _Collector,
    module: nn.Module,
    config: ShardingConfig,
    axes: Sequence[str],
    axis_sizes: Mapping[str, int] | None,
) -> None:
    """A dispatch must be registered, its axis on the mesh, and nothing else adapt activations.

    The dispatch replaces ``forward`` and takes plain local tensors, so ``in_*``/``out_*``,
    ``local_map`` and ``use_local_output`` would be ignored: refused rather than dropped.
    """
    dispatch = config.dispatch
    if dispatch is None:
        return
    # Imported here: the registry imports nothing of ours, but stays out of import cycles.
    from hyper_parallel.dmodule.dispatch import get_dispatch, list_dispatches

    found = get_dispatch(dispatch.kind)
    if found is None:
        c.error(
            "dispatch.kind",
            f"no token dispatch of kind {dispatch.kind!r} is registered "
            f"(known: {list_dispatches()}).",
            "use a registered kind, or register_dispatch() yours before parallelizing.",
        )
        return
    if dispatch.axis not in axes:
        c.error(
            "dispatch.axis",
            f"axis {dispatch.axis!r} is not in mesh {tuple(axes)}.",
            f"parallelize on a mesh with an axis named {dispatch.axis!r}, or name one of "
            f"{tuple(axes)}.",
        )
        return
    extra = [
        name
        for name in (
            "in_src_shardings",
            "in_dst_shardings",
            "out_src_shardings",
            "out_dst_shardings",
            "local_map",
        )
        if getattr(config, name) is not None
    ] + (["use_local_output"] if config.use_local_output else [])
    if extra:
        c.error(
            "dispatch",
            f"a {dispatch.kind!r} dispatch takes and returns plain local tensors, so "
            f"{extra} would be ignored.",
            "keep only state_shardings (and dispatch) in this config; lay out the tensors "
            "around it in the configs of the modules before and after.",
        )
    c.findings.extend(found.check(c.path, module, config, axes, axis_sizes))


def _check_nesting(entries: Sequence[PlanEntry], out: list[Finding]) -> None:
    """Inside a local_map region everything runs on local tensors: no nested configs."""
    for outer in entries:
        if outer.config.local_map is None:
            continue
        prefix = f"{outer.path}." if outer.path else ""
        for inner in entries:
            if inner is not outer and inner.path.startswith(prefix):
                out.append(
                    Finding(
                        "error",
                        inner.path,
                        "",
                        f"has its own sharding config inside the local_map region of "
                        f"{outer.path or '<root>'}, where everything runs on local tensors.",
                        "remove the inner config, or drop local_map from the outer module.",
                    )
                )


def _check_ties(entries: Sequence[PlanEntry], axes: tuple[str, ...], out: list[Finding]) -> None:
    """A tensor reached from two configs (tied weights) must be placed the same way."""
    seen: dict[int, tuple[str, list[Placement]]] = {}
    for e in entries:
        for key, named in e.config.state_shardings.items():
            tensor = get_state(e.module, key)
            if tensor is None:
                continue
            try:
                placements = resolve_placements(named, axes)
            except (ValueError, TypeError):  # reported by _check_axes
                continue
            where = f"{e.path}.{key}" if e.path else key
            ndim = tensor.dim()
            if isinstance(tensor, DTensor) and tensor.placements != normalize_placements(
                placements, ndim
            ):
                out.append(
                    Finding(
                        "error",
                        e.path,
                        f"state_shardings[{key!r}]",
                        f"{key!r} is already a DTensor placed {list(tensor.placements)}, "
                        f"which disagrees with the config's {placements}.",
                        "make the config agree with the existing placement (tied weights must "
                        "be placed the same way everywhere).",
                    )
                )
            prev = seen.setdefault(id(tensor), (where, placements))
            if prev[0] != where and normalize_placements(prev[1], ndim) != normalize_placements(
                placements, ndim
            ):
                out.append(
                    Finding(
                        "error",
                        e.path,
                        f"state_shardings[{key!r}]",
                        f"{where} is the same tensor as {prev[0]} (tied), but is placed "
                        f"{placements} here and {prev[1]} there.",
                        "place tied states identically in both configs.",
                    )
                )


def _check_ties_outside_the_plan(
    entries: Sequence[PlanEntry], root: nn.Module | None, out: list[Finding]
) -> None:
    """A state the plan distributes must not also be held (tied) by a module no config
    covers: parallelize keeps the tie, so that module would get the DTensor while its
    inputs stay plain tensors ("got mixed torch.Tensor and DTensor" at its first call).
    Covered: the states a config names (dotted paths too) and its module's own states
    (replicated implicitly)."""
    if root is None:
        return
    covered: dict[tuple[int, str], str] = {}  # (owner, leaf) -> where the plan places it
    for e in entries:
        for key in e.config.state_shardings:
            found = state_owner(e.module, key)
            if found is not None:
                covered[(id(found[0]), found[1])] = f"{e.path}.{key}" if e.path else key
        for owner, name, _ in implicit_state_slots(e.module, e.config):
            where = ".".join(n for n in (e.path, _relative_path(e.module, owner), name) if n)
            covered.setdefault((id(owner), name), where)
    placed: dict[int, str] = {}  # tensor -> a covered holder
    for e in entries:
        for m in e.module.modules():
            for store in (m._parameters, m._buffers):
                for leaf, t in store.items():
                    where = covered.get((id(m), leaf))
                    if t is not None and where is not None and not isinstance(t, DTensor):
                        placed.setdefault(id(t), where)
    if not placed:
        return
    seen: set[tuple[int, str]] = set()
    for path, m in root.named_modules(remove_duplicate=False):
        for store in (m._parameters, m._buffers):
            for leaf, t in store.items():
                key = (id(m), leaf)
                if t is None or id(t) not in placed or key in covered or key in seen:
                    continue
                seen.add(key)
                here = f"{path}.{leaf}" if path else leaf
                out.append(
                    Finding(
                        "error",
                        path,
                        f"state {leaf!r}",
                        f"{here} is the same tensor as {placed[id(t)]} (tied), which the plan "
                        f"distributes; {path or '<root>'} has no config, so it would hold "
                        "that DTensor while its inputs stay plain tensors (torch: 'got mixed "
                        "torch.Tensor and DTensor' at its first call).",
                        f"give {path or '<root>'} a config too (its in_dst_shardings, and "
                        f"state_shardings placing {leaf!r} as {placed[id(t)]} is placed, e.g. "
                        "a vocab-parallel embedding), or untie the weights.",
                    )
                )


def _relative_path(module: nn.Module, owner: nn.Module) -> str:
    """``owner``'s path inside ``module`` (``""`` for ``module`` itself)."""
    return next((path for path, m in module.named_modules() if m is owner), "")


def _check_partly_named_children(entries: Sequence[PlanEntry], out: list[Finding]) -> None:
    """A config naming some of a submodule's states by dotted path must name them all,
    unless the submodule has a config of its own (whose boundary replicates the rest):
    its forward would mix the DTensors made with the plain tensors left. (A local_map
    region replicates the rest itself.)"""
    configured = {id(e.module) for e in entries}
    for e in entries:
        if e.config.local_map is not None:
            continue
        named: dict[int, tuple[nn.Module, str, set[str]]] = {}
        for key in e.config.state_shardings:
            prefix, _, leaf = key.rpartition(".")
            found = state_owner(e.module, key) if prefix else None
            if found is None or id(found[0]) in configured:
                continue
            named.setdefault(id(found[0]), (found[0], prefix, set()))[2].add(leaf)
        for owner, prefix, leaves in named.values():
            left = [
                f"{prefix}.{name}"
                for store in (owner._parameters, owner._buffers)
                for name, t in store.items()
                if t is not None and name not in leaves and not isinstance(t, DTensor)
            ]
            if left:
                given = ", ".join(repr(f"{prefix}.{leaf}") for leaf in sorted(leaves))
                out.append(
                    Finding(
                        "error",
                        e.path,
                        "state_shardings",
                        f"names {given} of {prefix!r} ({type(owner).__name__}) but not "
                        f"{', '.join(map(repr, left))}: its forward would mix DTensors with "
                        "plain tensors.",
                        f"name {left[0]!r} too (e.g. {{'tp': Replicate()}}), or give "
                        f"{prefix!r} a config of its own (its unnamed states are replicated).",
                    )
                )


def check_entries(
    entries: Sequence[PlanEntry],
    mesh_axes: Sequence[str] | None,
    axis_sizes: Mapping[str, int] | None = None,
    root: nn.Module | None = None,
) -> list[Finding]:
    """Check every entry of a plan; returns all findings (errors and warnings).

    Args:
        entries: The modules to parallelize with their configs.
        mesh_axes: The mesh's axis names in order; ``None`` for a mesh without names.
        axis_sizes: Axis sizes, when known, for divisibility warnings.
        root: The model the entry paths are relative to, so a projection can be
            checked against the heads of the attention module around it.
    """
    # Imported here: the layout checks build Findings, defined in this module.
    from hyper_parallel.dmodule._known_layouts import check_known_layouts

    findings: list[Finding] = []
    if mesh_axes is None:
        findings.append(
            Finding(
                "error",
                "",
                "mesh",
                "the DeviceMesh has no mesh_dim_names, so named placements cannot be resolved.",
                "create it with init_device_mesh(..., mesh_dim_names=('dp', 'tp')).",
            )
        )
        return findings
    axes = tuple(mesh_axes)
    for e in entries:
        c = _Collector(e.path)
        if getattr(e.module, BOUNDARY_ATTR, None) is not None:
            c.error(
                "",
                f"{type(e.module).__name__} is already parallelized.",
                "parallelize a model once; build a fresh model to apply another plan.",
            )
        elif getattr(e.module, "_distribute_module_applied", False):
            # torch's parallelize_module / distribute_module: its hooks would run around
            # this boundary (each adapting inputs and outputs its own way).
            c.error(
                "",
                f"{type(e.module).__name__} is already parallelized by torch's "
                "parallelize_module (distribute_module); a second plan on it would stack "
                "its input and output hooks with torch's.",
                "apply one plan to a module: this library's or torch's, on a fresh model.",
            )
        _check_axes(c, e.config, axes, axis_sizes)
        _check_states(c, e.module, e.config, axis_sizes)
        _check_heads(c, root, e.module, e.config, axis_sizes)
        _check_inputs(c, e.module, e.config)
        _check_local_map(c, e.module, e.config, axes, axis_sizes)
        _check_dispatch(c, e.module, e.config, axes, axis_sizes)
        findings.extend(c.findings)
        findings.extend(check_known_layouts(e.path, e.module, e.config))
    _check_nesting(entries, findings)
    _check_partly_named_children(entries, findings)
    _check_ties(entries, axes, findings)
    _check_ties_outside_the_plan(entries, root, findings)
    return findings


def errors_of(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def as_placement_list(named: NamedPlacement, axes: tuple[str, ...]) -> tuple[Placement, ...]:
    return tuple(resolve_placements(named, axes))


def region_output_problem(out: Any, num_declared: int | None, field: str) -> str | None:
    """Why a local_map region's output does not fit its declared placements, else ``None``.

    Both boundary paths ask this before wrapping the output, so a mismatch is the same
    error on either (torch's local_map would stop at its own assertion, naming no module).

    Args:
        out: What the region's ``forward`` returned.
        num_declared: The number of placements a tuple declares; ``None`` for one
            NamedPlacement (a single tensor output).
        field: The config field the placements come from (``out_src_shardings``, or
            ``out_dst_shardings`` when that is all the config gives).
    """
    if isinstance(out, torch.Tensor):
        if num_declared is None:
            return None
        return (
            f"{field} has {num_declared} entries but the local_map region returned one "
            "tensor; use a single NamedPlacement for a single output."
        )
    if not isinstance(out, (tuple, list)):
        return (
            f"the local_map region returned {describe(out)}, but a region's output must be a "
            f"tensor or a tuple/list of tensors to be placed by {field}; return tensors from "
            "this module's forward (a wrapper module can build other structures from them)."
        )
    values = ", ".join(describe(v) for v in out)
    if num_declared is None:
        return (
            f"the local_map region returned {len(out)} values ({values}) but {field} is a "
            f"single NamedPlacement; give a tuple of {len(out)} NamedPlacements, one per output."
        )
    if len(out) != num_declared:
        return (
            f"{field} has {num_declared} entries but the local_map region returned "
            f"{len(out)} values ({values}); give one NamedPlacement per output."
        )
    others = [i for i, v in enumerate(out) if not isinstance(v, torch.Tensor)]
    if others:
        return (
            f"the local_map region returned {values}: output {others[0]} is not a tensor, "
            "and torch's local_map places every output of a region; return only tensors "
            "from this module's forward (a wrapper module can add the others)."
        )
    return None


def describe(value: Any) -> str:
    """Short description of a runtime value for error messages."""
    if isinstance(value, torch.Tensor):
        kind = "DTensor" if isinstance(value, DTensor) else "Tensor"
        return f"{kind}{tuple(value.shape)}"
    return type(value).__name__
