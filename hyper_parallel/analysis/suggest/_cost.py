"""The cost model applied to one candidate: memory per rank and step time."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hyper_parallel.analysis.cost_model import (
    Hardware,
    attention_seconds,
    axis_group,
    axis_span,
    collective_seconds,
    compute_seconds,
    exposed_seconds,
    optimizer_seconds,
    usable_memory,
)
from hyper_parallel.analysis.pipeline_cost import (
    in_flight_microbatches,
    rank_ops,
    simulate,
)
from hyper_parallel.analysis.published import RUNTIMES
from hyper_parallel.analysis.suggest._checks import _Checks
from hyper_parallel.analysis.suggest._operators import _Flops
from hyper_parallel.analysis.suggest._report import Candidate, Prediction
from hyper_parallel.analysis.suggest._source import ModelSource
from hyper_parallel.analysis.suggest._trace import _Comm, _Tracer
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.precision import DTYPES, PARAM_DTYPES

FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
"""torchao's float8 training recipes a published run may state (``none``: bf16 linears)."""

STATED_FACTORS: dict[str, float] = {
    "compile": 0.88,
    "float8_tensorwise": 0.56,
    "float8_rowwise": 0.98,
    "async_tp_exposed": 0.7,
    "megatron_te": 0.8,
    "attention": 0.16,
}
"""The values :meth:`RunFactors.stated` uses: the fit of ``benchmarks/bench_published.py``
on the ``fit`` rows of ``analysis/published/runs.yaml`` only (torchtitan's H100 tables,
Trainy's H200 run, the Llama 3 paper, NeMo AutoModel, Megatron-Bridge; 2026-12-04), fitted
together with the H100/H200 hardware files' efficiencies. ``compile``: compute time under ``torch.compile``
of each block as a fraction of eager; ``float8_*``: the time of the matmuls under
torchao's float8 linears of that recipe as a fraction of bf16 (only the matmuls: float8
converts the linear layers, not attention or the elementwise work; rowwise came out no
faster than bf16: its scaling kernels cost what the float8 matmuls save at these
shapes); ``async_tp_exposed``: the share of
tp's collectives async TP leaves on the critical path; ``megatron_te``: compute time of a
run on Megatron-Core with Transformer Engine's fused kernels (its norms, float8 GEMMs;
its fused attention runs at the hardware file's measured cuDNN rate besides) as a
fraction of ours (only to compare with published Megatron runs: this package's trainer
never applies it); ``attention``: the attention kernel's achieved fraction of peak in the
published runs of torch's SDPA (``attention: fitted`` in ``runs.yaml``;
:attr:`RunFactors.attention_efficiency`): their kernels (FlashAttention-2 in
torchtitan's, which an H200 runs at 0.29-0.34 of peak, ``benchmarks/results/gpu_h200.md``)
and what the model leaves out of their long-sequence context-parallel runs; runs on
Transformer Engine's fused attention and the Llama 3 paper's all-gather context
parallelism take the hardware file's measured kernel instead (``attention: measured``);
this package's trainer's kernels are measured, in the hardware files;
``RunFactors.stated`` does not apply it. ``bench_published.py --check`` fails when these
differ from its fit."""


