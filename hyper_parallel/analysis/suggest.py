"""The best layouts for a model on a cluster, found on a CPU: ``hyper-parallel suggest``.

:func:`suggest` searches the N-D mesh (pp, dp_replicate, dp_shard, cp, tp, ep), the
pipeline schedule and its micro-batches, activation checkpointing and sequence
parallelism; drops what the plan checks refuse (counted per reason, :func:`_findings`),
then what does not fit in memory; ranks the rest by the estimated step time of
:mod:`~hyper_parallel.analysis.cost_model`; and returns the best with the command that
runs each.

**Memory** is the dry run's (:func:`~hyper_parallel.analysis.dry_run`), per rank:
parameters, gradients and AdamW moments (fp32 master weights) sharded as FSDP2
shards them; the activations one micro-batch saves for backward, times the
micro-batches a pipeline stage holds at once (from the schedule's own action list);
and FSDP2's transient buffers (two units gathered in the compute dtype: the one
running and the one prefetched; one unit's unsharded fp32 gradients before its
reduce-scatter; under a pipeline, every unit of the stage gathered with its
unsharded fp32 gradients, which are reduced once at the step's end). A layout fits
when that is at most
:func:`~hyper_parallel.analysis.cost_model.usable_memory` (device memory less the
stated allocator and communication-library headroom).

**Speed: trace once per local structure.** What a rank holds and sends depends on
the model axes (tp, cp, ep), sequence parallelism and whether FSDP2 runs; not on how
many data-parallel ranks there are. So one dry run per ``(tp, cp, sp, ep, fsdp)``
(at the smallest mesh with those local shapes, one sequence per micro-batch) serves
every candidate with those: activations of every checkpointing mode and every
pipeline stage (blocks are identical: a stage's saved bytes are its blocks' plus the
embedding's or the output's; :class:`_Trace`), the model axes' collectives (scaled by
the micro-batch), and the states (divided by the FSDP size). FSDP2's own collectives
follow from the states (all-gather of each unit in the compute dtype, reduce-scatter
in fp32, HSDP all-reduce of the shard), as the dry run traces them. Candidates whose
states alone cannot fit are dropped before any trace. FLOPs are counted once per
model on the meta device.

Example::

    from hyper_parallel.analysis.suggest import suggest
    report = suggest("llama3-8b", gpus=64, gpu="h100-80gb", seq_len=8192,
                     global_batch_tokens=4 * 1024**2)
    print(report.to_table())
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hyper_parallel._torch_private import TorchDispatchMode
from hyper_parallel.analysis._format import human_bytes, table
from hyper_parallel.analysis.cost_model import (
    Hardware,
    axis_span,
    collective_seconds,
    compute_seconds,
    exposed_seconds,
    load_hardware,
    optimizer_seconds,
    usable_memory,
)
from hyper_parallel.analysis.pipeline_cost import (
    _block_gathers,
    in_flight_microbatches,
    rank_ops,
    simulate,
)
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.pipeline import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
)
from hyper_parallel.dmodule._checks import Finding

__all__ = [
    "AC_MODES",
    "Candidate",
    "DoesNotFit",
    "ModelSource",
    "Prediction",
    "SuggestReport",
    "count_operators",
    "model_from_hf_config",
    "predict",
    "suggest",
]

AC_MODES = ("none", "selective", "full")
MODEL_AXES = ("tp", "cp", "ep")
SP_DOMINATES = (
    "sp off: dominated by the same layout with sp (equal bytes on the wire: all-gather + "
    "reduce-scatter = all-reduce; fewer activations; Korthikanti et al. 2022)"
)
"""Why tp > 1 without sequence parallelism is not traced: Megatron's sequence parallelism
replaces each tp all-reduce by an all-gather and a reduce-scatter of the same total ring
bytes, and shards the norms' and dropouts' activations over tp (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022, section 4.2.2)."""
MAX_PP = 32
"""Largest pipeline searched (Llama 3 405B trained at pp=16; Dubey et al. 2024, Table 4)."""
MIN_CP_TOKENS = 1024
"""Context parallelism is searched down to this many tokens per cp rank (attention kernels
lose their efficiency on shorter pieces; torchtitan's cp runs keep >= 8k per rank)."""


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A registered model spec plus config overrides (what ``train.run`` takes).

    Attributes:
        spec_name: Registered name (``llama3-70b``).
        overrides: Keyword overrides of the spec's config (``--model-overrides``).
        label: How reports name it (the spec, or the Hugging Face config's path).
    """

    spec_name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    label: str = ""

    @property
    def spec(self) -> Any:
        from hyper_parallel.checkpoint_hf.specs import register_specs
        from hyper_parallel.dmodule.model_spec import get_spec

        register_specs()  # the *-hf specs of a Hugging Face config, also when named
        return get_spec(self.spec_name)

    def config(self, **extra: Any) -> Any:
        """The unsharded model config (``spec.config(**overrides, **extra)``)."""
        return self.spec.config(**{**dict(self.overrides), **extra})

    @property
    def name(self) -> str:
        return self.label or self.spec_name


def model_from_hf_config(path: str | Path) -> ModelSource:
    """A :class:`ModelSource` from a Hugging Face ``config.json`` (or its directory).

    The package's converter
    (:func:`~hyper_parallel.checkpoint_hf.config.read_hf_config`: Llama / Mistral,
    Qwen3 dense, Qwen3-MoE) gives the registered spec (``llama3-hf``, ``qwen3-hf``,
    ``qwen3-moe-hf``) and its overrides — the ``--model`` and ``--model-overrides`` the
    printed commands pass to ``train.run``; nothing is downloaded.

    Raises:
        ValueError: The file cannot be read or is not JSON, or the converter refuses
            it (:class:`~hyper_parallel.checkpoint_hf.config.HFConfigError`: an
            architecture we do not have, or each field we do not implement, named).
    """
    from hyper_parallel.checkpoint_hf.config import read_hf_config
    from hyper_parallel.checkpoint_hf.specs import register_specs

    where = f"--hf-config {str(path)!r}"
    try:
        hf = read_hf_config(path)
    except OSError as e:  # FileNotFoundError included
        raise ValueError(f"{where}: cannot read it ({e.strerror or e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}).") from None
    register_specs()
    return ModelSource(hf.spec, tuple(sorted(hf.model_overrides.items())), label=str(path))


# ----------------------------------------------------------------------------- candidates


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

    def describe(self) -> str:
        extra = [f"ac={self.ac}"] + (["sp"] if self.sp else [])
        if self.pp > 1:
            extra = [f"{self.schedule} x{self.microbatches}", *extra]
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "memory_bytes_per_gpu": self.memory_bytes_per_gpu,
            "memory": dict(self.memory),
            "time": dict(self.time),
            "bubble_fraction": self.bubble_fraction,
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
                    "ac": c.ac,
                    "sp": c.sp,
                    "predicted": p.to_dict(),
                    "command": cmd,
                }
                for c, p, cmd in self.plans
            ],
            "rejected": dict(self.rejected),
            "hardware": self.hardware.to_dict(),
            "memory_limit_bytes": self.memory_limit,
            "searched": self.searched,
            "traced": self.traced,
            "elapsed_s": round(self.elapsed_s, 2),
            "assumptions": list(self.assumptions),
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
                    str(c.microbatches),
                    c.schedule or "-",
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
        out += ["", "Commands:"]
        out += [f"  {i}. {cmd}" for i, (_, _, cmd) in enumerate(self.plans, 1)]
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


# ----------------------------------------------------------------------------- traces


@dataclasses.dataclass(frozen=True)
class _Comm:
    """Collectives of one kind on one axis in one phase: count and buffer bytes."""

    kind: str
    axis: str
    phase: str
    count: float
    bytes: float


@dataclasses.dataclass
class _Trace:
    """One dry run, reduced to what every candidate with its local structure needs.

    Per sequence (one micro-batch of one sequence): ``pre`` / ``post`` are the bytes
    saved before the first block and after the last; ``block`` what one block saves
    without checkpointing, ``block_input`` what a checkpointed block keeps (its input).
    ``per_layer`` and ``rest`` the model axes' collectives of one block and of
    everything else. ``dense_local`` / ``expert_local`` the elements a rank holds
    before FSDP (after tp, resp. ep), ``dense_total`` / ``expert_total`` of the model.
    """

    pre: int
    post: int
    block: int
    block_input: int
    per_layer: list[_Comm]
    rest: list[_Comm]
    dense_local: float
    expert_local: float
    dense_total: int
    expert_total: int

    def activations(self, blocks: int, first: bool, last: bool, ac: str) -> int:
        """Saved bytes of one sequence on a rank holding ``blocks`` blocks (+ ends)."""
        ends = first * self.pre + last * self.post
        if blocks == 0:
            return ends
        checkpointed = {"none": 0, "full": blocks, "selective": blocks // 2}[ac]
        kept = (blocks - checkpointed) * self.block + checkpointed * self.block_input
        # Backward recomputes one checkpointed block at a time, while it still holds
        # that block's input.
        recompute = self.block + self.block_input if checkpointed else 0
        return ends + kept + recompute


def _trace_layout(tp: int, cp: int, ep: int, fsdp: bool) -> MeshLayout:
    """The smallest mesh with these local shapes (FSDP on when the candidate has it)."""
    dp_shard = 2 if fsdp and cp == 1 else 1
    need = ep // math.gcd(ep, dp_shard * cp * tp)
    if need > 1:
        dp_shard *= need
    return MeshLayout(dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)


class _Tracer:
    """Dry runs per local structure, cached; counts how many ran."""

    def __init__(self, source: ModelSource, seq_len: int, dtype: str) -> None:
        self.source = source
        self.seq_len = seq_len
        self.dtype = dtype
        self.cache: dict[tuple[int, int, bool, int, bool], _Trace] = {}
        self.num_layers = len(source.config().layers)

    @property
    def count(self) -> int:
        return len(self.cache)

    def get(self, tp: int, cp: int, sp: bool, ep: int, fsdp: bool) -> _Trace:
        key = (tp, cp, sp, ep, fsdp)
        if key not in self.cache:
            self.cache[key] = self._run(*key)
        return self.cache[key]

    def _run(self, tp: int, cp: int, sp: bool, ep: int, fsdp: bool) -> _Trace:
        from hyper_parallel.analysis.dry_run import dry_run
        from hyper_parallel.distributed.axes import apply_model_axes

        layout = _trace_layout(tp, cp, ep, fsdp)
        spec = self.source.spec
        config = apply_model_axes(spec, self.source.config(), layout, sequence_parallel=sp)
        report = dry_run(
            config,
            layout,
            batch_size=1,
            seq_len=self.seq_len,
            param_dtype=torch.float32,
            loss_fn=spec.family.loss_fn,
            dtype=self.dtype,
        )
        num_layers = report.num_layers or self.num_layers
        pre, post = report.activations_outside_blocks
        by_ac = report.activations_by_ac
        block = (by_ac["none"] - pre - post) / num_layers
        # full = ends + L x input + (one block recomputed: block + input)
        block_input = max(0.0, (by_ac["full"] - pre - post - block) / (num_layers + 1))
        model_axes = {"tp", "cp", "ep"}
        total = [
            _Comm(c.kind, c.axis, c.phase, c.count, c.bytes)
            for c in report.collectives
            if c.axis in model_axes
        ]
        per_layer = [
            _Comm(c.kind, c.axis, c.phase, c.count, c.bytes)
            for c in (report.collectives_per_layer or [])
            if c.axis in model_axes
        ]
        layer_sum: dict[tuple[str, str, str], tuple[float, float]] = {}
        for c in per_layer:
            layer_sum[(c.kind, c.axis, c.phase)] = (c.count, c.bytes)
        rest = []
        for c in total:
            n, b = layer_sum.get((c.kind, c.axis, c.phase), (0, 0))
            count, nbytes = c.count - num_layers * n, c.bytes - num_layers * b
            if count > 0:
                rest.append(_Comm(c.kind, c.axis, c.phase, count, max(nbytes, 0)))
        element = 4  # fp32 master parameters in the trace
        experts = report.per_rank_experts
        expert_params = experts.params if experts is not None else 0
        efsdp = layout.efsdp if fsdp else 1
        fsdp_size = layout.fsdp if report.fsdp else 1
        expert_total = report.num_expert_params
        return _Trace(
            pre=pre,
            post=post,
            block=round(block),
            block_input=round(block_input),
            per_layer=per_layer,
            rest=rest,
            dense_local=(report.per_rank.params - expert_params) / element * fsdp_size,
            expert_local=expert_params / element * efsdp,
            dense_total=report.num_params - expert_total,
            expert_total=expert_total,
        )


# ----------------------------------------------------------------------------- FLOPs


@dataclasses.dataclass(frozen=True)
class _Flops:
    """FLOPs of one sequence: one block's and the rest's, forward and backward; the
    operators each runs (``*_ops``: one per aten call, whatever the batch); the
    elements the operators without a FLOP formula read and write (``*_elements``:
    elementwise ops, norms, softmax, copies, concatenations; views excluded), per
    sequence; the parameter tensors of one block and of the rest (``*_tensors``); and
    the operators the trainer's optimizer step runs per parameter tensor
    (``optimizer_ops_per_tensor``: gradient-norm and AdamW on a CPU tensor), of which
    ``optimizer_grad_reads`` arguments are the gradient (a gradient DTensor left
    ``Partial`` is reduced for each: DTensor redistributes per operator argument and
    keeps no result)."""

    block_fwd: float
    block_bwd: float
    rest_fwd: float
    rest_bwd: float
    num_layers: int
    block_fwd_ops: int = 0
    block_bwd_ops: int = 0
    rest_fwd_ops: int = 0
    rest_bwd_ops: int = 0
    block_fwd_elements: float = 0.0
    block_bwd_elements: float = 0.0
    rest_fwd_elements: float = 0.0
    rest_bwd_elements: float = 0.0
    block_tensors: int = 0
    rest_tensors: int = 0
    optimizer_ops_per_tensor: int = 0
    optimizer_grad_reads: int = 1

    @property
    def total(self) -> float:
        n = self.num_layers
        return n * (self.block_fwd + self.block_bwd) + self.rest_fwd + self.rest_bwd


class _OperatorCount(TorchDispatchMode):
    """Counts the aten operators that run under it (views and metadata ops included:
    each is a dispatch with its fixed cost), and the tensor elements the operators
    without a FLOP formula read and write (``elements``): every tensor argument and
    result of an operator that is neither a view nor has a formula in
    ``torch.utils.flop_counter`` (matmuls, convolutions, attention)."""

    def __init__(self, scores: int | None = None) -> None:
        super().__init__()
        self.count = 0
        self.elements = 0
        self.scores = scores

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        out = func(*args, **(kwargs or {}))
        if not _moves_no_data(func):
            self.elements += sum(
                _tensor_elements(tree, self.scores) for tree in (args, kwargs, out)
            )
        return out


def _moves_no_data(func: Any) -> bool:
    """A view, a metadata or allocation-only op, or a FLOP-counted op (matmul, attention:
    the compute term has it)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "overloadpacket", None)
    if packet is None or getattr(func, "is_view", False) or packet in flop_registry:
        return True
    name = packet.__name__
    return name in _NO_DATA_OPS or name.startswith("_grouped_mm")


_NO_DATA_OPS = frozenset(
    (
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "_to_copy_meta",
        "lift_fresh",
        "alias",
        "set_",
        "resize_",
        "_local_scalar_dense",
        "_unsafe_view",
        "_reshape_alias",
    )
)


def _tensor_elements(tree: Any, scores: int | None = None) -> int:
    """Elements of the tensors in ``tree``; with ``scores``, less those shaped ``[...,
    scores, scores]`` (an attention score matrix or mask of a ``scores``-token sequence)."""
    from torch.utils._pytree import tree_leaves

    return sum(
        t.numel()
        for t in tree_leaves(tree)
        if isinstance(t, torch.Tensor)
        and not (scores is not None and t.dim() >= 2 and t.shape[-2:] == (scores, scores))
    )


def count_operators(scores: int | None = None) -> _OperatorCount:
    """A context that counts the aten operators run inside it (``.count``) and the
    elements the non-matmul ones read and write (``.elements``): what the cost model
    multiplies by the hardware's ``op_overhead_s`` and charges at its memory
    bandwidth, and what ``calibrate`` takes out of a small step's time.

    ``scores``: a sequence length whose ``[..., S, S]`` tensors are left out of
    ``.elements``: on the meta device attention runs torch's unfused math path
    (scores, mask, softmax materialized), while the kernels a training step runs
    (flash attention on GPUs and CPUs) never write them; their reads of queries, keys
    and values and writes of the output are counted with the neighbouring operators."""
    return _OperatorCount(scores)


class _GradReads(TorchDispatchMode):
    """Counts the arguments of operators that are one of ``grads`` (by storage): a
    DTensor operator redistributes each argument apart."""

    def __init__(self, grads: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {g.untyped_storage().data_ptr() for g in grads}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_leaves

        self.count += sum(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
            for t in tree_leaves((args, kwargs or {}))
        )
        return func(*args, **(kwargs or {}))


def _optimizer_ops_per_tensor() -> tuple[int, int]:
    """Operators the trainer's optimizer step runs per parameter tensor on a CPU (the
    gradient norm, ``train.trainer.clip_grad_norm_``, AdamW's step and ``zero_grad``),
    and how many of their arguments are the gradient: the differences between two
    parameters and one (AdamW's lazily created states made first)."""
    from hyper_parallel.train.trainer import clip_grad_norm_

    counts = []
    for n in (1, 2):
        params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(n)]
        opt = torch.optim.AdamW(params)
        for _ in range(2):
            for q in params:
                q.grad = torch.zeros(2, 2)
            with count_operators() as ops, _GradReads([q.grad for q in params]) as reads:
                clip_grad_norm_(params, math.inf)
                opt.step()
                opt.zero_grad(set_to_none=True)
        counts.append((ops.count, reads.count))
    return max(0, counts[1][0] - counts[0][0]), max(1, counts[1][1] - counts[0][1])


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """``torch._grouped_mm``: 2 x rows x inner x cols summed over the groups."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # (tokens, k) x (experts, k, n)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (k, tokens) x (tokens, n), per group
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(a_shape) * b_shape[-1]


def count_flops(source: ModelSource, seq_len: int) -> _Flops:
    """Forward and backward FLOPs of one sequence, counted on the meta device.

    ``FlopCounterMode`` (torch's own formulas; ``torch._grouped_mm`` of the routed
    experts added: 2 x tokens x in x out) at depths 1 and 2: the difference is one
    block, the rest is the embedding, the output projection and the loss.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    mapping = {}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        mapping[torch.ops.aten._grouped_mm] = _grouped_mm_flops
    loss_fn = source.spec.family.loss_fn
    for depth in (1, 2):
        config = source.config()
        config = config.replace(layers=list(config.layers[:depth]))
        with torch.device("meta"):
            model = config.build().to(torch.bfloat16)
        tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        with (
            FlopCounterMode(display=False, custom_mapping=mapping) as fwd,
            count_operators(seq_len) as fo,
        ):
            out = model(tokens)
            loss = loss_fn(out, tokens) if loss_fn is not None else out.float().sum()
        with (
            FlopCounterMode(display=False, custom_mapping=mapping) as bwd,
            count_operators(seq_len) as bo,
        ):
            loss.backward()
        counts.append(
            (
                fwd.get_total_flops(),
                bwd.get_total_flops(),
                fo.count,
                bo.count,
                fo.elements,
                bo.elements,
                sum(1 for _ in model.parameters()),
            )
        )
    (f1, b1, fo1, bo1, fe1, be1, t1), (f2, b2, fo2, bo2, fe2, be2, t2) = counts
    n = len(source.config().layers)
    optimizer_ops, grad_reads = _optimizer_ops_per_tensor()
    return _Flops(
        f2 - f1,
        b2 - b1,
        f1 - (f2 - f1),
        b1 - (b2 - b1),
        n,
        block_fwd_ops=fo2 - fo1,
        block_bwd_ops=bo2 - bo1,
        rest_fwd_ops=max(0, fo1 - (fo2 - fo1)),
        rest_bwd_ops=max(0, bo1 - (bo2 - bo1)),
        block_fwd_elements=fe2 - fe1,
        block_bwd_elements=be2 - be1,
        rest_fwd_elements=max(0, fe1 - (fe2 - fe1)),
        rest_bwd_elements=max(0, be1 - (be2 - be1)),
        block_tensors=t2 - t1,
        rest_tensors=max(0, t1 - (t2 - t1)),
        optimizer_ops_per_tensor=optimizer_ops,
        optimizer_grad_reads=grad_reads,
    )


# ----------------------------------------------------------------------------- checks


class _Checks:
    """The run plan of every candidate; its errors are the filter.

    Each candidate is asked as the trainer asks it
    (:func:`hyper_parallel.train.trainer.run_plan`): :meth:`RunPlan.for_model
    <hyper_parallel.distributed.run_plan.RunPlan.for_model>` with the candidate's mesh,
    sequence parallelism, checkpointing, dtype, schedule, micro-batches, the batch per
    data-parallel rank and the sequence. One :class:`~hyper_parallel.distributed.run_plan.PlanCache`
    serves the search, so the sharded model is built on the meta device once per local
    structure and the pipeline plan once per schedule, micro-batches and batch.
    """

    def __init__(self, source: ModelSource, seq_len: int, global_batch: int, dtype: str) -> None:
        from hyper_parallel.distributed.run_plan import PlanCache

        self.source = source
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dtype = dtype
        self.config = source.config()
        self.stages = source.spec.family.pipeline
        self.cache = PlanCache()
        self._units: Any = None

    @property
    def units(self) -> Any:
        if self._units is None and self.stages is not None:
            self._units = self.stages.units(self.config)
        return self._units

    def run(self, c: Candidate) -> Any:
        """The candidate's :class:`~hyper_parallel.distributed.run_plan.RunPlan`."""
        from hyper_parallel.distributed.run_plan import RunPlan

        return RunPlan.for_model(
            self.source.spec_name,
            c.layout,
            model_overrides=dict(self.source.overrides),
            world_size=c.layout.world_size,
            cache=self.cache,
            sequence_parallel=c.sp,
            ac=c.ac,
            dtype=self.dtype,
            schedule=c.schedule or "1F1B",
            num_microbatches=c.microbatches,
            batch_size=self.global_batch // c.dp,
            seq_len=self.seq_len,
        )

    def findings(self, c: Candidate) -> list[tuple[str, Finding]]:
        """``(check, finding)`` for every error of the candidate's run plan; the check
        is the finding's kind (mesh, model, pipeline, ...)."""
        return [(f.path or f.field or "plan", f) for f in self.run(c).errors]


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
) -> Iterator[Candidate]:
    """Every layout worth asking the checks about; the ones refused here are counted."""
    tps = [t for t in _divisors(gpus) if allow_cross_node_tp or gpus_per_node % t == 0]
    if not allow_cross_node_tp:
        skipped = len(_divisors(gpus)) - len(tps)
        if skipped:
            rejected["tp would span nodes (allow with --allow-cross-node-tp)"] += skipped
    for tp in tps:
        rest_tp = gpus // tp
        for cp in _divisors(rest_tp):
            if cp > 1 and (cp & (cp - 1) or seq_len // cp < MIN_CP_TOKENS):
                continue  # not searched: see MIN_CP_TOKENS (powers of two only)
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
                        for schedule, m in _pipelines(pp, local):
                            for ac in AC_MODES:
                                if tp > 1:  # searched, and refused without a trace
                                    rejected[SP_DOMINATES] += 1
                                yield Candidate(
                                    pp, dp_replicate, dp_shard, cp, tp, ep, m, schedule, ac, tp > 1
                                )


def _pipelines(pp: int, local: int) -> list[tuple[str | None, int]]:
    """Schedules and micro-batch counts: none without pp (one forward of the local batch,
    as ``train.run`` steps); with pp every schedule torch runs, at the run plan's
    micro-batch count (:func:`~hyper_parallel.distributed.run_plan.default_num_microbatches`:
    one per stage) and at 2 and 4 times it. Whether the local batch splits into them is
    the run plan's finding."""
    from hyper_parallel.distributed.run_plan import default_num_microbatches

    del local  # the run plan checks the batch
    if pp == 1:
        return [(None, 1)]
    out: list[tuple[str | None, int]] = []
    for schedule in SCHEDULES:
        base = default_num_microbatches(pp, schedule)
        out += [(schedule, k * base) for k in (1, 2, 4)]
    return out


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
) -> SuggestReport:
    """Search the layouts of ``model`` on ``gpus`` GPUs; the best ``top`` by step time.

    Args:
        model: A registered model name, or a :class:`ModelSource` (e.g. from
            :func:`model_from_hf_config`).
        gpus: Number of GPUs.
        gpu: A shipped hardware kind (``"h100-80gb"``), a hardware file, or a
            :class:`~hyper_parallel.analysis.cost_model.Hardware`.
        seq_len: Tokens per sequence.
        global_batch_tokens: Tokens per optimizer step (a multiple of ``seq_len``).
        gpus_per_node: GPUs per node (default: the hardware file's).
        dtype: ``"bf16"`` (mixed precision, fp32 master weights) or ``"fp32"``.
        top: How many plans to return.
        allow_cross_node_tp: Also search tp groups that span nodes.
        allow_cross_node_ep: Also search ep groups that span nodes.

    Returns:
        A :class:`SuggestReport`, plans best first.

    Raises:
        ValueError: Bad arguments (named, with the fix).
        DoesNotFit: No layout fits; its message names the smallest memory per GPU
            needed and the layout that needs it.
    """
    start = time.perf_counter()
    source = model if isinstance(model, ModelSource) else ModelSource(model)
    hw = gpu if isinstance(gpu, Hardware) else load_hardware(gpu)
    node = gpus_per_node or hw.gpus_per_node
    _check_arguments(gpus, node, seq_len, global_batch_tokens, dtype, top)
    source, max_seq = _long_enough(source, seq_len)
    config = source.config()
    num_layers = len(config.layers)
    num_experts = _num_experts(config)
    global_batch = global_batch_tokens // seq_len
    rejected: Counter = Counter()
    checks = _Checks(source, seq_len, global_batch, dtype)
    tracer = _Tracer(source, seq_len, dtype)
    flops = count_flops(source, seq_len)
    limit = usable_memory(hw)
    ctx = _Context(
        source, hw, node, gpus, seq_len, global_batch, dtype, flops, checks, tracer, limit
    )
    lower_bound_states = 16 * sum(p for p in _param_counts(checks))
    searched = 0
    evaluated: list[tuple[Candidate, Prediction]] = []
    points: list[tuple[float, int, bool]] = []
    best_unfit: tuple[Candidate, int] | None = None
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
    ):
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
                best_unfit = (c, int(floor))
            continue
        prediction = _predict(ctx, c)
        fits = prediction.memory_bytes_per_gpu <= limit
        points.append((prediction.step_s, prediction.memory_bytes_per_gpu, fits))
        if not fits:
            rejected["does not fit in memory"] += 1
            if best_unfit is None or prediction.memory_bytes_per_gpu < best_unfit[1]:
                best_unfit = (c, prediction.memory_bytes_per_gpu)
            continue
        evaluated.append((c, prediction))
    # What the enumeration refused without yielding (sp off, tp or ep across nodes, a
    # batch that does not split) was searched too.
    searched += sum(rejected.values()) - (searched - len(evaluated))
    evaluated.sort(key=lambda cp: (cp[1].step_s, cp[1].memory_bytes_per_gpu))
    plans = [
        (c, p, _command(source, c, gpus, node, seq_len, global_batch, dtype))
        for c, p in evaluated[:top]
    ]
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
        assumptions=_assumptions(hw, max_seq, seq_len),
    )
    if not plans:
        if best_unfit is None:
            raise DoesNotFit(
                f"no layout of {source.name} on {gpus} GPUs passes the plan checks; "
                f"rejected: {dict(rejected)}.",
                report,
            )
        c, need = best_unfit
        device_need = _device_memory_needed(need)
        raise DoesNotFit(
            f"does not fit: needs >= {device_need / 1e9:.1f} GB per GPU at best (layout "
            f"{c.describe()}: {human_bytes(need)} per rank plus the headroom); "
            f"{hw.name} has {hw.memory_bytes / 1e9:.0f} GB. Use more GPUs, a GPU with more "
            "memory, or a shorter sequence / smaller batch.",
            report,
        )
    return report


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
) -> Prediction:
    """The cost model's prediction for one given layout (no search).

    Raises:
        ValueError: When the plan checks refuse ``candidate`` (every finding listed).

    Example::

        c = Candidate(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=1,
                      microbatches=1, schedule=None, ac="none", sp=False)
        predict("llama3-debug", c, gpus=4, gpu="h100-80gb", seq_len=128,
                global_batch_tokens=8 * 128).step_s
    """
    source = model if isinstance(model, ModelSource) else ModelSource(model)
    source, _ = _long_enough(source, seq_len)
    hw = gpu if isinstance(gpu, Hardware) else load_hardware(gpu)
    node = gpus_per_node or hw.gpus_per_node
    _check_arguments(gpus, node, seq_len, global_batch_tokens, dtype, 1)
    global_batch = global_batch_tokens // seq_len
    checks = _Checks(source, seq_len, global_batch, dtype)
    problems = _findings(checks, candidate)
    if candidate.layout.world_size != gpus:
        raise ValueError(
            f"predict: {candidate.mesh_text()} has {candidate.layout.world_size} ranks, not {gpus}."
        )
    if problems:
        raise ValueError(
            "predict: the plan checks refuse "
            + candidate.describe()
            + ": "
            + "; ".join(str(f) for _, f in problems)
        )
    ctx = _Context(
        source,
        hw,
        node,
        gpus,
        seq_len,
        global_batch,
        dtype,
        count_flops(source, seq_len),
        checks,
        _Tracer(source, seq_len, dtype),
        usable_memory(hw),
    )
    return _predict(ctx, candidate)


