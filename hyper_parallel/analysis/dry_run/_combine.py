"""Combining traced steps into the report: two depths extrapolated to the real depth,
activations under each checkpointing mode (:func:`checkpointed_peak`), accumulation,
DDP buckets and the stated assumptions."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from hyper_parallel.distributed.activation_checkpoint import checkpointed_blocks
from hyper_parallel.distributed.layout import (
    MeshLayout,
)

from .._model import (
    Target,
)
from ..collectives import (
    CollectiveStat,
    summarize,
    wire_bytes,
)
from ..memory import ddp_num_buckets, state_bytes
from ._report import DryRunReport, LossFn, ModuleShards
from ._trace import _data_axis, _Run, _stat_map

__all__ = ["checkpointed_held", "checkpointed_peak"]


def _combine(
    target: Target, runs: Sequence[_Run], layout: MeshLayout, settings: Mapping[str, Any]
) -> DryRunReport:
    """One run as is; two runs (depths d and d + 1) extrapolated to the real depth."""
    last = runs[-1]
    columns = settings["columns"]
    # AdamW's moments are in the parameters' dtype (torch.optim.AdamW's zeros_like).
    moment = getattr(torch, settings["param_dtype"]).itemsize
    for r in runs:
        r.modules = [_in_columns(m, columns) for m in r.modules]
    common = dict(model=target.name, mesh=layout.active(), world_size=layout.world_size, **settings)
    if len(runs) == 1:
        return DryRunReport(
            **common,
            num_params=last.num_params,
            modules=last.modules,
            per_rank=state_bytes(
                last.param_bytes,
                last.grad_bytes,
                last.trainable_numel,
                last.activation_bytes,
                moment_bytes=moment,
            ),
            collectives=summarize(last.records),
            comm_debug_counts=last.comm_counts,
            per_rank_experts=None
            if last.expert_bytes is None
            else state_bytes(*last.expert_bytes, moment_bytes=moment),
            num_expert_params=last.expert_numel,
            activations_per_block=last.block_bytes,
            activations_per_block_op=None
            if last.op_block_bytes is None
            else last.op_block_bytes[1:],
            activations_by_ac=dict(last.activations_by_ac),
            activations_held_by_ac=dict(last.held_by_ac),
            activations_outside_blocks=last.activations_outside_blocks,
        )
    a, b = runs
    assert a.depth is not None and b.depth == a.depth + 1
    assert target.num_layers is not None and target.layers_field is not None
    extra = target.num_layers - a.depth

    def ext(x: int, y: int) -> int:
        return x + extra * (y - x)

    stats_a, stats_b = _stat_map(a.records), _stat_map(b.records)
    zero = CollectiveStat("", "", "", 0, 0, 0)
    phases = {"forward": 0, "backward": 1, "optimizer": 2}
    collectives, per_layer = [], []
    for key in sorted(
        stats_a.keys() | stats_b.keys(),
        key=lambda k: (phases.get(k[2], 3), k[1], k[0]),
    ):
        sa, sb = stats_a.get(key, zero), stats_b.get(key, zero)
        kind, axis, phase, traced = key
        collectives.append(
            CollectiveStat(
                kind,
                axis,
                phase,
                ext(sa.count, sb.count),
                ext(sa.bytes, sb.bytes),
                ext(sa.wire_bytes, sb.wire_bytes),
                traced,
            )
        )
        if sb.count != sa.count or sb.bytes != sa.bytes:
            per_layer.append(
                CollectiveStat(
                    kind,
                    axis,
                    phase,
                    sb.count - sa.count,
                    sb.bytes - sa.bytes,
                    sb.wire_bytes - sa.wire_bytes,
                    traced,
                )
            )
    counts = {
        op: ext(a.comm_counts.get(op, 0), b.comm_counts.get(op, 0))
        for op in a.comm_counts.keys() | b.comm_counts.keys()
    }
    by_ac = _activations_by_ac(a, b, target.num_layers, ext)
    activations = by_ac.get(settings.get("ac", "none"), ext(a.activation_bytes, b.activation_bytes))
    return DryRunReport(
        **common,
        num_params=ext(a.num_params, b.num_params),
        modules=_expand_layers(b.modules, target.layers_field, b.depth, target.num_layers),
        per_rank=state_bytes(
            ext(a.param_bytes, b.param_bytes),
            ext(a.grad_bytes, b.grad_bytes),
            ext(a.trainable_numel, b.trainable_numel),
            activations,
            moment_bytes=moment,
        ),
        collectives=collectives,
        collectives_per_layer=per_layer,
        comm_debug_counts=dict(sorted(counts.items())),
        num_layers=target.num_layers,
        traced_layers=tuple(r.depth for r in runs if r.depth is not None),
        per_rank_experts=None
        if a.expert_bytes is None or b.expert_bytes is None
        else state_bytes(
            *(ext(x, y) for x, y in zip(a.expert_bytes, b.expert_bytes)), moment_bytes=moment
        ),
        num_expert_params=ext(a.expert_numel, b.expert_numel),
        activations_by_ac=by_ac,
        activations_held_by_ac=_held_by_ac(a, b, target.num_layers, ext),
        activations_per_block=_block_slopes(a, b),
        activations_per_block_op=_op_block(a, b),
        activations_outside_blocks=b.activations_outside_blocks,
    )


def _block_slopes(a: _Run, b: _Run) -> tuple[int, int, int] | None:
    """``(saved, kept, recomputed)`` of one block: the ``none`` and ``full`` slopes
    between the depths, and what the deeper trace's last block holds recomputed."""
    none, full = (b.activations_by_ac.get(m) for m in ("none", "full"))
    if none is None or full is None:
        return None
    if b.block_bytes is None:
        return None
    saved = none - a.activations_by_ac["none"]
    return saved, full - a.activations_by_ac["full"], b.block_bytes[2]


