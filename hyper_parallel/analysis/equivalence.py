"""Equivalence check: one training step of a parallelized model against its single-device twin.

:func:`check_equivalence` deep-copies a model as the reference, parallelizes the
original, runs forward and backward on both with the same input, and reports the
largest difference in outputs and in every parameter's gradient, by name. A plan
that lies about a layout (a ``Partial`` handed on as a plain tensor, an input
declared ``Replicate`` that is really a shard) shows up as a large difference and
names the parameter it hurts most, and the first module (in the order modules finish
their forward) whose output drifts from its single-device twin is where it started:
:func:`find_first_drift` returns just that module.

Example (on every rank of an initialized process group)::

    from hyper_parallel.analysis.equivalence import check_equivalence
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.dmodule import parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    report = check_equivalence(
        model, lambda m: parallelize_module(m, mesh, "plan.yaml"), {"input_ids": ids}
    )
    print(report)  # the same on every rank
    assert report.passed, report.worst_param
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hyper_parallel.analysis._format import placement_text, table
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.dmodule.entries import BOUNDARY_ATTR, normalize_placements
from hyper_parallel.dmodule.sharding import resolve_placements

__all__ = [
    "EquivalenceReport",
    "EquivalenceRow",
    "ModuleDrift",
    "check_equivalence",
    "find_first_drift",
]

Inputs = tuple[Any, ...] | dict[str, Any] | torch.Tensor

_TOP = 10  # rows per table in ``str(report)``

# Per-row flags, reduced with MAX over ranks alongside the diffs.
_SHAPE_MISMATCH = 1
_ONLY_PARALLEL = 2
_ONLY_REFERENCE = 4
_NON_FINITE = 8
_NOTES = {
    _SHAPE_MISMATCH: "shape differs from the reference",
    _ONLY_PARALLEL: "gradient only on the parallelized model",
    _ONLY_REFERENCE: "gradient only on the reference",
    _NON_FINITE: "NaN/inf in one model only",
}


# --------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class EquivalenceRow:
    """One compared tensor: an output, or one parameter's gradient.

    Attributes:
        name: ``loss``, ``output``, ``output[0]``, ``output.logits`` or a parameter name.
        shape: The reference tensor's shape (the full, unsharded shape).
        placements: The parallelized tensor's layout, ``tp=Shard(0)``; ``plain`` for a
            regular tensor.
        max_abs_diff: ``max |a - b|`` (``a`` parallelized, ``b`` reference), max over ranks.
        max_rel_diff: ``max |a - b| / max |b|``: relative to the reference's largest
            magnitude, so near-zero entries do not dominate.
        tolerance_ratio: ``max |a - b| / (atol + rtol * |b|)``; ``<= 1`` passes (the
            ``torch.allclose`` rule). Rows are ranked by it.
        note: Why a row failed regardless of values (shape mismatch, a missing
            gradient), or ``no gradient`` where neither model has one.
    """

    name: str
    shape: tuple[int, ...]
    placements: str
    max_abs_diff: float
    max_rel_diff: float
    tolerance_ratio: float
    note: str = ""

    @property
    def passed(self) -> bool:
        """Within tolerance (``tolerance_ratio <= 1``)."""
        return self.tolerance_ratio <= 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; non-finite numbers are written ``"inf"`` / ``"nan"``."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "placements": self.placements,
            "max_abs_diff": _json_float(self.max_abs_diff),
            "max_rel_diff": _json_float(self.max_rel_diff),
            "tolerance_ratio": _json_float(self.tolerance_ratio),
            "passed": self.passed,
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class ModuleDrift:
    """The first module whose output differs from its single-device twin beyond tolerance.

    Modules are taken in the order they finish their forward (a child before its
    parent), so the first one that drifts is the innermost module where the
    difference appears; everything that finished before it matched.

    Attributes:
        path: Module path in the model (``layers.2.mlp.down``; ``""`` for the root).
        call: Which call of the module (0 for the first), for modules called repeatedly.
        output: Which output tensor (``output``, ``output[0]``, ``output.logits``).
        placements: The parallelized output's layout (``tp=Shard(2)``; ``plain``).
        max_abs_diff: ``max |a - b|`` over ranks.
        tolerance_ratio: ``max |a - b| / (atol + rtol * |b|)``; ``inf`` for a shape
            mismatch or NaN/inf in one model only.
        num_compared: How many module outputs were compared in all.
    """

    path: str
    call: int
    output: str
    placements: str
    max_abs_diff: float
    tolerance_ratio: float
    num_compared: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (non-finite numbers as strings)."""
        return {
            "path": self.path,
            "call": self.call,
            "output": self.output,
            "placements": self.placements,
            "max_abs_diff": _json_float(self.max_abs_diff),
            "tolerance_ratio": _json_float(self.tolerance_ratio),
            "num_compared": self.num_compared,
        }

    def __str__(self) -> str:
        call = f" (call {self.call})" if self.call else ""
        return (
            f"{self.path or '<root>'}{call} {self.output} [{self.placements}]: "
            f"max |diff| {_num(self.max_abs_diff)}, diff/tol {_num(self.tolerance_ratio)}"
        )


