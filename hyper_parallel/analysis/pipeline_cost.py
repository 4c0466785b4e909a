"""What a pipeline schedule costs, from its own action list: bubble, memory, traffic.

Pure functions (no process group, no tensors). The action list is torch's
(``torch.distributed.pipelining`` builds it for every schedule; see
:func:`~hyper_parallel.distributed.pipeline.schedule_actions`), replayed by a small
event simulation: each rank runs its actions in order, a forward waits for the
previous stage's forward of the same micro-batch, a backward for the next stage's
backward and its own forward, a weight-gradient step (zero-bubble ``W``) for its
input-gradient step (``I``). Costs follow the zero-bubble paper's convention
(Qi et al., 2023, §2: F = B_input = B_weight, so a full backward costs 2 F).
Communication is taken as free, so the bubble is the schedule's own idle time.

Example:
    >>> round(bubble_fraction("GPipe", pp=4, num_microbatches=8), 4)  # (p-1)/(m+p-1)
    0.2727
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from hyper_parallel.distributed.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelinePlan,
    PipelineUnit,
    schedule_actions,
    stages_per_rank_of,
)
from hyper_parallel.distributed.precision import PARAM_DTYPES

__all__ = [
    "DEFAULT_COSTS",
    "Op",
    "StageCost",
    "bubble_fraction",
    "in_flight_microbatches",
    "p2p_bytes_per_step",
    "pipeline_report",
    "rank_ops",
    "simulate",
    "stage_collectives",
    "stage_costs",
]

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Relative time of a forward, a full backward, an input-gradient and a weight-gradient step."""


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One compute action: ``kind`` in F, B (full backward), I (input grad), W (weight grad)."""

    kind: str
    stage: int
    microbatch: int


_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W"}


def _from_torch(action: Any) -> Op | None:
    if action is None:
        return None
    kind = getattr(action.computation_type, "value", str(action.computation_type))
    if kind not in _KINDS:
        return None  # communication, REDUCE_GRAD: not compute
    return Op(_KINDS[kind], action.stage_index, action.microbatch_index)


def _runtime_1f1b(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """1F1B's order as torch's ``Schedule1F1B`` runs it (its IR skips micro-batch 0 on
    the last stage): ``min(m, S - s)`` forwards, then backward/forward pairs, then the
    remaining backwards."""
    ops: list[Op] = []
    warmup = min(num_microbatches, num_stages - stage)
    fwd = bwd = 0
    for _ in range(warmup):
        ops.append(Op("F", stage, fwd))
        fwd += 1
    while True:
        ops.append(Op("B", stage, bwd))
        bwd += 1
        if fwd == num_microbatches:
            break
        ops.append(Op("F", stage, fwd))
        fwd += 1
    ops += [Op("B", stage, b) for b in range(bwd, num_microbatches)]
    return ops


def _complete(ops: Sequence[Sequence[Op]], num_stages: int, m: int) -> bool:
    """Every stage does each micro-batch's forward and backward exactly once."""
    seen: dict[tuple[str, int, int], int] = {}
    for rank in ops:
        for op in rank:
            key = (op.kind, op.stage, op.microbatch)
            seen[key] = seen.get(key, 0) + 1
    for s in range(num_stages):
        for mb in range(m):
            if seen.get(("F", s, mb)) != 1:
                return False
            full = seen.get(("B", s, mb), 0)
            split = (seen.get(("I", s, mb), 0), seen.get(("W", s, mb), 0))
            if not (full == 1 and split == (0, 0)) and not (full == 0 and split == (1, 1)):
                return False
    return all(v == 1 for v in seen.values())


def rank_ops(
    schedule: str, pp: int, num_microbatches: int, stages_per_rank: int | None = None
) -> list[list[Op]]:
    """Each rank's compute actions in order, from torch's action list.

    Where torch's intermediate representation is incomplete (its 1F1B IR skips the
    last stage's micro-batch 0 in torch 2.13), the order its runtime executes is used.

    Raises:
        ValueError: torch refuses the combination (too few micro-batches, ...).
    """
    per_rank = stages_per_rank_of(schedule, stages_per_rank)
    actions = schedule_actions(schedule, pp, num_microbatches, per_rank)
    ops = [[op for a in rank if (op := _from_torch(a)) is not None] for rank in actions]
    num_stages = pp * per_rank
    if not _complete(ops, num_stages, num_microbatches) and schedule == "1F1B":
        ops = [_runtime_1f1b(num_stages, num_microbatches, s) for s in range(pp)]
    if not _complete(ops, num_stages, num_microbatches):
        raise ValueError(
            f"{schedule}: torch's action list for pp={pp}, {num_microbatches} micro-batches "
            "does not run every micro-batch through every stage exactly once."
        )
    return ops


