"""The dry run's report: per-module parameter shards, collectives and per-rank memory
(:class:`DryRunReport`), as a table or JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.distributed.layout import (
    MeshLayout,
)

from .._format import human_bytes, layer_pattern, table
from .._world import MeshShape
from ..collectives import (
    CollectiveStat,
)
from ..memory import StateBytes, state_bytes

__all__ = ["ANALYSIS_AXES", "DryRunReport", "ModuleShards", "ParamShard"]

ANALYSIS_AXES = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
"""User axes the dry run and ``validate`` trace; others of size > 1 are refused, by name."""

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ParamShard:
    """One parameter: its global shape, placement per mesh axis and rank 0's local shard."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: dict[str, str]
    dtype: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "global_shape": list(self.global_shape),
            "local_shape": list(self.local_shape),
            "placements": dict(self.placements),
            "dtype": self.dtype,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class ModuleShards:
    """The parameters a module holds itself."""

    path: str
    type: str
    params: tuple[ParamShard, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "type": self.type, "params": [p.to_dict() for p in self.params]}


@dataclass
class DryRunReport:
    """What one training step costs each rank.

    Attributes:
        model: The model's class name.
        mesh: The active axes (size > 1) → size.
        world_size: Number of ranks.
        num_params: Parameters of the whole model.
        num_expert_params: Of those, the routed experts' (the modules an ``ep`` plan
            entry dispatches to; 0 for a dense model).
        batch_size: Per-rank batch of the traced step (one micro-batch).
        num_microbatches: Micro-batches per step (gradient accumulation at pp=1): the
            collectives are a whole step's, the activations one micro-batch's.
        seq_len: Sequence length of the traced step.
        param_dtype: Parameter dtype, e.g. ``"float32"``.
        fsdp: Whether FSDP2 shards dense states over the data axes.
        fsdp_axes: The dims of the mesh FSDP2 runs on: ``("fsdp",)``, or
            ``("dp_replicate", "fsdp")`` for HSDP; ``()`` without FSDP.
        plan_axes: The axes the plan declares: the submesh it is applied on.
        columns: The placement columns of the parameter table (each active axis;
            ``fsdp`` stands for dp_shard x cp when FSDP shards over it).
        layout: The full mesh layout (every axis, derived sizes).
        modules: Per module, its parameters' placements and rank 0's shards.
        per_rank: Bytes per rank of parameters, gradients and AdamW state.
        collectives: Per (kind, axis, phase): count and bytes per rank per step.
        collectives_per_layer: The same for one layer, when layers were extrapolated.
        comm_debug_counts: ``CommDebugMode``'s count per collective op (per step).
        num_layers: Layers of the model, when it has a list of identical layers.
        traced_layers: The depths actually traced (``None``: the full model).
        assumptions: How the numbers were obtained; read them with the numbers.
        elapsed_s: Wall time of the dry run.
        ac: Activation checkpointing assumed for ``per_rank.activations``.
        dtype: Compute precision assumed for ``per_rank.activations``.
    """

    model: str
    mesh: MeshShape
    world_size: int
    num_params: int
    batch_size: int
    seq_len: int
    param_dtype: str
    fsdp: bool
    fsdp_axes: tuple[str, ...]
    plan_axes: tuple[str, ...]
    columns: tuple[str, ...]
    layout: MeshLayout
    modules: list[ModuleShards]
    per_rank: StateBytes
    collectives: list[CollectiveStat]
    collectives_per_layer: list[CollectiveStat] | None = None
    comm_debug_counts: dict[str, int] = field(default_factory=dict)
    num_layers: int | None = None
    traced_layers: tuple[int, ...] | None = None
    assumptions: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    per_rank_experts: StateBytes | None = None
    num_expert_params: int = 0
    num_microbatches: int = 1

    def _per_rank_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.per_rank.to_dict()
        e = self.per_rank_experts
        if e is not None:  # routed experts (split over ep x efsdp) and the rest, apart
            out["experts"] = e.to_dict()
            out["dense"] = state_bytes(
                self.per_rank.params - e.params,
                self.per_rank.grads - e.grads,
                0,
            ).to_dict() | {"optimizer": self.per_rank.optimizer - e.optimizer}
            out["dense"]["total"] = sum(out["dense"][k] for k in ("params", "grads", "optimizer"))
        return out

    ac: str = "none"
    dtype: str = "fp32"
    activations_by_ac: dict[str, int] = field(default_factory=dict)
    """Peak saved bytes under each checkpointing mode, from the same trace (one forward
    records what every mode keeps); ``selective`` extrapolated like the rest (linear in
    the depth from the traced depths)."""
    activations_held_by_ac: dict[str, int] = field(default_factory=dict)
    """Saved bytes one micro-batch holds at the end of its forward under each mode: the
    peak less the working set of a recompute. A pipeline stage holds this for each
    micro-batch in flight but the one in its backward (which reaches the peak)."""
    activations_outside_blocks: tuple[int, int] = (0, 0)
    """Saved bytes before the first block (embedding) and after the last (final norm,
    output projection, loss) of one micro-batch."""
    activations_per_block: tuple[int, int, int] | None = None
    """``(saved, kept, recomputed)`` of one block: what it adds to the ``none`` peak
    (everything it saves) and to the ``full`` peak (the input a checkpointed block
    keeps), the slopes between the two traced depths (a model traced whole: its last
    block's); and what it holds while backward recomputes it (its input and what it
    saves again). ``None`` for a model without blocks."""
    activations_per_block_op: tuple[int, int] | None = None
    """``(kept, recomputed)`` of one block under ``op`` checkpointing: its input and
    the operator outputs it keeps (the slope of the ``op`` end-of-forward bytes between
    the traced depths), and what it holds while backward recomputes the rest."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the CLI's ``--format json``)."""
        per_layer = self.collectives_per_layer
        return {
            "model": self.model,
            "world_size": self.world_size,
            "mesh": self.layout.to_dict(derived=True),
            "num_params": self.num_params,
            "num_expert_params": self.num_expert_params,
            "batch_size": self.batch_size,
            "num_microbatches": self.num_microbatches,
            "seq_len": self.seq_len,
            "param_dtype": self.param_dtype,
            "fsdp": self.fsdp,
            "fsdp_axes": list(self.fsdp_axes),
            "plan_axes": list(self.plan_axes),
            "placement_axes": list(self.columns),
            "ac": self.ac,
            "dtype": self.dtype,
            "per_rank_bytes": self._per_rank_dict(),
            "collectives": [c.to_dict() for c in self.collectives],
            "collectives_per_layer": None
            if per_layer is None
            else [c.to_dict() for c in per_layer],
            "comm_debug_counts": dict(self.comm_debug_counts),
            "num_layers": self.num_layers,
            "traced_layers": None if self.traced_layers is None else list(self.traced_layers),
            "modules": [m.to_dict() for m in self.modules],
            "assumptions": list(self.assumptions),
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def _precision(self) -> str:
        """``float32 parameters`` or, under ``dtype="bf16"``, the mixed precision's split."""
        if self.dtype == "bf16-true":
            return f"{self.param_dtype} parameters, gradients and AdamW state (bf16-true)"
        if self.dtype == "bf16":
            return (
                f"{self.param_dtype} parameters, gradients and AdamW state, bfloat16 compute "
                "(mixed precision)"
            )
        return f"{self.param_dtype} parameters"

    def to_table(self, on: str | None = None) -> str:
        """The report for people: parameters, memory, collectives, assumptions, summary.

        Args:
            on: Where the header says the plan runs (default: this report's mesh and
                ranks; :meth:`to_pipeline_table` names the whole mesh and the group).
        """
        axes = list(self.columns)
        fsdp_text = "no FSDP"
        if self.fsdp:
            kind = "HSDP" if "dp_replicate" in self.fsdp_axes else "FSDP2"
            fsdp_text = f"{kind} over {' x '.join(self.fsdp_axes)}"
            if "fsdp" in self.fsdp_axes:
                fsdp_text += " (fsdp = dp_shard x cp)"
        out = [
            f"plan: {self.model} on "
            f"{on or f'{self.layout.describe()} ({self.world_size:,} ranks)'}; "
            f"batch {self.batch_size} x seq {self.seq_len}"
            + (f" x {self.num_microbatches} micro-batches" if self.num_microbatches > 1 else "")
            + f"; {self._precision()}; "
            f"{fsdp_text}; plan on {' x '.join(self.plan_axes) or 'no axis'}",
            "",
            "Parameters (rank 0's shard; one placement column per mesh axis; numbered layers "
            "folded into '*'):",
        ]
        rows = []
        for (path, name), (p, count) in _fold_params(self.modules).items():
            rows.append(
                (
                    path + (f" (x{count})" if count > 1 else ""),
                    name,
                    _shape(p.global_shape),
                    *(p.placements.get(a, "Replicate()") for a in axes),
                    _shape(p.local_shape),
                    human_bytes(p.bytes),
                )
            )
        right = (len(axes) + 4,)
        out.append(table(["module", "param", "global", *axes, "local", "bytes"], rows, right))
        m = self.per_rank
        memory = self._per_rank_dict()
        activations_label = f"activations (ac={self.ac}, {self.dtype})"
        if "experts" in memory:
            e, d = memory["experts"], memory["dense"]
            rows = [
                (label, human_bytes(d[k]), human_bytes(e[k]), human_bytes(memory[k]))
                for label, k in (
                    ("parameters", "params"),
                    ("gradients", "grads"),
                    ("AdamW moments", "optimizer"),
                )
            ]
            rows.append((activations_label, "", "", human_bytes(m.activations)))
            rows.append(("total", "", "", human_bytes(m.total)))
            memory_table = table(["state", "dense", "experts", "bytes"], rows, right=(1, 2, 3))
        else:
            memory_table = table(
                ["state", "bytes"],
                [
                    ("parameters", human_bytes(m.params)),
                    ("gradients", human_bytes(m.grads)),
                    ("AdamW moments", human_bytes(m.optimizer)),
                    (f"activations (ac={self.ac}, {self.dtype})", human_bytes(m.activations)),
                    ("total", human_bytes(m.total)),
                ],
                right=(1,),
            )
        out += [
            "",
            "Memory per rank (training states, plus one micro-batch's activations):",
            memory_table,
            "",
            "Collectives per training step (per rank):",
            _collective_table(self.collectives),
        ]
        if self.collectives_per_layer is not None:
            out += ["", "Of which one layer:", _collective_table(self.collectives_per_layer)]
        out += ["", "Assumptions:"] + [f"  - {a}" for a in self.assumptions]
        num_calls = sum(c.count for c in self.collectives)
        moved = sum(c.bytes for c in self.collectives)
        out += [
            "",
            f"Summary: {_count(self.num_params)} parameters on {self.world_size:,} ranks: "
            f"{human_bytes(m.total)} per rank with activations; {num_calls:,} collectives per "
            f"step over {human_bytes(moved)} of buffers per rank ({self.elapsed_s:.1f} s).",
        ]
        return "\n".join(out)

    def to_pipeline_table(self, layout: Any, pipeline: dict[str, Any]) -> str:
        """:meth:`to_table` of a pipeline's trace: this report is the whole model traced on
        one pipeline's group (the mesh without pp), which the table says; its memory is
        the heaviest pp rank's (its stages' states and activations in flight: the
        ``per_rank_bytes`` of ``pipeline``, the pipeline part of ``plan``'s report), and
        the summary counts every rank of ``layout``."""
        heaviest = pipeline["per_rank_bytes"]
        ranks: dict[int, list[int]] = {}
        totals: dict[int, int] = {}
        for s in pipeline["stages"]:
            ranks.setdefault(s["rank"], []).append(s["stage"])
            totals[s["rank"]] = totals.get(s["rank"], 0) + s["total"]
        rank = min(r for r in totals if totals[r] == max(totals.values()))
        per_rank = StateBytes(
            heaviest["params"], heaviest["grads"], heaviest["optimizer"], heaviest["activations"]
        )
        # The header names the whole mesh (it said "on one device (1 ranks)" at pp=2).
        axes = " x ".join(f"{a}={n}" for a, n in self.layout.active().items()) or "one device"
        on = (
            f"{layout.describe()} ({layout.world_size:,} ranks; one pipeline's group: {axes}, "
            f"{self.world_size:,} rank{'s' if self.world_size > 1 else ''})"
        )
        lines = dataclasses.replace(self, per_rank=per_rank, per_rank_experts=None)
        lines = lines.to_table(on=on).split("\n")
        stages = ", ".join(map(str, ranks[rank]))
        scope = (
            f"pp={layout.pp} ({layout.world_size:,} ranks): parameters and collectives below "
            f"are the whole model traced on one pipeline's group of {self.world_size:,} "
            f"ranks, every stage's units at once; memory per rank is the heaviest pp rank's, "
            f"rank {rank} (stage{'s' if len(ranks[rank]) > 1 else ''} {stages}: states and "
            "the activations of its micro-batches in flight); each stage's at the end."
        )
        calls = sum(c.count for c in self.collectives)
        moved = sum(c.bytes for c in self.collectives)
        relabel = {
            "Memory per rank (": f"Memory per rank (pp rank {rank}, the heaviest: training "
            "states, plus the activations of its micro-batches in flight):",
            "Collectives per training step (per rank):": "Collectives per training step (per "
            "rank, the whole model on one pipeline's group; each stage's own at the end):",
            "Summary:": f"Summary: {_count(self.num_params)} parameters on "
            f"{layout.world_size:,} ranks (pp={layout.pp} x {self.world_size:,}): the "
            f"heaviest pp rank holds {human_bytes(per_rank.total)} with activations; the "
            f"whole model on one pipeline's group: {calls:,} collectives per step over "
            f"{human_bytes(moved)} of buffers per rank ({self.elapsed_s:.1f} s).",
        }
        out = [lines[0], scope]
        for line in lines[1:]:
            out.append(next((new for old, new in relabel.items() if line.startswith(old)), line))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_table()


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n:,}"


def _shape(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


def _fold_params(modules: Sequence[ModuleShards]) -> dict[tuple[str, str], tuple[ParamShard, int]]:
    folded: dict[tuple[str, str], tuple[ParamShard, int]] = {}
    for m in modules:
        for p in m.params:
            key = (layer_pattern(m.path), p.name)
            first, count = folded.get(key, (p, 0))
            folded[key] = (first, count + 1)
    return folded


def _collective_table(stats: Sequence[CollectiveStat]) -> str:
    if not stats:
        return "  (none)"
    rows = [
        (
            s.phase,
            s.kind if s.traced else f"{s.kind} (computed)",
            s.axis,
            f"{s.count:,}",
            human_bytes(s.bytes),
            human_bytes(s.wire_bytes),
        )
        for s in stats
    ]
    return table(["phase", "kind", "axis", "count", "bytes", "wire bytes"], rows, right=(3, 4, 5))


# ---------------------------------------------------------------------- dry run
