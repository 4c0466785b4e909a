"""Where the Qwen3-MoE decoder's states and activations live: sharding configs only.

Expert parallelism (:func:`apply_ep`): each ``GroupedExperts`` gets
:func:`~hyper_parallel.distributed.expert_parallel.expert_parallel` (``w1, w2, w3``
``Shard(0)`` on ``ep``, tokens dispatched to the rank holding their expert); a mesh
with an ``ep`` axis applies it on ``mesh["ep"]``.

Tensor parallelism (:func:`apply_tp`, :func:`apply_tp_sp`): the attention is the
Llama's Megatron layout (``wq, wk, wv`` column-parallel, ``wo`` row-parallel, the
attention core a ``local_map`` region on each rank's heads, embedding vocab-parallel,
logits sharded on the vocabulary; with fewer key/value heads than ranks, ``wk`` and
``wv`` are replicated and their heads repeated per query head). ``q_norm`` and
``k_norm`` normalize each head over ``head_dim``, so they run on head-sharded
activations unchanged (their replicated scale's gradient is ``Partial`` on ``tp`` and
reduced like any other).

The mixture of experts runs sequence-parallel: tensor-parallel ranks hold the same
tokens, so ``ffn_norm`` hands the block its ``Shard(seq)`` slice as a local tensor (a
local slice of a replicated residual stream: no communication; under SP the stream is
already split) and every rank routes only its slice. The router re-enters DTensor on
its tokens with a replicated weight, so its weight gradient is ``Partial`` on ``tp``
(reduced over the ranks whose tokens produced it); without expert parallelism the
experts are a ``local_map`` region with replicated weights and ``Partial`` gradients
the same way. The per-sequence balance statistics are sums over a rank's slice,
declared ``Partial`` and reduced to ``Replicate`` (one all-reduce of ``2 x batch x
num_experts`` values), so the balance loss equals one device's. The block's output
re-enters as ``Shard(seq)`` and goes back to the residual layout: an all-gather under
plain TP, nothing under SP.

With ``ep`` and ``tp`` together, ``ep`` borrows the ``tp`` ranks (the layout puts
``ep`` innermost): each rank dispatches its own slice of the sequence, so no token
is sent twice.

Context parallelism (:func:`apply_cp`): the attention is the Llama's context-parallel
layout (activations ``Shard(seq)`` on ``cp``, keys and values all-gathered into the
attention core computed by chunks, rotary tables read at global ``positions``). The
mixture of experts runs on each cp rank's own tokens exactly as on a tensor-parallel
rank's slice (so ``ep`` may borrow ``cp`` ranks too, each dispatching its own tokens);
the balance statistics are summed over ``cp`` as well, so every rank's balance loss
is the whole sequence's.
"""

from __future__ import annotations

import copy

from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.distributed.expert_parallel import expert_parallel
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.models.common.sharding import (
    Placements,
    context_parallel,
    put,
    tensor_parallel,
)
from hyper_parallel.models.qwen3_moe.model import (
    BalanceStatistics,
    Transformer,
    TransformerBlock,
)

__all__ = ["EXPERT_PARAMS", "apply_cp", "apply_ep", "apply_tp", "apply_tp_sp", "check_ep"]

EXPERT_PARAMS = ("w1", "w2", "w3")
"""The stacked weights of one layer's experts."""


def apply_ep(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.EP,
) -> Transformer.Config:
    """Expert parallelism on mesh axis ``axis``: each rank holds ``num_experts / ep`` experts.

    Composes with :func:`apply_tp` in either order: the experts leave the tensor-parallel
    block's replicated states and move to ``axis``.

    Args:
        config: The model config; it is not changed.
        axis: Name of the expert-parallel mesh axis.

    Returns:
        A new config with sharding configs on every ``layers.*.moe.experts``. Whether
        an ``ep`` size divides the experts is checked where the mesh is known:
        :func:`check_ep`, ``expert_parallel.ep_findings``, and ``parallelize`` itself.

    Example:
        >>> from hyper_parallel.models.qwen3_moe import preset_config
        >>> model = apply_ep(preset_config("qwen3-moe-debug")).build()
        >>> # model.parallelize(mesh["ep"])
    """
    new = copy.deepcopy(config)
    for layer in new.layers:
        # Replaces the tensor-parallel layout's replicated experts, if any.
        layer.moe.experts.sharding_config = expert_parallel(EXPERT_PARAMS, axis=axis)
    return new


def apply_tp(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.TP,
    tp_size: int | None = None,
) -> Transformer.Config:
    """Tensor parallelism on ``axis``: Megatron attention, sequence-parallel experts.

    The residual stream is replicated on ``axis``; see the module docstring for the
    layout of each part.

    Args:
        config: The model config; it is not changed.
        axis: Name of the tensor-parallel mesh axis.
        tp_size: When given, checked to divide the query heads (a head is never
            split); when it does not divide the key/value heads, keys and values are
            computed whole on every rank and repeated per query head.

    Returns:
        A new config with sharding configs attached.

    Raises:
        ValueError: If ``tp_size`` does not divide the query heads, or the config
            already places ``axis``.

    Example:
        >>> from hyper_parallel.models.qwen3_moe import preset_config
        >>> model = apply_tp(preset_config("qwen3-moe-debug")).build()
        >>> # model.parallelize(mesh)  # a DeviceMesh with an axis named "tp"
    """
    return tensor_parallel(
        config, axis, tp_size, sequence_parallel=False, ffn=_moe_placement, repeat_kv=True
    )


