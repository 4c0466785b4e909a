"""The run configurations of the matrix: every switch, reduced by a pairwise covering array.

Switches (:data:`SWITCHES`): the model family, the pipeline (``pp=1``, or ``pp=2`` with
each of the five schedules), micro-batches (the pipeline's under ``pp=2``, gradient
accumulation at ``pp=1``), reducing each accumulated micro-batch's gradients, stages per
rank, dp_replicate, dp_shard, cp, tp, sequence parallelism, ep, dtype, activation
checkpointing and compile. The
schedule is one switch with ``pp`` (a schedule only means something at ``pp=2``), so
"every schedule with every data axis" is a pair the covering array holds.

Constraints (:func:`allowed`) keep rows that are *runs someone would ask for*, not
rows a one-line rule already refuses: 4 ranks exactly (pp x dp_replicate x dp_shard
x cp x tp), ``sp`` only with ``tp=2``, ``ep=2`` only for the mixture of experts and
with ranks to borrow (dp_shard x cp x tp >= 2), stages per rank other than the default
only with ``pp=2``, one stage per rank for GPipe and 1F1B and two for the others,
``reduce_each`` only where it means something (accumulation at ``pp=1`` over a data
axis FSDP2 reduces on). Each rule left out this way has a probe in :data:`PROBES`. Whatever
the run plan then refuses among them (a schedule against a stage count, ep with a
split backward, ...) is a refusal the matrix checks is given before any rank builds.
:data:`EIGHT_RANKS` adds a few 8-rank runs.

Stages per rank map onto the trainer's ``pipeline_split``: 1 -> two units a stage,
2 -> one unit a stage (the debug models have 4 units: embedding, 2 blocks, head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tests.matrix.covering import Covering, pairwise

__all__ = [
    "EIGHT_RANKS",
    "PROBES",
    "SEED",
    "SLICE",
    "SWITCHES",
    "Config",
    "allowed",
    "covering",
    "matrix",
]

SEED = 2026
"""The covering array's seed: the same matrix on every run."""

MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
PIPELINES = ("pp1", "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")

SWITCHES: dict[str, tuple[Any, ...]] = {
    "family": ("llama3-debug", "qwen3-debug", "qwen3-moe-debug"),
    "pipeline": PIPELINES,
    "microbatches": ("default", 2, 4),
    "reduce_each": (False, True),
    "stages_per_rank": ("default", 1, 2),
    "dp_replicate": (1, 2),
    "dp_shard": (1, 2),
    "cp": (1, 2),
    "tp": (1, 2),
    "sp": (False, True),
    "ep": (1, 2),
    "dtype": ("fp32", "bf16", "bf16-true"),
    "ac": ("none", "full", "selective", "op"),
    "compile": (False, True),
}
"""Every switch of a run and the values the matrix takes of it."""

WORLD_SIZE = 4
GLOBAL_BATCH = 8
SEQ_LEN = 16


def _world(row: Mapping[str, Any]) -> int:
    pp = 1 if row.get("pipeline", "pp1") == "pp1" else 2
    size = pp
    for axis in ("dp_replicate", "dp_shard", "cp", "tp"):
        size *= row.get(axis, 1)
    return size


