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

Context parallel (:func:`apply_cp`): every activation is sharded on the sequence dim
over ``cp`` (a head-tail split, see
:mod:`hyper_parallel.distributed.context_parallel`) and the states are replicated on
``cp``. The attention core is the one place that needs other tokens: its queries stay
local while keys and values are all-gathered over ``cp`` on the way in, and its
``in_grad_placements`` declare their gradients ``Partial`` on ``cp``, so backward
reduce-scatters them. The causal mask compares global positions: the model's root
gathers ``positions`` once per forward; the rotary tables read their local slice of
it (no communication), and the mask module builds, once per forward, the rows of this
rank's queries against every key (``Shard`` on the query dim), which every layer's
attention core takes as it is.

The layouts compose: each writes placements for its own axis and joins the configs a
module already has (:func:`~hyper_parallel.distributed.compose.merge_sharding_configs`),
so ``apply_cp(apply_tp(config))`` and ``apply_tp(apply_cp(config))`` are the same
(cp, tp) layout.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.distributed.compose import ComposeError, merge_sharding_configs
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.models.llama.model import Linear, Transformer

__all__ = ["apply_cp", "apply_tp", "apply_tp_sp", "attention_heads"]

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
    _check_not_applied(config, axis, "apply_tp_sp" if sequence_parallel else "apply_tp")
    _put(
        new.tok_embeddings,
        ShardingConfig(
            state_shardings={"weight": {axis: Shard(0)}},
            in_dst_shardings={"input": replicated},
            out_dst_shardings=residual,
        ),
        "tok_embeddings",
    )
    _put(new.rope, ShardingConfig(state_shardings={"cos": replicated, "sin": replicated}), "rope")
    for i, layer in enumerate(new.layers):
        p = f"layers.{i}"
        attention, ffn = layer.attention, layer.feed_forward
        _put(layer.attention_norm, _norm(residual, replicated, hand_off), f"{p}.attention_norm")
        _put(layer.ffn_norm, _norm(residual, replicated, hand_off), f"{p}.ffn_norm")
        # Each block gathers its input once, for all its column projections.
        for name, block in (("attention", attention), ("feed_forward", ffn)):
            _put(
                block,
                ShardingConfig(in_src_shardings=entry, in_dst_shardings={"x": replicated}),
                f"{p}.{name}",
            )
        for name, linear in (
            ("attention.wq", attention.wq),
            ("attention.wk", attention.wk),
            ("attention.wv", attention.wv),
            ("feed_forward.w1", ffn.w1),
            ("feed_forward.w3", ffn.w3),
        ):
            _put(linear, _colwise(linear, axis), f"{p}.{name}")
        for name, linear in (("attention.wo", attention.wo), ("feed_forward.w2", ffn.w2)):
            _put(linear, _rowwise(axis, residual), f"{p}.{name}")
        heads: NamedPlacement = {axis: Shard(_HEADS_DIM)}
        _put(
            attention.inner_attention,
            ShardingConfig(
                in_dst_shardings={"q": heads, "k": heads, "v": heads},
                out_src_shardings=heads,
                local_map=LocalMapConfig(in_grad_placements=(heads, heads, heads)),
            ),
            f"{p}.attention.inner_attention",
        )
    _put(new.norm, _norm(residual, replicated, hand_off), "norm")
    _put(new.output, _colwise(new.output, axis, in_src={"input": residual}), "output")
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