def apply_tp_sp(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.TP,
    tp_size: int | None = None,
) -> Transformer.Config:
    """Tensor plus sequence parallelism: as :func:`apply_tp`, residual stream ``Shard(1)``.

    The mixture of experts then needs no communication on ``axis`` at its boundary.

    Example:
        >>> from hyper_parallel.models.qwen3_moe import preset_config
        >>> model = apply_tp_sp(preset_config("qwen3-moe-debug")).build()
    """
    return tensor_parallel(
        config, axis, tp_size, sequence_parallel=True, ffn=_moe_placement, repeat_kv=True
    )


def _moe_placement(layer: TransformerBlock.Config, where: Placements, path: str) -> None:
    """The mixture of experts on this rank's slice of the sequence (see the module docstring).

    ``ffn_norm`` hands the block its slice as a local tensor (``Shard(seq)``, then
    ``use_local_output``: a local slice from a replicated stream, nothing under SP; in
    backward the slices' gradients are all-gathered). The router re-enters DTensor on
    its tokens (``Shard(0)``) with a replicated weight, so its weight gradient is
    ``Partial`` on ``axis``; the experts, when not dispatched over ``ep``, are a
    ``local_map`` region with replicated weights, whose gradients are declared
    ``Partial`` the same way. The balance statistics are declared ``Partial`` and
    reduced. The block's local output re-enters as ``Shard(seq)`` and goes back to the
    residual layout.
    """
    moe, axis, residual, seq = layer.moe, where.axis, where.residual, where.seq
    tokens: NamedPlacement = {axis: Shard(0)}
    replicated: NamedPlacement = {axis: Replicate()}
    put(
        layer.ffn_norm,
        ShardingConfig(
            state_shardings={"weight": replicated},
            in_dst_shardings={"x": residual},
            out_dst_shardings=seq,
            use_local_output=True,
        ),
        f"{path}.ffn_norm",
    )
    put(
        moe.router,
        ShardingConfig(
            state_shardings={"weight": replicated},
            in_src_shardings={"x": tokens},
            use_local_output=True,
        ),
        f"{path}.moe.router",
    )
    experts = moe.experts.sharding_config
    if experts is None or experts.dispatch is None:  # not dispatched over ep: replicated
        put(moe.experts, _replicated_experts(axis), f"{path}.moe.experts")
    if moe.balance is None:
        moe.balance = BalanceStatistics.Config(num_experts=moe.router.num_experts)
    put(
        moe.balance,
        ShardingConfig(
            out_src_shardings={axis: Partial()},
            out_dst_shardings=replicated,
            use_local_output=True,
        ),
        f"{path}.moe.balance",
    )
    put(
        moe,
        ShardingConfig(out_src_shardings=seq, out_dst_shardings=residual),
        f"{path}.moe",
    )


def _replicated_experts(axis: MeshAxisName | str) -> ShardingConfig:
    """Every expert on every ``axis`` rank, run on the rank's own tokens (``Shard(0)``)."""
    tokens: NamedPlacement = {axis: Shard(0)}
    return ShardingConfig(
        state_shardings={w: {axis: Replicate()} for w in EXPERT_PARAMS},
        in_src_shardings={"x": tokens, "top_k_index": tokens, "top_k_weights": tokens},
        out_src_shardings=tokens,
        use_local_output=True,
        local_map=LocalMapConfig(in_grad_placements=(tokens, tokens, tokens)),
    )


def apply_cp(
    config: Transformer.Config,
    cp_size: int,
    axis: MeshAxisName | str = MeshAxisName.CP,
) -> Transformer.Config:
    """Context parallelism on mesh axis ``axis``: the sequence split over its ranks.

    The attention is the Llama's layout
    (:func:`hyper_parallel.models.llama.apply_cp`): activations ``Shard(seq)``, states
    replicated, keys and values all-gathered into the attention core, which computes by
    chunks without a mask. The mixture of experts runs on the
    rank's own tokens (router and replicated experts with ``Partial`` weight gradients,
    or dispatched over ``ep``), and the per-sequence balance statistics are reduced over
    ``axis``, so each rank's balance loss equals one device's.

    Gradients follow the trainer's convention
    (:meth:`~hyper_parallel.train.Trainer.backward`): the rank's loss is the mean over
    its tokens, scaled by ``1 / cp_size`` before ``backward()``, and the ``cp``-partial
    gradients are summed. The balance loss, the whole sequence's on every rank, sends
    its gradient (``aux_loss_coef``, independent of that scaling) into the rank's own
    tokens' routing, and the ``cp`` sum completes it: exactly one device's gradient.
    Call the model as ``model(tokens, positions=positions)`` with the rank's part of
    each sequence (:func:`~hyper_parallel.distributed.context_parallel.shard_sequence`).

    Args:
        config: The model config; it is not changed.
        cp_size: The size of the ``axis`` mesh axis.
        axis: Name of the context-parallel mesh axis.

    Returns:
        A new config with the ``axis`` placements joined to any it already has.

    Raises:
        ValueError: ``cp_size`` is not an integer >= 1, or the layout was already applied.

    Example:
        >>> from hyper_parallel.models.qwen3_moe import preset_config
        >>> config = apply_cp(apply_ep(preset_config("qwen3-moe-debug")), cp_size=2)
        >>> # config.build().parallelize(mesh)  # axes "cp" and "ep"
    """
    return context_parallel(config, cp_size, axis, ffn=_moe_placement)


def check_ep(config: Transformer.Config, ep_size: int) -> None:
    """Raise if ``ep_size`` does not divide every layer's number of experts.

    Raises:
        ValueError: Naming the layer, the counts and the fix.
    """
    for i, layer in enumerate(config.layers):
        num_experts = layer.moe.experts.num_experts
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"layers.{i}.moe.experts: {num_experts} experts cannot be split over "
                f"ep={ep_size} ranks (each rank holds whole experts); use an ep size that "
                f"divides {num_experts}."
            )