def allowed(row: Mapping[str, Any]) -> bool:
    """Whether a (partial) row can be a matrix run (module doc); exact for full rows."""
    if _world(row) > WORLD_SIZE:
        return False
    if len(row) == len(SWITCHES) and _world(row) != WORLD_SIZE:
        return False
    if row.get("sp") is True and row.get("tp") == 1:
        return False
    if row.get("ep") == 2 and row.get("family", "qwen3-moe-debug") != "qwen3-moe-debug":
        return False
    if row.get("ep") == 2 and row.get("dp_shard", 2) * row.get("cp", 2) * row.get("tp", 2) < 2:
        return False  # ep borrows ranks from dp_shard x cp x tp
    pipeline, spr = row.get("pipeline"), row.get("stages_per_rank", "default")
    if row.get("reduce_each") is True:
        # Reducing each micro-batch means something for accumulation at pp=1, over a
        # data axis FSDP2 reduces on (pp's schedule reduces once per step itself).
        if pipeline not in (None, "pp1") or row.get("microbatches") == "default":
            return False
        if all(a in row for a in ("dp_replicate", "dp_shard", "cp")) and (
            row["dp_replicate"] * row["dp_shard"] * row["cp"] == 1
        ):
            return False
    if pipeline == "pp1" and spr != "default":
        return False
    # A stage count the schedule runs: one stage per rank for GPipe and 1F1B, several
    # for the interleaved and V schedules.
    if pipeline in ("GPipe", "1F1B") and spr == 2:
        return False
    return not (pipeline in MULTI_STAGE and spr == 1)


@dataclasses.dataclass(frozen=True)
class Config:
    """One run of the matrix: its switches, and the trainer's config for them."""

    index: int
    switches: dict[str, Any]

    @property
    def mesh(self) -> dict[str, int]:
        s = self.switches
        pp = 1 if s["pipeline"] == "pp1" else s.get("pp", 2)
        sizes = {
            "pp": pp,
            "dp_replicate": s["dp_replicate"],
            "dp_shard": s["dp_shard"],
            "cp": s["cp"],
            "tp": s["tp"],
            "ep": s["ep"],
        }
        return {k: v for k, v in sizes.items() if v > 1}

    @property
    def world_size(self) -> int:
        size = 1
        for axis, n in self.mesh.items():
            if axis != "ep":
                size *= n
        return size

    def train_config(self, compile_backend: str = "aot_eager") -> dict[str, Any]:
        """The :class:`~hyper_parallel.train.TrainConfig` fields of this run (2 steps)."""
        s = self.switches
        pipelined = s["pipeline"] != "pp1"
        out: dict[str, Any] = dict(
            model=s["family"],
            mesh=self.mesh,
            sp=s["sp"],
            steps=2,
            batch_size=GLOBAL_BATCH,
            seq_len=SEQ_LEN,
            log_every=0,
            progress=False,
            dtype=s["dtype"],
            ac=s["ac"],
            compile=s["compile"],
            compile_backend=compile_backend,
        )
        if pipelined:
            out["schedule"] = s["pipeline"]
            if s["stages_per_rank"] != "default":
                out["stages_per_rank"] = s["stages_per_rank"]
        if s["microbatches"] != "default":
            out["microbatches"] = s["microbatches"]
        if s.get("reduce_each"):
            out["reduce_each_microbatch"] = True
        if s["family"] == "qwen3-moe-debug":
            # The balance loss on, so its gradients through every axis are compared too.
            out["model_overrides"] = {"aux_loss_coef": 0.1}
        return out

    def describe(self) -> str:
        s = self.switches
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items()) or "1"
        parts = [s["family"], mesh]
        if s["pipeline"] != "pp1":
            parts.append(s["pipeline"])
            parts.append(f"mb={s['microbatches']}")
            parts.append(f"spr={s['stages_per_rank']}")
        elif s["microbatches"] != "default":
            parts.append(f"mb={s['microbatches']}")
            if s.get("reduce_each"):
                parts.append("reduce-each")
        parts += [
            s["dtype"],
            f"ac={s['ac']}",
            *(["sp"] if s["sp"] else []),
            *(["compile"] if s["compile"] else []),
        ]
        return " ".join(parts)


def covering(seed: int = SEED) -> Covering:
    """The covering array over :data:`SWITCHES` under :func:`allowed`."""
    return pairwise(SWITCHES, allowed, seed=seed)


_EIGHT_BASE = dict(
    microbatches="default",
    reduce_each=False,
    stages_per_rank="default",
    sp=False,
    ep=1,
    dtype="fp32",
    ac="none",
    compile=False,
)