def _op_block(a: _Run, b: _Run) -> tuple[int, int] | None:
    """``(kept, recomputed)`` of one block under ``op`` checkpointing: the slope of its
    end-of-forward bytes between the depths, and what the deeper trace's last block
    holds recomputed."""
    if b.op_block_bytes is None or "op" not in b.held_by_ac:
        return None
    return b.held_by_ac["op"] - a.held_by_ac["op"], b.op_block_bytes[2]


def _activations_by_ac(
    a: _Run, b: _Run, num_layers: int, ext: Callable[[int, int], int]
) -> dict[str, int]:
    """Peak activation bytes per checkpointing mode at the real depth, from two traces.

    ``none``, ``full`` and ``op`` treat every block alike, so the traces at depths d and
    d + 1 extrapolate linearly. ``selective`` checkpoints every second block, which two
    consecutive depths cannot show (the added block is checkpointed in one and not the
    other), so it is composed from per-block quantities of the traces, following
    :meth:`~hyper_parallel.analysis.memory.SavedActivations.peak_bytes`: a block saves
    ``S`` (the per-block slope of ``none``) and a checkpointed one keeps only its input
    ``I`` (the slope of ``full``). At the end of the forward the ``none`` peak is less
    ``S - I`` per checkpointed block; recomputing the last checkpointed block holds
    everything kept before it plus its recomputed ``S`` (its input is among them), i.e.
    the end-of-forward peak less its own ``I``, the ``S`` of each block after it and the
    bytes saved after the last block ``T``, plus ``S``. The peak is the larger of the
    two (equal to a trace at the full depth: ``tests/unit/test_dry_run.py``).
    """
    by_ac = {
        m: ext(a.activations_by_ac[m], b.activations_by_ac[m])
        for m in b.activations_by_ac
        if m != "selective"
    }
    slopes = _block_slopes(a, b)
    if slopes is not None and "selective" in b.activations_by_ac:
        saved, kept, recomputed = slopes
        tail = b.activations_outside_blocks[1]
        by_ac["selective"] = checkpointed_peak(
            by_ac["none"], num_layers, saved, kept, recomputed, tail, "selective"
        )
    return by_ac


def _held_by_ac(
    a: _Run, b: _Run, num_layers: int, ext: Callable[[int, int], int]
) -> dict[str, int]:
    """End-of-forward bytes per checkpointing mode at the real depth: linear in the depth
    for ``none``, ``full`` and ``op``; ``selective`` composed like its peak
    (:func:`checkpointed_held`)."""
    held = {m: ext(a.held_by_ac[m], b.held_by_ac[m]) for m in b.held_by_ac if m != "selective"}
    slopes = _block_slopes(a, b)
    if slopes is not None and "selective" in b.held_by_ac and "none" in held:
        saved, kept, _ = slopes
        held["selective"] = checkpointed_held(held["none"], num_layers, saved, kept, "selective")
    return held


def checkpointed_held(none: int, blocks: int, saved: int, kept: int, ac: str) -> int:
    """Bytes held at the end of the forward of ``blocks`` identical blocks when ``ac``
    checkpoints some (see :func:`checkpointed_peak`): the ``none`` peak less ``saved -
    kept`` per checkpointed block."""
    return none - len(checkpointed_blocks(blocks, ac)) * (saved - kept)


