"""The search: candidates, the run plan's checks as the filter, the ranking, the command."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.analysis._format import human_bytes
from hyper_parallel.analysis.cost_model import (
    Hardware,
    load_hardware,
)
from hyper_parallel.analysis.suggest._checks import _Checks
from hyper_parallel.analysis.suggest._cost import RunFactors, _Context, _predict
from hyper_parallel.analysis.suggest._report import (
    Candidate,
    DoesNotFit,
    Prediction,
    SuggestReport,
)
from hyper_parallel.analysis.suggest._source import ModelSource, _long_enough, _num_experts
from hyper_parallel.distributed.pipeline import (
    SCHEDULES,
)
from hyper_parallel.distributed.precision import PARAM_DTYPES
from hyper_parallel.dmodule.findings import Finding
from hyper_parallel.train.launch import node_command, slurm_script, train_options

AC_MODES = ("none", "selective", "full", "op")
MODEL_AXES = ("tp", "cp", "ep")
SP_ONLY = (
    "sp off: not searched (with sp the same layout keeps tp times less of the residual "
    "stream, the norms and each block's input for backward, for 5/4 of the tp bytes; "
    "Korthikanti et al. 2022)"
)
"""Why tp > 1 without sequence parallelism is not traced: Megatron's sequence parallelism
replaces each tp all-reduce by an all-gather and a reduce-scatter of the same total ring
bytes, and shards the residual stream and the norms' activations over tp (Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", 2022, section
4.2.2); as there, each block keeps its input's shard for backward and gathers it again (one
more all-gather per block in backward: 5/4 of the ring bytes without sp). Without sp a
layout can be faster by at most that share of its tp communication, where memory is not
short; it is not searched (it would double the tp candidates)."""
MAX_PP = 32
"""Largest pipeline searched (Llama 3 405B trained at pp=16; Dubey et al. 2024, Table 4)."""
MODEL_ERROR = 0.20
"""The error the cost model states for one predicted step time: issue #30's goal for the
median on held-out published GPU runs. It lies between the held-out median and worst
|error| that ``benchmarks/bench_published.py`` measures (``make bench`` section u;
``tests/unit/test_published_fit.py`` checks it stays between them): a plan is not put
ahead of a simpler one for a gain inside the typical error, nor kept behind for one
beyond the worst."""
TOLD_APART = (1 + MODEL_ERROR) / (1 - MODEL_ERROR)
"""Step times closer than this ratio (1.5) are not told apart by the model: with each
prediction within +-:data:`MODEL_ERROR` of its run, the one predicted slower by less may
be the faster run. Within it the simpler plan goes first (:func:`_simplicity`)."""
MIN_CP_TOKENS = 1024
"""Context parallelism is searched down to this many tokens per cp rank (attention kernels
lose their efficiency on shorter pieces; torchtitan's cp runs keep >= 8k per rank). A
fixed ``--mesh`` is scored whatever its cp."""
CP_PRUNED = (
    f"cp not searched: not a power of two, or under {MIN_CP_TOKENS:,} tokens per cp rank "
    "(score such a mesh with --mesh)"
)
"""Why the free search skips a cp size (:data:`MIN_CP_TOKENS`)."""


# ----------------------------------------------------------------------------- search


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(
    *,
    gpus: int,
    gpus_per_node: int,
    num_layers: int,
    global_batch: int,
    seq_len: int,
    num_experts: int,
    allow_cross_node_tp: bool,
    allow_cross_node_ep: bool,
    rejected: Counter,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    mesh: Mapping[str, int] | None = None,
) -> Iterator[Candidate]:
    """Every layout worth asking the checks about; the ones refused here are counted.

    ``mesh`` (every axis, as :func:`_fixed_mesh` gives it): only that mesh, whatever its
    tp, cp and ep span (the free search's pruning is not applied to the user's layout)."""
    if mesh is not None:
        yield from _mesh_candidates(
            mesh, num_layers, global_batch, rejected, microbatches, stages_per_rank
        )
        return
    tps = [t for t in _divisors(gpus) if allow_cross_node_tp or gpus_per_node % t == 0]
    if not allow_cross_node_tp:
        skipped = len(_divisors(gpus)) - len(tps)
        if skipped:
            rejected["tp would span nodes (allow with --allow-cross-node-tp)"] += skipped
    for tp in tps:
        rest_tp = gpus // tp
        for cp in _divisors(rest_tp):
            if cp > 1 and (cp & (cp - 1) or seq_len // cp < MIN_CP_TOKENS):
                rejected[CP_PRUNED] += 1  # not searched: see MIN_CP_TOKENS
                continue
            rest_cp = rest_tp // cp
            for pp in _divisors(rest_cp):
                if pp > min(num_layers, MAX_PP):
                    continue
                dp = rest_cp // pp
                if global_batch % dp:
                    rejected["global batch does not split over the data-parallel ranks"] += 1
                    continue
                local = global_batch // dp
                for dp_replicate in _divisors(dp):
                    dp_shard = dp // dp_replicate
                    borrow = dp_shard * cp * tp
                    eps = [1]
                    if num_experts > 1:
                        eps = [e for e in _divisors(borrow) if num_experts % e == 0]
                        if not allow_cross_node_ep:
                            near = [e for e in eps if gpus_per_node % e == 0]
                            if len(near) < len(eps):
                                rejected[
                                    "ep would span nodes (allow with --allow-cross-node-ep)"
                                ] += len(eps) - len(near)
                            eps = near
                    for ep in eps:
                        sizes = (pp, dp_replicate, dp_shard, cp, tp, ep)
                        yield from _settings(
                            sizes, local, rejected, microbatches, stages_per_rank, num_layers
                        )


def _mesh_candidates(
    mesh: Mapping[str, int],
    num_layers: int,
    global_batch: int,
    rejected: Counter,
    microbatches: int | None,
    stages_per_rank: int | None,
) -> Iterator[Candidate]:
    """The candidates of one fixed mesh: its settings (micro-batches, schedule, ac, sp)."""
    sizes = tuple(mesh[a] for a in MESH_AXES)
    dp = mesh["dp_replicate"] * mesh["dp_shard"]
    if global_batch % dp:
        rejected["global batch does not split over the data-parallel ranks"] += 1
        return
    yield from _settings(
        sizes, global_batch // dp, rejected, microbatches, stages_per_rank, num_layers
    )


def _settings(
    sizes: tuple[int, ...],
    local: int,
    rejected: Counter,
    microbatches: int | None,
    stages_per_rank: int | None,
    num_layers: int,
) -> Iterator[Candidate]:
    """One mesh's candidates (``sizes``: pp, dp_replicate, dp_shard, cp, tp, ep) over its
    schedules, micro-batches, reduce-each, checkpointing; sp with tp."""
    pp, dp_replicate, dp_shard, cp, tp, ep = sizes
    for schedule, m, per_rank in _pipelines(pp, local, microbatches, stages_per_rank, num_layers):
        # Accumulation under FSDP2: its gradients held unsharded to the last micro-batch,
        # or reduced each (sharded).
        sharded = _accumulates_sharded(pp, m, dp_replicate * dp_shard * cp)
        for each, ac in itertools.product((False, True) if sharded else (False,), AC_MODES):
            if tp > 1:  # searched, and refused without a trace
                rejected[SP_ONLY] += 1
            yield Candidate(
                pp, dp_replicate, dp_shard, cp, tp, ep, m, schedule, ac, tp > 1, per_rank, each
            )


def _accumulates_sharded(pp: int, microbatches: int, data_ranks: int) -> bool:
    """Whether a run accumulates gradients under FSDP2, where reducing each micro-batch
    is a choice (``data_ranks``: dp_replicate x dp_shard x cp)."""
    return pp == 1 and microbatches > 1 and data_ranks > 1


def _structure(c: Candidate, settings: bool = False) -> tuple:
    """What tells two layouts apart beyond how dp splits into dp_replicate x dp_shard
    (micro-batches, schedule, checkpointing and sp are the plan's settings; with
    ``settings``, as under a fixed ``--mesh``, they tell plans apart too)."""
    mesh = (c.pp, c.dp, c.cp, c.tp, c.ep)
    if not settings:
        return mesh
    return (*mesh, c.microbatches, c.schedule, c.stages_per_rank, c.reduce_each, c.ac, c.sp)


@dataclasses.dataclass(frozen=True)
class _Needs:
    """Whether every layout that fits uses pp (the states need it) or cp (the sequence
    needs it)."""

    pp: bool
    cp: bool

    @classmethod
    def of(cls, candidates: list[Candidate]) -> _Needs:
        return cls(pp=all(c.pp > 1 for c in candidates), cp=all(c.cp > 1 for c in candidates))


def _simplicity(c: Candidate, needs: _Needs) -> tuple[int, int]:
    """How much a layout asks of its user, lower first: pp and cp used where a layout
    without them fits (a schedule and micro-batches to tune, the sequence split), then
    the mesh axes beyond FSDP (pp, cp, tp, ep, dp_replicate). Checkpointing, micro-batches
    and sp are flags, not structure: among equally simple layouts the faster goes first.
    tp stays within a node unless ``--allow-cross-node-tp``."""
    needless = (c.pp > 1 and not needs.pp) + (c.cp > 1 and not needs.cp)
    axes = (c.pp > 1) + (c.cp > 1) + (c.tp > 1) + (c.ep > 1) + (c.dp_replicate > 1)
    return needless, axes


def _simplicity_text(c: Candidate, needs: _Needs) -> str:
    """:func:`_simplicity` in words."""
    parts = [
        f"{axis} where a layout without it fits"
        for axis, used, needed in (("pp", c.pp > 1, needs.pp), ("cp", c.cp > 1, needs.cp))
        if used and not needed
    ]
    axes = [a for a in ("pp", "cp", "tp", "ep", "dp_replicate") if getattr(c, a) > 1]
    parts.append(f"axes beyond FSDP: {', '.join(axes)}" if axes else "no axis beyond FSDP")
    return "; ".join(parts)


Scored = tuple[Candidate, Prediction]


def _flags(c: Candidate) -> int:
    """How many of a plan's settings differ from the plain run: checkpointing, micro-batches
    beyond one per stage's need (pp's schedule sets its own), sequence parallelism."""
    return (c.ac != "none") + (c.pp == 1 and c.microbatches > 1) + bool(c.sp)


def _same_time(step_s: float) -> float:
    """``step_s`` to 9 significant digits: the same time summed in another order (a last
    bit apart) is equal, so the flags decide (llama3-debug at dp_replicate=4 x dp_shard=4
    was offered ac=op, 1 ulp faster than no checkpointing)."""
    return float(f"{step_s:.9g}")


def _order(items: list[Scored], needs: _Needs) -> tuple[list[Scored], int]:
    """``items`` fastest first, except that those within :data:`TOLD_APART` of the
    fastest go simplest first (:func:`_simplicity`, then time); and how many that is.
    Equal times (a model so small that its step is latency) go fewest flags first
    (:func:`_flags`: no checkpointing, one micro-batch, no sp), then least memory."""
    items = sorted(
        items, key=lambda cp: (_same_time(cp[1].step_s), _flags(cp[0]), cp[1].memory_bytes_per_gpu)
    )
    fastest = items[0][1].step_s
    band = [x for x in items if x[1].step_s <= fastest * TOLD_APART]
    band.sort(key=lambda cp: (_simplicity(cp[0], needs), _same_time(cp[1].step_s)))
    return band + items[len(band) :], len(band)


def _rank(
    evaluated: list[Scored], top: int, settings: bool = False, needs: _Needs | None = None
) -> tuple[list[Scored], list[str], list[list[str]]]:
    """The top ``top`` distinct structures, each with why it is where it is and the dp
    splits that are its equivalents.

    The same layout with dp split otherwise (dp_replicate x dp_shard), whatever its
    micro-batches, schedule, checkpointing and sp, is one plan: the one :func:`_order`
    puts first stands for it, the other splits are listed as equivalent (with their time
    against it). With ``settings`` (a fixed ``--mesh``: one structure) each setting is a
    plan. Plans: fastest first, except that those the model cannot tell apart from the
    fastest (within :data:`TOLD_APART`) go simplest first. ``needs``: what
    :meth:`_Needs.of` says of ``evaluated`` (computed when not given).
    """
    if not evaluated:
        return [], [], []
    needs = needs or _Needs.of([c for c, _ in evaluated])
    groups: dict[tuple, list[Scored]] = {}
    for c, p in evaluated:
        groups.setdefault(_structure(c, settings), []).append((c, p))
    heads = {}
    for key, members in groups.items():
        heads[key] = _order(members, needs)[0]
    ordered, in_band = _order([m[0] for m in heads.values()], needs)
    fastest = min(ordered, key=lambda cp: cp[1].step_s)
    why, equivalents = [], []
    for i, (c, p) in enumerate(ordered[:top]):
        slower = p.step_s / fastest[1].step_s - 1
        if i < in_band:
            told = (
                f"within the model's error (+-{MODEL_ERROR:.0%} a prediction: step times "
                f"within {TOLD_APART:.1f}x are not told apart)"
                if i == 0
                else f"not told apart (within {TOLD_APART:.1f}x)"
            )
            note = (
                f"{_percent(slower)} vs the fastest, {told}, so simplest first: "
                f"{_simplicity_text(c, needs)}"
            )
            if i == 0 and c is not fastest[0]:
                note += (
                    f"; ahead of the fastest, {fastest[0].describe()} "
                    f"({_simplicity_text(fastest[0], needs)})"
                )
        else:
            note = f"{_percent(slower)} vs the fastest: beyond the model's error, by time"
        why.append(note)
        splits: dict[tuple[int, int], Scored] = {}
        for m, q in heads[_structure(c, settings)]:
            splits.setdefault((m.dp_replicate, m.dp_shard), (m, q))
        equivalents.append(
            [
                f"{m.mesh_text()} ({_percent(q.step_s / p.step_s - 1)})"
                for (rep, shard), (m, q) in splits.items()
                if (rep, shard) != (c.dp_replicate, c.dp_shard)
            ]
        )
    return ordered[:top], why, equivalents


def _percent(x: float) -> str:
    """``+12%``; ``+0%`` for what rounds to zero (never ``-0%``)."""
    return f"{(0.0 if abs(x) < 0.005 else x):+.0%}"


def _pipelines(
    pp: int,
    local: int,
    fixed: int | None = None,
    stages_per_rank: int | None = None,
    num_layers: int | None = None,
) -> list[tuple[str | None, int, int | None]]:
    """Schedules, micro-batch counts and stages per rank (only ``fixed`` /
    ``stages_per_rank`` when given). Without pp, gradient accumulation: every power of
    two that divides the local batch, and the local batch itself (one sequence per
    micro-batch) — the fewest that fit win (the same compute, fewer FSDP2 gathers). With
    pp every schedule torch runs; the looped ones (several stages per rank) at 2 stages
    per rank and, where the layers allow, 4 and 8 (a smaller bubble); each at the run
    plan's micro-batch count
    (:func:`~hyper_parallel.distributed.run_plan.default_num_microbatches`: one per
    stage), at 2 and 4 times it (2 stages per rank only), at each pp x 2^k below it, and at
    the local batch and half of it (one or two sequences per micro-batch: the smallest
    bubble; e.g. pp=16 with 16 sequences per rank, below the interleaved schedules'
    default of 32): those the local batch splits into, at least one per pipeline rank
    (fewer leave ranks idle). Whether the schedule takes that many stages is the run
    plan's finding."""
    from hyper_parallel.distributed.pipeline import MULTI_STAGE_SCHEDULES
    from hyper_parallel.distributed.run_plan import default_num_microbatches

    if pp == 1:
        if fixed:
            return [(None, fixed, None)]
        counts = [1 << k for k in range(local.bit_length()) if local % (1 << k) == 0]
        return [(None, m, None) for m in sorted({*counts, local})]
    out: list[tuple[str | None, int, int | None]] = []
    for schedule in SCHEDULES:
        if stages_per_rank is not None:
            per_ranks: list[int | None] = [stages_per_rank]
        elif schedule in MULTI_STAGE_SCHEDULES and schedule != "ZBVZeroBubble":
            deeper = [s for s in (4, 8) if num_layers is None or pp * s <= num_layers]
            per_ranks = [None, *deeper]  # None: the default, 2
        else:
            per_ranks = [None]
        for per_rank in per_ranks:
            base = default_num_microbatches(pp, schedule, per_rank)
            if fixed:
                counts = [fixed]
            else:
                # Also fewer than one per stage when the local batch is short (pp=16 with
                # 16 sequences per data-parallel rank: Llama 3 405B's 8K run).
                fewer = {pp << k for k in range(8) if (pp << k) < base}
                # Deeper loops at their own default count only: each doubles the stages
                # (a smaller bubble) where more micro-batches would do it too.
                more = (1, 2, 4) if per_rank is None else (1,)
                wanted = {*fewer, *(k * base for k in more), local, local // 2}
                counts = sorted(m for m in wanted if m >= pp and local % m == 0)
            out += [(schedule, m, per_rank) for m in counts]
    return out


MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def _fixed_mesh(mesh: Mapping[str, int] | None, gpus: int) -> dict[str, int] | None:
    """``mesh`` with every axis (the ones not named are 1; ``dp`` is ``dp_shard``),
    checked against ``gpus``."""
    if mesh is None:
        return None
    named = {("dp_shard" if a == "dp" else a): int(v) for a, v in mesh.items()}
    unknown = sorted(set(named) - set(MESH_AXES))
    if unknown:
        raise ValueError(
            f"suggest: --mesh names {unknown}; the axes are {', '.join(MESH_AXES)} (dp = dp_shard)."
        )
    out = {a: named.get(a, 1) for a in MESH_AXES}
    world = out["pp"] * out["dp_replicate"] * out["dp_shard"] * out["cp"] * out["tp"]
    if world != gpus:
        raise ValueError(
            f"suggest: --mesh {','.join(f'{a}={v}' for a, v in named.items() if v > 1) or 'dp=1'} "
            f"has {world} "
            f"ranks, not --gpus {gpus}; make pp x dp_replicate x dp_shard x cp x tp = {gpus}."
        )
    return out


def _matches(
    c: Candidate,
    mesh: dict[str, int] | None,
    schedule: str | None,
    ac: str | None,
    microbatches: int | None,
    sp: bool | None = None,
    reduce_each: bool | None = None,
) -> bool:
    """Whether ``c`` keeps what the caller fixed (``stages_per_rank`` is fixed where the
    candidates are made). ``reduce_each`` applies where the run accumulates sharded
    (pp=1, several micro-batches, a data axis); elsewhere the run does not use it."""
    if mesh is not None and c.mesh() != mesh:
        return False
    if sp is not None and c.sp != sp:
        return False
    accumulates = _accumulates_sharded(c.pp, c.microbatches, c.dp * c.cp)
    if reduce_each is not None and accumulates and c.reduce_each != reduce_each:
        return False
    if schedule is not None and c.pp > 1 and c.schedule != schedule:
        return False
    if microbatches is not None and c.pp > 1 and c.microbatches != microbatches:
        return False
    return ac is None or c.ac == ac


def suggest(
    model: str | ModelSource,
    *,
    gpus: int,
    gpu: str | Path | Hardware,
    seq_len: int,
    global_batch_tokens: int,
    gpus_per_node: int | None = None,
    dtype: str = "bf16",
    top: int = 5,
    allow_cross_node_tp: bool = False,
    allow_cross_node_ep: bool = False,
    mesh: Mapping[str, int] | None = None,
    schedule: str | None = None,
    ac: str | None = None,
    microbatches: int | None = None,
    sp: bool | None = None,
    compile: bool = False,
    pipeline_split: Mapping[str, Any] | None = None,
    stages_per_rank: int | None = None,
    reduce_each_microbatch: bool | None = None,
) -> SuggestReport:
    """Search the layouts of ``model`` on ``gpus`` GPUs; the best ``top`` by step time.

    With ``mesh`` (axis sizes; axes not named are 1) the mesh is fixed and only the
    micro-batches, schedule, checkpointing and sequence parallelism are searched, unless
    ``schedule``, ``ac`` or ``microbatches`` fix those too: "what would my layout do?".

    Args:
        model: A registered model name, or a :class:`ModelSource` (e.g. from
            :func:`model_from_hf_config`).
        gpus: Number of GPUs.
        gpu: A shipped hardware kind (``"h100-80gb"``), a hardware file, or a
            :class:`~hyper_parallel.analysis.cost_model.Hardware`.
        seq_len: Tokens per sequence.
        global_batch_tokens: Tokens per optimizer step (a multiple of ``seq_len``).
        gpus_per_node: GPUs per node (default: the hardware file's).
        dtype: ``"bf16"`` (mixed precision, fp32 master weights), ``"bf16-true"``
            (bf16 parameters, gradients and AdamW moments) or ``"fp32"``.
        top: How many plans to return.
        allow_cross_node_tp: Also search tp groups that span nodes.
        allow_cross_node_ep: Also search ep groups that span nodes.
        mesh: Fix the mesh: ``{"dp_shard": 8, "tp": 8}`` (``dp`` is ``dp_shard``).
        schedule: Fix the pipeline schedule (pp > 1).
        ac: Fix activation checkpointing (``none``, ``selective``, ``full``, ``op``).
        microbatches: Fix the pipeline's micro-batches (pp > 1).
        sp: Fix sequence parallelism (``None``: searched).
        compile: The run compiles its blocks (the run plan's compile findings).
        pipeline_split: The run's stage split (``{"units_per_stage": n}``, ...).
        stages_per_rank: Fix the pipeline stages per rank (pp > 1; ``None``: searched
            for the looped schedules: 2, 4, 8).
        reduce_each_microbatch: Fix whether gradient accumulation under FSDP2 reduces
            each micro-batch's gradients (``--reduce-each-microbatch``; ``None``: searched).

    Returns:
        A :class:`SuggestReport`, plans best first.

    Raises:
        ValueError: Bad arguments (named, with the fix), or with ``mesh``, a run the
            run plan refuses (every finding, word for word as the trainer, ``validate``
            and ``plan`` say it) when no candidate of it passes.
        DoesNotFit: No layout fits; its message names the smallest memory per GPU
            needed and the layout that needs it.
    """
    start = time.perf_counter()
    source = model if isinstance(model, ModelSource) else ModelSource(model)
    hw = gpu if isinstance(gpu, Hardware) else load_hardware(gpu)
    node = gpus_per_node or hw.gpus_per_node
    _check_arguments(gpus, node, seq_len, global_batch_tokens, dtype, top)
    fixed = _fixed_mesh(mesh, gpus)
    if ac is not None and ac not in AC_MODES:
        raise ValueError(f"suggest: --ac {ac!r}; use one of {', '.join(AC_MODES)}.")
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"suggest: --schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
    if fixed is not None:  # the user's own layout: tp / ep where they put them
        allow_cross_node_tp = allow_cross_node_ep = True
    source, max_seq = _long_enough(source, seq_len)
    config = source.config()
    num_layers = source.spec.family.num_layers(config)
    num_experts = _num_experts(source, config)
    global_batch = global_batch_tokens // seq_len
    rejected: Counter = Counter()
    # What differs from the eager trainer that the run states (compile), at the
    # published-runs fit (STATED_FACTORS).
    ctx = _Context.build(
        source, hw, node, gpus, seq_len, global_batch, dtype, compile, pipeline_split
    )
    checks, tracer, limit = ctx.checks, ctx.tracer, ctx.limit
    state_bytes = 4 * PARAM_DTYPES[dtype].itemsize  # weights, gradients, two moments
    lower_bound_states = state_bytes * sum(p for p in _param_counts(checks))
    searched = 0
    evaluated: list[tuple[Candidate, Prediction]] = []
    points: list[tuple[float, int, bool]] = []
    best_unfit: tuple[Candidate, int] | None = None
    unfit_states_only = False  # best_unfit's need is the states' lower bound, not a trace
    unfit_at_optimizer = False  # best_unfit's peak is its optimizer step's, not backward's
    for c in _candidates(
        gpus=gpus,
        gpus_per_node=node,
        num_layers=num_layers,
        global_batch=global_batch,
        seq_len=seq_len,
        num_experts=num_experts,
        allow_cross_node_tp=allow_cross_node_tp,
        allow_cross_node_ep=allow_cross_node_ep,
        rejected=rejected,
        microbatches=microbatches,
        stages_per_rank=stages_per_rank,
        mesh=fixed,
    ):
        if not _matches(c, fixed, schedule, ac, microbatches, sp, reduce_each_microbatch):
            continue
        searched += 1
        problems = _findings(checks, c)
        if problems:
            check, f = problems[0]
            rejected[f"{check}: {f.field or f.path}"] += 1
            continue
        # States alone, spread over every rank that does not hold a replica: a lower
        # bound needing no trace.
        floor = lower_bound_states / (gpus // c.dp_replicate)
        if floor > limit:
            rejected["does not fit in memory"] += 1
            if best_unfit is None or floor < best_unfit[1]:
                best_unfit, unfit_states_only = (c, int(floor)), True
            continue
        prediction = _predict(ctx, c)
        fits = prediction.memory_bytes_per_gpu <= limit
        points.append((prediction.step_s, prediction.memory_bytes_per_gpu, fits))
        if not fits:
            rejected["does not fit in memory"] += 1
            if best_unfit is None or prediction.memory_bytes_per_gpu < best_unfit[1]:
                best_unfit, unfit_states_only = (c, prediction.memory_bytes_per_gpu), False
                unfit_at_optimizer = prediction.optimizer_step_bytes == best_unfit[1]
            continue
        evaluated.append((c, prediction))
    # What the enumeration refused without yielding (sp off, tp or ep across nodes, a
    # batch that does not split) was searched too.
    if fixed is None:
        searched += sum(rejected.values()) - (searched - len(evaluated))
    # Under a fixed --mesh the plans are its settings (schedule, micro-batches, ac, sp).
    needs = _Needs.of([c for c, _ in evaluated]) if evaluated else None
    ranked, why, equivalents = _rank(evaluated, top, settings=fixed is not None, needs=needs)
    plans = [
        (c, p, _command(source, c, gpus, node, seq_len, global_batch, dtype)) for c, p in ranked
    ]
    slurms = [_slurm(cmd, gpus, node) for _, _, cmd in plans]
    report = SuggestReport(
        model=source.name,
        gpus=gpus,
        gpus_per_node=node,
        hardware=hw,
        seq_len=seq_len,
        global_batch_tokens=global_batch_tokens,
        dtype=dtype,
        plans=plans,
        rejected=dict(rejected),
        searched=searched,
        traced=tracer.count,
        elapsed_s=time.perf_counter() - start,
        points=points,
        memory_limit=int(limit),
        best_unfit=best_unfit,
        assumptions=_assumptions(hw, max_seq, seq_len, ctx.factors),
        why=why,
        equivalents=equivalents,
        slurm=slurms[0] if slurms else None,
        slurms=slurms,
        needs={} if needs is None else {"pp": needs.pp, "cp": needs.cp},
    )
    if not plans and fixed is not None:
        _refuse_fixed(checks, fixed, schedule, ac, microbatches, sp, stages_per_rank)
    if not plans:
        if best_unfit is None:
            raise DoesNotFit(
                f"no layout of {source.name} on {gpus} GPUs passes the plan checks; "
                f"rejected: {dict(rejected)}.",
                report,
            )
        c, need = best_unfit
        device_need = _device_memory_needed(need)
        if unfit_states_only:
            # No layout got as far as a trace: even spread over every GPU, the states
            # alone exceed the device, whatever the activations and checkpointing.
            where = (
                f"the training states alone ({_state_dtype(dtype)} weights, gradients and AdamW "
                f"moments, {state_bytes} bytes a parameter) spread over all {gpus // c.dp_replicate} GPUs: "
                f"{human_bytes(need)} per rank plus the headroom, before any activation"
            )
            fix = "Use more GPUs or a GPU with more memory (a shorter sequence does not help)"
            fix += "." if dtype == "bf16-true" else ", or --dtype bf16-true (half the states)."
        else:
            where = f"layout {c.describe()}: {human_bytes(need)} per rank plus the headroom"
            if unfit_at_optimizer:
                where += (
                    " at its optimizer step (the states and AdamW's sqrt(exp_avg_sq) of "
                    "every local parameter)"
                )
            fix = "Use more GPUs, a GPU with more memory, or a shorter sequence / smaller batch."
        raise DoesNotFit(
            f"does not fit: needs >= {device_need / 1e9:.1f} GB per GPU at best ({where}); "
            f"{hw.name} has {hw.memory_bytes / 1e9:.0f} GB. {fix}",
            report,
        )
    return report


def _refuse_fixed(
    checks: _Checks,
    mesh: dict[str, int],
    schedule: str | None,
    ac: str | None,
    microbatches: int | None,
    sp: bool | None,
    stages_per_rank: int | None = None,
) -> None:
    """Raise the run plan's errors of the fixed run (the switches not fixed at the
    trainer's defaults), when it has any: the gate the trainer, ``validate`` and
    ``plan`` ask, word for word."""
    from hyper_parallel.distributed.run_plan import default_num_microbatches, raise_findings

    schedule = schedule or "1F1B"
    c = Candidate(
        **mesh,
        microbatches=microbatches
        or default_num_microbatches(mesh["pp"], schedule, stages_per_rank),
        schedule=schedule if mesh["pp"] > 1 else None,
        ac=ac or "none",
        sp=bool(sp),
        stages_per_rank=stages_per_rank if mesh["pp"] > 1 else None,
    )
    described = ",".join(f"{a}={v}" for a, v in mesh.items() if v > 1) or "one device"
    raise_findings(
        [_in_suggest_terms(f, checks.seq_len, c.dp) for f in checks.run(c).errors],
        f"suggest --mesh {described}",
    )


def _in_suggest_terms(finding: Finding, seq_len: int, dp: int) -> Finding:
    """``finding`` with a fix that names suggest's options: its global batch is
    ``--global-batch-tokens`` / ``--seq`` (it has no ``--batch-size``)."""
    if finding.path != "switches" or finding.field != "batch_size":
        return finding
    step = dp * seq_len
    return dataclasses.replace(
        finding,
        fix=f"make --global-batch-tokens a multiple of {dp} x --seq {seq_len} = {step:,} "
        "(each data-parallel rank takes whole sequences), or change the data axes.",
    )


def predict(
    model: str | ModelSource,
    candidate: Candidate,
    *,
    gpus: int,
    gpu: str | Path | Hardware,
    seq_len: int,
    global_batch_tokens: int,
    gpus_per_node: int | None = None,
    dtype: str = "bf16",
    factors: RunFactors | None = None,
) -> Prediction:
    """The cost model's prediction for one given layout (no search).

    ``factors``: what differs from this package's eager trainer (compile, float8, async
    TP), as :class:`~hyper_parallel.analysis.suggest.RunFactors`.

    Raises:
        ValueError: When the global batch does not split over the layout's data-parallel
            ranks and micro-batches, or the plan checks refuse ``candidate`` (every
            finding listed).

    Example::

        c = Candidate(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=1,
                      microbatches=1, schedule=None, ac="none", sp=False)
        predict("llama3-debug", c, gpus=4, gpu="h100-80gb", seq_len=128,
                global_batch_tokens=8 * 128).step_s
    """
    scorer = LayoutScorer(
        model,
        gpus=gpus,
        gpu=gpu,
        seq_len=seq_len,
        global_batch_tokens=global_batch_tokens,
        gpus_per_node=gpus_per_node,
        dtype=dtype,
    )
    return scorer.predict(candidate, factors=factors)


class LayoutScorer:
    """One model on one cluster at one sequence and batch: predicts any layout, sharing
    the traces, FLOP counts and run plans between calls (``plan --gpu``, ``suggest
    --mesh`` and the published-runs bench score through it).

    Example::

        scorer = LayoutScorer("llama3-8b", gpus=8, gpu="h100-80gb", seq_len=8192,
                              global_batch_tokens=16 * 8192)
        scorer.predict(Candidate(1, 1, 8, 1, 1, 1, 1, None, "selective", False)).mfu
    """

    def __init__(
        self,
        model: str | ModelSource,
        *,
        gpus: int,
        gpu: str | Path | Hardware,
        seq_len: int,
        global_batch_tokens: int,
        gpus_per_node: int | None = None,
        dtype: str = "bf16",
        compile: bool = False,
        pipeline_split: Mapping[str, Any] | None = None,
    ) -> None:
        source = model if isinstance(model, ModelSource) else ModelSource(model)
        source, _ = _long_enough(source, seq_len)
        hw = gpu if isinstance(gpu, Hardware) else load_hardware(gpu)
        node = gpus_per_node or hw.gpus_per_node
        _check_arguments(gpus, node, seq_len, global_batch_tokens, dtype, 1)
        global_batch = global_batch_tokens // seq_len
        self.hardware = hw
        # A compiled run is scored at the stated compile factor (as `suggest --compile`).
        self._ctx = _Context.build(
            source, hw, node, gpus, seq_len, global_batch, dtype, compile, pipeline_split
        )

    @property
    def memory_limit(self) -> float:
        """Bytes per GPU a layout may use (:func:`~hyper_parallel.analysis.cost_model.usable_memory`)."""
        return self._ctx.limit

    def predict(
        self,
        candidate: Candidate,
        *,
        hardware: Hardware | None = None,
        factors: RunFactors | None = None,
    ) -> Prediction:
        """Memory and step time of ``candidate`` (``hardware`` replaces the scorer's, e.g.
        with other efficiencies; ``factors`` as in :func:`predict`).

        Raises:
            ValueError: As :func:`predict`.
        """
        ctx = self._ctx
        if candidate.layout.world_size != ctx.gpus:
            raise ValueError(
                f"predict: {candidate.mesh_text()} has {candidate.layout.world_size} ranks, "
                f"not {ctx.gpus}."
            )
        _check_batch(ctx.global_batch, candidate)
        problems = _findings(ctx.checks, candidate)
        if problems:
            raise ValueError(
                "predict: the plan checks refuse "
                + candidate.describe()
                + ": "
                + "; ".join(str(f) for _, f in problems)
            )
        hw = hardware or ctx.hw
        if hw is not ctx.hw or factors is not None:
            # Cached seconds depend on the hardware and the factors: a fresh cache,
            # but for the pipeline's plan, action lists and replay (counts, not seconds).
            kept = {k: v for k, v in ctx.pipeline_cache.items() if k[0] in _COUNTS}
            fresh = dataclasses.replace(
                ctx, hw=hw, factors=factors or RunFactors(), pipeline_cache=kept
            )
            out = _predict(fresh, candidate)
            for k, v in fresh.pipeline_cache.items():
                if k[0] in _COUNTS:
                    ctx.pipeline_cache[k] = v
            return out
        return _predict(ctx, candidate)


_COUNTS = ("plan", "ops", "sim")
"""The scorer's cache entries that do not depend on the hardware or the factors."""


def _check_batch(global_batch: int, c: Candidate) -> None:
    """Refuse a global batch that does not split over the data-parallel ranks and then
    into the candidate's micro-batches (a rank with no sequence has nothing to compute)."""
    if global_batch % c.dp:
        raise ValueError(
            f"predict: a global batch of {global_batch} sequences does not split over "
            f"dp_replicate x dp_shard = {c.dp} data-parallel ranks of {c.mesh_text()}; give "
            f"--global-batch-tokens as a multiple of {c.dp} x seq, e.g. "
            f"{max(1, global_batch // c.dp) * c.dp} sequences."
        )
    local = global_batch // c.dp
    if local % c.microbatches:
        raise ValueError(
            f"predict: {local} sequences per data-parallel rank do not split into "
            f"{c.microbatches} micro-batches; give --microbatches dividing {local}."
        )


def _findings(checks: _Checks, c: Candidate) -> list[tuple[str, Finding]]:
    """The plan checks' errors for one candidate: the one place the search asks them."""
    return checks.findings(c)


def _state_dtype(dtype: str) -> str:
    """The states' dtype under a precision, as the options name it (``bf16`` keeps fp32)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[PARAM_DTYPES[dtype]]


def _check_arguments(gpus: int, node: int, seq_len: int, tokens: int, dtype: str, top: int) -> None:
    if gpus < 1 or node < 1 or seq_len < 1 or top < 1:
        raise ValueError("suggest: --gpus, --gpus-per-node, --seq and --top must be >= 1.")
    if gpus > node and gpus % node:
        raise ValueError(
            f"suggest: {gpus} GPUs do not fill nodes of {node}; give a multiple of "
            f"--gpus-per-node ({node})."
        )
    if tokens % seq_len or tokens < seq_len:
        raise ValueError(
            f"suggest: --global-batch-tokens {tokens:,} is not a multiple of --seq "
            f"{seq_len:,}; use e.g. {max(1, tokens // seq_len) * seq_len:,}."
        )
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"suggest: --dtype {dtype!r}; use one of {', '.join(PARAM_DTYPES)}.")


def _param_counts(checks: _Checks) -> list[int]:
    if checks.units is not None:
        return [u.num_params for u in checks.units]
    with torch.device("meta"):
        return [sum(p.numel() for p in checks.config.build().parameters())]


def _device_memory_needed(per_rank: int) -> float:
    from hyper_parallel.analysis.cost_model import (
        MEMORY_HEADROOM_BYTES,
        MEMORY_HEADROOM_FRACTION,
    )

    return (per_rank + MEMORY_HEADROOM_BYTES) / (1 - MEMORY_HEADROOM_FRACTION)


def _train_args(
    source: ModelSource, c: Candidate, seq_len: int, global_batch: int, dtype: str
) -> list[str]:
    """The ``hyper_parallel.train.run`` options that run ``c``."""
    args = ["--model", source.spec_name]
    if source.overrides:
        args += ["--model-overrides", json.dumps(dict(source.overrides), separators=(",", ":"))]
    if source.weights is not None:  # start from the checkpoint's weights, not random ones
        args += ["--hf-checkpoint", source.weights]
    args += [
        "--mesh",
        c.mesh_text(),
        "--seq-len",
        str(seq_len),
        "--batch-size",
        str(global_batch),
        "--dtype",
        dtype,
        "--ac",
        c.ac,
    ]
    if c.sp:
        args.append("--sp")
    if c.pp > 1:
        args += ["--schedule", c.schedule or "1F1B", "--microbatches", str(c.microbatches)]
        if c.stages_per_rank is not None:
            args += ["--stages-per-rank", str(c.stages_per_rank)]
    elif c.microbatches > 1:  # gradient accumulation
        args += ["--microbatches", str(c.microbatches)]
        if c.reduce_each:
            args.append("--reduce-each-microbatch")
    return args


def _nodes(gpus: int, node: int) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of ``gpus`` GPUs on nodes of ``node``."""
    return (1, gpus) if gpus <= node else (gpus // node, node)


def _command(
    source: ModelSource,
    c: Candidate,
    gpus: int,
    node: int,
    seq_len: int,
    global_batch: int,
    dtype: str,
) -> str:
    """The ``torchrun ... -m hyper_parallel.train.run ...`` line that runs ``c`` (on each
    node when it needs several: :func:`~hyper_parallel.train.launch.node_command`)."""
    nodes, per_node = _nodes(gpus, node)
    return node_command(
        _train_args(source, c, seq_len, global_batch, dtype), nodes=nodes, gpus_per_node=per_node
    )


def _slurm(command: str, gpus: int, node: int) -> str | None:
    """The SLURM batch script of a plan's ``command`` when it needs more than one node,
    else ``None``."""
    nodes, per_node = _nodes(gpus, node)
    if nodes == 1:
        return None
    return slurm_script(train_options(command), nodes=nodes, gpus_per_node=per_node)


def _assumptions(
    hw: Hardware, max_seq: int | None, seq_len: int, factors: RunFactors | None = None
) -> list[str]:
    from hyper_parallel.analysis.cost_model import (
        MEMORY_HEADROOM_BYTES,
        MEMORY_HEADROOM_FRACTION,
    )

    notes = [
        f"Memory limit: {hw.memory_bytes / 1e9:.0f} GB less {MEMORY_HEADROOM_FRACTION:.0%} "
        f"(allocator fragmentation) less {MEMORY_HEADROOM_BYTES / 1024**3:.0f} GiB (CUDA "
        "context, workspaces, NCCL buffers).",
        "Per-rank memory: the dry run's parameters, gradients and AdamW moments (fp32 "
        "master weights; bf16 under --dtype bf16-true) sharded by FSDP2, activations: one micro-batch's peak (its "
        "backward, a recompute's working set included) plus what its forward keeps for "
        "each other micro-batch a stage holds (schedule's action list), and FSDP2's transient "
        "buffers (two units gathered + one unit's fp32 gradients; under a pipeline the "
        "whole stage gathered with its unsharded fp32 gradients, reduced at the step's "
        "end); or, where larger, the optimizer step's: the states plus AdamW's "
        "sqrt(exp_avg_sq) of every local parameter (5 of a moment's size per element).",
        "Time: FLOPs counted on the meta device at the hardware file's efficiency; "
        "collectives by a latency-bandwidth model per link (tp/cp/ep exposed; FSDP2 "
        "gathers and reduces hidden behind compute of the same phase, except one unit "
        "each); pipeline bubble from the schedule's action list with the heaviest stage's "
        "op times; recompute of checkpointed blocks' forward (FLOPs and collectives).",
        f"Fixed cost per operator: {hw.op_overhead_s * 1e6:.1f} us x the aten operators "
        "counted on the meta device per block and for the rest (forward, backward, "
        "recompute).",
        "Operators without a FLOP formula (elementwise, norms, softmax, copies): the "
        "elements they read and write (counted on the meta device per sequence) x the "
        f"compute dtype's bytes at {hw.hbm_bandwidth / 1e9:.1f} GB/s, divided by tp x cp.",
        "Optimizer: AdamW's 28 bytes per local element at the memory bandwidth, plus "
        "the trainer's gradient-norm, AdamW and zero_grad operators per parameter "
        f"tensor at {hw.op_overhead_s * 1e6:.1f} us each, "
        f"+{hw.dtensor_op_overhead_s * 1e6:.1f} us on DTensor (sharded) parameters; a "
        "gradient left Partial by backward is reduced once per optimizer-operator "
        "argument that reads it.",
        f"Overlap: {hw.comm_overlap:.0%} of an FSDP2 all-gather / reduce-scatter / HSDP "
        "all-reduce hides behind the compute of its phase (up to that compute's length); "
        "the Python cost of DTensor around forward and backward operators and of "
        "FSDP2's hooks is not modeled.",
        "Micro-batches: each data-parallel rank's batch splits into them, with and without "
        "pp. Without pp they are gradient accumulation (searched: the powers of two that "
        "divide the local batch, and one sequence each): activations of one micro-batch, "
        "compute and tp/cp/ep collectives of all of them, FSDP2 gathering each unit again "
        "per micro-batch and reducing once per step, its unsharded fp32 gradients held "
        "until then (counted as the gradients' memory).",
        f"cp is searched in powers of two down to {MIN_CP_TOKENS} tokens per rank (a "
        f"fixed --mesh is scored whatever its cp); pp up "
        f"to {MAX_PP}, with 1, 2 and 4 times the run plan's micro-batch count (one per "
        "stage: pp, or 2 pp for the interleaved schedules) and the local batch and half "
        "of it (one or two sequences per micro-batch), each that the local batch splits "
        "into with at least one micro-batch per pipeline rank.",
    ]
    if factors is not None and factors.compute != 1.0:
        notes.append(
            f"torch.compile: compute times x{factors.compute:g} (STATED_FACTORS: the fit of "
            "benchmarks/bench_published.py on published runs that compile)."
        )
    for field_name, source in sorted(hw.sources.items()):
        notes.append(f"{hw.name} {field_name}: {source}")
    if max_seq is not None and seq_len > max_seq:
        notes.append(
            f"seq {seq_len} exceeds the model's max_seq_len {max_seq}: the model is built "
            f"with max_seq_len={seq_len} (in the commands' --model-overrides)."
        )
    return notes