EIGHT_RANKS: tuple[dict[str, Any], ...] = (
    # Every data axis and tp at once; HSDP x cp x tp with ep borrowing dp_shard x cp.
    dict(_EIGHT_BASE, family="llama3-debug", pipeline="pp1", dp_replicate=2, dp_shard=2, cp=1,
         tp=2, sp=True),
    dict(_EIGHT_BASE, family="qwen3-moe-debug", pipeline="pp1", dp_replicate=2, dp_shard=2, cp=2,
         tp=1, ep=4),
    dict(_EIGHT_BASE, family="qwen3-debug", pipeline="Interleaved1F1B", dp_replicate=1,
         dp_shard=2, cp=1, tp=2, dtype="bf16"),
    dict(_EIGHT_BASE, family="llama3-debug", pipeline="1F1B", dp_replicate=2, dp_shard=1, cp=2,
         tp=1, pp=2, ac="full"),
    # Gradient accumulation over HSDP x tp with sp, each micro-batch's gradients reduced.
    dict(_EIGHT_BASE, family="qwen3-debug", pipeline="pp1", dp_replicate=2, dp_shard=2, cp=1,
         tp=2, sp=True, microbatches=2, reduce_each=True),
)  # fmt: skip
"""A few 8-rank runs (``pp`` = 2 where piped), beside the 4-rank covering array."""


PROBES: tuple[dict[str, Any], ...] = (
    # Outside the constraints on purpose: each must be refused, alike by every gate.
    # Sequence parallelism without tp.
    dict(_EIGHT_BASE, family="llama3-debug", pipeline="pp1", dp_replicate=2, dp_shard=2, cp=1,
         tp=1, sp=True),
    # ep on a dense model (no routed experts to spread).
    dict(_EIGHT_BASE, family="llama3-debug", pipeline="pp1", dp_replicate=1, dp_shard=2, cp=1,
         tp=2, ep=2),
    # One stage per rank for a V schedule, and two per rank for 1F1B (--stages-per-rank).
    dict(_EIGHT_BASE, family="qwen3-debug", pipeline="ZBVZeroBubble", stages_per_rank=1,
         dp_replicate=1, dp_shard=2, cp=1, tp=1),
    dict(_EIGHT_BASE, family="llama3-debug", pipeline="1F1B", stages_per_rank=2,
         dp_replicate=1, dp_shard=1, cp=1, tp=2),
    # ep with no rank to borrow (dp_shard x cp x tp = 1).
    dict(_EIGHT_BASE, family="qwen3-moe-debug", pipeline="GPipe", dp_replicate=2, dp_shard=1,
         cp=1, tp=1, ep=2),
)  # fmt: skip
"""Runs every gate must refuse (the covering array's constraints keep them out)."""


def matrix(seed: int = SEED, eight: bool = True) -> list[Config]:
    """Every configuration of the matrix: the covering array, the refusal probes, then the
    8-rank runs."""
    rows = covering(seed).rows + list(PROBES) + (list(EIGHT_RANKS) if eight else [])
    return [Config(i, dict(r)) for i, r in enumerate(rows)]


SLICE = (
    # The fixed slice in ``make test``: the crash the matrix was built for (4 stages over
    # 2 blocks: stages without a block), a refusal, and pipelined MoE with ep and bf16.
    dict(_EIGHT_BASE, family="llama3-debug", pipeline="Interleaved1F1B", microbatches=4,
         dp_replicate=1, dp_shard=2, cp=1, tp=1),
    dict(_EIGHT_BASE, family="qwen3-moe-debug", pipeline="ZBVZeroBubble", dp_replicate=1,
         dp_shard=2, cp=1, tp=1, ep=2),
    dict(_EIGHT_BASE, family="qwen3-moe-debug", pipeline="1F1B", dp_replicate=1, dp_shard=1,
         cp=1, tp=2, sp=True, ep=2, dtype="bf16", ac="selective"),
)  # fmt: skip
"""A few configurations run by ``tests/matrix/test_matrix_slice.py``."""
