"""Where the Llama decoder's states and activations live: sharding configs only.

:func:`apply_tp` and :func:`apply_tp_sp` return a copy of a ``Transformer.Config``
with a :class:`~hyper_parallel.dmodule.sharding.ShardingConfig` on every module that
needs one; ``model.parallelize(mesh)`` then applies them.

Tensor parallel (Megatron-LM, Shoeybi et al., 2019): ``wq, wk, wv, w1, w3`` and the
output projection are column-parallel (weight ``Shard(0)``, replicated input,
output sharded on its last dim); ``wo`` and ``w2`` are row-parallel (weight
``Shard(1)``, their partial sums reduced at the output); the embedding is
vocab-parallel (weight ``Shard(0)``; DTensor masks ids outside a rank's rows and
the partial lookups are reduced). Logits stay sharded on the vocabulary:
:func:`~hyper_parallel.models.llama.loss.cross_entropy_loss` works on the shards.
The attention core runs as a ``local_map`` region on each rank's heads.

Sequence parallel (Korthikanti et al., 2022) adds: the residual stream and the
norms are sharded on the sequence dim; each attention and feed-forward block
all-gathers its input once and reduce-scatters its output.
"""

from __future__ import annotations

import copy

from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.models.llama.model import Linear, Transformer

__all__ = ["apply_tp", "apply_tp_sp"]

# Activation layouts inside an attention block: (batch, seq, heads, head_dim).
_HEADS_DIM = 2
_SEQ_DIM = 1


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
    return _tensor_parallel(config, axis, tp_size, sequence_parallel=False)


def apply_tp_sp(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.TP,
    tp_size: int | None = None,
) -> Transformer.Config:
    """Tensor plus sequence parallelism: as :func:`apply_tp`, residual stream ``Shard(1)``.

    A sequence length the axis size does not divide gives uneven sequence shards,
    which stay correct (those boundaries run through DTensor rather than the fast path).

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
        >>> model = apply_tp_sp(preset_config("llama3-debug")).build()
    """
    return _tensor_parallel(config, axis, tp_size, sequence_parallel=True)


def _tensor_parallel(
    config: Transformer.Config,
    axis: MeshAxisName | str,
    tp_size: int | None,
    *,
    sequence_parallel: bool,
) -> Transformer.Config:
    if tp_size is not None:
        _check_heads(config, tp_size)
    replicated: NamedPlacement = {axis: Replicate()}
    # Layout of the residual stream between blocks.
    residual: NamedPlacement = {axis: Shard(_SEQ_DIM)} if sequence_parallel else replicated
    # How a normalized activation enters the next column projection(s); see `_norm`.
    hand_off = not sequence_parallel
    # Blocks declare the layout their input arrives in; under SP that makes the
    # Shard(seq) -> Replicate all-gather a declared redistribution, not an implicit one.
    entry: dict[str, NamedPlacement] = {"x": residual}
    new = copy.deepcopy(config)
    new.tok_embeddings.sharding_config = ShardingConfig(
        state_shardings={"weight": {axis: Shard(0)}},
        in_dst_shardings={"input": replicated},
        out_dst_shardings=residual,
    )
    new.rope.sharding_config = ShardingConfig(
        state_shardings={"cos": replicated, "sin": replicated}
    )
    for layer in new.layers:
        attention, ffn = layer.attention, layer.feed_forward
        layer.attention_norm.sharding_config = _norm(residual, replicated, hand_off)
        layer.ffn_norm.sharding_config = _norm(residual, replicated, hand_off)
        # Each block gathers its input once, for all its column projections.
        for block in (attention, ffn):
            block.sharding_config = ShardingConfig(
                in_src_shardings=entry, in_dst_shardings={"x": replicated}
            )
        for linear in (attention.wq, attention.wk, attention.wv, ffn.w1, ffn.w3):
            linear.sharding_config = _colwise(linear, axis)
        for linear in (attention.wo, ffn.w2):
            linear.sharding_config = _rowwise(axis, residual)
        heads: NamedPlacement = {axis: Shard(_HEADS_DIM)}
        attention.inner_attention.sharding_config = ShardingConfig(
            in_dst_shardings={"q": heads, "k": heads, "v": heads},
            out_src_shardings=heads,
            local_map=LocalMapConfig(in_grad_placements=(heads, heads, heads)),
        )
    new.norm.sharding_config = _norm(residual, replicated, hand_off)
    new.output.sharding_config = _colwise(new.output, axis, in_src={"input": residual})
    return new


def _colwise(
    linear: Linear.Config,
    axis: MeshAxisName | str,
    in_src: dict[str, NamedPlacement] | None = None,
) -> ShardingConfig:
    states: dict[str, NamedPlacement] = {"weight": {axis: Shard(0)}}
    if linear.bias:
        states["bias"] = {axis: Shard(0)}
    return ShardingConfig(
        state_shardings=states,
        in_src_shardings=in_src,
        in_dst_shardings={"input": {axis: Replicate()}},
        out_dst_shardings={axis: Shard(-1)},
    )


def _rowwise(axis: MeshAxisName | str, output: NamedPlacement) -> ShardingConfig:
    # The matmul of Shard(-1) input by Shard(1) weight is Partial: reduced into `output`
    # (all-reduce to Replicate, or reduce-scatter to Shard(seq)).
    return ShardingConfig(
        state_shardings={"weight": {axis: Shard(1)}},
        in_dst_shardings={"input": {axis: Shard(-1)}},
        out_dst_shardings=output,
    )


def _norm(residual: NamedPlacement, replicated: NamedPlacement, hand_off: bool) -> ShardingConfig:
    """An RMSNorm on the residual stream; with ``hand_off`` its output leaves as a local tensor.

    The column projections after a norm sum partial input gradients, which must be
    reduced once before the norm's backward (Megatron's "f" operator). Under
    sequence parallelism the consumer's ``Shard(seq) -> Replicate`` redistribution
    does it (forward all-gather, backward reduce-scatter). Under plain TP the
    forward has nothing to redistribute, and DTensor reduces a gradient only where
    the forward redistributed or entered DTensor; so the norm hands over a local
    tensor and the consumer re-enters it with ``in_src`` (``DTensor.from_local``),
    whose backward returns the gradient replicated: one all-reduce. Staying in
    DTensor, the Partial gradient would flow on through the norm and the residual
    stream and be reduced later, several times, in worse places.
    """
    return ShardingConfig(
        state_shardings={"weight": replicated},
        in_dst_shardings={"x": residual},
        use_local_output=hand_off,
    )


def _check_heads(config: Transformer.Config, tp_size: int) -> None:
    for i, layer in enumerate(config.layers):
        attention = layer.attention
        for kind, proj in (("query", attention.wq), ("key/value", attention.wk)):
            num_heads = proj.out_features // attention.head_dim
            if num_heads % tp_size:
                raise ValueError(
                    f"layers.{i}.attention: {num_heads} {kind} heads cannot be split over "
                    f"tp_size={tp_size} ranks (each rank holds whole heads); use a tp size "
                    f"that divides {num_heads}, or more heads."
                )
