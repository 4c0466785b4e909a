"""A written-down cost model for one training step: compute, collectives, pipeline, memory.

Everything here is a formula over data (a hardware file, the dry run's counts); no
process group and no accelerator. The planner (:mod:`hyper_parallel.analysis.suggest`)
feeds it what it traced; ``hyper-parallel calibrate`` writes a hardware file of this
machine so the same formulas can be checked against measured steps.

**Hardware** is data: one YAML file per kind under ``analysis/hardware/`` (``h100-80gb``,
``h100-96gb`` (torchtitan's 500 W part), ``h200-141gb``, ``b200``, ``a100-80gb``,
``a100-40gb``, ``mi300x``), each value with its source (vendor datasheet, or a stated assumption). A user's own file has the same
fields, plain numbers or ``{value, source}`` pairs (:func:`load_hardware`).

**Compute.** ``seconds = FLOPs / (peak_flops[dtype] * compute_efficiency[dtype])``. FLOPs
are counted on the meta device by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls;
attention's score matmuls at the causal half of the ``S x S`` matrix, and at the attention
kernel's own ``attention_efficiency`` when the file gives one), forward and backward
apart; each rank does ``1 / (tp * cp)`` of a sequence's work (experts: uniform routing).
Three more terms, each a field of the hardware file that ``calibrate`` measures on a
CPU (the shipped GPU kinds give the value that makes it vanish, with the reason):

- **fixed cost per operator**: ``op_overhead_s`` x the aten operators the step runs,
  counted on the meta device per block and for the rest (forward, backward,
  recompute); GPU kinds 0 (host launches are queued ahead of long kernels);
- **memory traffic of the operators without a FLOP formula** (elementwise, norms,
  softmax, copies, concatenations; matmuls and attention are in the FLOPs): the
  elements they read and write, counted on the meta device per sequence, times the
  compute dtype's bytes, over ``hbm_bandwidth``; divided by ``tp x cp`` like the
  FLOPs;
- **the optimizer step's operators**: the trainer's gradient norm, AdamW step and
  ``zero_grad`` run ``optimizer_ops_per_tensor`` operators per parameter tensor
  (counted once on a small CPU tensor: the single-tensor AdamW a CPU runs), each
  costing ``op_overhead_s`` plus ``dtensor_op_overhead_s`` when the parameters are
  DTensors (FSDP2, tp or ep shard them); GPU kinds 0 (as above).

Not counted: the Python cost of DTensor around the forward and backward operators
(tp, cp), and of FSDP2's hooks per unit.

**Collectives** (Hockney's latency-bandwidth model, as NCCL's own tuner writes it in
``src/graph/tuning.cc``): ``seconds = steps * latency + wire_bytes / (bandwidth *
efficiency)``, ``wire_bytes`` what one rank sends in a ring (nccl-tests
``PERFORMANCE.md`` bus-bandwidth factors: ``(p-1)/p`` of the buffer for all-gather,
reduce-scatter and all-to-all, ``2(p-1)/p`` for all-reduce). Ring steps: ``p - 1``
(``2(p - 1)`` for all-reduce); NCCL picks a tree for all-reduce when that is faster
(``2 log2 p`` steps, same bytes): the faster of the two is taken. The link is the
slowest one the group crosses: the mesh is laid out outermost first as ``pp,
dp_replicate, dp_shard, cp, tp`` (tp innermost), so an axis whose ranks are
``stride`` apart with ``size`` ranks stays inside a node when ``stride * size <=
gpus_per_node``; otherwise it crosses nodes and runs at the per-GPU network bandwidth
(a ring through several nodes is limited by its inter-node hops) times the group's ranks
in one node for a ring collective: NCCL runs one ring per NIC, each leaving the node
through another GPU's NIC (:meth:`Hardware.link`, with NVIDIA's measurements). A calibrated file
may give links per collective kind (``collectives``) and per kind and group size
(``collectives_by_group``: measured with every group of that size at once, as a
mesh axis runs them; on one host the groups share its cores and memory); the most
specific one measured is used.

**Overlap** (stated assumptions, as FSDP2 and torch's pipelining behave):

- tensor-, context- and expert-parallel collectives sit between dependent
  computations: fully exposed (counted on the critical path);
- FSDP2's all-gathers are prefetched one unit ahead and its reduce-scatters run behind
  the next unit's backward (FSDP2 defaults, ``torch.distributed.fsdp.fully_shard``):
  hidden behind the compute of the same phase up to that compute's length, except
  the first unit's gather and the last unit's reduce (one unit each) which nothing
  hides; HSDP's all-reduce over ``dp_replicate`` is hidden the same way;
- under a pipeline, FSDP2's gradient reduction runs once at the end of the step
  (torch's ``REDUCE_GRAD`` action): hidden behind the last backward only;
- pipeline point-to-point sends of a micro-batch's activations add to the op that
  produces them (a stage waits for its input);
- compute and communication do not slow each other (no SM or memory contention);
- "hidden" is scaled by ``comm_overlap`` (0 to 1): the part of an overlappable
  collective that compute running with it hides is ``comm_overlap x min(collective,
  compute)``. GPU kinds 1 (NCCL moves data on its own channels); ``calibrate``
  measures it (an asynchronous all-gather with matmuls running against the two
  apart; about 0 on a CPU, where gloo and the compute share the same cores).

**Pipeline.** The bubble comes from the schedule's own action list (torch's
``get_schedule_ops``, :func:`~hyper_parallel.analysis.pipeline_cost.rank_ops`)
replayed with the heaviest stage's forward, backward, input-gradient and
weight-gradient times (:func:`~hyper_parallel.analysis.pipeline_cost.simulate`).

**Activation checkpointing** recomputes the forward of each checkpointed block
inside its backward: its forward FLOPs and its forward collectives once more.

**Optimizer.** AdamW is memory-bound: per local element it reads parameter, gradient
and two moments and writes parameter and moments (about 28 bytes in fp32) at the HBM
bandwidth; plus its operators (above). A gradient that backward leaves ``Partial``
(the dry run's collectives of phase ``optimizer``: e.g. the norms' weights under
sequence parallelism without FSDP2) is reduced for every operator argument of the
optimizer step that reads it (``optimizer_grad_reads`` per tensor, counted on a CPU
tensor: DTensor redistributes each argument and keeps no reduced copy).

Example::

    from hyper_parallel.analysis.cost_model import load_hardware, collective_seconds
    hw = load_hardware("h100-80gb")
    collective_seconds(hw, "all_gather", 1 << 30, count=1, group_size=8, crosses_nodes=False)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hyper_parallel.config.data_files import DuplicateKeyError, load_yaml

__all__ = [
    "HARDWARE_KINDS",
    "MEMORY_HEADROOM_BYTES",
    "MEMORY_HEADROOM_FRACTION",
    "OPTIMIZER_BYTES_PER_ELEMENT",
    "Hardware",
    "Link",
    "attention_seconds",
    "axis_group",
    "axis_per_node",
    "axis_span",
    "collective_seconds",
    "compute_seconds",
    "exposed_seconds",
    "list_hardware",
    "load_hardware",
    "optimizer_seconds",
    "usable_memory",
]

HARDWARE_KINDS = (
    "h100-80gb",
    "h100-96gb",
    "h200-141gb",
    "b200",
    "a100-80gb",
    "a100-40gb",
    "mi300x",
)
"""The hardware files shipped with the package (``analysis/hardware/<kind>.yaml``)."""

MEMORY_HEADROOM_FRACTION = 0.14
"""Share of the caching allocator's reserved bytes that are not live tensors (PyTorch's
allocator rounds blocks, caches freed ones and cannot always reuse freed segments): a
layout fits when its peak of live bytes is at most this much less than what the
allocator may reserve. Fitted by ``benchmarks/bench_published.py`` on the memory of the
fit rows of ``analysis/published/runs.yaml`` only (torchtitan's and Trainy's H100/H200
runs, which publish the allocator's peak reserved bytes; 2026-12-04): reserved = live /
(1 - 0.14), 1.16x; ``bench_published.py --check`` fails when it is not the fit (it was the
assumption 0.08)."""

MEMORY_HEADROOM_BYTES = 2 * 1024**3
"""Bytes kept free for the CUDA context, cuBLAS workspaces and NCCL's communication
buffers (NCCL's default ``NCCL_BUFFSIZE`` is 4 MiB per channel and peer; a context plus
workspaces is around 1 GiB)."""

OPTIMIZER_BYTES_PER_ELEMENT = 28
"""HBM bytes AdamW moves per local fp32 element: reads parameter, gradient and two
moments (16), writes parameter and two moments (12)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth each way per GPU (bytes/s), per-step latency, efficiency."""

    bandwidth: float
    latency_s: float
    efficiency: float = 1.0

    def to_dict(self) -> dict[str, float]:
        """JSON-friendly form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU kind (or a calibrated machine): what the cost model needs to know.

    Attributes:
        name: Kind name (``h100-80gb``) or the file's own name.
        description: One line for people.
        memory_bytes: Device memory per GPU.
        peak_flops: Dense peak FLOP/s per compute dtype (``bf16``, ``fp32``).
        compute_efficiency: Achieved fraction of ``peak_flops`` per dtype.
        hbm_bandwidth: Device memory bandwidth (bytes/s), for the optimizer step.
        gpus_per_node: GPUs in one node (the default of ``--gpus-per-node``).
        intra_node: Links inside a node.
        inter_node: The network between nodes (per GPU).
        collectives: Optional per-kind links measured by ``calibrate`` (inside a node);
            they replace ``intra_node`` for that kind of collective.
        collectives_by_group: Optional per-kind links for a group size (``{2:
            {all_gather: link, ...}}``), measured by ``calibrate`` with every group of
            that size running at once; they replace ``collectives`` for groups of that
            size inside a node.
        op_overhead_s: Optional fixed seconds per operator the step runs (host
            dispatch, autograd bookkeeping, the kernel's start), added per counted
            operator; ``calibrate`` measures it on a CPU. Default 0: on a GPU the
            kernels are queued asynchronously and this cost hides behind the previous
            kernel while kernels are long (the shipped kinds say so).
        dtensor_op_overhead_s: Optional extra seconds per operator run on a DTensor
            (sharding propagation, unwrapping and wrapping in Python), charged for
            the optimizer step's operators on sharded parameters; ``calibrate``
            measures it. Default 0, as ``op_overhead_s`` (host work hidden behind the
            GPU's queued kernels).
        comm_overlap: Share (0 to 1) of an overlappable collective's time that hides
            behind compute running at the same time. Default 1: NCCL moves data on
            its own channels while kernels run; ``calibrate`` measures it (on a CPU
            the same cores run gloo's collectives and the compute).
        sources: Where each value comes from, by dotted field name.
    """

    name: str
    description: str
    memory_bytes: float
    peak_flops: dict[str, float]
    compute_efficiency: dict[str, float]
    hbm_bandwidth: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    collectives: dict[str, Link] = dataclasses.field(default_factory=dict)
    collectives_by_group: dict[int, dict[str, Link]] = dataclasses.field(default_factory=dict)
    op_overhead_s: float = 0.0
    dtensor_op_overhead_s: float = 0.0
    comm_overlap: float = 1.0
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    optimizer_temporary: float = 1.0
    """Moment-sized tensors of every local parameter that AdamW's step allocates at once
    (0 to 1). 1 on a GPU: ``torch.optim.AdamW``'s multi-tensor path, its default on CUDA
    (DTensor parameters included), computes ``sqrt(exp_avg_sq)`` of all of them before
    its ``addcdiv`` (torch/optim/adam.py, ``_multi_tensor_adam``). 0 on a CPU, where it
    loops over the parameters and one parameter's temporary is alive at a time (not
    counted); ``calibrate`` writes 0."""
    attention_efficiency: float | None = None
    """Achieved fraction of peak in the attention kernel's score matmuls (``Q K^T`` and
    ``P V`` at the causal half, forward and backward) as this package's trainer calls it
    (``scaled_dot_product_attention(..., is_causal=True)``: torch picks the kernel;
    FlashAttention-2 reports 50-73 % of A100 peak forward and less backward: Dao 2023,
    section 4.1); ``None``: as ``compute_efficiency``."""
    chunked_attention_efficiency: float | None = None
    """The same for the trainer's context-parallel attention, which runs torch's
    FlashAttention-2 kernel (else the memory-efficient one) per pair of sequence chunks
    (:mod:`hyper_parallel.models.common.chunked_attention`: the kernels that return the
    log-sum-exp the chunks merge by); ``None``: as ``attention_efficiency``."""

    def flops(self, dtype: str) -> float:
        """Achieved FLOP/s in ``dtype``: peak times efficiency."""
        key = "bf16" if dtype in ("bf16", "bf16-true", "fp16") else "fp32"
        return self.peak_flops[key] * self.compute_efficiency[key]

    def attention_flops(self, dtype: str, chunked: bool = False) -> float:
        """Achieved FLOP/s of the attention kernel in ``dtype`` (``chunked``: the
        context-parallel kernel, :attr:`chunked_attention_efficiency`)."""
        efficiency = self.attention_efficiency
        if chunked and self.chunked_attention_efficiency is not None:
            efficiency = self.chunked_attention_efficiency
        if efficiency is None:
            return self.flops(dtype)
        key = "bf16" if dtype in ("bf16", "bf16-true", "fp16") else "fp32"
        return self.peak_flops[key] * efficiency

    def link(
        self, kind: str, crosses_nodes: bool, group_size: int | None = None, per_node: int = 1
    ) -> Link:
        """The link a collective of ``kind`` over ``group_size`` ranks runs at.

        Across nodes, a ring collective (all-gather, reduce-scatter, all-reduce,
        broadcast) whose group has ``per_node`` ranks in each node runs one ring per
        NIC, each crossing the node's boundary through a different GPU's NIC (NCCL's
        channels): the node's share of the traffic leaves through ``per_node`` NICs,
        so a rank's bytes move at ``per_node`` x the per-GPU network bandwidth, at most
        the links inside the node they also cross. NVIDIA measures 192 GB/s all-reduce
        bus bandwidth across DGX A100 nodes with 8 x 200 Gb/s NICs (8 x 25 GB/s;
        https://github.com/NVIDIA/nccl/issues/812), and twice the bus bandwidth with 8
        GPUs per node as with 4 (https://github.com/NVIDIA/nccl/issues/1168). An
        all-to-all and a point-to-point send leave through the rank's own NIC.
        """
        if crosses_nodes:
            if per_node <= 1 or kind not in _RING_KINDS:
                return self.inter_node
            net = self.inter_node
            bandwidth = min(per_node * net.bandwidth, max(net.bandwidth, self.intra_node.bandwidth))
            return dataclasses.replace(net, bandwidth=bandwidth)
        measured = self.collectives_by_group.get(group_size or 0, {})
        return measured.get(kind) or self.collectives.get(kind, self.intra_node)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the ``hardware`` key of ``suggest --format json``)."""
        return {
            "name": self.name,
            "description": self.description,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "compute_efficiency": dict(self.compute_efficiency),
            "hbm_bandwidth": self.hbm_bandwidth,
            "gpus_per_node": self.gpus_per_node,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "collectives": {k: v.to_dict() for k, v in self.collectives.items()},
            "collectives_by_group": {
                g: {k: v.to_dict() for k, v in links.items()}
                for g, links in self.collectives_by_group.items()
            },
            "op_overhead_s": self.op_overhead_s,
            "dtensor_op_overhead_s": self.dtensor_op_overhead_s,
            "comm_overlap": self.comm_overlap,
            "optimizer_temporary": self.optimizer_temporary,
            "attention_efficiency": self.attention_efficiency,
            "chunked_attention_efficiency": self.chunked_attention_efficiency,
            "sources": dict(self.sources),
        }


def list_hardware() -> list[str]:
    """The shipped hardware kinds (file names without ``.yaml``)."""
    files = resources.files("hyper_parallel.analysis").joinpath("hardware")
    return sorted(f.name.removesuffix(".yaml") for f in files.iterdir() if f.name.endswith(".yaml"))


def load_hardware(kind_or_path: str | Path) -> Hardware:
    """Read a hardware file: a shipped kind (``"h100-80gb"``) or a path to a YAML file.

    Every value may be a plain number or ``{value: X, source: "..."}``.

    Raises:
        ValueError: An unknown kind (the known ones listed), an unreadable file, or a
            missing or malformed field (named, with the fix).
    """
    text = str(kind_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            raw = load_yaml(path.read_text(encoding="utf-8"))
        except DuplicateKeyError as e:
            raise ValueError(f"hardware file {text!r}: {e}") from None
        except OSError as e:
            raise ValueError(f"hardware file {text!r}: cannot read it ({e.strerror}).") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ValueError(
                f"hardware file {text!r}: not valid YAML ({problem}{at}); correct the file "
                "(see hyper_parallel/analysis/hardware/h100-80gb.yaml for the fields)."
            ) from None
        where = f"hardware file {text!r}"
    else:
        kinds = list_hardware()
        if text not in kinds:
            # 'h200' -> 'h200-141gb': the kinds that start with it, else the closest names.
            near = [k for k in kinds if k.startswith(text.lower())] or difflib.get_close_matches(
                text.lower(), kinds, n=2
            )
            hint = f" (did you mean {' or '.join(repr(k) for k in near)}?)" if near else ""
            raise ValueError(
                f"unknown GPU kind {text!r}{hint}; known kinds: {', '.join(kinds)}. Give one "
                "of them with --gpu, or your own file with --hardware FILE.yaml "
                "(hyper-parallel calibrate --out FILE.yaml writes one for this machine)."
            )
        files = resources.files("hyper_parallel.analysis").joinpath("hardware")
        raw = yaml.safe_load(files.joinpath(f"{text}.yaml").read_text(encoding="utf-8"))
        where = f"hardware kind {text!r}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a YAML mapping of fields, got {type(raw).__name__}.")
    return _parse(raw, where, default_name=path.stem if path.suffix else text)


def _parse(raw: Mapping[str, Any], where: str, default_name: str) -> Hardware:
    sources: dict[str, str] = {}

    def value(
        key: str,
        node: Any,
        cast: type = float,
        low: float | None = None,
        fraction: bool = False,
    ) -> Any:
        if isinstance(node, Mapping):
            if "value" not in node:
                raise ValueError(
                    f"{where}: field {key!r} is a mapping without 'value'; "
                    "write it as a number or {value: X, source: '...'}."
                )
            if "source" in node:
                sources[key] = str(node["source"])
            node = node["value"]
        try:
            out = cast(node)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: field {key!r} is {node!r}, not a number.") from None
        if fraction and not 0 < out <= 1:
            raise ValueError(
                f"{where}: field {key!r} is {out}; an efficiency is the achieved share of "
                "the peak and must be in (0, 1] (e.g. 0.5 for half of it)."
            )
        if low is None and out <= 0:
            raise ValueError(f"{where}: field {key!r} is {out}; it must be > 0.")
        if low is not None and out < low:
            raise ValueError(f"{where}: field {key!r} is {out}; it must be >= {low}.")
        return out

    def optional(key: str, default: float, high: float | None = None) -> float:
        if key not in raw:
            return default
        out = value(key, raw[key], float, low=0.0)
        if high is not None and out > high:
            raise ValueError(f"{where}: field {key!r} is {out}; it must be <= {high}.")
        return out

    def need(key: str) -> Any:
        if key not in raw:
            raise ValueError(
                f"{where}: missing field {key!r}; a hardware file needs memory_bytes, "
                "peak_flops {bf16, fp32}, compute_efficiency {bf16, fp32}, hbm_bandwidth, "
                "gpus_per_node, intra_node and inter_node {bandwidth, latency_s, efficiency} "
                "(see hyper_parallel/analysis/hardware/h100-80gb.yaml)."
            )
        return raw[key]

    def per_dtype(key: str, fraction: bool = False) -> dict[str, float]:
        node = need(key)
        if not isinstance(node, Mapping) or "value" in node:
            return {d: value(key, node, fraction=fraction) for d in ("bf16", "fp32")}
        missing = [d for d in ("bf16", "fp32") if d not in node]
        if missing:
            raise ValueError(f"{where}: field {key!r} lacks {missing}; give bf16 and fp32.")
        return {d: value(f"{key}.{d}", node[d], fraction=fraction) for d in ("bf16", "fp32")}

    def link(key: str, node: Any) -> Link:
        if not isinstance(node, Mapping):
            raise ValueError(
                f"{where}: field {key!r} must be a mapping of bandwidth, "
                "latency_s and (optionally) efficiency."
            )
        for k in ("bandwidth", "latency_s"):
            if k not in node:
                raise ValueError(f"{where}: field {key!r} lacks {k!r}.")
        return Link(
            bandwidth=value(f"{key}.bandwidth", node["bandwidth"]),
            latency_s=value(f"{key}.latency_s", node["latency_s"]),
            efficiency=value(f"{key}.efficiency", node.get("efficiency", 1.0), fraction=True),
        )

    collectives = raw.get("collectives") or {}
    if not isinstance(collectives, Mapping):
        raise ValueError(f"{where}: field 'collectives' must map a collective kind to a link.")
    by_group_raw = raw.get("collectives_by_group") or {}
    if not isinstance(by_group_raw, Mapping) or not all(
        isinstance(v, Mapping) for v in by_group_raw.values()
    ):
        raise ValueError(
            f"{where}: field 'collectives_by_group' must map a group size to "
            "{collective kind: link}."
        )
    by_group: dict[int, dict[str, Link]] = {}
    for size, links in by_group_raw.items():
        try:
            g = int(size)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: field 'collectives_by_group' key {size!r} is not a group size."
            ) from None
        by_group[g] = {str(k): link(f"collectives_by_group.{g}.{k}", v) for k, v in links.items()}
    return Hardware(
        name=str(raw.get("name", default_name)),
        description=str(raw.get("description", "")),
        memory_bytes=value("memory_bytes", need("memory_bytes")),
        peak_flops=per_dtype("peak_flops"),
        compute_efficiency=per_dtype("compute_efficiency", fraction=True),
        hbm_bandwidth=value("hbm_bandwidth", need("hbm_bandwidth")),
        gpus_per_node=value("gpus_per_node", need("gpus_per_node"), int),
        intra_node=link("intra_node", need("intra_node")),
        inter_node=link("inter_node", need("inter_node")),
        collectives={str(k): link(f"collectives.{k}", v) for k, v in collectives.items()},
        collectives_by_group=by_group,
        op_overhead_s=optional("op_overhead_s", 0.0),
        dtensor_op_overhead_s=optional("dtensor_op_overhead_s", 0.0),
        comm_overlap=optional("comm_overlap", 1.0, high=1.0),
        sources=sources,
        optimizer_temporary=optional("optimizer_temporary", 1.0, high=1.0),
        # Efficiencies in (0, 1]; left out: as compute_efficiency / attention_efficiency.
        attention_efficiency=(
            value("attention_efficiency", raw["attention_efficiency"], fraction=True)
            if "attention_efficiency" in raw
            else None
        ),
        chunked_attention_efficiency=(
            value(
                "chunked_attention_efficiency", raw["chunked_attention_efficiency"], fraction=True
            )
            if "chunked_attention_efficiency" in raw
            else None
        ),
    )


def usable_memory(hw: Hardware) -> float:
    """Bytes a rank may plan for: device memory less the stated headroom.

    ``memory_bytes * (1 - MEMORY_HEADROOM_FRACTION) - MEMORY_HEADROOM_BYTES``; a file
    with less than four times the fixed headroom (a CPU calibration) keeps only the
    fractional part.
    """
    fixed = MEMORY_HEADROOM_BYTES if hw.memory_bytes > 4 * MEMORY_HEADROOM_BYTES else 0
    return hw.memory_bytes * (1 - MEMORY_HEADROOM_FRACTION) - fixed


# ------------------------------------------------------------------------------ axes

_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_RING_KINDS = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast"})


def axis_span(layout: Any, axis: str, gpus_per_node: int) -> tuple[int, bool]:
    """``(group size, crosses nodes)`` of ``axis`` under the mesh's rank order (see
    :func:`axis_group`).

    Example:
        >>> from hyper_parallel.distributed.layout import MeshLayout
        >>> axis_span(MeshLayout(dp_shard=4, tp=8), "tp", 8), axis_span(
        ...     MeshLayout(dp_shard=4, tp=8), "dp_shard", 8)
        ((8, False), (4, True))
    """
    return axis_group(layout, axis, gpus_per_node)[:2]


def axis_per_node(layout: Any, axis: str, gpus_per_node: int) -> int:
    """How many of one ``axis`` group's ranks share a node (the NICs a ring over the
    group drives per node when it crosses nodes; see :meth:`Hardware.link`).

    Example:
        >>> from hyper_parallel.distributed.layout import MeshLayout
        >>> [axis_per_node(MeshLayout(dp_shard=64), "dp_shard", 8),
        ...  axis_per_node(MeshLayout(dp_shard=32, tp=2), "dp_shard", 8),
        ...  axis_per_node(MeshLayout(dp_shard=8, tp=8), "dp_shard", 8)]
        [8, 4, 1]
    """
    return axis_group(layout, axis, gpus_per_node)[2]


@functools.lru_cache(maxsize=1 << 16)
def axis_group(layout: Any, axis: str, gpus_per_node: int) -> tuple[int, bool, int]:
    """``(group size, crosses nodes, ranks per node)`` of ``axis`` under the mesh's rank
    order: the arguments ``group_size``, ``crosses_nodes`` and ``per_node`` of
    :func:`collective_seconds`.

    Ranks are laid out outermost first as pp, dp_replicate, dp_shard, cp, tp; an axis'
    group holds ranks ``stride`` apart, ``stride`` being the product of the sizes inside
    it. Derived axes: ``fsdp`` = dp_shard x cp (stride tp), ``ep`` borrows the innermost
    ranks (stride 1), ``efsdp`` the rest of dp_shard x cp x tp (stride ep), ``batch`` =
    dp_replicate x dp_shard (stride cp x tp), ``loss`` = batch x cp. Contiguous blocks of
    ``gpus_per_node`` ranks form a node: a group stays inside one when its span (stride x
    size) tiles the node; otherwise each node holds ``gpus_per_node / stride`` of its
    ranks (1 when the stride is a node or more).

    Example:
        >>> from hyper_parallel.distributed.layout import MeshLayout
        >>> axis_group(MeshLayout(dp_shard=32, tp=2), "dp_shard", 8)
        (32, True, 4)
    """
    group, stride = _group_stride(layout, axis)
    if group <= 1:
        return 1, False, 1
    crosses = gpus_per_node % (stride * group) != 0
    if stride >= gpus_per_node or gpus_per_node % stride:
        return group, crosses, 1
    return group, crosses, min(group, gpus_per_node // stride)


def _group_stride(layout: Any, axis: str) -> tuple[int, int]:
    """``(group size, stride)`` of ``axis`` under the mesh's rank order (:func:`axis_group`)."""
    size = {a: layout.size(a) for a in _ORDER}
    inner = {a: math.prod(size[b] for b in _ORDER[i + 1 :]) for i, a in enumerate(_ORDER)}
    if axis in _ORDER:
        return size[axis], inner[axis]
    if axis == "fsdp":
        return size["dp_shard"] * size["cp"], inner["cp"]
    if axis == "ep":
        return layout.ep, 1
    if axis == "efsdp":
        return layout.efsdp, layout.ep
    if axis == "batch":
        return size["dp_replicate"] * size["dp_shard"], inner["dp_shard"]
    if axis == "loss":
        return size["dp_replicate"] * size["dp_shard"] * size["cp"], inner["cp"]
    raise ValueError(f"axis_span: unknown axis {axis!r}.")


# ------------------------------------------------------------------------------ costs


def compute_seconds(hw: Hardware, flops: float, dtype: str) -> float:
    """Seconds for ``flops`` at the achieved rate of ``dtype`` (peak x efficiency)."""
    return flops / hw.flops(dtype)


def attention_seconds(hw: Hardware, flops: float, dtype: str, chunked: bool = False) -> float:
    """Seconds for ``flops`` of attention's score matmuls at the attention kernel's rate
    (``chunked``: context parallelism's)."""
    return flops / hw.attention_flops(dtype, chunked)


def exposed_seconds(hw: Hardware, comm: float, compute: float) -> float:
    """What of an overlappable collective of ``comm`` seconds stays on the critical path
    while ``compute`` seconds of work run with it: ``comm - comm_overlap x min(comm,
    compute)`` (at ``comm_overlap`` 1: ``max(0, comm - compute)``).

    Example:
        >>> exposed_seconds(load_hardware("h100-80gb"), 3.0, 2.0)
        1.0
    """
    return comm - hw.comm_overlap * min(comm, compute)


def optimizer_seconds(
    hw: Hardware,
    elements: float,
    tensors: float,
    ops_per_tensor: float,
    sharded: bool,
    state_bytes: int = 4,
) -> float:
    """One optimizer step over ``elements`` local elements in ``tensors`` parameter
    tensors: AdamW's :data:`OPTIMIZER_BYTES_PER_ELEMENT` at the memory bandwidth (scaled
    by ``state_bytes``, the states' element size: 2 for bf16 parameters, gradients and
    moments), plus ``ops_per_tensor`` operators per tensor at ``op_overhead_s`` each, and
    ``dtensor_op_overhead_s`` more each when the parameters are DTensors (``sharded``).
    """
    per_op = hw.op_overhead_s + (hw.dtensor_op_overhead_s if sharded else 0.0)
    moved = OPTIMIZER_BYTES_PER_ELEMENT * state_bytes / 4
    return moved * elements / hw.hbm_bandwidth + (tensors * ops_per_tensor * per_op)


_WIRE = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
}


def collective_seconds(
    hw: Hardware,
    kind: str,
    num_bytes: float,
    *,
    count: int,
    group_size: int,
    crosses_nodes: bool,
    per_node: int = 1,
) -> float:
    """Seconds for ``count`` collectives moving ``num_bytes`` (buffer bytes, all together).

    ``per_node``: the group's ranks in one node (:func:`axis_per_node`); across nodes a
    ring collective drives that many NICs per node (:meth:`Hardware.link`).

    ``num_bytes`` is the dry run's per-rank buffer (all-gather: the gathered output;
    reduce-scatter: the full input; all-reduce: the tensor; all-to-all: the input).

    Example:
        >>> hw = load_hardware("h100-80gb")
        >>> round(collective_seconds(hw, "all_gather", 0, count=1, group_size=8,
        ...                          crosses_nodes=False) * 1e6, 1)  # 7 ring steps
        21.0
    """
    if group_size <= 1 or count <= 0:
        return 0.0
    link = hw.link(kind, crosses_nodes, group_size, per_node)
    wire = num_bytes * _WIRE.get(kind, _WIRE["all_gather"])(group_size)
    transfer = wire / (link.bandwidth * link.efficiency)
    ring_steps = (2 if kind == "all_reduce" else 1) * (group_size - 1)
    steps = ring_steps
    if kind == "all_reduce":  # NCCL's tree: 2 log2(p) steps for the same bytes
        steps = min(ring_steps, 2 * math.ceil(math.log2(group_size)))
    return count * steps * link.latency_s + transfer