def apply_cp(
    config: Transformer.Config,
    cp_size: int,
    axis: MeshAxisName | str = MeshAxisName.CP,
) -> Transformer.Config:
    """Context parallelism on mesh axis ``axis``: the sequence split over its ranks.

    Every activation is ``Shard(seq)`` on ``axis``; states are replicated on it. In each
    attention block the queries stay local and the keys and values are all-gathered on
    the way into the attention core (a ``local_map`` region) — ``2 x num_layers``
    all-gathers per forward, and their gradients reduce-scattered in backward (declared
    ``Partial`` by ``in_grad_placements``). Positions are gathered once per forward for
    the causal mask, which is built once (this rank's query rows) and shared by every
    layer. Combine with :func:`apply_tp` / :func:`apply_tp_sp` in either order
    and parallelize on the 2-D ``(cp, tp)`` mesh.

    The model must then be called as ``model(tokens, positions=positions)`` with each
    rank's part of the sequence, cut by
    :func:`~hyper_parallel.distributed.context_parallel.shard_sequence` (head-tail
    balanced) and its :func:`~hyper_parallel.distributed.context_parallel.positions`.
    Logits come back ``Shard(1)`` on ``axis`` in that order;
    :func:`~hyper_parallel.models.llama.cross_entropy_loss` gives the mean over the
    rank's tokens (average it over ``cp``, as FSDP2 over ``dp_shard x cp`` does with
    the gradients, for the global mean).

    Args:
        config: The model config; it is not changed.
        cp_size: The size of the ``axis`` mesh axis (checked; the placements do not
            depend on it). Sequence lengths are checked per batch by
            :func:`~hyper_parallel.distributed.context_parallel.cp_findings` and
            :func:`~hyper_parallel.distributed.context_parallel.shard_sequence`.
        axis: Name of the context-parallel mesh axis.

    Returns:
        A new config with the ``axis`` placements joined to any it already has.

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
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(
            f"apply_cp: cp_size={cp_size!r}; it must be an integer >= 1 (the size of the "
            f"{_axis_name(axis)!r} mesh axis)."
        )
    _check_not_applied(config, axis, "apply_cp")
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    replicated: NamedPlacement = {axis: Replicate()}
    activation = {"x": seq}
    new = copy.deepcopy(config)
    _cp_model_inputs(new, axis)
    for i, layer in enumerate(new.layers):
        p = f"layers.{i}"
        attention, ffn = layer.attention, layer.feed_forward
        for name, norm in (("attention_norm", layer.attention_norm), ("ffn_norm", layer.ffn_norm)):
            _put(norm, _cp_norm(seq, replicated), f"{p}.{name}")
        for name, block in (("attention", attention), ("feed_forward", ffn)):
            _put(block, ShardingConfig(in_dst_shardings=activation), f"{p}.{name}")
        for name, linear in (
            ("attention.wq", attention.wq),
            ("attention.wk", attention.wk),
            ("attention.wv", attention.wv),
            ("attention.wo", attention.wo),
            ("feed_forward.w1", ffn.w1),
            ("feed_forward.w2", ffn.w2),
            ("feed_forward.w3", ffn.w3),
        ):
            _put(linear, _cp_linear(linear, seq, replicated), f"{p}.{name}")
        _cp_attention_core(attention.inner_attention, axis, f"{p}.attention.inner_attention")
    _put(new.norm, _cp_norm(seq, replicated), "norm")
    _put(new.output, _cp_linear(new.output, seq, replicated), "output")
    return new


def _cp_model_inputs(new: Module.Config, axis: MeshAxisName | str) -> None:
    """The context-parallel entry of a decoder with the Llama's top level (shared with the
    Qwen3-MoE): positions in as this rank's slice and gathered, the embedding's output
    sequence-sharded, the rotary tables indexed by local positions, and the one causal
    mask whose rows are this rank's queries (local positions), its columns every key."""
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    replicated: NamedPlacement = {axis: Replicate()}
    local_positions: NamedPlacement = {axis: Shard(-1)}  # positions are [S] or [B, S]
    _put(
        new,
        ShardingConfig(
            in_src_shardings={"positions": local_positions},
            in_dst_shardings={"positions": replicated},
        ),
        "",
    )
    _put(
        new.tok_embeddings,
        ShardingConfig(
            state_shardings={"weight": replicated},
            in_dst_shardings={"input": seq},
            out_dst_shardings=seq,
        ),
        "tok_embeddings",
    )
    _put(
        new.rope,
        ShardingConfig(
            state_shardings={"cos": replicated, "sin": replicated},
            in_dst_shardings={"positions": local_positions},
        ),
        "rope",
    )
    _put(
        new.mask,
        ShardingConfig(
            in_dst_shardings={"q_positions": local_positions, "kv_positions": replicated},
            out_src_shardings=_cp_mask_rows(axis),
            local_map=LocalMapConfig(in_grad_placements=(local_positions, replicated)),
        ),
        "mask",
    )