@dataclass(frozen=True, slots=True)
class EquivalenceReport:
    """The result of :func:`check_equivalence`; identical on every rank.

    Attributes:
        outputs: The loss first, then every output tensor, in output order.
        rows: One per parameter, in ``named_parameters()`` order: its gradient compared.
        atol: Absolute tolerance used.
        rtol: Relative tolerance used.
        world_size: Ranks that took part.
        synced: Parameters, buffers and inputs that differed between ranks before the
            check and were overwritten with rank 0's values (``param:up.weight``,
            ``inputs.input_ids``, ``inputs[0]``).
        first_drift: The first module whose output drifts (:class:`ModuleDrift`), or
            ``None`` when every module output that could be compared matched.
    """

    outputs: tuple[EquivalenceRow, ...]
    rows: tuple[EquivalenceRow, ...]
    atol: float
    rtol: float
    world_size: int
    synced: tuple[str, ...] = ()
    first_drift: ModuleDrift | None = None

    @property
    def max_abs_output_diff(self) -> float:
        """Largest ``|a - b|`` over the loss and every output tensor."""
        return max((r.max_abs_diff for r in self.outputs), default=0.0)

    @property
    def max_abs_grad_diff(self) -> float:
        """Largest ``|a - b|`` over every parameter gradient."""
        return max((r.max_abs_diff for r in self.rows), default=0.0)

    @property
    def worst_param(self) -> str | None:
        """The parameter whose gradient is furthest outside tolerance (``None``: no params)."""
        ranked = _ranked(self.rows)
        return ranked[0].name if ranked else None

    @property
    def passed(self) -> bool:
        """Every output and every gradient within ``atol + rtol * |reference|``."""
        return all(r.passed for r in (*self.outputs, *self.rows))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable summary plus every row (non-finite numbers as strings)."""
        return {
            "passed": self.passed,
            "atol": self.atol,
            "rtol": self.rtol,
            "world_size": self.world_size,
            "max_abs_output_diff": _json_float(self.max_abs_output_diff),
            "max_abs_grad_diff": _json_float(self.max_abs_grad_diff),
            "worst_param": self.worst_param,
            "synced": list(self.synced),
            "first_drift": None if self.first_drift is None else self.first_drift.to_dict(),
            "outputs": [r.to_dict() for r in self.outputs],
            "rows": [r.to_dict() for r in self.rows],
        }

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"equivalence check {verdict} on {self.world_size} ranks "
            f"(atol={self.atol:g}, rtol={self.rtol:g})",
            f"max |output diff| {_num(self.max_abs_output_diff)}   "
            f"max |grad diff| {_num(self.max_abs_grad_diff)}   "
            f"worst parameter: {self.worst_param or '-'}",
            f"first module whose output drifts: {self.first_drift or '-'}",
        ]
        if self.synced:
            shown = ", ".join(self.synced[:5]) + (" ..." if len(self.synced) > 5 else "")
            lines.append(f"differed between ranks, rank 0's values used: {shown}")
        lines += ["", *_section("output", "outputs", self.outputs, ranked=False)]
        if self.rows:
            lines += ["", *_section("parameter", "parameter gradients", self.rows, ranked=True)]
        return "\n".join(lines)


def _ranked(rows: tuple[EquivalenceRow, ...]) -> list[EquivalenceRow]:
    return sorted(rows, key=lambda r: (-r.tolerance_ratio, -r.max_abs_diff))


def _section(kind: str, title: str, rows: tuple[EquivalenceRow, ...], ranked: bool) -> list[str]:
    """A titled table: all rows in order when few, else the worst ``_TOP`` first."""
    if ranked or len(rows) > _TOP:
        shown = _ranked(rows)[:_TOP]
        heading = f"{title}, worst first ({len(shown)} of {len(rows)}):"
    else:
        shown, heading = list(rows), f"{title}:"
    body = [
        [
            r.name,
            r.shape,
            r.placements,
            _num(r.max_abs_diff),
            _num(r.max_rel_diff),
            _num(r.tolerance_ratio),
            ("ok" if r.passed else "FAIL") + (f"  {r.note}" if r.note else ""),
        ]
        for r in shown
    ]
    headers = [kind, "shape", "placements", "max abs", "max rel", "diff/tol", ""]
    return [heading, table(headers, body, right=(3, 4, 5))]


def _num(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else str(x)


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


# --------------------------------------------------------------------------- the check


def check_equivalence(
    model: nn.Module,
    parallelize: Callable[[nn.Module], nn.Module | None],
    inputs: Inputs,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> EquivalenceReport:
    """Compare one forward and backward of ``parallelize(model)`` with a single-device copy.

    Call it collectively, on every rank of an initialized default process group.
    In order:

    1. Every rank must hold a model with the same parameter and buffer names,
       shapes and dtypes, and inputs of the same structure. Their *values* are
       made identical by broadcasting rank 0's (in place, on ``model``); names
       that differed are listed in ``report.synced``.
    2. ``model`` is deep-copied as the reference *before* ``parallelize(model)``
       runs; ``parallelize`` changes ``model`` in place (and may return it, or a
       replacement module whose parameter names are the same).
    3. Both run forward on their own copy of ``inputs``: a tuple is passed as
       positional arguments, a dict as keyword arguments, a tensor as the one
       argument; non-tensor values pass through. DTensor outputs are gathered
       with ``full_tensor()`` (differentiably), so ``Partial`` outputs resolve.
    4. The loss is ``loss_fn(output)`` (``output`` with DTensors gathered, the same
       structure the model returned), else the sum of ``t.float().sum()`` over every
       floating output tensor that requires grad (a tuple, dict or Hugging Face
       ``ModelOutput`` contributes all of its tensors). Both run ``backward``.
    5. The loss, every output tensor and every parameter gradient (DTensor
       gradients gathered with ``full_tensor()``) are compared by name; the
       differences are reduced with an all-reduce MAX, so every rank returns
       the same report.

    Random layers must be off (dropout ``p=0``): sharded and unsharded masks differ.
    Existing ``.grad`` fields on ``model`` are cleared.

    Args:
        model: The model on one device, not yet parallelized (no DTensor states,
            nothing on the meta device).
        parallelize: Applies the parallelism in place, e.g.
            ``lambda m: parallelize_module(m, mesh, plan)`` or
            ``lambda m: m.parallelize(mesh)``.
        inputs: The full (global) input of one step, the same on every rank.
        loss_fn: Output → scalar loss; default: sum of all floating outputs.
        atol: Absolute tolerance per element.
        rtol: Relative tolerance per element (``|a - b| <= atol + rtol * |b|``).

    Returns:
        An :class:`EquivalenceReport`; ``print(report)`` shows the worst rows.

    Raises:
        RuntimeError: No process group is initialized.
        ValueError: ``model`` is already parallelized or on the meta device, ranks
            disagree on names/shapes/dtypes, the loss is not a scalar, or the
            parallelized model's parameter names differ from the reference's.
        TypeError: ``inputs`` or the result of ``parallelize``/``loss_fn`` has the
            wrong type.

    Example::

        report = check_equivalence(
            model, lambda m: parallelize_module(m, mesh, plan), (x,), atol=1e-5
        )
        if not report.passed:
            print(report)  # worst parameters first
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "check_equivalence runs collectively on every rank: initialize the default "
            "process group first (torch.distributed.init_process_group, or torchrun)."
        )
    if not isinstance(inputs, (tuple, dict, torch.Tensor)):
        raise TypeError(
            "check_equivalence(inputs=...): expected a tuple of positional arguments, a dict "
            f"of keyword arguments or one tensor, got {type(inputs).__name__}."
        )
    if not (atol >= 0 and rtol >= 0):
        raise ValueError(
            f"check_equivalence: atol and rtol must be >= 0, got atol={atol}, rtol={rtol}."
        )
    _check_unparallelized(model)
    states = _named_states(model)
    named_inputs = dict(_named_leaves(inputs, "inputs"))
    _check_same_structure({**states, **named_inputs})
    synced = _sync_states(states)
    synced_inputs, synced_input_names = _sync_inputs(inputs, named_inputs)

    for p in model.parameters():
        p.grad = None
    reference = copy.deepcopy(model)
    result = parallelize(model)
    if result is not None and not isinstance(result, nn.Module):
        raise TypeError(
            f"check_equivalence: parallelize returned {type(result).__name__}; return the "
            "parallelized nn.Module, or None when it works in place."
        )
    parallel = model if result is None else result

    with _ModuleOutputs(parallel, parallel=True) as module_outputs:
        loss, outputs, placements = _step(parallel, _clone_tree(synced_inputs), loss_fn)
    with _ModuleOutputs(reference, parallel=False) as ref_module_outputs:
        ref_loss, ref_outputs, _ = _step(reference, _clone_tree(synced_inputs), loss_fn)
    first_drift = _first_drift(module_outputs, ref_module_outputs, atol, rtol)

    local_outputs = [_compare("loss", loss, ref_loss, (), "plain", atol, rtol)]
    local_outputs += _compare_outputs(outputs, ref_outputs, placements, atol, rtol)
    local_rows = _compare_grads(parallel, reference, atol, rtol)
    out_rows, rows = _reduce_rows(local_outputs, local_rows)
    return EquivalenceReport(
        outputs=tuple(out_rows),
        rows=tuple(rows),
        atol=atol,
        rtol=rtol,
        world_size=dist.get_world_size(),
        synced=(*synced, *synced_input_names),
        first_drift=first_drift,
    )


