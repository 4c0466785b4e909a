"""Checks for third-party modules whose weight layout a plan can get wrong.

Hugging Face's ``Conv1D`` (GPT-2 and relatives) stores its weight ``(in, out)``,
transposed from ``nn.Linear``, and GPT-2's ``c_attn`` packs q|k|v into one weight.
A plan written for ``nn.Linear`` applies cleanly to them yet computes the wrong
thing once activations are handed on as local tensors, so these are refused with a
message saying why and what to do. An ``nn.Embedding`` whose rows are split over two
mesh axes fails inside torch at its first call; it is refused here instead. Modules are recognised by class name, so
``transformers`` is never imported here.
"""

from __future__ import annotations

from torch import nn

from hyper_parallel.core.dtensor.placement_types import Placement, Shard
from hyper_parallel.dmodule.findings import Finding
from hyper_parallel.dmodule.sharding import ShardingConfig

__all__ = ["check_known_layouts"]

# Path segments Hugging Face uses for a Conv1D that packs q|k|v (or k|v) column blocks.
_FUSED_QKV_NAMES = frozenset({"c_attn"})


def _is_hf_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and hasattr(module, "nx")
        and weight is not None
        and weight.dim() == 2
    )


def _shard_dim(placement: Placement, ndim: int) -> int | None:
    if isinstance(placement, Shard) and -ndim <= placement.dim < ndim:
        return placement.dim % ndim
    return None  # replicated, partial, or out of range (reported by the state checks)


def _sharded_axes(config: ShardingConfig, state: str, dim: int, ndim: int) -> list[str]:
    named = config.state_shardings.get(state, {})
    return [str(axis) for axis, p in named.items() if _shard_dim(p, ndim) == dim]


def _conv1d_findings(path: str, module: nn.Module, config: ShardingConfig) -> list[Finding]:
    name = path.rpartition(".")[2]
    nx, nf = module.nx, module.nf
    out_axes = sorted(
        set(_sharded_axes(config, "weight", 1, 2)) | set(_sharded_axes(config, "bias", 0, 1))
    )
    if name in _FUSED_QKV_NAMES and out_axes:
        return [
            Finding(
                "error",
                path,
                "state_shardings",
                f"{name} is a fused q|k|v projection (Conv1D weight ({nx}, {nf}): column blocks "
                f"q|k|v of {nx} each), and the plan shards its output features over "
                f"{out_axes}. Contiguous column shards do not hold whole heads of q, k and v: "
                "e.g. with 2 ranks, rank 0 gets q and half of k, rank 1 the rest of k and v, so the "
                "attention's split into q, k, v (over local tensors) pairs the wrong heads.",
                "un-fuse it into separate q/k/v projections and shard each with "
                "colwise(transposed_weight=True, input_name='x'); or shard it per head inside "
                "a custom local_map region over the whole attention module; or leave it out "
                "of the plan (replicated) and shard only the MLP (c_fc: colwise("
                "transposed_weight=True, input_name='x'), c_proj: rowwise("
                "transposed_weight=True, input_name='x')).",
            )
        ]
    in_axes = set(_sharded_axes(config, "weight", 0, 2))
    linear_style = sorted(in_axes & set(_sharded_axes(config, "bias", 0, 1)))
    if linear_style:
        return [
            Finding(
                "error",
                path,
                "state_shardings",
                f"Conv1D stores its weight as (in, out) = ({nx}, {nf}), transposed from "
                f"nn.Linear; this config shards weight dim 0 (input features) and bias dim 0 "
                f"(output features) over {linear_style} — a column-wise plan written for "
                "nn.Linear.",
                "use colwise(transposed_weight=True, input_name='x') (weight Shard(1), bias "
                "Shard(0)), or rowwise(transposed_weight=True, input_name='x') (weight "
                "Shard(0), bias replicated).",
            )
        ]
    return []


def _embedding_findings(path: str, config: ShardingConfig) -> list[Finding]:
    rows = _sharded_axes(config, "weight", 0, 2)
    if len(rows) < 2:
        return []
    return [
        Finding(
            "error",
            path,
            "state_shardings['weight']",
            f"a vocab-parallel embedding shards its rows over one mesh axis; this config "
            f"shards them over {rows}. torch 2.13's embedding on a weight sharded on dim 0 "
            "over two axes fails at the first call ('MaskBuffer has been materialized with "
            "conflicting data').",
            f"shard the rows over one axis (e.g. {{{rows[-1]!r}: Shard(0)}}) and replicate "
            "the weight over the others (FSDP2 shards it for data parallelism on its own).",
        )
    ]


def check_known_layouts(path: str, module: nn.Module, config: ShardingConfig) -> list[Finding]:
    """Findings for a module with a known layout trap (Hugging Face ``Conv1D``, an
    ``nn.Embedding`` whose rows are split over two axes)."""
    if _is_hf_conv1d(module):
        return _conv1d_findings(path, module, config)
    if isinstance(module, nn.Embedding):
        return _embedding_findings(path, config)
    return []
