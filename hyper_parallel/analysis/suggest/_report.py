"""What a search returns: candidates, predictions, the report and its chart."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hyper_parallel.analysis._format import human_bytes, table
from hyper_parallel.analysis.cost_model import (
    Hardware,
)
from hyper_parallel.distributed.layout import MeshLayout


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout: mesh sizes, micro-batches, schedule, checkpointing, sequence parallel."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    microbatches: int
    schedule: str | None
    ac: str
    sp: bool
    stages_per_rank: int | None = None
    """Pipeline stages each rank runs (interleaved schedules); ``None``: the schedule's
    default (:func:`~hyper_parallel.distributed.pipeline.stages_per_rank_of`)."""
    reduce_each: bool = False
    """Gradient accumulation (pp=1) with FSDP2 reducing each micro-batch's gradients
    (``--reduce-each-microbatch``: sharded accumulation) rather than only the last's."""

    @property
    def layout(self) -> MeshLayout:
        return MeshLayout(
            pp=self.pp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            ep=self.ep,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def mesh(self) -> dict[str, int]:
        """Every user axis and its size (JSON ``mesh``)."""
        return {a: getattr(self, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}

    def mesh_text(self) -> str:
        """``pp=2,dp_shard=4,tp=8`` (axes of size > 1; ``dp_shard=1`` for one device)."""
        active = [f"{a}={s}" for a, s in self.mesh().items() if s > 1]
        return ",".join(active) or "dp_shard=1"

    def stages(self) -> int | None:
        """Pipeline stages each rank runs, the schedule's default resolved (``None``
        without pp)."""
        if self.pp == 1:
            return None
        from hyper_parallel.distributed.pipeline.plan import stages_per_rank_of

        return stages_per_rank_of(self.schedule or "1F1B", self.stages_per_rank)

    def schedule_text(self) -> str:
        """The table's schedule cell: ``1F1B``, ``Interleaved1F1B x2`` (stages per rank,
        where more than one), ``-`` without pp."""
        if self.pp == 1:
            return "-"
        stages = self.stages() or 1
        return (self.schedule or "1F1B") + (f" x{stages}" if stages > 1 else "")

    def microbatches_text(self) -> str:
        """The table's micro-batches cell: ``4``, or ``4 each`` where FSDP2 reduces each
        micro-batch's gradients (``--reduce-each-microbatch``)."""
        return f"{self.microbatches}" + (" each" if self.reduce_each else "")

    def describe(self) -> str:
        extra = [f"ac={self.ac}"] + (["sp"] if self.sp else [])
        if self.pp > 1:
            per_rank = f", {self.stages_per_rank} stages/rank" if self.stages_per_rank else ""
            extra = [f"{self.schedule} x{self.microbatches}{per_rank}", *extra]
        elif self.microbatches > 1:
            each = ", reduced each" if self.reduce_each else ""
            extra = [f"{self.microbatches} micro-batches{each}", *extra]
        return f"{self.mesh_text()} ({', '.join(extra)})"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one candidate (per GPU)."""

    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_bytes_per_gpu: int
    memory: dict[str, int]
    time: dict[str, float]
    bubble_fraction: float
    #: The optimizer step's peak: the states and AdamW's moment-sized temporary (_cost.py).
    #: ``memory_bytes_per_gpu`` is the larger of it and the sum of ``memory`` (backward's).
    optimizer_step_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "memory_bytes_per_gpu": self.memory_bytes_per_gpu,
            "memory": dict(self.memory),
            "time": dict(self.time),
            "bubble_fraction": self.bubble_fraction,
            "optimizer_step_bytes": self.optimizer_step_bytes,
        }


class DoesNotFit(ValueError):
    """No layout fits in memory; carries the smallest requirement found."""

    def __init__(self, message: str, report: SuggestReport) -> None:
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class SuggestReport:
    """The search's result: the best plans, what was refused and why, what it cost."""

    model: str
    gpus: int
    gpus_per_node: int
    hardware: Hardware
    seq_len: int
    global_batch_tokens: int
    dtype: str
    plans: list[tuple[Candidate, Prediction, str]]
    rejected: dict[str, int]
    searched: int
    traced: int
    elapsed_s: float
    points: list[tuple[float, int, bool]]
    memory_limit: int
    best_unfit: tuple[Candidate, int] | None
    assumptions: list[str]
    why: list[str] = dataclasses.field(default_factory=list)
    """Per plan: why it stands where it does (within the model's error and simpler, or
    faster beyond it)."""
    equivalents: list[list[str]] = dataclasses.field(default_factory=list)
    """Per plan: the same layout with dp split otherwise (predicted no faster)."""
    slurm: str | None = None
    """The SLURM batch script of plan 1 when it needs more than one node."""
    slurms: list[str | None] = dataclasses.field(default_factory=list)
    """Per plan: its SLURM batch script when it needs more than one node."""
    needs: dict[str, bool] = dataclasses.field(default_factory=dict)
    """``{"pp": ..., "cp": ...}``: whether every layout that fits uses the axis (the states
    or the sequence need it); empty when nothing fits."""

    @property
    def nodes(self) -> int:
        """The nodes the plans run on (``gpus`` over ``gpus_per_node``, at least one)."""
        return max(1, self.gpus // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``plans``, ``rejected``, ``hardware``, ``searched``, ``traced`` + context."""
        return {
            "model": self.model,
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "seq_len": self.seq_len,
            "global_batch_tokens": self.global_batch_tokens,
            "dtype": self.dtype,
            "plans": [
                {
                    "mesh": c.mesh(),
                    "microbatches": c.microbatches,
                    "schedule": c.schedule,
                    "stages_per_rank": c.stages(),
                    "reduce_each_microbatch": c.reduce_each,
                    "ac": c.ac,
                    "sp": c.sp,
                    "predicted": p.to_dict(),
                    "command": cmd,
                    "slurm": self.slurms[i] if i < len(self.slurms) else None,
                    "why": self.why[i] if i < len(self.why) else "",
                    "equivalent": self.equivalents[i] if i < len(self.equivalents) else [],
                }
                for i, (c, p, cmd) in enumerate(self.plans)
            ],
            "rejected": dict(self.rejected),
            "hardware": self.hardware.to_dict(),
            "memory_limit_bytes": self.memory_limit,
            "searched": self.searched,
            "traced": self.traced,
            "elapsed_s": round(self.elapsed_s, 2),
            "assumptions": list(self.assumptions),
            "nodes": self.nodes,
            "slurm": self.slurm,
            "needs": dict(self.needs),
        }

    def to_table(self) -> str:
        """The report for people."""
        out = [
            f"suggest: {self.model} on {self.gpus:,} x {self.hardware.name} "
            f"({self.gpus_per_node} per node); seq {self.seq_len:,}, "
            f"{self.global_batch_tokens:,} tokens per step, {self.dtype}; memory limit "
            f"{human_bytes(self.memory_limit)} per GPU",
            "",
        ]
        rows = []
        for i, (c, p, _) in enumerate(self.plans, 1):
            rows.append(
                (
                    str(i),
                    c.mesh_text(),
                    c.microbatches_text(),
                    c.schedule_text(),
                    c.ac,
                    "yes" if c.sp else "no",
                    f"{p.step_s:.3f}",
                    f"{p.tokens_per_s_per_gpu:,.0f}",
                    f"{100 * p.mfu:.1f}%",
                    human_bytes(p.memory_bytes_per_gpu),
                )
            )
        out.append(
            table(
                ["#", "mesh", "mb", "schedule", "ac", "sp", "step s", "tok/s/GPU", "MFU", "memory"],
                rows,
                right=(2, 6, 7, 8, 9),
            )
        )
        key = []
        if any(c.reduce_each for c, _, _ in self.plans):
            key.append("mb 'N each': FSDP2 reduces each micro-batch (--reduce-each-microbatch)")
        if any((c.stages() or 1) > 1 for c, _, _ in self.plans):
            key.append("schedule 'xN': N pipeline stages per rank (--stages-per-rank)")
        if key:
            out.append("; ".join(key) + ".")
        out += ["", "Why this order:"]
        for i, note in enumerate(self.why, 1):
            same = self.equivalents[i - 1] if i - 1 < len(self.equivalents) else []
            also = f"; same layout, dp split otherwise: {', '.join(same[:4])}" if same else ""
            out.append(f"  {i}. {note}{also}")
        if self.nodes > 1:
            out += [
                "",
                f"Commands (run on each of the {self.nodes} nodes, NODE_RANK=0..{self.nodes - 1},"
                " MASTER_ADDR / MASTER_PORT of node 0):",
            ]
        else:
            out += ["", "Commands:"]
        out += [f"  {i}. {cmd}" for i, (_, _, cmd) in enumerate(self.plans, 1)]
        if self.slurm is not None:
            out += ["", "SLURM batch script of plan 1 (sbatch FILE):"]
            out += [f"  {line}" if line else "" for line in self.slurm.splitlines()]
        if self.rejected:
            out += ["", "Rejected:"]
            out += [
                f"  {n:>8,}  {reason}"
                for reason, n in sorted(self.rejected.items(), key=lambda kv: -kv[1])
            ]
        out += ["", "Assumptions:"] + [f"  - {a}" for a in self.assumptions]
        out += [
            "",
            f"Searched {self.searched:,} candidates, traced {self.traced} local structures "
            f"({self.elapsed_s:.1f} s).",
        ]
        return "\n".join(out)


def suggest_chart(report: SuggestReport, path: str | Path) -> None:
    """Draw the candidates as predicted step time vs memory per GPU, the limit and the top K.

    Example::

        suggest_chart(suggest("llama3-8b", gpus=16, gpu="h100-80gb", seq_len=4096,
                              global_batch_tokens=1 << 20), "suggest.png")
    """
    from hyper_parallel.analysis.charts import suggest_chart as draw

    draw(report, path)