def find_first_drift(
    model: nn.Module,
    parallelize: Callable[[nn.Module], nn.Module | None],
    inputs: Inputs,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> ModuleDrift | None:
    """The first module whose output drifts from its single-device twin (a parity bisector).

    Runs :func:`check_equivalence` (same arguments, same collective contract) and
    returns its ``first_drift``: the module, in the order modules finish their
    forward, whose output first differs beyond ``atol + rtol * |reference|``.

    A module's output is compared when its global value is known: a DTensor
    (gathered), a plain tensor its own config lays out (``use_local_output`` with
    ``out_dst``/``out_src``), or a plain tensor of the reference's shape. A plain
    local piece with no declared layout (inside a region that hands local tensors
    around) is skipped; the first comparable module after it reports the drift.

    Returns:
        A :class:`ModuleDrift`, or ``None`` when every compared output matched.

    Example::

        drift = find_first_drift(model, lambda m: parallelize_module(m, mesh, plan), (x,))
        if drift is not None:
            print(drift.path)  # e.g. "layers.2.mlp.down"
    """
    report = check_equivalence(model, parallelize, inputs, loss_fn=loss_fn, atol=atol, rtol=rtol)
    return report.first_drift


# --------------------------------------------------------------------------- preparation


def _check_unparallelized(model: nn.Module) -> None:
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if isinstance(t, DTensor):
            raise ValueError(
                f"check_equivalence: {name!r} is already a DTensor; pass the model before "
                "parallelizing it and let `parallelize` apply the plan, so the reference "
                "copy is a plain single-device model."
            )
        if t.is_meta:
            raise ValueError(
                f"check_equivalence: {name!r} is on the meta device; materialize the model "
                "(to_empty + init_states, or load weights) before comparing numerics."
            )


def _named_states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{f"param:{n}": p for n, p in model.named_parameters()},
        **{f"buffer:{n}": b for n, b in model.named_buffers()},
    }