def checkpointed_peak(
    none: int, blocks: int, saved: int, kept: int, recomputed: int, tail: int, ac: str
) -> int:
    """Peak saved bytes of ``blocks`` identical blocks (plus what surrounds them) when
    ``ac`` checkpoints some, from the peak without checkpointing.

    Following :meth:`~hyper_parallel.analysis.memory.SavedActivations.peak_bytes`: a
    block saves ``saved`` and a checkpointed one keeps only its input, ``kept``. At the
    end of the forward the ``none`` peak is less ``saved - kept`` per checkpointed block;
    recomputing the last checkpointed block holds everything kept before it plus what
    it holds recomputed, ``recomputed`` (its input and what it saves again), i.e. the
    end-of-forward peak less its own ``kept``, the ``saved`` of each block after it and
    the bytes saved after the blocks, ``tail`` (consumed by then), plus ``recomputed``.
    The peak is the larger of the two (equal to a trace at the full depth:
    ``tests/unit/test_dry_run.py``).

    Args:
        none: The peak without checkpointing.
        blocks: Number of blocks.
        saved: Bytes one block saves.
        kept: Bytes one checkpointed block keeps (its input; under ``op`` also the
            operator outputs it keeps).
        recomputed: Bytes one block holds while backward recomputes it.
        tail: Bytes saved after the last block (0 on a pipeline stage without it).
        ac: ``"none"``, ``"selective"``, ``"full"`` or ``"op"``.
    """
    chosen = checkpointed_blocks(blocks, ac)
    end_of_forward = checkpointed_held(none, blocks, saved, kept, ac)
    if not chosen:
        return end_of_forward
    after = blocks - 1 - chosen[-1]
    return max(end_of_forward, end_of_forward - kept - after * saved - tail + recomputed)


def _expand_layers(
    modules: Sequence[ModuleShards], field_name: str, depth: int, num_layers: int
) -> list[ModuleShards]:
    """Rows of the last traced layer repeated for every layer the trace left out."""
    template = f"{field_name}.{depth - 1}"

    def in_template(path: str) -> bool:
        return path == template or path.startswith(f"{template}.")

    rows = [m for m in modules if in_template(m.path)]
    out: list[ModuleShards] = []
    for i, m in enumerate(modules):
        out.append(m)
        ends_template = in_template(m.path) and (
            i + 1 == len(modules) or not in_template(modules[i + 1].path)
        )
        if ends_template:
            for layer in range(depth, num_layers):
                prefix = f"{field_name}.{layer}"
                out += [
                    ModuleShards(prefix + r.path[len(template) :], r.type, r.params) for r in rows
                ]
    return out


def _in_columns(module: ModuleShards, columns: Sequence[str]) -> ModuleShards:
    """Each parameter's placements over the report's columns (absent: ``Replicate()``)."""
    params = tuple(
        replace(p, placements={c: p.placements.get(c, "Replicate()") for c in columns})
        for p in module.params
    )
    return replace(module, params=params)


def _ddp_all_reduce(grad_bytes: int, dp_axis: str, dp_size: int) -> CollectiveStat:
    """Data-parallel gradient all-reduce without FSDP, computed from DDP's default buckets."""
    return CollectiveStat(
        "all_reduce",
        dp_axis,
        "backward",
        ddp_num_buckets(grad_bytes),
        grad_bytes,
        wire_bytes("all_reduce", grad_bytes, dp_size),
        traced=False,
    )