def _cp_mask_rows(axis: MeshAxisName | str) -> NamedPlacement:
    return {axis: Shard(-2)}


def _cp_attention_core(inner: Module.Config, axis: MeshAxisName | str, path: str) -> None:
    """The attention core under cp: this rank's queries against every key and value
    (k and v gathered on ``axis``; their gradients leave as partial sums)."""
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    gathered: NamedPlacement = {axis: Replicate()}
    partial: NamedPlacement = {axis: Partial()}
    mask_rows = _cp_mask_rows(axis)
    _put(
        inner,
        ShardingConfig(
            in_src_shardings={"k": seq, "v": seq},
            in_dst_shardings={"q": seq, "k": gathered, "v": gathered, "mask": mask_rows},
            out_src_shardings=seq,
            local_map=LocalMapConfig(in_grad_placements=(seq, partial, partial, mask_rows)),
        ),
        path,
    )


def _cp_linear(
    linear: Linear.Config, seq: NamedPlacement, replicated: NamedPlacement
) -> ShardingConfig:
    states = {"weight": replicated}
    if linear.bias:
        states["bias"] = replicated
    return ShardingConfig(
        state_shardings=states, in_dst_shardings={"input": seq}, out_dst_shardings=seq
    )


def _cp_norm(seq: NamedPlacement, replicated: NamedPlacement) -> ShardingConfig:
    # Token-wise: runs on each rank's tokens; the weight's gradient is a partial sum
    # over the rank's tokens (Partial on cp), reduced where it is consumed.
    return ShardingConfig(state_shardings={"weight": replicated}, in_dst_shardings={"x": seq})


def _axis_name(axis: MeshAxisName | str) -> str:
    return str(getattr(axis, "value", axis))


def _put(node: Module.Config, config: ShardingConfig, path: str) -> None:
    """Join ``config`` to the sharding config ``node`` already carries (another axis')."""
    owner: Any = type(node).__dict__.get("_owner") or getattr(type(node), "_owner", None)
    order = list(inspect.signature(owner.forward).parameters)[1:] if owner is not None else []
    try:
        node.sharding_config = merge_sharding_configs(
            node.sharding_config, config, input_order=order, where=path or "<root>"
        )
    except ComposeError as e:
        raise ValueError(str(e)) from None


def _placed_axes(config: Transformer.Config) -> set[str]:
    existing = config.tok_embeddings.sharding_config
    if existing is None:
        return set()
    return {_axis_name(k) for k in existing.state_shardings.get("weight", {})}


def _check_not_applied(config: Transformer.Config, axis: MeshAxisName | str, fn: str) -> None:
    name = _axis_name(axis)
    if name in _placed_axes(config):
        raise ValueError(
            f"{fn}: the config already places axis {name!r} (a layout for it was applied); "
            "apply each axis' layout once, to a config without it (e.g. "
            f"apply_cp(apply_tp(preset_config(...)))), and give different axes different "
            "names."
        )


def attention_heads(config: Any) -> list[tuple[str, int, int]]:
    """``(path, query heads, key/value heads)`` of each attention of a decoder config.

    An attention that repeats its key/value heads per query head before the core
    (``repeat_kv``, e.g. Qwen3-MoE's tensor-parallel layout with fewer key/value heads
    than ranks) counts as having as many key/value heads as query heads.

    Example:
        >>> from hyper_parallel.models.llama import preset_config
        >>> attention_heads(preset_config("llama3-debug"))[0]
        ('layers.0.attention', 8, 4)
    """
    out = []
    for i, layer in enumerate(config.layers):
        attention = layer.attention
        num_heads = attention.wq.out_features // attention.head_dim
        repeated = getattr(attention, "repeat_kv", False)
        num_kv_heads = num_heads if repeated else attention.wk.out_features // attention.head_dim
        out.append((f"layers.{i}.attention", num_heads, num_kv_heads))
    return out