def _long_enough(source: ModelSource, seq_len: int) -> tuple[ModelSource, int | None]:
    """``source`` with ``max_seq_len`` raised to ``seq_len`` when its rotary tables are
    shorter (the command then passes it in ``--model-overrides``); and the old limit."""
    limit = None
    for value in _walk(source.config()):
        n = getattr(value, "max_seq_len", None)
        if isinstance(n, int):
            limit = n
            break
    if limit is None or seq_len <= limit:
        return source, limit
    overrides = dict(source.overrides) | {"max_seq_len": seq_len}
    return dataclasses.replace(source, overrides=tuple(sorted(overrides.items()))), limit


def _findings(checks: _Checks, c: Candidate) -> list[tuple[str, Finding]]:
    """The plan checks' errors for one candidate: the one place the search asks them."""
    return checks.findings(c)


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
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"suggest: --dtype {dtype!r}; use bf16 or fp32.")


def _num_experts(config: Any) -> int:
    for layer in config.layers[:1]:
        for value in _walk(layer):
            n = getattr(value, "num_experts", None)
            if isinstance(n, int):
                return n
    return 1


def _walk(config: Any, depth: int = 0) -> Iterator[Any]:
    yield config
    if depth > 4 or not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, depth + 1)


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


# ----------------------------------------------------------------------------- predict


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