@dataclasses.dataclass(frozen=True, slots=True)
class _Timeline:
    makespan: float
    busy: list[float]
    finish: dict[Op, float]
    start: dict[Op, float]


def simulate(ops: Sequence[Sequence[Op]], costs: Mapping[str, float] | None = None) -> _Timeline:
    """Replay per-rank action lists with dependencies; returns start/finish of every op.

    Raises:
        ValueError: The lists deadlock (an op waits for one that can never run).
    """
    costs = {**DEFAULT_COSTS, **(costs or {})}
    num_stages = 1 + max(op.stage for rank in ops for op in rank)
    finish: dict[Op, float] = {}
    start: dict[Op, float] = {}
    position = [0] * len(ops)
    clock = [0.0] * len(ops)

    def ready_at(op: Op) -> float | None:
        """When ``op``'s inputs are ready, or ``None`` while one is not done yet."""
        if op.kind == "F":
            deps = [Op("F", op.stage - 1, op.microbatch)] if op.stage > 0 else []
        elif op.kind == "W":
            deps = [Op("I", op.stage, op.microbatch)]
        else:  # B or I: own forward, and the next stage's input gradient (B or I)
            deps = [Op("F", op.stage, op.microbatch)]
            if op.stage < num_stages - 1:
                nxt = [Op(k, op.stage + 1, op.microbatch) for k in ("B", "I")]
                done = [d for d in nxt if d in finish]
                if not done:
                    return None
                deps.append(done[0])
        if any(d not in finish for d in deps):
            return None
        return max((finish[d] for d in deps), default=0.0)

    remaining = sum(len(r) for r in ops)
    while remaining:
        progressed = False
        for r, rank in enumerate(ops):
            while position[r] < len(rank):
                op = rank[position[r]]
                at = ready_at(op)
                if at is None:
                    break
                start[op] = max(clock[r], at)
                finish[op] = start[op] + costs[op.kind]
                clock[r] = finish[op]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [rank[position[r]] for r, rank in enumerate(ops) if position[r] < len(rank)]
            raise ValueError(f"pipeline actions deadlock; waiting ops: {stuck}")
    busy = [sum(costs[op.kind] for op in rank) for rank in ops]
    return _Timeline(max(clock), busy, finish, start)


def bubble_fraction(
    schedule: str,
    pp: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    costs: Mapping[str, float] | None = None,
) -> float:
    """Idle fraction of the pipeline's ranks over one step, from the schedule's actions.

    ``1 - sum(busy time) / (pp * makespan)`` with :data:`DEFAULT_COSTS`; for GPipe
    and 1F1B this is (p - 1) / (m + p - 1) (Huang et al., 2019; Narayanan et al., 2021).

    Example:
        >>> bubble_fraction("1F1B", pp=2, num_microbatches=4) == 1 / 5
        True
    """
    timeline = simulate(rank_ops(schedule, pp, num_microbatches, stages_per_rank), costs)
    return 1.0 - sum(timeline.busy) / (len(timeline.busy) * timeline.makespan)