@dataclasses.dataclass(frozen=True)
class RunFactors:
    """What differs between the run being predicted and this package's eager trainer,
    as stated factors (1.0: no difference).

    Attributes:
        compute: Multiplies every compute time (FLOPs and memory traffic): e.g. the
            speed-up of ``torch.compile`` or of another stack's kernels, as a fraction of
            the eager time.
        matmul: Multiplies the matmuls' time alone (not attention's score matmuls, not
            the memory traffic): float8 linears, as a fraction of bf16.
        tp_exposed: Share of the tensor-parallel collectives left on the critical path
            (async TP overlaps the all-gather / reduce-scatter with the matmuls that use
            them; 1.0: all exposed, as eager TP runs them).
        compiled_loss: The loss runs under ``torch.compile`` (torchtitan compiles its
            cross-entropy with ``--training.compile`` from 2025): it holds
            :data:`COMPILED_LOSS_BYTES_PER_LOGIT` instead of
            :data:`LOSS_PEAK_BYTES_PER_LOGIT` (this package's trainer runs it eagerly).
        attention_efficiency: The attention kernel's achieved fraction of peak in a run
            that does not run this package's kernels (a published run's, fitted:
            ``STATED_FACTORS["attention"]``); it replaces both of the hardware file's
            attention rates, which are this package's trainer's (``None``: those).
    """

    compute: float = 1.0
    matmul: float = 1.0
    tp_exposed: float = 1.0
    compiled_loss: bool = False
    attention_efficiency: float | None = None

    @classmethod
    def stated(
        cls,
        *,
        compile: bool = False,
        float8: str = "none",
        async_tp: bool = False,
        runtime: str = "pytorch",
        compiled_loss: bool = False,
        values: dict[str, float] | None = None,
    ) -> RunFactors:
        """The factors of a run that compiles, uses float8 linears or async TP, or runs
        on another stack (``runtime``: ``pytorch`` or ``megatron-te``), from ``values``
        (default :data:`STATED_FACTORS`, the published-runs fit).

        Raises:
            ValueError: ``float8`` is not one of :data:`FLOAT8_RECIPES`, or ``runtime``
                not one of :data:`~hyper_parallel.analysis.published.RUNTIMES`.

        Example:
            >>> RunFactors.stated(compile=True).compute
            0.88
            >>> RunFactors.stated(float8="tensorwise").matmul
            0.56
        """
        if float8 not in FLOAT8_RECIPES:
            raise ValueError(
                f"RunFactors.stated: float8={float8!r}; use one of {', '.join(FLOAT8_RECIPES)}."
            )
        if runtime not in RUNTIMES:
            raise ValueError(
                f"RunFactors.stated: runtime={runtime!r}; use one of {', '.join(RUNTIMES)}."
            )
        v = STATED_FACTORS if values is None else values
        compute = v["compile"] if compile else 1.0
        if runtime == "megatron-te":
            compute *= v["megatron_te"]
        return cls(
            compute=compute,
            matmul=v[f"float8_{float8}"] if float8 != "none" else 1.0,
            tp_exposed=v["async_tp_exposed"] if async_tp else 1.0,
            compiled_loss=compiled_loss,
        )


@dataclasses.dataclass
class _Context:
    source: ModelSource
    hw: Hardware
    node: int
    gpus: int
    seq_len: int
    global_batch: int
    dtype: str
    flops: _Flops
    checks: _Checks
    tracer: _Tracer
    limit: float
    pipeline_cache: dict[Any, Any] = dataclasses.field(default_factory=dict)
    factors: RunFactors = dataclasses.field(default_factory=RunFactors)

    @classmethod
    def build(
        cls,
        source: ModelSource,
        hw: Hardware,
        node: int,
        gpus: int,
        seq_len: int,
        global_batch: int,
        dtype: str,
        compile: bool = False,
        pipeline_split: Any = None,
    ) -> _Context:
        """The context of one search or scorer: the model's FLOP counts, its plan
        checks and traces, the memory limit, and the run's stated factors (compile)."""
        from hyper_parallel.analysis.suggest._operators import count_flops

        checks = _Checks(
            source, seq_len, global_batch, dtype, compile=compile, pipeline_split=pipeline_split
        )
        return cls(
            source,
            hw,
            node,
            gpus,
            seq_len,
            global_batch,
            dtype,
            count_flops(source, seq_len),
            checks,
            _Tracer(source, seq_len, dtype, compile),
            usable_memory(hw),
            factors=RunFactors.stated(compile=compile),
        )


def _stage_blocks(ctx: _Context, c: Candidate) -> list[tuple[int, bool, bool, int]]:
    """Per stage: (blocks, holds the first unit, holds the last, pp rank)."""
    if c.pp == 1:
        return [(ctx.flops.num_layers, True, True, 0)]
    key = ("plan", c.pp, c.schedule, c.microbatches, c.stages_per_rank)
    if key not in ctx.pipeline_cache:
        plan = ctx.checks.run(c).pipeline
        stages = ctx.checks.stages
        first, last = stages.first_name, stages.last_name
        ctx.pipeline_cache[key] = [
            (
                len(names) - (first in names) - (last in names),
                first in names,
                last in names,
                plan.ranks[s],
            )
            for s, names in enumerate(plan.stages)
        ]
    return ctx.pipeline_cache[key]