def _named_leaves(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in nested tuples, lists and mappings, named by their path."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            yield from _named_leaves(v, f"{prefix}[{i}]")
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            key = f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"
            yield from _named_leaves(v, prefix + key)


def _map_tree(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with every tensor replaced by ``fn(tensor)``, in :func:`_named_leaves` order."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        values = [_map_tree(v, fn) for v in tree]
        if type(tree) in (tuple, list):
            return type(tree)(values)
        return type(tree)(*values)  # a namedtuple
    if isinstance(tree, Mapping):
        out = copy.copy(tree)  # keeps the type: dict, OrderedDict, Hugging Face ModelOutput
        for k, v in tree.items():
            out[k] = _map_tree(v, fn)
        return out
    return tree


def _check_same_structure(named: dict[str, torch.Tensor]) -> None:
    """Every rank has the same names, shapes and dtypes (else a broadcast would hang)."""
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named.items()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            diff = next(
                (f"{a} vs {b}" for a, b in zip(gathered[0], theirs) if a != b),
                f"{len(gathered[0])} vs {len(theirs)} tensors",
            )
            raise ValueError(
                f"check_equivalence: rank {rank}'s model or inputs differ from rank 0's in "
                f"structure ({diff}); build the same model and the same input shapes on "
                "every rank (values may differ: rank 0's are broadcast)."
            )


def _broadcast_copy(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of ``t``, as a new tensor (bool travels as uint8)."""
    buf = t.detach().clone(memory_format=torch.contiguous_format)
    if buf.dtype == torch.bool:
        buf = buf.to(torch.uint8)
        dist.broadcast(buf, src=0)
        return buf.to(torch.bool)
    dist.broadcast(buf, src=0)
    return buf


def _differed(names: list[str], flags: list[bool]) -> list[str]:
    """The names whose flag is set on any rank."""
    if not names:
        return []
    local = torch.tensor(flags, dtype=torch.uint8, device=_comm_device())
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return [n for n, f in zip(names, local.tolist()) if f]


def _sync_states(states: dict[str, torch.Tensor]) -> list[str]:
    flags = []
    with torch.no_grad():
        for t in states.values():
            value = _broadcast_copy(t)
            flags.append(not torch.equal(value, t))
            t.copy_(value)
    return _differed(list(states), flags)


def _sync_inputs(inputs: Inputs, named: dict[str, torch.Tensor]) -> tuple[Inputs, list[str]]:
    """Inputs with rank 0's tensor values (the caller's tensors are not modified)."""
    flags: list[bool] = []

    def sync(t: torch.Tensor) -> torch.Tensor:
        value = _broadcast_copy(t)
        flags.append(not torch.equal(value, t.detach()))
        return value.requires_grad_(t.requires_grad)

    synced = _map_tree(inputs, sync)
    return synced, _differed(list(named), flags)


def _clone_tree(tree: Any) -> Any:
    return _map_tree(tree, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def _comm_device() -> torch.device:
    """Where small reduction tensors live: NCCL-only groups need them on the GPU."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- one step


def _step(
    model: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], torch.Tensor] | None
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Forward (DTensor outputs gathered), loss, backward; returns loss and named outputs."""
    if isinstance(inputs, dict):
        raw = model(**inputs)
    elif isinstance(inputs, tuple):
        raw = model(*inputs)
    else:
        raw = model(inputs)
    placements = {name: _placements_text(t) for name, t in _named_leaves(raw, "output")}
    output = _map_tree(raw, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    named = list(_named_leaves(output, "output"))
    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"check_equivalence: loss_fn returned {type(loss).__name__}; return a scalar "
                "tensor (e.g. out.logits.float().pow(2).mean())."
            )
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
    else:
        terms = [t.float().sum() for _, t in named if t.is_floating_point() and t.requires_grad]
        if not terms:
            raise ValueError(
                "check_equivalence: the output has no floating tensor that requires grad "
                f"(got {[n for n, _ in named] or type(raw).__name__}); pass loss_fn=."
            )
        loss = torch.stack(terms).sum()
    if loss.numel() != 1:
        raise ValueError(
            f"check_equivalence: the loss must be a scalar, got shape {tuple(loss.shape)}; "
            "reduce it in loss_fn (e.g. .sum() or .mean())."
        )
    loss.backward()
    return loss.detach().reshape(()), [(n, t.detach()) for n, t in named], placements


def _placements_text(t: torch.Tensor) -> str:
    if not isinstance(t, DTensor):
        return "plain"
    axes = t.device_mesh.mesh_dim_names or tuple(str(i) for i in range(t.device_mesh.ndim))
    return ", ".join(f"{a}={placement_text(p)}" for a, p in zip(axes, t.placements))


# --------------------------------------------------------------------------- comparison


@dataclass(slots=True)
class _Local:
    """A row before the cross-rank reduction: this rank's diffs and flags."""

    name: str
    shape: tuple[int, ...]
    placements: str
    abs_diff: float = 0.0
    rel_diff: float = 0.0
    ratio: float = 0.0
    flags: int = 0
    no_grad: bool = False


def _compare(
    name: str,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    shape: tuple[int, ...],
    placements: str,
    atol: float,
    rtol: float,
) -> _Local:
    row = _Local(name, shape, placements)
    if a is None or b is None:
        row.no_grad = a is None and b is None
        row.flags = 0 if row.no_grad else (_ONLY_REFERENCE if a is None else _ONLY_PARALLEL)
        return row
    if a.shape != b.shape:
        row.flags = _SHAPE_MISMATCH
        return row
    a64, b64 = a.detach().double(), b.detach().double()
    bad_a, bad_b = ~torch.isfinite(a64), ~torch.isfinite(b64)
    # NaN/inf must sit at the same places with the same values (NaN matching NaN).
    if not torch.equal(bad_a, bad_b) or not torch.equal(
        a64[bad_a].nan_to_num(nan=0.0), b64[bad_b].nan_to_num(nan=0.0)
    ):
        row.flags = _NON_FINITE
        return row
    diff = (a64 - b64).abs().masked_fill(bad_b, 0.0)
    if diff.numel() == 0:
        return row
    ref = b64.abs().masked_fill(bad_b, 0.0)
    row.abs_diff = diff.max().item()
    ref_max = ref.max().item()
    row.rel_diff = (
        row.abs_diff / ref_max if ref_max > 0 else (0.0 if row.abs_diff == 0 else math.inf)
    )
    scaled = torch.where(diff > 0, diff / (atol + rtol * ref), torch.zeros_like(diff))
    row.ratio = scaled.max().item()
    return row


def _compare_outputs(
    outputs: list[tuple[str, torch.Tensor]],
    ref_outputs: list[tuple[str, torch.Tensor]],
    placements: dict[str, str],
    atol: float,
    rtol: float,
) -> list[_Local]:
    got = dict(outputs)
    names = [n for n, _ in ref_outputs] + [n for n, _ in outputs if n not in dict(ref_outputs)]
    rows = []
    for name in names:
        ref = dict(ref_outputs).get(name)
        a = got.get(name)
        shape = tuple((ref if ref is not None else a).shape)  # type: ignore[union-attr]
        row = _compare(name, a, ref, shape, placements.get(name, "plain"), atol, rtol)
        if row.flags & (_ONLY_PARALLEL | _ONLY_REFERENCE):
            raise ValueError(
                f"check_equivalence: output {name!r} exists on only one model (parallelized: "
                f"{[n for n, _ in outputs]}, reference: {[n for n, _ in ref_outputs]}); both "
                "models must return the same structure."
            )
        rows.append(row)
    return rows


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def _compare_grads(
    parallel: nn.Module, reference: nn.Module, atol: float, rtol: float
) -> list[_Local]:
    params = dict(parallel.named_parameters())
    ref_params = dict(reference.named_parameters())
    if params.keys() != ref_params.keys():
        only_par = sorted(params.keys() - ref_params.keys())
        only_ref = sorted(ref_params.keys() - params.keys())
        raise ValueError(
            "check_equivalence: the parallelized model's parameter names differ from the "
            f"reference's (only parallelized: {only_par[:5]}, only reference: {only_ref[:5]}); "
            "return the model itself from `parallelize` (not a wrapper that renames "
            "parameters), or compare the wrapped module."
        )
    # Same order on every rank: full_tensor() is a collective.
    return [
        _compare(
            name,
            _grad_of(p),
            ref_params[name].grad,
            tuple(ref_params[name].shape),
            _placements_text(p),
            atol,
            rtol,
        )
        for name, p in params.items()
    ]


def _reduce_rows(
    outputs: list[_Local], rows: list[_Local]
) -> tuple[list[EquivalenceRow], list[EquivalenceRow]]:
    """Max over ranks of every diff and flag: one all-reduce of a (rows, 4) tensor."""
    local = [*outputs, *rows]
    values = torch.tensor(
        [[r.abs_diff, r.rel_diff, r.ratio, float(r.flags)] for r in local],
        dtype=torch.float64,
        device=_comm_device(),
    ).nan_to_num(nan=math.inf)
    if values.numel():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    done = []
    for r, (abs_diff, rel_diff, ratio, flags) in zip(local, values.tolist()):
        flag_bits = int(flags)
        notes = [text for bit, text in _NOTES.items() if flag_bits & bit]
        if flag_bits:
            abs_diff = rel_diff = ratio = math.inf
        elif r.no_grad:
            notes.append("no gradient")
        done.append(
            EquivalenceRow(
                name=r.name,
                shape=r.shape,
                placements=r.placements,
                max_abs_diff=abs_diff,
                max_rel_diff=rel_diff,
                tolerance_ratio=ratio,
                note="; ".join(notes),
            )
        )
    return done[: len(outputs)], done[len(outputs) :]


# --------------------------------------------------------------------------- module outputs

_OutputKey = tuple[str, int, str]  # (module path, call index, output leaf name)


class _ModuleOutputs:
    """Every module's output tensors (detached, global values), in the order modules finish.

    On the parallelized model a DTensor output is gathered with ``full_tensor()`` (a
    collective, issued in the same order on every rank); a plain output is wrapped
    with the layout its module's config declares for it, else kept as it is and
    marked undeclared.
    """

    def __init__(self, model: nn.Module, *, parallel: bool) -> None:
        self.model = model
        self.parallel = parallel
        self.records: list[tuple[_OutputKey, torch.Tensor, str, bool]] = []
        self._calls: dict[str, int] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _ModuleOutputs:
        for path, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(path)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, path: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            call = self._calls.get(path, 0)
            self._calls[path] = call + 1
            layout = _declared_layout(module) if self.parallel else None
            with torch.no_grad():
                for leaf, t in _named_leaves(output, "output"):
                    if isinstance(t, DTensor):
                        value, placements, declared = t.detach().full_tensor(), t, True
                    elif layout is not None and t.is_floating_point():
                        mesh, spec = layout
                        dt = DTensor.from_local(
                            t.detach(), mesh, normalize_placements(spec, t.ndim), run_check=False
                        )
                        value, placements, declared = dt.full_tensor(), dt, True
                    else:
                        value, placements, declared = t.detach().clone(), t, not self.parallel
                    text = _placements_text(placements)
                    self.records.append(((path, call, leaf), value, text, declared))

        return hook


def _declared_layout(module: nn.Module) -> tuple[Any, tuple[Any, ...]] | None:
    """``(mesh, placements)`` a module's config gives its plain (local) output, if any."""
    boundary = getattr(module, BOUNDARY_ATTR, None)
    if boundary is None or not boundary.config.use_local_output:
        return None
    config = boundary.config
    named = config.out_dst_shardings
    if named is None and not isinstance(config.out_src_shardings, tuple):
        named = config.out_src_shardings
    if named is None:
        return None
    return boundary.mesh, tuple(resolve_placements(named, boundary.mesh))


def _first_drift(
    parallel: _ModuleOutputs, reference: _ModuleOutputs, atol: float, rtol: float
) -> ModuleDrift | None:
    """The first compared module output beyond tolerance, agreed on by every rank."""
    ref = {key: value for key, value, _, _ in reference.records}
    # One row per record of the parallelized model, the same list on every rank (the
    # forward is SPMD); -1 marks a record this rank cannot compare.
    keys: list[tuple[_OutputKey, str]] = []
    rows: list[tuple[float, float]] = []
    for key, value, placements, declared in parallel.records:
        want = ref.get(key)
        keys.append((key, placements))
        if want is None or (not declared and value.shape != want.shape):
            rows.append((-1.0, -1.0))  # not in the reference, or a local piece
            continue
        row = _compare(key[2], value, want, tuple(want.shape), placements, atol, rtol)
        rows.append((math.inf, math.inf) if row.flags else (row.ratio, row.abs_diff))
    if not rows:
        return None
    values = torch.tensor(rows, dtype=torch.float64, device=_comm_device()).nan_to_num(nan=math.inf)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    reduced = values.tolist()
    num_compared = sum(ratio >= 0 for ratio, _ in reduced)
    for ((path, call, leaf), placements), (ratio, abs_diff) in zip(keys, reduced):
        if ratio > 1.0:
            return ModuleDrift(path, call, leaf, placements, abs_diff, ratio, num_compared)
    return None
