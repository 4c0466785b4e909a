"""Where the Llama decoder's states and activations live: sharding configs only.

:func:`apply_tp` and :func:`apply_tp_sp` return a copy of a ``Transformer.Config``
with a :class:`~hyper_parallel.dmodule.sharding.ShardingConfig` on every module that
needs one; ``model.parallelize(mesh)`` then applies them. The placements are the
shared decoder's (:mod:`hyper_parallel.models.common.sharding`: Megatron tensor
parallel, sequence parallel, context parallel) with the dense SwiGLU feed-forward;
the Llama splits whole key/value heads only (``tp`` must divide them).

The layouts compose: each writes placements for its own axis and joins the configs a
module already has, so ``apply_cp(apply_tp(config))`` and ``apply_tp(apply_cp(config))``
are the same (cp, tp) layout.
"""

from __future__ import annotations

from hyper_parallel.dmodule.types import MeshAxisName
from hyper_parallel.models.common.sharding import (
    context_parallel,
    swiglu_cp,
    swiglu_tp,
    tensor_parallel,
)
from hyper_parallel.models.llama.model import Transformer

__all__ = ["apply_cp", "apply_tp", "apply_tp_sp"]


def apply_tp(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.TP,
    tp_size: int | None = None,
) -> Transformer.Config:
    """Megatron tensor parallelism on mesh axis ``axis``; the residual stream is replicated.

    Args:
        config: The model config; it is not changed.
        axis: Name of the tensor-parallel mesh axis.
        tp_size: When given, checked to divide the head counts (a head is never split).

    Returns:
        A new config with sharding configs attached.

    Raises:
        ValueError: If ``tp_size`` does not divide the query or key/value head count.

    Example:
        >>> from hyper_parallel.models.llama import preset_config
        >>> model = apply_tp(preset_config("llama3-debug")).build()
        >>> # model.parallelize(mesh)  # a DeviceMesh with an axis named "tp"
    """
    return tensor_parallel(config, axis, tp_size, sequence_parallel=False, ffn=swiglu_tp)


def apply_tp_sp(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.TP,
    tp_size: int | None = None,
) -> Transformer.Config:
    """Tensor plus sequence parallelism: as :func:`apply_tp`, residual stream ``Shard(1)``.

    A sequence length the axis size does not divide gives uneven sequence shards,
    which stay correct (those boundaries run through DTensor rather than the fast path).

    Example:
        >>> from hyper_parallel.models.llama import preset_config
        >>> model = apply_tp_sp(preset_config("llama3-debug")).build()
    """
    return tensor_parallel(config, axis, tp_size, sequence_parallel=True, ffn=swiglu_tp)


def apply_cp(
    config: Transformer.Config,
    cp_size: int,
    axis: MeshAxisName | str = MeshAxisName.CP,
) -> Transformer.Config:
    """Context parallelism on mesh axis ``axis``: the sequence split over its ranks.

    Every activation is ``Shard(seq)`` on ``axis``; states are replicated on it; keys
    and values are all-gathered into each attention core, which computes this rank's
    query chunks against them block by block, without a mask
    (:func:`~hyper_parallel.models.common.sharding.context_parallel`). Combine with
    :func:`apply_tp` / :func:`apply_tp_sp` in either order and parallelize on the 2-D
    ``(cp, tp)`` mesh.

    The model must then be called as ``model(tokens, positions=positions)`` with each
    rank's part of the sequence, cut by
    :func:`~hyper_parallel.distributed.context_parallel.shard_sequence` (head-tail
    balanced) and its :func:`~hyper_parallel.distributed.context_parallel.positions`.
    Logits come back ``Shard(1)`` on ``axis`` in that order;
    :func:`~hyper_parallel.models.llama.cross_entropy_loss` gives the rank's share of the
    mean over the whole sequence (the ranks' mean is the one-device loss).

    Args:
        config: The model config; it is not changed.
        cp_size: The size of the ``axis`` mesh axis (checked; the placements do not
            depend on it).
        axis: Name of the context-parallel mesh axis.

    Raises:
        TypeError: ``config`` is not the Llama ``Transformer.Config``.
        ValueError: ``cp_size`` is not an integer >= 1, or the layout was already applied.

    Example:
        >>> from hyper_parallel.models.llama import apply_tp, preset_config
        >>> config = apply_cp(apply_tp(preset_config("llama3-debug"), tp_size=2), cp_size=2)
        >>> # config.build().parallelize(mesh.submesh(("cp", "tp")))
    """
    if not isinstance(config, Transformer.Config):
        raise TypeError(
            f"apply_cp: expected the Llama Transformer.Config, got {type(config).__name__}; "
            "context parallelism needs a model that takes global positions (this layout "
            "is for the reference Llama)."
        )
    return context_parallel(config, cp_size, axis, ffn=swiglu_cp)
