"""Where Qwen3 dense's states and activations live: the shared decoder's placements.

Tensor (+ sequence) parallel and context parallel as
:mod:`hyper_parallel.models.common.sharding` writes them for a SwiGLU decoder; the
per-head ``q_norm`` / ``k_norm`` run on each rank's heads. With fewer key/value heads
than ``tp`` ranks, keys and values are computed whole on every rank and repeated per
query head (as for Qwen3-MoE). A tied output keeps the embedding's placement (both
``Shard(0)`` on ``tp``, replicated on ``cp``).
"""

from __future__ import annotations

from hyper_parallel.dmodule.types import MeshAxisName
from hyper_parallel.models.common.sharding import (
    context_parallel,
    swiglu_cp,
    swiglu_tp,
    tensor_parallel,
)
from hyper_parallel.models.qwen3.model import Transformer

__all__ = ["apply_cp", "apply_tp", "apply_tp_sp"]

Axis = MeshAxisName | str


def apply_tp(
    config: Transformer.Config, *, axis: Axis = MeshAxisName.TP, tp_size: int | None = None
) -> Transformer.Config:
    """Megatron tensor parallelism on ``axis``; ``tp_size`` must divide the query heads.

    Example:
        >>> model = apply_tp(preset_config("qwen3-debug"), tp_size=2).build()
    """
    return tensor_parallel(
        config, axis, tp_size, sequence_parallel=False, ffn=swiglu_tp, repeat_kv=True
    )


def apply_tp_sp(
    config: Transformer.Config, *, axis: Axis = MeshAxisName.TP, tp_size: int | None = None
) -> Transformer.Config:
    """As :func:`apply_tp`, with the residual stream sequence-parallel (``Shard(1)``)."""
    return tensor_parallel(
        config, axis, tp_size, sequence_parallel=True, ffn=swiglu_tp, repeat_kv=True
    )


def apply_cp(
    config: Transformer.Config, cp_size: int, axis: Axis = MeshAxisName.CP
) -> Transformer.Config:
    """Context parallelism on ``axis``: call the model with ``positions=`` (see
    :func:`~hyper_parallel.models.common.sharding.context_parallel`)."""
    return context_parallel(config, cp_size, axis, ffn=swiglu_cp)
