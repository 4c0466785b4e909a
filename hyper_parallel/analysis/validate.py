"""Validate a model, its sharding plan and a mesh shape, before any process group exists.

:func:`validate` reports every problem in one call, each with its module path:

- everything ``parallelize`` would reject (the same checks, reused), and plan
  patterns that match nothing;
- sharded dimensions that do not divide by their axis size (states, and the
  activations that reach a sharded input);
- parameters no config covers (left plain, replicated in full on every rank) and
  parameters a configured module replicates implicitly;
- every redistribution at a module boundary — where the tensor a module receives
  is placed differently from what it declared — with the collective it costs;
  undeclared ones (the arriving layout is not the module's ``in_src``) are
  warnings, as is a *local* tensor read back under a different layout;
- a forward pass that fails once the plan is applied;
- with a ``pp`` axis, the pipeline plan, by the trainer's own checks: micro-batches
  fewer than the schedule needs, a layer count the split cannot place, an empty
  stage, weights tied across stages, a batch that does not split into micro-batches
  (then the rest is checked on one pipeline's ranks: the mesh without ``pp``);
- the mesh: every problem of its layout, a ``cp`` axis the plan does not declare,
  and the HSDP trap
  (a plan or a DeviceMesh that puts a data axis beside a model axis: a 2-D mesh
  handed to ``fully_shard`` silently becomes HSDP).

The plan is checked and applied on the submesh of the axes it declares, exactly as
the trainer and the dry run apply it.

The boundary analysis runs the model once, forward only, on fake tensors over a fake
process group of the mesh's size (nothing is allocated or computed), following each
tensor from the module that produced it to the module that reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from hyper_parallel._torch_private import FakeTensorMode, pytree
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Shard
from hyper_parallel.distributed.fsdp import fsdp_mesh_findings
from hyper_parallel.distributed.layout import (
    DATA_AXES,
    DENSE_AXES,
    MeshLayout,
    as_layout,
)
from hyper_parallel.distributed.pipeline import PipelineLayout, PipelineSplit
from hyper_parallel.distributed.run_plan import RunPlan, default_num_microbatches
from hyper_parallel.dmodule.entries import (
    BOUNDARY_ATTR,
    ParallelizeError,
    PlanEntry,
    check_entries,
    check_mesh,
    forward_signature,
    get_state,
)
from hyper_parallel.dmodule.findings import Finding
from hyper_parallel.dmodule.sharding import ShardingConfig, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement

from ._format import human_bytes, layer_pattern, placement_text, table
from ._model import (
    Target,
    check_sizes,
    cp_inputs,
    default_inputs,
    fake_trace,
    resolve_target,
)
from ._world import MeshShape, fake_world
from .collectives import ALL_GATHER, redistribution_collectives

__all__ = ["Redistribution", "ValidationReport", "validate"]

# Axes over which a batch is split by the data loader, not by a plan.
_DATA_AXES = frozenset({"dp", *DATA_AXES})
# User axes validate traces (the dry run's); others of size > 1 are refused by name.
_ANALYSIS_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


@dataclass(frozen=True)
class Redistribution:
    """A tensor that reaches a module placed differently from what the module needs.

    Attributes:
        path: The module that receives it.
        field: ``in_dst_shardings['x']``.
        source: The module whose output it is (through any ops in between), if any.
        arrives: Placement per mesh axis as it arrives.
        needs: Placement per mesh axis the module declared (``in_dst``).
        collectives: ``[{"kind", "axis", "bytes"}]`` DTensor issues to move it.
        declared: The module's ``in_src`` names the arriving layout (an intended
            redistribution); otherwise it is reported as a warning.
    """

    path: str
    field: str
    source: str | None
    arrives: dict[str, str]
    needs: dict[str, str]
    collectives: list[dict[str, Any]]
    declared: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "field": self.field,
            "source": self.source,
            "arrives": self.arrives,
            "needs": self.needs,
            "collectives": self.collectives,
            "declared": self.declared,
        }


@dataclass
class ValidationReport:
    """Everything :func:`validate` found.

    Attributes:
        model: The model's class name.
        mesh: The active axes (size > 1) → size.
        findings: Every problem, errors first, each with severity, path, field,
            message and fix. Severities: ``error`` (``parallelize`` refuses it or
            the forward fails), ``warning`` (runs, but probably not as meant),
            ``info`` (worth knowing).
        redistributions: Every redistribution at a module boundary seen in the
            traced forward pass, declared or not.
        traced: Whether the boundary analysis ran.
        notes: How the analysis was done.
        layout: The whole mesh layout (every axis and the derived sizes).
        plan_axes: The axes the plan declares: the submesh it is applied on.
    """

    model: str
    mesh: MeshShape
    findings: list[Finding] = field(default_factory=list)
    redistributions: list[Redistribution] = field(default_factory=list)
    traced: bool = False
    notes: list[str] = field(default_factory=list)
    layout: MeshLayout | None = None
    plan_axes: tuple[str, ...] = ()

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "info"]

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        layout = self.layout if self.layout is not None else as_layout(self.mesh)
        return {
            "model": self.model,
            "mesh": layout.to_dict(derived=True),
            "world_size": layout.world_size,
            "plan_axes": list(self.plan_axes),
            "ok": self.ok,
            "num_errors": len(self.errors),
            "num_warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
            "redistributions": [r.to_dict() for r in self.redistributions],
            "traced": self.traced,
            "notes": list(self.notes),
        }

    def to_table(self, *, verbose: bool = False) -> str:
        """Findings for people; identical findings on every layer are folded into one line.

        Args:
            verbose: List ``info`` findings and every redistribution too.
        """
        layout = self.layout if self.layout is not None else as_layout(self.mesh)
        out = [
            f"validate: {self.model} on {layout.describe()}; plan on "
            f"{' x '.join(self.plan_axes) or 'no axis'}"
        ]
        shown = [f for f in self.findings if verbose or f.severity != "info"]
        for (severity, path, fld), group in _fold(shown):
            first = group[0]
            count = f" (x{len(group)})" if len(group) > 1 else ""
            out += ["", f"{severity.upper()} {path or '<root>'}{count} {fld}".rstrip()]
            message, fix = first.message, first.fix
            if len(group) > 1:
                message, fix = layer_pattern(message), layer_pattern(fix)
            out += [f"    {message}", f"    fix: {fix}"]
        if self.redistributions:
            out += [
                "",
                "Redistributions at module boundaries"
                + ("" if verbose else " (numbered layers folded into '*'; --verbose lists each)")
                + ":",
                self._redistribution_table(fold=not verbose),
            ]
        out += [""] + [f"note: {n}" for n in self.notes]
        num_declared = sum(r.declared for r in self.redistributions)
        out.append(
            f"{'OK' if self.ok else 'FAILED'}: {len(self.errors)} error(s), "
            f"{len(self.warnings)} warning(s), {len(self.infos)} info; "
            f"{len(self.redistributions)} boundary redistribution(s) "
            f"({num_declared} declared)."
        )
        return "\n".join(out)

    def _redistribution_table(self, *, fold: bool) -> str:
        rows: dict[tuple[str, ...], int] = {}
        for r in self.redistributions:
            cost = ", ".join(
                f"{c['kind']} on {c['axis']} ({human_bytes(c['bytes'])})" for c in r.collectives
            )
            row = (
                r.path,
                r.field,
                r.source or "-",
                _axes_text(r.arrives),
                _axes_text(r.needs),
                cost or "none (local)",
                "declared" if r.declared else "implicit",
            )
            if fold:
                row = (layer_pattern(row[0]), row[1], layer_pattern(row[2]), *row[3:])
            rows[row] = rows.get(row, 0) + 1
        return table(
            ["module", "input", "from", "arrives", "needs", "costs", "kind", "count"],
            [(*row, n) for row, n in rows.items()],
            right=(7,),
        )

    def __str__(self) -> str:
        return self.to_table()


def _fold(findings: Sequence[Finding]) -> list[tuple[tuple[str, str, str], list[Finding]]]:
    groups: dict[tuple[str, str, str, str], list[Finding]] = {}
    for f in findings:
        key = (f.severity, layer_pattern(f.path), f.field, layer_pattern(f.message))
        groups.setdefault(key, []).append(f)
    folded = []
    for (severity, pattern, fld, _), group in groups.items():
        path = group[0].path if len(group) == 1 else pattern
        folded.append(((severity, path, fld), group))
    return folded


def _axes_text(placements: Mapping[str, str]) -> str:
    """``{dp: Replicate(), tp: Shard(1)}`` → ``"tp: Shard(1)"`` (replicated axes left out)."""
    shown = {a: p for a, p in placements.items() if p != "Replicate()"}
    if not shown:
        return "Replicate()"
    return ", ".join(f"{a}: {p}" for a, p in shown.items())


# ---------------------------------------------------------------------- validate


def validate(
    model_or_config: Any,
    mesh: DeviceMesh | Mapping[str, int],
    plan: Mapping[str, ShardingConfig] | str | Path | None = None,
    *,
    inputs: Sequence[torch.Tensor] | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    trace: bool = True,
    world_size: int | None = None,
    schedule: str = "1F1B",
    num_microbatches: int | None = None,
    pipeline_split: PipelineSplit | Mapping[str, Any] | None = None,
    stages_per_rank: int | None = None,
    pipeline: PipelineLayout | None = None,
) -> ValidationReport:
    """Check a model + plan + mesh shape and report every problem at once.

    No process group is needed: the mesh is given by its axis sizes. The static
    checks run on the model built on the meta device; the boundary analysis runs
    one forward pass on fake tensors over a fake process group of the mesh's size
    (skipped, with a note, when a real process group already exists).

    Args:
        model_or_config: A model ``Config`` (built on the meta device), a model
            built from ``Module`` configs (its ``sharding_config``s are the plan), or
            any ``nn.Module`` together with ``plan``.
        mesh: A :class:`~hyper_parallel.distributed.MeshLayout`, axis sizes over
            ``pp, dp_replicate, dp_shard`` (alias ``dp``), ``cp, tp, ep``
            (``{"dp": 128, "tp": 8}``), or a DeviceMesh with those dim names.
        plan: Module path pattern → ShardingConfig, or a ``.yaml``/``.json`` plan file;
            it is checked on the submesh of the axes it declares.
        inputs: Example inputs for the traced forward; by default token ids
            ``(batch_size, seq_len)`` for a model that starts with an embedding, or
            features for one that starts with a linear layer.
        batch_size: The sequences per data-parallel rank per step, split into the
            micro-batches (default: ``num_microbatches``, one sequence each; 1 without
            micro-batches); the traced forward takes one micro-batch.
        seq_len: Sequence length of the default inputs; default twice the product of
            the non-data-parallel axis sizes (at least 16), so sequence sharding divides.
        trace: Run the boundary analysis (a forward pass on fake tensors).
        world_size: Ranks the job will have; an error when the mesh's size differs.
        schedule: With ``pp > 1``: the pipeline schedule (torch's name).
        num_microbatches: Micro-batches per step, with and without ``pp`` (at ``pp=1``:
            gradient accumulation, default 1; under ``pp`` default one per stage, the
            run plan's rule,
            :func:`~hyper_parallel.distributed.run_plan.default_num_microbatches`).
        pipeline_split: With ``pp > 1``: the stage split (a
            :class:`~hyper_parallel.distributed.pipeline.PipelineSplit` or its dict
            form); ``None`` balances stages by parameter count.
        stages_per_rank: With ``pp > 1``: stages per rank (interleaved schedules).
        pipeline: With ``pp > 1``: how the model is cut into stages; by default the
            pipeline of the registered model of the same class (its family's
            :attr:`~hyper_parallel.dmodule.ModelFamily.pipeline`).

    Returns:
        A :class:`ValidationReport`; ``report.ok`` is ``False`` when there are errors.

    Raises:
        ValueError: For a malformed mesh (``LayoutError``: every problem at once).
        TypeError: For a model that is neither a Config nor an ``nn.Module``.

    Example::

        from hyper_parallel.analysis import validate
        from hyper_parallel.dmodule import get_spec

        spec = get_spec("llama3-8b")
        report = validate(spec.sharding("tp")(spec.config()), {"dp": 16, "tp": 8})
        print(report.to_table())
    """
    check_sizes("validate", batch_size=batch_size, seq_len=seq_len)  # micro-batches: the run plan's
    mesh_findings: list[Finding] = []
    if isinstance(mesh, DeviceMesh) and mesh.mesh_dim_names is not None:
        # A DeviceMesh may name an axis twice; read as sizes it would silently collapse.
        mesh_findings = check_mesh(mesh.mesh_dim_names)
    layout = as_layout(mesh)
    layout.check()
    if world_size is not None:
        mesh_findings += check_mesh(
            tuple(layout.active()), world_size=world_size, mesh_size=layout.world_size
        )
    target = resolve_target(model_or_config, plan)
    model = target.build_meta()
    entries, plan_findings = target.entries(model)
    if batch_size is None and (layout.pp > 1 or (num_microbatches or 1) > 1):
        # One sequence per micro-batch unless given: the run's micro-batches.
        batch_size = num_microbatches or default_num_microbatches(
            layout.pp, schedule, stages_per_rank
        )
    # The run's decisions and checks: the same object the trainer and `plan` ask.
    run = target.run_plan(
        layout,
        model,
        entries,
        pipeline_layout=pipeline,
        schedule=schedule,
        num_microbatches=num_microbatches,
        pipeline_split=pipeline_split,
        stages_per_rank=stages_per_rank,
        batch_size=batch_size,
        seq_len=seq_len if seq_len is not None or layout.pp == 1 else _default_seq_len(layout),
    )
    pipeline_errors = [f for f in run.pipeline_findings if f.severity == "error"]
    if layout.pp > 1:
        # The rest is one pipeline's model-parallel group, as each stage is built.
        layout = dataclasses.replace(layout, pp=1)
    # One forward sees one micro-batch (a pipeline's, or gradient accumulation's at pp=1).
    if batch_size is not None and batch_size % max(1, run.num_microbatches) == 0:
        batch_size //= max(1, run.num_microbatches)
    batch_size = 1 if batch_size is None else batch_size
    plan_axes = run.dense_plan_axes
    report = ValidationReport(
        model=target.name,
        mesh=as_layout(mesh).active(),
        layout=as_layout(mesh),
        plan_axes=plan_axes,
    )
    sizes = {a: layout.size(a) for a in DENSE_AXES}
    findings = [*mesh_findings, *run.findings]
    findings += _user_mesh_findings(mesh)
    dense = [e for e in entries if e.config.dispatch is None]
    experts = [e for e in entries if e.config.dispatch is not None]
    findings += [*plan_findings, *check_entries(dense, DENSE_AXES, sizes, model)]
    if experts:  # routed experts are applied on the ep mesh
        findings += [
            f for f in check_entries(experts, ("ep",), {"ep": layout.ep}) if f not in findings
        ]
    # A parameter no config names is replicated over the axes a plan shards parameters on:
    # tp (and cp where the plan declares it). The data axes are data parallelism's (FSDP2
    # shards over them in training, a replica per rank is DP's design), so a mesh without
    # such an axis (dp only, dp x ep) has nothing to report: hundreds of false warnings.
    model_axes = tuple(
        a for a in ("cp", "tp") if layout.size(a) > 1 and (a == "tp" or a in plan_axes)
    )
    if model_axes:
        findings += _coverage(model, entries, model_axes)
    # A sequence the run cannot split (head-tail over cp, over tp under SP or the MoE's
    # slices) fails the traced forward too: one error, not a second one blaming placements.
    unsplit = [f for f in run.findings if f.severity == "error" and f.field == "seq_len"]
    if trace and pipeline_errors:
        report.notes.append("boundary analysis skipped: the pipeline plan has errors.")
    elif trace and unsplit:
        report.notes.append(
            "boundary analysis skipped: the sequence length cannot be split as the run "
            "needs (the seq_len error above)."
        )
    elif trace:
        if seq_len is None:
            seq_len = _default_seq_len(layout)
        # The run's own findings at the model's root (path "": the micro-batch count, the
        # sequence length) say nothing of the root module's config, which under cp carries
        # the positions: dropping it for them made the trace fail with a finding of its own.
        run_level = {id(f) for f in [*mesh_findings, *run.findings] if not f.path}
        broken = {f.path for f in findings if f.severity == "error" and id(f) not in run_level}
        findings += _trace(target, run, layout, broken, report, inputs, batch_size, seq_len)
    order = {"error": 0, "warning": 1, "info": 2}
    report.findings = sorted(_unique(findings), key=lambda f: order.get(f.severity, 3))
    return report


def _unique(findings: Sequence[Finding]) -> list[Finding]:
    out: list[Finding] = []
    for f in findings:
        if f not in out:
            out.append(f)
    return out


def _default_seq_len(layout: MeshLayout) -> int:
    """Twice the product of the sequence-sharding axes (at least 16): every split divides."""
    return max(16, 2 * math.prod(layout.size(a) for a in ("cp", "tp")))


def _user_mesh_findings(mesh: Any) -> list[Finding]:
    """The HSDP trap in a DeviceMesh the user passed: data and model axes side by side."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim < 2:
        return []
    names = tuple(mesh.mesh_dim_names or ())
    data = [a for a in names if a in _DATA_AXES]
    if not data or names in (("dp_replicate", "dp_shard"), ("dp_replicate", "fsdp")):
        return []
    if mesh.ndim == 2:
        found = fsdp_mesh_findings(mesh, "mesh")
        if found:
            return found
    return [
        Finding(
            "warning",
            "mesh",
            "fsdp mesh",
            f"the DeviceMesh {names} puts the data axis {data[0]!r} beside other axes: "
            "handing it, or a 2-D slice of it, to fully_shard silently becomes HSDP "
            "(replicate over the first dim, shard over the second), not FSDP over the "
            "data ranks.",
            "build the mesh with MeshLayout(...).build() and hand fully_shard "
            "ParallelMesh.fsdp_mesh() (1-D fsdp, or (dp_replicate, fsdp) for HSDP).",
        )
    ]


# ---------------------------------------------------------------------- coverage


def _coverage(
    model: nn.Module, entries: Sequence[PlanEntry], axes: tuple[str, ...]
) -> list[Finding]:
    """Parameters that no config names: plain (uncovered) or implicitly replicated."""
    named: set[int] = set()
    for e in entries:
        for key in e.config.state_shardings:
            t = get_state(e.module, key)
            if t is not None:
                named.add(id(t))
    configured = {id(e.module) for e in entries}
    findings, seen = [], set()
    replicated = {a: "Replicate()" for a in axes}
    for path, m in model.named_modules():
        for name, p in m._parameters.items():
            if p is None or id(p) in seen or id(p) in named:
                continue
            seen.add(id(p))
            where = f"{path}.{name}" if path else name
            size = f"{tuple(p.shape)}, {p.numel():,} elements"
            if id(m) in configured:
                findings.append(
                    Finding(
                        "info",
                        path,
                        f"state_shardings[{name!r}]",
                        f"parameter {name!r} {size} is not named in state_shardings, so it is "
                        f"replicated implicitly ({replicated}).",
                        f"name it in state_shardings to shard it (e.g. {{{name!r}: "
                        f"{{'{axes[-1]}': Shard(0)}}}}), or leave it replicated.",
                    )
                )
            else:
                findings.append(
                    Finding(
                        "warning",
                        path,
                        "",
                        f"parameter {where!r} {size} is covered by no sharding config: it stays "
                        f"a plain tensor, a full copy on every rank of {' x '.join(axes)}.",
                        f"add a config for {path or '<root>'!r} (state_shardings={{{name!r}: "
                        "...}), or keep it replicated knowingly.",
                    )
                )
    return findings


# ---------------------------------------------------------------------- boundary trace


@dataclass(frozen=True)
class _Label:
    """Where a tensor came from: the configured module that produced it, and its layout."""

    path: str
    seq: int
    placements: tuple[Placement, ...] | None  # shard dims stored negative (from the end)
    local: bool  # handed on as a plain local tensor


def _from_end(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim - ndim if p.dim >= 0 else p.dim) if isinstance(p, Shard) else p
        for p in placements
    )