def _schedule(ctx: _Context, c: Candidate) -> tuple[Any, dict[int, int]]:
    key = ("ops", c.pp, c.schedule, c.microbatches, c.stages_per_rank)
    if key not in ctx.pipeline_cache:
        ops = rank_ops(c.schedule or "1F1B", c.pp, c.microbatches, c.stages_per_rank)
        ctx.pipeline_cache[key] = (ops, in_flight_microbatches(ops))
    return ctx.pipeline_cache[key]


def _simulated(
    ctx: _Context, c: Candidate, ops: Any, costs: dict[str, float]
) -> tuple[float, float, float]:
    """Makespan, the busiest rank's busy time and the bubble of the schedule's actions.

    The actions are replayed once per schedule, pp and micro-batch count with the
    zero-bubble paper's ratios (F : B : I : W = 1 : 2 : 1 : 1,
    :data:`~hyper_parallel.analysis.pipeline_cost.DEFAULT_COSTS`); the makespan is
    scaled by the heaviest stage's ``F + B`` over ``3`` (exact for GPipe and 1F1B, whose
    bubble does not depend on the ratio; an approximation for the zero-bubble ones).
    """
    key = ("sim", c.pp, c.schedule, c.microbatches, c.stages_per_rank)
    if key not in ctx.pipeline_cache:
        timeline = simulate(ops)
        bubble = 1.0 - sum(timeline.busy) / (len(timeline.busy) * timeline.makespan)
        ctx.pipeline_cache[key] = (timeline.makespan, max(timeline.busy), bubble)
    makespan, busy, bubble = ctx.pipeline_cache[key]
    scale = (costs["F"] + costs["B"]) / 3.0
    return makespan * scale, busy * scale, bubble


def _comm_seconds(
    ctx: _Context,
    layout: MeshLayout,
    comms: Sequence[_Comm],
    scale: float,
    count_scale: float = 1.0,
) -> dict[str, float]:
    """Seconds per phase of ``comms`` repeated ``count_scale`` times, bytes times ``scale``.

    Linear in both: per phase the latency part (counts x steps x latency) and the
    transfer part (wire bytes over bandwidth) are cached per traced list and the spans
    of the axes it uses.
    """
    spans = ctx.pipeline_cache.get(("spans", layout))
    if spans is None:  # once per layout: the key below shares lists across dp splits
        spans = ctx.pipeline_cache[("spans", layout)] = tuple(
            axis_group(layout, a, ctx.node) for a in ("tp", "cp", "ep")
        )
    tp_exposed = ctx.factors.tp_exposed
    key = ("comm", id(comms), spans, tp_exposed)
    if key not in ctx.pipeline_cache:
        parts: dict[str, list[float]] = {}
        for c in comms:
            span = dict(
                zip(
                    ("group_size", "crosses_nodes", "per_node"),
                    axis_group(layout, c.axis, ctx.node),
                    strict=True,
                )
            )
            latency = collective_seconds(ctx.hw, c.kind, 0.0, count=max(1, round(c.count)), **span)
            transfer = collective_seconds(
                ctx.hw, c.kind, c.bytes, count=1, **span
            ) - collective_seconds(ctx.hw, c.kind, 0.0, count=1, **span)
            # Async TP hides part of tp's collectives behind the matmuls that use them.
            hidden = tp_exposed if c.axis == "tp" and c.phase != "optimizer" else 1.0
            into = parts.setdefault(c.phase, [0.0, 0.0])
            into[0] += hidden * latency
            into[1] += hidden * transfer
        ctx.pipeline_cache[key] = parts
    return {
        phase: count_scale * (latency + scale * transfer)
        for phase, (latency, transfer) in ctx.pipeline_cache[key].items()
    }