def _assumptions(
    target: Target,
    runs: Sequence[_Run],
    layout: MeshLayout,
    fsdp_axes: tuple[str, ...],
    loss_fn: LossFn,
) -> list[str]:
    last = runs[-1]
    plan_axes = " x ".join(last.plan_axes) or "no axis"
    notes = [
        "Traced on fake tensors (shapes and dtypes, no storage) over PyTorch's fake process "
        f"group of {layout.world_size:,} ranks: one forward and one backward pass.",
        f"The mesh is the trainer's: {layout.describe()}; the plan is applied on the submesh "
        f"of the axes it declares ({plan_axes}), as in training.",
        "Per-rank figures are rank 0's, whose shard is the largest when a dim does not divide "
        "(FSDP2 pads every rank's shard to that size).",
        "The states are the steady state between steps: parameters; gradients with the "
        "dtype and sharding of their parameters; AdamW's two moments in the parameter "
        "dtype, as torch.optim.AdamW keeps them. "
        "Under bf16 (the trainer's mixed precision) all three stay fp32 and only the compute "
        "is bf16: FSDP2 gathers bf16 copies of the parameters and reduce-scatters gradients "
        "in fp32; under bf16-true all three are bf16 (gradients reduce-scattered in fp32). "
        "Activations are what the forward keeps for backward at its end (in the total); "
        "transient buffers (FSDP's unsharded units, collective buffers) are not included.",
        "Collective bytes are the per-rank buffer (all_gather: gathered output; "
        "reduce_scatter: full input; all_reduce: the tensor; all_to_all: the input); wire bytes "
        "are what a ring sends per rank (nccl-tests bus-bandwidth factors).",
        "Shard(i) -> Shard(j) counts as all_to_all (DTensor emulates it on a CPU mesh with "
        "all_gather + chunk; NCCL issues all_to_all).",
        f"Loss: {getattr(loss_fn, '__qualname__', repr(loss_fn))}; collectives of a different "
        "loss (e.g. loss-parallel cross entropy) differ.",
        "Attention's activations are what the fused kernels keep (FlashAttention, "
        "memory-efficient SDPA; the chunks under cp too): queries, keys, values, the output and the log-sum-exp per "
        "query row, never the seq x seq probabilities. The trace's fake tensors are on the CPU, "
        "where scaled_dot_product_attention takes torch's fused CPU kernel, which keeps the same.",
    ]
    if layout.cp > 1:
        notes.append(
            f"Under cp={layout.cp} attention runs by chunks, without a mask: each rank's two "
            "query chunks (head-tail) against the keys and values all-gathered over cp, the "
            "diagonal block causal, earlier blocks in full, merged by log-sum-exp; backward keeps "
            "the rank's queries, the gathered keys and values, the output and the log-sum-exp."
        )
    if last.expert_bytes is not None:
        notes.append(
            f"Routed experts: weights Shard(0) over ep={layout.ep} (whole experts per rank), "
            f"FSDP2 over efsdp={layout.efsdp}; listed apart from the dense states. Their "
            "all_to_all bytes assume uniform routing (each rank's (token, choice) pairs split "
            "evenly over the ep ranks): counts exchange (num_experts int64), dispatch and "
            "combine forward (tokens x top_k x dim each), their two transposes backward. "
            "Real routing is data-dependent; skew moves more bytes to some ranks."
        )
    num_units = len(last.fsdp_units)
    if len(runs) == 2 and target.num_layers is not None and last.depth is not None:
        num_units += (target.num_layers - last.depth) * (num_units - len(runs[0].fsdp_units))
    data_axis, data_size = _data_axis(layout, last.plan_axes)
    if fsdp_axes:
        hsdp = (
            " (HSDP: states sharded within each dp_replicate group, gradients all-reduced "
            "across the groups)"
            if "dp_replicate" in fsdp_axes
            else ""
        )
        notes.append(
            f"FSDP2 fully_shard over {' x '.join(fsdp_axes)}{hsdp} on {num_units} unit(s) "
            "(each element of the top-level ModuleLists) and the root, default "
            "reshard_after_forward (the root keeps its parameters gathered between forward and "
            "backward); gradients are reduce-scattered in backward. Traced, not computed."
        )
        if layout.cp > 1 and "fsdp" not in fsdp_axes:
            notes.append(
                f"States are replicated over cp={layout.cp}: FSDP2 shards over cp as well "
                "only when the plan runs on cp; see "
                "hyper_parallel.distributed.axes.fsdp_shards_over_cp."
            )
    elif data_size == 1:
        notes.append(
            f"FSDP off: the mesh ({layout.describe()}) has no data axis FSDP can shard "
            "over (dp_replicate, dp_shard, cp)."
        )
    else:
        notes.append(
            f"FSDP off (fsdp=False): parameters, gradients and optimizer states are replicated "
            f"over {data_axis!r}. The gradient all-reduce over {data_axis!r} is computed, not "
            "traced: all gradient bytes, in DDP's default buckets (1 MiB, then 25 MiB)."
        )
    if len(runs) > 1:
        notes.append(target.depth_note([r.depth for r in runs if r.depth is not None]))
    if any(r.records and not r.records[-1].traced for r in runs):
        notes.append(
            "Gradients that backward leaves Partial (DTensor reduces a partial sum when it is "
            "read) owe one all_reduce each per partial axis when the optimizer step reads them: "
            "listed in phase 'optimizer', computed from their shards, not traced."
        )
    traced = [sum(c.traced for c in r.records) for r in runs]
    if any(r.comm_debug_total != n for r, n in zip(runs, traced)):
        notes.append(
            "CommDebugMode and the recorder disagree on the number of collectives: "
            + "; ".join(f"{r.comm_debug_total} vs {n}" for r, n in zip(runs, traced))
        )
    return notes