def _stage_blocks(ctx: _Context, c: Candidate) -> list[tuple[int, bool, bool, int]]:
    """Per stage: (blocks, holds the first unit, holds the last, pp rank)."""
    if c.pp == 1:
        return [(ctx.flops.num_layers, True, True, 0)]
    key = ("plan", c.pp, c.schedule, c.microbatches)
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
    key = ("ops", c.pp, c.schedule, c.microbatches)
    if key not in ctx.pipeline_cache:
        ops = rank_ops(c.schedule or "1F1B", c.pp, c.microbatches)
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
    key = ("sim", c.pp, c.schedule, c.microbatches)
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
    spans = tuple(axis_span(layout, a, ctx.node) for a in ("tp", "cp", "ep"))
    key = ("comm", id(comms), spans)
    if key not in ctx.pipeline_cache:
        parts: dict[str, list[float]] = {}
        for c in comms:
            group, crosses = axis_span(layout, c.axis, ctx.node)
            latency = collective_seconds(
                ctx.hw,
                c.kind,
                0.0,
                count=max(1, round(c.count)),
                group_size=group,
                crosses_nodes=crosses,
            )
            transfer = collective_seconds(
                ctx.hw, c.kind, c.bytes, count=1, group_size=group, crosses_nodes=crosses
            ) - collective_seconds(
                ctx.hw, c.kind, 0.0, count=1, group_size=group, crosses_nodes=crosses
            )
            into = parts.setdefault(c.phase, [0.0, 0.0])
            into[0] += latency
            into[1] += transfer
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
    stages = _stage_blocks(ctx, c)
    n_layers = ctx.flops.num_layers
    compute_bytes = 2 if ctx.dtype == "bf16" else 4
    # --- states per stage (fp32 master, grads, AdamW): local elements after FSDP
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
        acts = trace.activations(k, first, last, c.ac) * mbs * in_flight.get(s, 1)
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
            },
        )
        into["params"] += 4 * elements
        into["grads"] += 4 * elements
        into["optimizer"] += 8 * elements
        into["activations"] += acts
        into["elements"] += elements
        into["tensors"] += k * ctx.flops.block_tensors + (first + last) / 2 * ctx.flops.rest_tensors
        into["unsharded"] += dense * fsdp + experts * efsdp
    # FSDP2's transient buffers: two units gathered (compute dtype), one unit's fp32 grads.
    unit = max(block_dense * dense_ratio + block_expert / c.ep, rest_dense / 2 * dense_ratio)
    transient = (2 * compute_bytes + 4) * unit if fsdp > 1 else 0
    heaviest = max(per_rank.values(), key=lambda d: d["params"] + d["activations"])
    if c.pp > 1 and fsdp > 1:
        # Under a pipeline FSDP2 keeps a unit gathered from its backward to the next
        # forward and reduces gradients once, at the step's end (REDUCE_GRAD): at the
        # end of a backward every unit of the stage is gathered (compute dtype) and
        # holds its unsharded fp32 gradients.
        transient = (compute_bytes + 4) * heaviest["unsharded"]
    kept = ("elements", "tensors", "unsharded")
    memory = {k: int(v) for k, v in heaviest.items() if k not in kept}
    memory["transient"] = int(transient)
    total_memory = sum(memory.values())
    # --- compute per micro-batch per stage
    share = 1.0 / (c.tp * c.cp)
    f = ctx.flops
    recompute_blocks = {"none": 0.0, "full": 1.0, "selective": 0.5}[c.ac]
    t_f, t_b, t_w = [], [], []
    comm_f_all, comm_b_all = [], []
    for k, _first, last, _ in stages:
        fwd = mbs * share * (k * f.block_fwd + last * f.rest_fwd)
        bwd = mbs * share * (k * f.block_bwd + last * f.rest_bwd)
        recompute = mbs * share * recompute_blocks * k * f.block_fwd
        # A fixed cost per operator, whatever its size (hardware's op_overhead_s).
        ops_f = k * f.block_fwd_ops + last * f.rest_fwd_ops
        ops_b = k * f.block_bwd_ops + last * f.rest_bwd_ops + recompute_blocks * k * f.block_fwd_ops
        comm_layer = _comm_seconds(ctx, layout, trace.per_layer, mbs, k)
        comm_rest = _comm_seconds(ctx, layout, trace.rest, mbs) if last else {}
        comm_f = comm_layer.get("forward", 0.0) + comm_rest.get("forward", 0.0)
        comm_b = comm_layer.get("backward", 0.0) + comm_rest.get("backward", 0.0)
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
        t_f.append(compute_seconds(hw, fwd, ctx.dtype) + overhead_f + traffic_f + comm_f)
        t_b.append(
            compute_seconds(hw, bwd + recompute, ctx.dtype) + overhead_b + traffic_b + comm_b
        )
        t_w.append((compute_seconds(hw, bwd, ctx.dtype) + overhead_b + traffic_b) / 2)
        comm_f_all.append(comm_f)
        comm_b_all.append(comm_b)
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
        makespan = busy = t_f[0] + t_b[0]
    # --- data-parallel collectives (FSDP2 / HSDP), per step, on the heaviest rank
    # The same for every checkpointing mode and SP choice of this mesh and pipeline.
    data_key = (
        "data",
        c.pp,
        c.schedule,
        c.microbatches,
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
    fwd_compute = sum(t_f) if c.pp == 1 else max(t_f) * c.microbatches
    bwd_compute = sum(t_b) if c.pp == 1 else max(t_b) * c.microbatches
    # hw.comm_overlap of each collective hides behind the compute of its phase.
    exposed = exposed_seconds(hw, data["gather_forward"], fwd_compute) + data["first_unit"]
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
    )
    step = makespan + exposed + optimizer + optimizer_comm
    tokens = ctx.global_batch * ctx.seq_len
    peak = hw.peak_flops["bf16" if ctx.dtype == "bf16" else "fp32"]
    model_flops = ctx.global_batch * f.total
    times = {
        "pipeline_or_compute": makespan,
        "model_axes_comm": (sum(comm_f_all) + sum(comm_b_all))
        * (c.microbatches if c.pp > 1 else 1),
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
    fsdp_axis = axis_span(layout, "fsdp", ctx.node)
    efsdp_axis = axis_span(layout, "efsdp", ctx.node)
    rep_axis = axis_span(layout, "dp_replicate", ctx.node)
    worst = None
    for s, (k, first, last, rank) in enumerate(stages):
        if c.pp > 1 and c.schedule not in SPLIT_BACKWARD_SCHEDULES:
            gathers_f, gathers_b = _block_gathers(ops[rank], s)
        elif c.pp > 1:
            gathers_f, gathers_b = 1, 0
        else:
            gathers_f, gathers_b = 1, 1
        dense_block = block_dense * dense_ratio
        expert_block = block_expert / c.ep
        root = rest_dense * (first + last) / 2 * dense_ratio
        t = dict.fromkeys(out, 0.0)

        def gather(per_unit: float, axis: tuple[int, bool], units: int, times: int = 1) -> float:
            """``units`` units of ``per_unit`` elements each gathered ``times`` times."""
            return collective_seconds(
                hw,
                "all_gather",
                per_unit * units * times * compute_bytes,
                count=units * times,
                group_size=axis[0],
                crosses_nodes=axis[1],
            )

        def reduce(elements: float, axis: tuple[int, bool], count: int) -> float:
            return collective_seconds(
                hw,
                "reduce_scatter",
                4 * elements,
                count=count,
                group_size=axis[0],
                crosses_nodes=axis[1],
            )

        def replicas(elements: float, shards: int, count: int) -> float:
            return collective_seconds(
                hw,
                "all_reduce",
                4 * elements / shards,
                count=count,
                group_size=rep_axis[0],
                crosses_nodes=rep_axis[1],
            )

        units = k + (1 if root else 0)
        if fsdp > 1:
            t["gather_forward"] += gather(dense_block, fsdp_axis, k, gathers_f) + (
                gather(root, fsdp_axis, 1) if root else 0.0
            )
            t["gather_backward"] += gather(dense_block, fsdp_axis, k, gathers_b)
            t["reduce"] += reduce(dense_block * k + root, fsdp_axis, units)
            t["first_unit"] = gather(max(dense_block, root), fsdp_axis, 1)
            t["last_unit"] = reduce(max(dense_block, root), fsdp_axis, 1)
        if block_expert and efsdp > 1:
            t["gather_forward"] += gather(expert_block, efsdp_axis, k, gathers_f)
            t["gather_backward"] += gather(expert_block, efsdp_axis, k, gathers_b)
            t["reduce"] += reduce(expert_block * k, efsdp_axis, k)
        if c.dp_replicate > 1:
            t["reduce"] += replicas(dense_block * k + root, fsdp, units)
            if block_expert:
                t["reduce"] += replicas(expert_block * k, efsdp, k)
            t["last_unit"] += replicas(max(dense_block, root), fsdp, 1)
        if worst is None or sum(t.values()) > sum(worst.values()):
            worst = t
    return worst or out


def _rest_params(ctx: _Context) -> float:
    units = ctx.checks.units
    if units is None:
        return 0.0
    return float(units[0].num_params + units[-1].num_params)


def _dim(ctx: _Context) -> int:
    return ctx.checks.stages.stage_width(ctx.checks.config)


def _command(
    source: ModelSource,
    c: Candidate,
    gpus: int,
    node: int,
    seq_len: int,
    global_batch: int,
    dtype: str,
) -> str:
    """The ``torchrun ... -m hyper_parallel.train.run ...`` line that runs ``c``."""
    if gpus <= node:
        launch = ["torchrun", "--standalone", "--nproc-per-node", str(gpus)]
    else:
        launch = [
            "torchrun",
            "--nnodes",
            str(gpus // node),
            "--nproc-per-node",
            str(node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "HOST:29400",
        ]
    args = ["-m", "hyper_parallel.train.run", "--model", source.spec_name]
    if source.overrides:
        args += ["--model-overrides", json.dumps(dict(source.overrides), separators=(",", ":"))]
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
    return " ".join(shlex.quote(a) for a in launch + args)


def _assumptions(hw: Hardware, max_seq: int | None, seq_len: int) -> list[str]:
    from hyper_parallel.analysis.cost_model import (
        MEMORY_HEADROOM_BYTES,
        MEMORY_HEADROOM_FRACTION,
    )

    notes = [
        f"Memory limit: {hw.memory_bytes / 1e9:.0f} GB less {MEMORY_HEADROOM_FRACTION:.0%} "
        f"(allocator fragmentation) less {MEMORY_HEADROOM_BYTES / 1024**3:.0f} GiB (CUDA "
        "context, workspaces, NCCL buffers).",
        "Per-rank memory: the dry run's parameters, gradients and AdamW moments (fp32 "
        "master weights) sharded by FSDP2, activations per micro-batch times the "
        "micro-batches a stage holds (schedule's action list), and FSDP2's transient "
        "buffers (two units gathered + one unit's fp32 gradients; under a pipeline the "
        "whole stage gathered with its unsharded fp32 gradients, reduced at the step's "
        "end).",
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
        "Without pp the data-parallel rank's whole batch runs as one forward (train.run "
        "has no gradient accumulation); with pp it is split into the micro-batches.",
        f"cp is searched in powers of two down to {MIN_CP_TOKENS} tokens per rank; pp up "
        f"to {MAX_PP}, with 1, 2 and 4 times the run plan's micro-batch count (one per "
        "stage: pp, or 2 pp for the interleaved schedules); counts the local batch does "
        "not split into are the run plan's 'num_microbatches' refusals.",
    ]
    for field_name, source in sorted(hw.sources.items()):
        notes.append(f"{hw.name} {field_name}: {source}")
    if max_seq is not None and seq_len > max_seq:
        notes.append(
            f"seq {seq_len} exceeds the model's max_seq_len {max_seq}: the model is built "
            f"with max_seq_len={seq_len} (in the commands' --model-overrides)."
        )
    return notes


def suggest_chart(report: SuggestReport, path: str | Path) -> None:
    """Draw the candidates as predicted step time vs memory per GPU, the limit and the top K.

    Example::

        suggest_chart(suggest("llama3-8b", gpus=16, gpu="h100-80gb", seq_len=4096,
                              global_batch_tokens=1 << 20), "suggest.png")
    """
    from hyper_parallel.analysis.charts import suggest_chart as draw

    draw(report, path)