def in_flight_microbatches(ops: Sequence[Sequence[Op]]) -> dict[int, int]:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not).

    Activations are freed by the full backward or the input-gradient step (the
    weight-gradient step keeps a smaller set; counted as freed here).
    """
    out: dict[int, int] = {}
    for rank in ops:
        live: dict[int, int] = {}
        for op in rank:
            if op.kind == "F":
                live[op.stage] = live.get(op.stage, 0) + 1
                out[op.stage] = max(out.get(op.stage, 0), live[op.stage])
            elif op.kind in ("B", "I"):
                live[op.stage] -= 1
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class StageCost:
    """Per-rank memory of one stage (bytes) and the units it holds."""

    stage: int
    rank: int
    units: tuple[str, ...]
    num_params: int
    params: int
    grads: int
    optimizer: int
    in_flight_microbatches: int
    activations: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return dataclasses.asdict(self) | {"units": list(self.units)}


def stage_costs(
    plan: PipelinePlan,
    units: Sequence[PipelineUnit],
    *,
    shard_ways: int = 1,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
    activation_bytes_per_microbatch: Mapping[str, int] | None = None,
) -> list[StageCost]:
    """Per-rank parameter, gradient, optimizer and activation bytes of each stage.

    Args:
        plan: The checked pipeline plan.
        units: The model's units (parameter counts).
        shard_ways: How many ways the stage's states are sharded within the stage's
            ranks (tp x fsdp; replicated norms are counted as sharded too, a bound
            off by the norms' share).
        param_bytes, grad_bytes: Bytes per parameter / gradient element.
        optimizer_bytes: Optimizer-state bytes per parameter (AdamW: two moments in the
            parameters' dtype, 8 for fp32 parameters).
        activation_bytes_per_microbatch: Per unit, the activations one micro-batch
            keeps for the backward on one rank; multiplied by the stage's in-flight
            micro-batches from the schedule's actions.

    Returns:
        One :class:`StageCost` per stage.
    """
    by_name = {u.name: u for u in units}
    in_flight = in_flight_microbatches(
        rank_ops(plan.schedule, plan.pp, plan.num_microbatches, plan.stages_per_rank)
    )
    acts = activation_bytes_per_microbatch or {}
    out = []
    for s, names in enumerate(plan.stages):
        count = sum(by_name[n].num_params for n in names)
        per_rank = -(-count // shard_ways)
        flying = in_flight.get(s, 0)
        out.append(
            StageCost(
                stage=s,
                rank=plan.ranks[s],
                units=tuple(names),
                num_params=count,
                params=per_rank * param_bytes,
                grads=per_rank * grad_bytes,
                optimizer=per_rank * optimizer_bytes,
                in_flight_microbatches=flying,
                activations=flying * sum(acts.get(n, 0) for n in names),
            )
        )
    return out


def p2p_bytes_per_step(
    plan: PipelinePlan,
    activation_bytes: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
) -> dict[str, int]:
    """Point-to-point bytes of one step: activations forward, their gradients backward.

    Each of the ``num_stages - 1`` boundaries carries, per micro-batch, the activation
    forward and its gradient backward (``activation_bytes`` = micro-batch x seq x
    dim x element size). Every tp rank of a stage sends its own copy: the whole
    tensor under plain TP (the residual stream is replicated), a 1/tp sequence
    shard under sequence parallelism. Under context parallelism each cp rank sends
    its own 1/cp of the sequence.

    Returns:
        ``per_microbatch`` (one boundary, one direction, one rank), ``per_rank_max``
        (the most one rank sends in a step), ``total`` (all ranks of one pipeline:
        its cp x tp ranks per stage).
    """
    per_mb = activation_bytes // cp
    per_mb = per_mb // tp if sequence_parallel else per_mb
    m = plan.num_microbatches
    sent = [0] * plan.pp
    for s in range(plan.num_stages):
        rank = plan.ranks[s]
        if s < plan.num_stages - 1:
            sent[rank] += m * per_mb  # forward activations to stage s + 1
        if s > 0:
            sent[rank] += m * per_mb  # gradients back to stage s - 1
    return {
        "per_microbatch": per_mb,
        "per_rank_max": max(sent),
        "total": sum(sent) * tp * cp,
    }


def pipeline_report(
    layout: Any,
    stages: Any,
    config: Any,
    *,
    schedule: str,
    num_microbatches: int,
    microbatch_size: int,
    seq_len: int,
    element_bytes: int,
    sequence_parallel: bool = False,
    sharded_config: Any = None,
    fsdp: bool = True,
    param_dtype: Any = None,
    ac: str = "none",
    dtype: str = "fp32",
    loss_fn: Any = None,
    split: Any = None,
    stages_per_rank: int | None = None,
) -> dict[str, Any]:
    """The pipeline part of a dry run: stages, per-rank bytes, bubble and P2P traffic.

    Args:
        layout: The mesh layout (``pp``, ``tp``, ``fsdp`` sizes).
        stages: The model's :class:`~hyper_parallel.distributed.pipeline.PipelineLayout`.
        config: The model config (unsharded).
        schedule, num_microbatches: The pipeline schedule and its micro-batches.
        microbatch_size: Sequences per micro-batch on one data-parallel rank.
        seq_len: Tokens per sequence.
        element_bytes: Bytes of an activation element (the compute dtype's), and of a
            parameter and its gradient unless ``param_dtype`` is given (the trainer's
            fp32 master weights under bf16: their dtype's bytes); the optimizer keeps
            two states per parameter in that dtype (AdamW).
        sequence_parallel: Activations between and inside blocks split over tp.
        sharded_config: The config with its sharding as the trainer applies it; when
            given, each stage also lists its own collectives per micro-batch and per
            step (:func:`stage_collectives`), traced with ``fsdp``, ``param_dtype``,
            ``ac``, ``dtype`` and ``loss_fn`` (the last stage's), and its activations
            are the traced stage's saved bytes (rank 0's ``seq_len / cp`` tokens under
            context parallelism): one micro-batch's peak plus, for each other micro-batch
            in flight, what its forward keeps; without it, the
            model's per-token estimate (``stages.activation_elements``, no cp).
        split: The stage split (a :class:`~hyper_parallel.distributed.pipeline.PipelineSplit`,
            as the run plan holds it); ``None``: balanced by parameters.
        stages_per_rank: Stages per rank, as the run plan holds it (``None``: the
            schedule's default).

    Returns:
        ``stages`` (per stage: units, parameters, per-rank bytes, and with
        ``sharded_config`` its collectives), ``per_rank_bytes``
        (the heaviest pp rank), ``bubble_fraction``, ``p2p_bytes`` and the plan.
    """
    from hyper_parallel.distributed.pipeline import plan_pipeline

    units = stages.units(config)
    plan = plan_pipeline(
        units,
        pp=layout.pp,
        schedule=schedule,
        num_microbatches=num_microbatches,
        split=split,
        stages_per_rank=stages_per_rank,
    )
    if sharded_config is None and layout.cp > 1:
        raise ValueError(
            f"pipeline_report: cp={layout.cp} splits each stage's sequence, which the "
            "per-token activation estimate does not model; pass sharded_config= (the "
            "config as the trainer shards it) so the stages are traced with their cp part."
        )
    tokens = microbatch_size * seq_len
    acts: dict[str, int] = {}  # the estimate without traced stages (no sharded_config)
    if stages.activation_elements is not None:
        for u in units:
            replicated, split = stages.activation_elements(config, u.name)
            if sequence_parallel:
                replicated //= layout.tp
            acts[u.name] = (replicated + split // layout.tp) * tokens * element_bytes
    # Parameters and their gradients in the parameters' dtype (FSDP2 reduce-scatters into
    # the fp32 shards under bf16 compute), as the flat dry run counts them.
    state_bytes = param_dtype.itemsize if param_dtype is not None else element_bytes
    costs = stage_costs(
        plan,
        units,
        shard_ways=layout.tp * layout.fsdp,
        param_bytes=state_bytes,
        grad_bytes=state_bytes,
        optimizer_bytes=2 * state_bytes,  # AdamW's moments: the parameters' dtype
        activation_bytes_per_microbatch=acts,
    )
    traced = None
    if sharded_config is not None:
        traced = stage_collectives(
            plan,
            stages,
            sharded_config,
            layout,
            microbatch_size=microbatch_size,
            seq_len=seq_len,
            fsdp=fsdp,
            param_dtype=param_dtype,
            ac=ac,
            dtype=dtype,
            loss_fn=loss_fn,
        )
        # The traced stage's saved activations (its cp part of the sequence, its ac and
        # dtype): each micro-batch in flight holds what its forward saved, the one in
        # its backward reaches the peak (a recompute's working set is needed once).
        costs = [
            dataclasses.replace(
                c,
                activations=t["activations_per_microbatch"]
                + max(c.in_flight_microbatches - 1, 0) * t["activations_held_per_microbatch"]
                if c.in_flight_microbatches
                else 0,
            )
            for c, t in zip(costs, traced, strict=True)
        ]
    per_rank: dict[int, dict[str, int]] = {}
    for c in costs:
        into = per_rank.setdefault(
            c.rank, dict.fromkeys(("params", "grads", "optimizer", "activations"), 0)
        )
        for key in into:
            into[key] += getattr(c, key)
    heaviest = max(per_rank.values(), key=lambda d: sum(d.values()))
    dim = stages.stage_width(config)
    rows = [
        c.to_dict() | {"total": c.params + c.grads + c.optimizer + c.activations} for c in costs
    ]
    for row, t in zip(rows, traced or (), strict=False):
        row["collectives_per_microbatch"] = t["collectives_per_microbatch"]
        row["collectives"] = t["collectives"]
    return {
        "pipeline": plan.to_dict(),
        "stages": rows,
        "per_rank_bytes": heaviest | {"total": sum(heaviest.values())},
        "bubble_fraction": bubble_fraction(
            schedule, layout.pp, num_microbatches, plan.stages_per_rank
        ),
        "p2p_bytes": p2p_bytes_per_step(
            plan,
            tokens * dim * element_bytes,
            tp=layout.tp,
            sequence_parallel=sequence_parallel,
            cp=layout.cp,
        ),
    }


# ---------------------------------------------------------------------------- collectives

_Key = tuple[str, str, str]  # (kind, axis, phase)


def _by_key(collectives: Sequence[Any]) -> dict[_Key, dict[str, int]]:
    """The dry run's collective rows (``to_dict`` form) summed per (kind, axis, phase)."""
    out: dict[_Key, dict[str, int]] = {}
    for c in collectives:
        row = c if isinstance(c, Mapping) else c.to_dict()
        into = out.setdefault((row["kind"], row["axis"], row["phase"]), {"count": 0, "bytes": 0})
        into["count"] += row["count"]
        into["bytes"] += row["bytes"]
    return out


def _combine(
    parts: Sequence[tuple[dict[_Key, dict[str, int]], int]],
) -> dict[_Key, dict[str, int]]:
    """``sum(weight * part)`` per key; entries that end at zero count are dropped."""
    out: dict[_Key, dict[str, int]] = {}
    for part, weight in parts:
        for key, v in part.items():
            into = out.setdefault(key, {"count": 0, "bytes": 0})
            into["count"] += weight * v["count"]
            into["bytes"] += weight * v["bytes"]
    return {k: v for k, v in out.items() if v["count"] > 0}


def _block_gathers(ops: Sequence[Op], stage: int) -> tuple[int, int]:
    """How often a block's FSDP2 unit all-gathers in forward and in backward in one step.

    Replays the stage's actions against the builder's FSDP2 settings under a pipeline
    schedule: stage parameters stay gathered after forward
    (``reshard_after_forward=False``, the run plan's
    :attr:`~hyper_parallel.distributed.run_plan.RunPlan.reshard_after_forward` under
    ``pp``, as torchtitan) and after backward (``PipelineStage``'s
    ``set_reshard_after_backward(False)``) until the step's ``REDUCE_GRAD``: a forward
    or backward that finds the block sharded gathers it — the step's first action only.
    """
    gathered = False
    forward = backward = 0
    for op in ops:
        if op.stage != stage:
            continue
        if op.kind == "F":
            forward += not gathered
        elif op.kind in ("B", "I"):
            backward += not gathered
        else:
            continue
        gathered = True
    return forward, backward


def stage_collectives(
    plan: PipelinePlan,
    stages: Any,
    config: Any,
    layout: Any,
    *,
    microbatch_size: int,
    seq_len: int,
    fsdp: bool = True,
    param_dtype: Any = None,
    ac: str = "none",
    dtype: str = "fp32",
    loss_fn: Any = None,
) -> list[dict[str, Any]]:
    """Each stage's own collectives (tp, cp, FSDP inside the stage) per step, traced.

    Each kind of stage (with the first unit, the last unit, or neither) is built as
    the trainer builds it (``stages.stage_config`` of the sharded ``config``) and
    traced by :func:`~hyper_parallel.analysis.dry_run` for one micro-batch, with one
    block and with two: the difference is one block's collectives (the blocks are
    identical), the rest the stage's own units. Per step, collectives of the
    activations (``tp``, ``cp``) repeat per micro-batch; FSDP2's reduce-scatter (and
    HSDP's all-reduce) runs once, at torch's ``REDUCE_GRAD``; the stage root and each
    block are gathered once, by the step's first forward (the builder keeps stage
    parameters gathered across micro-batches, :func:`_block_gathers`; under the
    zero-bubble schedules the stage is one FSDP2 unit: gathered once).
    The stages are traced as rank 0 of the pipeline's other axes sees them: under
    context parallelism its ``seq_len / cp`` tokens with their global positions
    (what the trainer's stages hold, ``set_positions``), so each block's key/value
    gathers on ``cp`` are among its collectives. A stage's loss is the sum of its
    outputs, the last stage's ``loss_fn(logits, targets)`` when given.

    Args:
        plan: The checked pipeline plan.
        stages: The model's ``PipelineLayout``.
        config: The model config with its sharding (as the trainer shards it).
        layout: The mesh layout; traced without ``pp`` (one pipeline's group).
        microbatch_size: Sequences per micro-batch.
        seq_len: Tokens per sequence (global, before the cp split).
        fsdp, param_dtype, ac, dtype: As :func:`~hyper_parallel.analysis.dry_run`.
        loss_fn: The model's loss ``loss_fn(logits, targets)`` for the last stage,
            with token-id targets of the rank's part of the sequence.

    Returns:
        Per stage: ``stage``, ``collectives_per_microbatch`` and ``collectives`` (per
        step), each a list of ``{kind, axis, phase, count, bytes}`` per rank, and
        ``activations_per_microbatch``: the bytes one micro-batch saves for the
        backward on one rank (traced, as the dry run's ``per_rank.activations``).
    """
    import torch

    from hyper_parallel.analysis.dry_run import dry_run

    flat = dataclasses.replace(layout, pp=1)
    dim = stages.stage_width(config)
    first, last = stages.first_name, stages.last_name
    depth = len(getattr(config, stages.layers))
    traces: dict[tuple[bool, bool, int], _Trace] = {}
    # The residual stream a stage receives, as this rank holds it (its cp part of the
    # sequence, and under sequence parallelism its tp part of that).
    hidden = _local_shape((microbatch_size, seq_len, dim), stages.activation_layout(config), flat)
    tokens = (microbatch_size, seq_len // layout.cp)

    def trace(has_first: bool, has_last: bool, num_blocks: int) -> _Trace:
        key = (has_first, has_last, num_blocks)
        if key not in traces:
            if not (has_first or has_last or num_blocks):
                traces[key] = _Trace({}, (), 0, 0)
                return traces[key]
            blocks = [f"{stages.layers}.{i}" for i in range(num_blocks)]
            names = [first] * has_first + blocks + [last] * has_last
            stage_config = stages.stage_config(config, names)
            # The dry run reads only the shape and dtype: no storage (a stage's input at
            # a large micro-batch would not fit in this machine's memory).
            example = (
                torch.empty(tokens, dtype=torch.long, device="meta")
                if has_first
                else torch.empty(hidden, dtype=param_dtype or PARAM_DTYPES[dtype], device="meta")
            )
            report = dry_run(
                stage_config,
                # A stage with no block holds no routed experts: traced without ep
                # (which borrows ranks and adds none, so the dense mesh is the same).
                flat if num_blocks else dataclasses.replace(flat, ep=1),
                batch_size=microbatch_size,
                seq_len=seq_len,
                fsdp=fsdp,
                param_dtype=param_dtype,  # None: dtype's
                inputs=[example],
                loss_fn=_LastStageLoss(loss_fn) if has_last and loss_fn is not None else None,
                ac=ac,
                dtype=dtype,
            )
            traces[key] = _Trace(
                _by_key(report.collectives),
                tuple(report.fsdp_axes),
                report.per_rank.activations,
                report.activations_held_by_ac.get(ac, report.per_rank.activations),
            )
        return traces[key]

    def stage_activations(has_first: bool, has_last: bool, num_blocks: int) -> tuple[int, int]:
        """Saved bytes of a stage with ``num_blocks`` blocks, from two traced depths: the
        peak of one micro-batch and what it holds at the end of its forward.

        As the dry run extrapolates a model's depth: 1 and 2 blocks traced, the
        second minus the first is one more block (the first block also saves what
        the blocks share, built once per forward: under cp the causal mask and the
        rotary tables at the rank's positions; with checkpointing, the backward's
        recompute of one block). ``selective`` checkpoints every second block: 1 and
        3 blocks traced, the difference is one pair.
        """
        low, step = 1, 2 if ac == "selective" and depth >= 3 else 1
        if num_blocks <= low:
            t = trace(has_first, has_last, num_blocks)
            return t.activations, t.held
        a = trace(has_first, has_last, low)
        b = trace(has_first, has_last, low + step)
        n = num_blocks - low
        return (
            a.activations + n * (b.activations - a.activations) // step,
            a.held + n * (b.held - a.held) // step,
        )

    ops = rank_ops(plan.schedule, plan.pp, plan.num_microbatches, plan.stages_per_rank)
    m = plan.num_microbatches
    out = []
    for s, names in enumerate(plan.stages):
        has_first, has_last = first in names, last in names
        num_blocks = len(names) - has_first - has_last
        if num_blocks and depth >= 2:  # a block: the second minus the first; the rest the root's
            with_one, with_two = trace(has_first, has_last, 1), trace(has_first, has_last, 2)
            one_block = _combine([(with_two.collectives, 1), (with_one.collectives, -1)])
            root_collectives = _combine([(with_one.collectives, 1), (one_block, -1)])
        else:
            root, with_one = trace(has_first, has_last, 0), trace(has_first, has_last, num_blocks)
            one_block = _combine([(with_one.collectives, 1), (root.collectives, -1)])
            root_collectives = root.collectives
        per_mb = _combine([(root_collectives, 1), (one_block, num_blocks)])
        forward, backward = _block_gathers(ops[plan.ranks[s]], s)
        if plan.schedule in SPLIT_BACKWARD_SCHEDULES:
            forward, backward = 1, 0
        data = set(with_one.fsdp_axes) | {"dp_replicate"}
        block_weights = {"forward": forward, "backward": backward}
        blocks = _combine([(one_block, num_blocks)])
        total = _combine(
            _per_step(root_collectives, data, m, {"forward": 1, "backward": 0})
            + _per_step(blocks, data, m, block_weights)
        )
        peak, held = stage_activations(has_first, has_last, num_blocks)
        out.append(
            {
                "stage": s,
                "collectives_per_microbatch": _as_list(per_mb),
                "collectives": _as_list(total),
                "activations_per_microbatch": peak,
                "activations_held_per_microbatch": held,
            }
        )
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Trace:
    """One traced stage kind: collectives per micro-batch, FSDP axes, saved bytes."""

    collectives: dict[_Key, dict[str, int]]
    fsdp_axes: tuple[str, ...]
    activations: int
    held: int


def _local_shape(shape: tuple[int, ...], placements: Mapping[Any, Any], layout: Any) -> tuple:
    """``shape`` as one rank holds it under ``placements`` (mesh axis → placement)."""
    local = list(shape)
    for axis, placement in (placements or {}).items():
        dim = getattr(placement, "dim", None)
        if placement.is_shard() and dim is not None:
            local[dim % len(local)] //= layout.size(str(getattr(axis, "value", axis)))
    return tuple(local)


class _LastStageLoss:
    """The model's loss on the last stage's logits, against targets of their tokens."""

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn

    def __call__(self, logits: Any, *_inputs: Any) -> Any:
        import torch

        from hyper_parallel.core.dtensor.dtensor import DTensor

        local = logits.to_local() if isinstance(logits, DTensor) else logits
        return self.loss_fn(logits, torch.zeros(local.shape[:-1], dtype=torch.long))


def _per_step(
    part: dict[_Key, dict[str, int]],
    data_axes: set[str],
    num_microbatches: int,
    gathers: Mapping[str, int] | None,
) -> list[tuple[dict[_Key, dict[str, int]], int]]:
    """Weights that turn one micro-batch's collectives into one step's.

    Collectives on a model axis move activations: once per micro-batch, as does every
    all-to-all (the routed experts' dispatch, whose ep group may be the very ranks of a
    data axis). On a data axis, gradients are reduced once per step; parameters are
    gathered ``gathers[phase]`` times (``None``: once per phase): the stage root once,
    by the step's first forward, and each block as :func:`_block_gathers` replays it
    (the builder keeps stage parameters gathered through the step).
    """
    scaled = []
    for (kind, axis, phase), v in part.items():
        if axis not in data_axes or kind == "all_to_all":
            weight = num_microbatches
        elif kind == "all_gather":
            weight = 1 if gathers is None else gathers.get(phase, 0)
        else:
            weight = 1
        scaled.append(({(kind, axis, phase): v}, weight))
    return scaled


def _as_list(part: dict[_Key, dict[str, int]]) -> list[dict[str, Any]]:
    return [
        {"kind": k, "axis": a, "phase": p, "count": v["count"], "bytes": v["bytes"]}
        for (k, a, p), v in sorted(part.items())
    ]