def _predict(ctx: _Context, c: Candidate) -> Prediction:
    """Memory and step time of one candidate (see the module's and cost_model's notes)."""
    hw, layout = ctx.hw, c.layout
    fsdp_on = c.dp_replicate * c.fsdp > 1
    trace = ctx.tracer.get(c.tp, c.cp, c.sp, c.ep, fsdp_on)
    local = ctx.global_batch // c.dp  # sequences per data-parallel rank per step
    mbs = local // c.microbatches  # sequences per micro-batch
    # Gradient accumulation (pp=1): forward and backward of each micro-batch in turn.
    accumulation = c.microbatches if c.pp == 1 else 1
    stages = _stage_blocks(ctx, c)
    n_layers = ctx.flops.num_layers
    compute_bytes = DTYPES[ctx.dtype].itemsize
    # The states' element size: fp32 master weights under bf16 mixed precision, bf16
    # under bf16-true (gradients and AdamW's two moments in the parameters' dtype).
    state = PARAM_DTYPES[ctx.dtype].itemsize
    # --- states per stage (parameters, grads, AdamW): local elements after FSDP
    dense_ratio = trace.dense_local / max(trace.dense_total, 1)
    block_dense = (trace.dense_total - _rest_params(ctx)) / n_layers
    block_expert = trace.expert_total / n_layers
    rest_dense = _rest_params(ctx)
    fsdp = c.fsdp if fsdp_on else 1
    efsdp = layout.efsdp if fsdp_on else 1
    if c.pp > 1:
        ops, in_flight = _schedule(ctx, c)
    else:
        ops, in_flight = None, {0: 1}
    per_rank: dict[int, dict[str, float]] = {}
    for s, (k, first, last, rank) in enumerate(stages):
        ends = rest_dense * (first + last) / 2  # embedding and output: about equal halves
        dense = (k * block_dense + ends) * dense_ratio / fsdp
        experts = k * block_expert / c.ep / efsdp
        elements = dense + experts
        # Each micro-batch in flight holds what its forward saved; the one in its
        # backward reaches the peak (a recompute's working set is needed once).
        waiting = max(in_flight.get(s, 1) - 1, 0)
        acts = mbs * (
            trace.activations(k, first, last, c.ac) + waiting * trace.held(k, first, last, c.ac)
        )
        into = per_rank.setdefault(
            rank,
            {
                "params": 0.0,
                "grads": 0.0,
                "optimizer": 0.0,
                "activations": 0.0,
                "elements": 0.0,
                "tensors": 0.0,
                "unsharded": 0.0,
                "loss": 0.0,
            },
        )
        if last:
            into["loss"] = _loss_peak(ctx, c, mbs)
        into["params"] += state * elements
        into["grads"] += state * elements
        into["optimizer"] += 2 * state * elements
        into["activations"] += acts
        into["elements"] += elements
        into["tensors"] += k * ctx.flops.block_tensors + (first + last) / 2 * ctx.flops.rest_tensors
        into["unsharded"] += dense * fsdp + experts * efsdp
    # FSDP2's transient buffers: two units gathered (compute dtype), one unit's fp32 grads.
    unit = max(block_dense * dense_ratio + block_expert / c.ep, rest_dense / 2 * dense_ratio)
    transient = (2 * compute_bytes + 4) * unit if fsdp > 1 else 0
    heaviest = max(per_rank.values(), key=lambda d: d["params"] + d["activations"] + d["loss"])
    if c.pp > 1 and fsdp > 1:
        # Under a pipeline FSDP2 keeps a unit gathered from its backward to the next
        # forward and reduces gradients once, at the step's end (REDUCE_GRAD): at the
        # end of a backward every unit of the stage is gathered (compute dtype) and
        # holds its unsharded fp32 gradients.
        transient = (compute_bytes + 4) * heaviest["unsharded"]
    if accumulation > 1 and fsdp > 1 and not c.reduce_each:
        # FSDP2 reduces only the last micro-batch's backward: until then each unit's
        # gradients are summed unsharded, in fp32 (its reduce dtype).
        heaviest = dict(heaviest, grads=4 * heaviest["unsharded"])
    kept = ("elements", "tensors", "unsharded")  # "loss" is reported as memory
    memory = {k: int(v) for k, v in heaviest.items() if k not in kept}
    memory["transient"] = int(transient)
    # The step's other peak, the optimizer's (OPTIMIZER_STEP_STATES).
    tensors = OPTIMIZER_STEP_STATES + hw.optimizer_temporary
    optimizer_step = int(tensors * state * heaviest["elements"])
    total_memory = max(sum(memory.values()), optimizer_step)
    # --- compute per micro-batch per stage
    share = 1.0 / (c.tp * c.cp)
    f = ctx.flops
    # Blocks' forwards backward repeats: none, all, every second; ``op`` repeats every
    # operator (the kept ones answer from their cache), the FLOPs of the matmuls it
    # does not keep, and the forward collectives but the reduce-scatters.
    recompute_blocks = {"none": 0.0, "full": 1.0, "selective": 0.5, "op": 1.0}[c.ac]
    per_op = c.ac == "op"
    # Attention at the trainer's kernels (the hardware file: one kernel per sequence,
    # another per chunk pair under cp), or at a published run's stated rate.
    chunked = c.cp > 1
    hw_attn = hw
    if ctx.factors.attention_efficiency is not None:
        rate = ctx.factors.attention_efficiency
        hw_attn = dataclasses.replace(
            hw, attention_efficiency=rate, chunked_attention_efficiency=rate
        )
    t_f, t_b, t_w = [], [], []
    comm_f_all, comm_b_all = [], []
    for k, _first, last, _ in stages:
        fwd = mbs * share * (k * f.block_fwd + last * f.rest_fwd)
        bwd = mbs * share * (k * f.block_bwd + last * f.rest_bwd)
        recompute = (
            mbs * share * k * (f.block_op_recompute if per_op else recompute_blocks * f.block_fwd)
        )
        # Attention's score matmuls run at the attention kernel's rate.
        attn_f = mbs * share * k * f.block_score_fwd
        attn_b = (
            mbs * share * k * f.block_score_bwd + (0.0 if per_op else recompute_blocks) * attn_f
        )
        # A fixed cost per operator, whatever its size (hardware's op_overhead_s).
        ops_f = k * f.block_fwd_ops + last * f.rest_fwd_ops
        ops_b = k * f.block_bwd_ops + last * f.rest_bwd_ops + recompute_blocks * k * f.block_fwd_ops
        comm_layer = _comm_seconds(ctx, layout, trace.per_layer, mbs, k)
        comm_rest = _comm_seconds(ctx, layout, trace.rest, mbs) if last else {}
        comm_f = comm_layer.get("forward", 0.0) + comm_rest.get("forward", 0.0)
        comm_b = comm_layer.get("backward", 0.0) + comm_rest.get("backward", 0.0)
        if per_op:
            again = _comm_seconds(ctx, layout, trace.per_layer_op_recompute, mbs, k)
            comm_b += again.get("forward", 0.0)
        else:
            comm_b += recompute_blocks * comm_layer.get("forward", 0.0)
        overhead_f, overhead_b = hw.op_overhead_s * ops_f, hw.op_overhead_s * ops_b
        # Operators without a FLOP formula (elementwise, norms, softmax, copies) move
        # their elements through memory: compute-dtype bytes at the memory bandwidth.
        moved = compute_bytes * mbs * share / hw.hbm_bandwidth
        traffic_f = moved * (k * f.block_fwd_elements + last * f.rest_fwd_elements)
        traffic_b = moved * (
            k * f.block_bwd_elements
            + last * f.rest_bwd_elements
            + recompute_blocks * k * f.block_fwd_elements
        )
        cf = ctx.factors.compute  # compile / another stack, stated per run (1.0: eager)
        traffic_f, traffic_b = cf * traffic_f, cf * traffic_b
        cm = ctx.factors.matmul  # float8 linears: the matmuls alone
        flops_f = cm * compute_seconds(hw, fwd - attn_f, ctx.dtype) + attention_seconds(
            hw_attn, attn_f, ctx.dtype, chunked
        )
        flops_b = cm * compute_seconds(hw, bwd + recompute - attn_b, ctx.dtype) + attention_seconds(
            hw_attn, attn_b, ctx.dtype, chunked
        )
        t_f.append(cf * flops_f + overhead_f + traffic_f + comm_f)
        t_b.append(cf * flops_b + overhead_b + traffic_b + comm_b)
        attn_w = mbs * share * k * f.block_score_bwd
        flops_w = cm * compute_seconds(hw, bwd - attn_w, ctx.dtype) + attention_seconds(
            hw_attn, attn_w, ctx.dtype, chunked
        )
        t_w.append((cf * flops_w + overhead_b + traffic_b) / 2)
        comm_f_all.append(comm_f)
        comm_b_all.append(comm_b)
    # tp/cp/ep seconds per step on the busiest pp rank: its stages' per micro-batch.
    comm_by_rank: dict[int, float] = {}
    for (_k, _first, _last, rank), cf_, cb_ in zip(stages, comm_f_all, comm_b_all, strict=True):
        comm_by_rank[rank] = comm_by_rank.get(rank, 0.0) + cf_ + cb_
    # Gradients left Partial by backward are reduced when the optimizer reads them:
    # for each operator argument that is one (DTensor keeps no reduced copy).
    optimizer_comm = 0.0
    reads = f.optimizer_grad_reads
    for k, _, last, _ in stages:
        owed = _comm_seconds(ctx, layout, trace.per_layer, 1.0, k * reads).get("optimizer", 0.0)
        if last:
            owed += _comm_seconds(ctx, layout, trace.rest, 1.0, reads).get("optimizer", 0.0)
        optimizer_comm = max(optimizer_comm, owed)
    bubble = 0.0
    if c.pp > 1:
        hidden = mbs * (ctx.seq_len // c.cp) * _dim(ctx) * compute_bytes
        if c.sp:
            hidden //= c.tp
        _group, crosses = axis_span(layout, "pp", ctx.node)
        link = hw.link("p2p", crosses)
        p2p = link.latency_s + hidden / (link.bandwidth * link.efficiency)
        costs = {"F": max(t_f) + p2p, "B": max(t_b) + p2p}
        costs["W"] = max(t_w)
        costs["I"] = max(costs["B"] - costs["W"], 1e-12)
        makespan, busy, bubble = _simulated(ctx, c, ops, costs)
    else:
        makespan = busy = (t_f[0] + t_b[0]) * accumulation
    # --- data-parallel collectives (FSDP2 / HSDP), per step, on the heaviest rank
    # The same for every checkpointing mode and SP choice of this mesh and pipeline.
    data_key = (
        "data",
        c.pp,
        c.schedule,
        c.microbatches,
        c.stages_per_rank,
        c.reduce_each,
        c.dp_replicate,
        c.dp_shard,
        c.cp,
        c.tp,
        c.ep,
        dense_ratio,
    )
    data = ctx.pipeline_cache.get(data_key) or _data_comm(
        ctx,
        c,
        layout,
        stages,
        ops,
        dense_ratio,
        block_dense,
        block_expert,
        rest_dense,
        compute_bytes,
        fsdp,
        efsdp,
    )
    ctx.pipeline_cache[data_key] = data
    fwd_compute = sum(t_f) * accumulation if c.pp == 1 else max(t_f) * c.microbatches
    bwd_compute = sum(t_b) * accumulation if c.pp == 1 else max(t_b) * c.microbatches
    # hw.comm_overlap of each collective hides behind the compute of its phase.
    # The first unit's gather has nothing before it to hide behind, in each micro-batch's
    # forward under accumulation.
    exposed = (
        exposed_seconds(hw, data["gather_forward"], fwd_compute) + data["first_unit"] * accumulation
    )
    if c.pp > 1:  # gradients reduced once, at the end of the step
        exposed += exposed_seconds(hw, data["gather_backward"], bwd_compute)
        exposed += exposed_seconds(hw, data["reduce"], max(t_b))
    else:
        exposed += exposed_seconds(hw, data["gather_backward"] + data["reduce"], bwd_compute)
        exposed += data["last_unit"]
    # AdamW's bytes, and the optimizer step's operators (gradient norm, AdamW,
    # zero_grad) per parameter tensor: DTensor operators when FSDP2, tp or ep shard them.
    optimizer = optimizer_seconds(
        hw,
        heaviest["elements"],
        heaviest["tensors"],
        f.optimizer_ops_per_tensor,
        sharded=c.dp_replicate * c.fsdp * c.tp * c.ep > 1,
        state_bytes=state,
    )
    step = makespan + exposed + optimizer + optimizer_comm
    tokens = ctx.global_batch * ctx.seq_len
    peak = hw.peak_flops["fp32" if ctx.dtype == "fp32" else "bf16"]
    model_flops = ctx.global_batch * f.total
    times = {
        "pipeline_or_compute": makespan,
        # Per micro-batch on the busiest pp rank; at pp=1 the micro-batches accumulate.
        "model_axes_comm": max(comm_by_rank.values()) * c.microbatches,
        "data_comm_exposed": exposed,
        "optimizer": optimizer + optimizer_comm,
        "busy": busy,
    }
    return Prediction(
        step_s=step,
        tokens_per_s_per_gpu=tokens / step / ctx.gpus,
        mfu=model_flops / (step * ctx.gpus * peak),
        memory_bytes_per_gpu=int(total_memory),
        memory=memory,
        optimizer_step_bytes=optimizer_step,
        time=times,
        bubble_fraction=bubble,
    )


def _data_comm(
    ctx: _Context,
    c: Candidate,
    layout: MeshLayout,
    stages: Any,
    ops: Any,
    dense_ratio: float,
    block_dense: float,
    block_expert: float,
    rest_dense: float,
    compute_bytes: int,
    fsdp: int,
    efsdp: int,
) -> dict[str, float]:
    """FSDP2 / HSDP seconds per step on the heaviest pp rank, by what hides them."""
    hw = ctx.hw
    out = dict.fromkeys(
        ("gather_forward", "gather_backward", "reduce", "first_unit", "last_unit"), 0.0
    )
    fsdp_axis, efsdp_axis, rep_axis = (
        axis_group(layout, a, ctx.node) for a in ("fsdp", "efsdp", "dp_replicate")
    )
    worst = None
    for k, first, last, _rank in stages:
        if c.pp > 1:
            # Under a pipeline the stage's units stay gathered across micro-batches
            # (torchtitan: reshard_after_forward off under pp; backward keeps them
            # gathered until REDUCE_GRAD): one all-gather per unit per step, whatever
            # the schedule.
            gathers_f, gathers_b = 1, 0
        else:  # each micro-batch of gradient accumulation gathers every unit again
            gathers_f, gathers_b = c.microbatches, c.microbatches
        # Reductions per step: one, or one per micro-batch (--reduce-each-microbatch).
        reductions = c.microbatches if c.pp == 1 and c.reduce_each else 1
        dense_block = block_dense * dense_ratio
        expert_block = block_expert / c.ep
        root = rest_dense * (first + last) / 2 * dense_ratio
        t = dict.fromkeys(out, 0.0)

        def gather(
            per_unit: float, axis: tuple[int, bool, int], units: int, times: int = 1
        ) -> float:
            """``units`` units of ``per_unit`` elements each gathered ``times`` times."""
            return collective_seconds(
                hw,
                "all_gather",
                per_unit * units * times * compute_bytes,
                count=units * times,
                group_size=axis[0],
                crosses_nodes=axis[1],
                per_node=axis[2],
            )

        def reduce(elements: float, axis: tuple[int, bool, int], count: int) -> float:
            return collective_seconds(
                hw,
                "reduce_scatter",
                4 * elements,
                count=count,
                group_size=axis[0],
                crosses_nodes=axis[1],
                per_node=axis[2],
            )

        def replicas(elements: float, shards: int, count: int) -> float:
            return collective_seconds(
                hw,
                "all_reduce",
                4 * elements / shards,
                count=count,
                group_size=rep_axis[0],
                crosses_nodes=rep_axis[1],
                per_node=rep_axis[2],
            )

        units = k + (1 if root else 0)
        if fsdp > 1:
            # The root keeps its parameters gathered from forward to backward.
            t["gather_forward"] += gather(dense_block, fsdp_axis, k, gathers_f) + (
                gather(root, fsdp_axis, 1, gathers_f if c.pp == 1 else 1) if root else 0.0
            )
            t["gather_backward"] += gather(dense_block, fsdp_axis, k, gathers_b)
            t["reduce"] += reductions * reduce(dense_block * k + root, fsdp_axis, units)
            t["first_unit"] = gather(max(dense_block, root), fsdp_axis, 1)
            t["last_unit"] = reduce(max(dense_block, root), fsdp_axis, 1)
        if block_expert and efsdp > 1:
            t["gather_forward"] += gather(expert_block, efsdp_axis, k, gathers_f)
            t["gather_backward"] += gather(expert_block, efsdp_axis, k, gathers_b)
            t["reduce"] += reductions * reduce(expert_block * k, efsdp_axis, k)
        if c.dp_replicate > 1:
            t["reduce"] += reductions * replicas(dense_block * k + root, fsdp, units)
            if block_expert:
                t["reduce"] += reductions * replicas(expert_block * k, efsdp, k)
            t["last_unit"] += replicas(max(dense_block, root), fsdp, 1)
        if worst is None or sum(t.values()) > sum(worst.values()):
            worst = t
    return worst or out


OPTIMIZER_STEP_STATES = 4
"""Tensors of a local parameter's size alive at AdamW's step, where activations and the
loss are gone and gradients sharded: the parameter, its gradient and the two moments, plus
the hardware file's ``optimizer_temporary`` (:class:`~hyper_parallel.analysis.cost_model.Hardware`:
1 on a GPU, AdamW's multi-tensor ``sqrt(exp_avg_sq)``; 0 on a CPU). Measured on an H200
(``benchmarks/results/gpu_h200.md``, "Where the memory peaks"): the optimizer phase peaks
10.4 GiB above its start, one fp32 copy of the run's 2.8B parameters. The step's peak is
the larger of this and the backward's."""


LOSS_PEAK_BYTES_PER_LOGIT = 8
"""Bytes per local logit the loss holds beyond what it saves: at the start of backward the
gradient of the fp32 log-probabilities and the gradient of the fp32 logits are alive
together (4 + 4 bytes), next to the saved fp32 log-probabilities (in the dry run's
activations); the forward's extra (the bf16 logits and their fp32 copy, 2 + 4) is smaller."""


COMPILED_LOSS_BYTES_PER_LOGIT = 0
"""The same under a compiled loss, relative to what the dry run counts of the eager one.
Inductor fuses the fp32 cast, log-softmax and the loss into one kernel and AOTAutograd's
min-cut partitioner saves its input (the bf16 logits, 2 bytes) and a logsumexp per
token, not the fp32 log-probabilities (4 bytes, in the dry run's activations); backward
writes the gradient of the bf16 logits (2 bytes) in one kernel. So 2 bytes alive at its
peak, less the 2 the dry run counts beyond what it saves: 0 per logit (8 fewer than
eager's peak)."""


def _loss_peak(ctx: _Context, c: Candidate, mbs: int) -> float:
    """The loss's transient peak on the last stage: :data:`LOSS_PEAK_BYTES_PER_LOGIT`
    (:data:`COMPILED_LOSS_BYTES_PER_LOGIT` under a compiled loss) x the micro-batch's
    local logits (tokens / cp, vocabulary / tp: the output projection is column-parallel
    and the loss vocab-parallel)."""
    vocab = _vocab(ctx)
    if not vocab:
        return 0.0
    per_logit = (
        COMPILED_LOSS_BYTES_PER_LOGIT if ctx.factors.compiled_loss else LOSS_PEAK_BYTES_PER_LOGIT
    )
    return per_logit * mbs * (ctx.seq_len // c.cp) * vocab / c.tp


def _vocab(ctx: _Context) -> int:
    output = getattr(ctx.checks.config, "output", None)
    return int(getattr(output, "out_features", 0) or 0)


def _rest_params(ctx: _Context) -> float:
    units = ctx.checks.units
    if units is None:
        return 0.0
    return float(units[0].num_params + units[-1].num_params)


def _dim(ctx: _Context) -> int:
    return ctx.checks.stages.stage_width(ctx.checks.config)