def _normalized(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim + ndim if p.dim < 0 else p.dim) if isinstance(p, Shard) else p
        for p in placements
    )


class _Provenance(TorchFunctionMode):
    """Labels every op's outputs with the most recent producer among its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # The newest DTensor an op produced: what a module turns into its local output.
        self.last_dtensor: DTensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, DTensor):
            self.last_dtensor = out
        newest: _Label | None = None
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                label = self.labels.get(t)
                if label is not None and (newest is None or label.seq > newest.seq):
                    newest = label
        if newest is not None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    old = self.labels.get(t)
                    if old is None or old.seq < newest.seq:
                        self.labels[t] = newest
        return out


class _BoundaryTracer:
    """Forward hooks on the configured modules, comparing what arrives with what is declared."""

    def __init__(self, entries: Sequence[PlanEntry], shape: MeshShape) -> None:
        self.entries = {id(e.module): e for e in entries}
        self.shape = shape
        self.axes = tuple(shape)
        self.provenance = _Provenance()
        self.counter = itertools.count()
        self.findings: list[Finding] = []
        self.redistributions: list[Redistribution] = []
        self.stack: list[str] = []
        self.names: dict[int, str] = {}

    @contextlib.contextmanager
    def active(self, model: nn.Module) -> Iterator[None]:
        self.names = {id(m): p for p, m in model.named_modules()}
        handles = [
            register_module_forward_pre_hook(self._push),
            register_module_forward_hook(self._pop),
        ]
        for e in self.entries.values():
            handles.append(e.module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            handles.append(e.module.register_forward_hook(self._post_hook))
        try:
            with self.provenance:
                yield
        finally:
            for h in handles:
                h.remove()

    def current_path(self) -> str | None:
        return self.stack[-1] if self.stack else None

    # hooks ----------------------------------------------------------------

    def _push(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._check_inputs(self.entries[id(module)], args, kwargs)

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        entry = self.entries[id(module)]
        config = entry.config
        declared = config.out_dst_shardings or config.out_src_shardings
        seq = next(self.counter)
        outputs = pytree.tree_leaves(output)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        for i, t in enumerate(tensors):
            if isinstance(t, DTensor):
                label = _Label(entry.path, seq, _from_end(t.placements, t.ndim), False)
            else:
                placements = self._local_layout(declared, i, t)
                if placements is None:
                    continue
                label = _Label(entry.path, seq, _from_end(placements, t.ndim), True)
            self.provenance.labels[t] = label

    def _local_layout(
        self, declared: Any, index: int, local: torch.Tensor
    ) -> tuple[Placement, ...] | None:
        """Layout of a local output: as declared, else that of the DTensor it was taken from."""
        named = declared[index] if isinstance(declared, tuple) else declared
        if isinstance(named, Mapping):
            return tuple(resolve_placements(named, self.axes))
        last = self.provenance.last_dtensor
        if (
            last is not None
            and last.device_mesh.mesh_dim_names == self.axes
            and last.to_local().shape == local.shape
        ):
            return tuple(last.placements)
        return None

    # checks ---------------------------------------------------------------

    def _check_inputs(self, entry: PlanEntry, args: tuple[Any, ...], kwargs: dict) -> None:
        config = entry.config
        src_map = config.in_src_shardings or {}
        dst_map = config.in_dst_shardings or {}
        names = [*dst_map, *(k for k in src_map if k not in dst_map)]
        if not names:
            return
        try:
            sig = forward_signature(entry.module)
            bound = sig.bind_partial(*args, **kwargs).arguments
        except (TypeError, ValueError):
            return
        var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        extra = bound.get(var_kw, {}) if var_kw is not None else {}
        for name in names:
            value = bound.get(name, extra.get(name))
            if not isinstance(value, torch.Tensor):
                continue
            dst = self._resolve(dst_map.get(name), value.ndim)
            src = self._resolve(src_map.get(name), value.ndim)
            label = self.provenance.labels.get(value)
            if isinstance(value, DTensor):
                self._check_dtensor(entry, name, value, src, dst, label)
            else:
                self._check_local(entry, name, value, src or dst, label)
                if src is not None and dst is not None and src != dst:
                    # Wrapped as src, then redistributed to dst, as the module declares.
                    local_bytes = value.numel() * value.element_size()
                    self._record(entry, name, src, dst, local_bytes, True, label)
            if dst is not None:
                self._check_divisible(entry, name, value, dst)

    def _resolve(self, named: NamedPlacement | None, ndim: int) -> tuple[Placement, ...] | None:
        if named is None:
            return None
        return _normalized(resolve_placements(named, self.axes), ndim)

    def _texts(self, placements: Sequence[Placement]) -> dict[str, str]:
        return {a: placement_text(p) for a, p in zip(self.axes, placements)}

    def _check_dtensor(
        self,
        entry: PlanEntry,
        name: str,
        value: DTensor,
        src: tuple[Placement, ...] | None,
        dst: tuple[Placement, ...] | None,
        label: _Label | None,
    ) -> None:
        if dst is None or value.device_mesh.mesh_dim_names != self.axes:
            return
        arrives = _normalized(value.placements, value.ndim)
        if arrives == dst:
            return
        declared = src is not None and arrives == src
        local_bytes = value.to_local().numel() * value.element_size()
        collectives = self._record(entry, name, arrives, dst, local_bytes, declared, label)
        source = label.path if label is not None else None
        field_name = f"in_dst_shardings[{name!r}]"
        if declared:
            return
        cost = ", ".join(
            f"{c['kind']} on {c['axis']} ({human_bytes(c['bytes'])} per call)" for c in collectives
        )
        origin = f"the output of {source}" if source else "the value passed in"
        self.findings.append(
            Finding(
                "warning",
                entry.path,
                field_name,
                f"input {name!r} arrives as {_axes_text(self._texts(arrives))} ({origin}) but the "
                f"module needs {_axes_text(self._texts(dst))}: an implicit redistribution costing "
                f"{cost or 'no collective (a local slice)'}.",
                f"if intended, declare in_src_shardings[{name!r}] = "
                f"{_axes_text(self._texts(arrives))} to document it; otherwise make "
                f"{source or 'the producer'}'s out_dst_shardings match.",
            )
        )

    def _record(
        self,
        entry: PlanEntry,
        name: str,
        arrives: tuple[Placement, ...],
        dst: tuple[Placement, ...],
        local_bytes: int,
        declared: bool,
        label: _Label | None,
    ) -> list[dict[str, Any]]:
        collectives = [
            {
                "kind": kind,
                "axis": axis,
                "bytes": local_bytes * self.shape[axis] if kind == ALL_GATHER else local_bytes,
            }
            for kind, axis in redistribution_collectives(arrives, dst, self.axes)
        ]
        self.redistributions.append(
            Redistribution(
                entry.path,
                f"in_dst_shardings[{name!r}]",
                label.path if label is not None else None,
                self._texts(arrives),
                self._texts(dst),
                collectives,
                declared,
            )
        )
        return collectives

    def _check_local(
        self,
        entry: PlanEntry,
        name: str,
        value: torch.Tensor,
        reads_as: tuple[Placement, ...] | None,
        label: _Label | None,
    ) -> None:
        if reads_as is None or label is None or not label.local or label.placements is None:
            return
        produced = _normalized(label.placements, value.ndim)
        if produced == reads_as:
            return
        self.findings.append(
            Finding(
                "warning",
                entry.path,
                f"in_src_shardings[{name!r}]"
                if entry.config.in_src_shardings
                else (f"in_dst_shardings[{name!r}]"),
                f"input {name!r} is the local tensor {label.path} handed on as "
                f"{_axes_text(self._texts(produced))} (use_local_output), but this module reads "
                f"it as {_axes_text(self._texts(reads_as))}: no communication happens and the "
                "values are misread.",
                f"make {name!r}'s in_src (or in_dst) {_axes_text(self._texts(produced))}, or "
                f"change {label.path}'s out_dst_shardings.",
            )
        )

    def _check_divisible(
        self, entry: PlanEntry, name: str, value: torch.Tensor, dst: tuple[Placement, ...]
    ) -> None:
        divisors: dict[int, int] = {}
        axes_of: dict[int, list[str]] = {}
        for axis, p in zip(self.axes, dst):
            if isinstance(p, Shard) and p.dim < value.ndim:
                divisors[p.dim] = divisors.get(p.dim, 1) * self.shape[axis]
                axes_of.setdefault(p.dim, []).append(axis)
        for dim, divisor in divisors.items():
            size = value.shape[dim]
            if divisor > 1 and size % divisor:
                per_rank = -(-size // divisor)
                axis = "x".join(axes_of[dim])
                self.findings.append(
                    Finding(
                        "warning",
                        entry.path,
                        f"in_dst_shardings[{name!r}]",
                        f"input {name!r} dim {dim} has size {size} in the traced forward, not "
                        f"divisible by {divisor} (axis {axis!r}): shards of {per_rank} and "
                        f"{size - per_rank * (divisor - 1)}, uneven.",
                        f"choose batch/sequence sizes divisible by {divisor} (the {axis!r} "
                        "size), e.g. pad the sequence.",
                    )
                )


def _trace(
    target: Target,
    run: RunPlan,
    layout: MeshLayout,
    broken: set[str],
    report: ValidationReport,
    inputs: Sequence[torch.Tensor] | None,
    batch_size: int,
    seq_len: int,
) -> list[Finding]:
    """Run the parallelized model forward once on fake tensors; return the findings."""
    mode = FakeTensorMode()
    model = target.build_fake(mode)
    entries, _ = target.entries(model)
    if any(getattr(e.module, BOUNDARY_ATTR, None) is not None for e in entries):
        report.notes.append("boundary analysis skipped: the model is already parallelized.")
        return []
    kept = [e for e in entries if e.path not in broken and e.config.dispatch is None]
    if any(e.config.dispatch is not None for e in entries):
        report.notes.append(
            "boundary analysis ran with the routed experts unsplit (their dispatch is traced "
            "by `plan`, on the ep mesh)."
        )
    if len(kept) < len([e for e in entries if e.config.dispatch is None]):
        report.notes.append(
            f"boundary analysis ran without the {len(entries) - len(kept)} module config(s) "
            "that have errors."
        )
    try:
        with fake_world(layout) as world, fake_trace():
            mesh = run.plan_mesh(world)  # the builder's (a plan naming no axis: the dense mesh)
            shape = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
            return _trace_on(
                target, model, mesh, kept, shape, report, inputs, batch_size, seq_len, mode
            )
    except RuntimeError as e:
        if "process group" not in str(e):
            raise
        report.notes.append(f"boundary analysis skipped: {e}")
        return []


def _trace_on(
    target: Target,
    model: nn.Module,
    mesh: DeviceMesh,
    entries: Sequence[PlanEntry],
    shape: MeshShape,
    report: ValidationReport,
    inputs: Sequence[torch.Tensor] | None,
    batch_size: int,
    seq_len: int,
    mode: FakeTensorMode,
) -> list[Finding]:
    plain: tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]] | None = None
    try:
        args = _fake_inputs(inputs, mode) if inputs is not None else None
        kwargs: dict[str, torch.Tensor] = {}
        layout = report.layout
        if args is None and layout is not None and layout.cp > 1 and "cp" in report.plan_axes:
            # One sequence: the placements do not depend on the batch, and a linear layer
            # flattening (batch, seq / cp) reads a sequence shard as a strided shard of
            # the rows, whose sharding DTensor cannot propagate on fake tensors (a
            # data-dependent size): a batch > 1 refused runs the trainer runs.
            args, kwargs = cp_inputs(model, 1, seq_len, layout.cp, mode)
            # Without its plan the model runs on one device: the whole sequence, its own
            # positions (a rank's part would pass checks of the global length, the rope's).
            plain = default_inputs(model, 1, seq_len, mode), {}
        if args is None:
            args = default_inputs(model, batch_size, seq_len, mode)
    except ValueError as e:
        report.notes.append(f"boundary analysis skipped: {e}")
        return []
    try:
        target.parallelize(model, mesh, entries)
    except ParallelizeError as e:
        report.notes.append(f"boundary analysis skipped: the plan could not be applied: {e}")
        return []
    tracer = _BoundaryTracer(entries, shape)
    try:
        with tracer.active(model), mode:
            model(*args, **kwargs)
    except Exception as e:  # any failure of the forward is a finding
        path = tracer.current_path()
        reason = _plain_forward_failure(target, *(plain or (args, kwargs)), mode=mode)
        if reason is not None:
            report.notes.append(
                f"boundary analysis skipped: the example inputs do not fit the model even "
                f"without the plan ({reason}); pass inputs=."
            )
            return []
        tracer.findings.append(
            Finding(
                "error",
                path or "",
                "forward",
                f"the forward pass fails once the plan is applied "
                f"(traced on fake tensors, inputs {[tuple(a.shape) for a in args]}): "
                f"{type(e).__name__}: {_first_lines(str(e))}",
                _forward_failure_fix(model, path, str(e)),
            )
        )
    report.traced = True
    report.redistributions = tracer.redistributions
    report.notes.append(
        f"boundary analysis: one forward pass on fake tensors over a fake process group of "
        f"{torch.distributed.get_world_size()} ranks, plan on the "
        f"{' x '.join(mesh.mesh_dim_names or ())} submesh, inputs "
        f"{[tuple(a.shape) for a in args]}."
    )
    return tracer.findings


def _forward_failure_fix(model: nn.Module, path: str | None, error: str) -> str:
    """The fix of a traced forward's failure: specific for the commonest first mistake —
    a module whose states the plan makes DTensors, its inputs left plain tensors (torch's
    ColwiseParallel converts them; a ShardingConfig says so in ``in_dst_shardings``)."""
    if "mixed torch.Tensor and DTensor" not in error:
        return "fix the placements of this module and its neighbours so the shapes agree."
    module = dict(model.named_modules()).get(path or "")
    names = []
    if module is not None:
        try:
            params = list(inspect.signature(type(module).forward).parameters)[1:]
        except (TypeError, ValueError):
            params = []
        names = [n for n in params if n not in ("args", "kwargs")]
    arg = names[0] if names else "input"
    return (
        f"say where this module's inputs are (its states are DTensors, an input arrives as "
        f"a plain tensor): e.g. in_dst_shardings={{'{arg}': {{'tp': Replicate()}}}} before a "
        f"column-wise (Shard(0)) weight, {{'{arg}': {{'tp': Shard(-1)}}}} before a row-wise "
        "(Shard(1)) one, or out_dst_shardings on the module that produces it."
    )


def _plain_forward_failure(
    target: Target,
    args: Sequence[torch.Tensor],
    kwargs: Mapping[str, torch.Tensor] | None = None,
    *,
    mode: FakeTensorMode,
) -> str | None:
    """Why the model without its plan cannot run on ``args`` (``None`` when it can)."""
    model = target.build_fake(mode)
    try:
        with mode:
            model(*args, **(kwargs or {}))
    except Exception as e:
        return f"{type(e).__name__}: {_first_lines(str(e))}"
    return None


def _fake_inputs(inputs: Sequence[torch.Tensor], mode: FakeTensorMode) -> tuple[torch.Tensor, ...]:
    out = []
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"inputs must be tensors, got {type(t).__name__}.")
        with mode:
            out.append(torch.zeros(t.shape, dtype=t.dtype))
    return tuple(out)


def _first_lines(text: str, limit: int = 400) -> str:
    text = " ".join(text.strip().splitlines()[:3])
    return text if len(text) <= limit else text[: limit - 1] + "…"
