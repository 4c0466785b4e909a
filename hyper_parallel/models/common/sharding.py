"""Where a decoder's states and activations live: the placements every family shares.

:func:`tensor_parallel` and :func:`context_parallel` return a copy of a
:class:`~hyper_parallel.models.common.decoder.Decoder` config with a
:class:`~hyper_parallel.dmodule.sharding.ShardingConfig` on every module that needs
one; the family says how its feed-forward is placed (``ffn``) and ``model.parallelize(mesh)``
applies them.

Tensor parallel (Megatron-LM, Shoeybi et al., 2019): ``wq, wk, wv, w1, w3`` and the
output projection are column-parallel (weight ``Shard(0)``, replicated input,
output sharded on its last dim); ``wo`` and ``w2`` are row-parallel (weight
``Shard(1)``, their partial sums reduced at the output); the embedding is
vocab-parallel (weight ``Shard(0)``; DTensor masks ids outside a rank's rows and
the partial lookups are reduced). Logits stay sharded on the vocabulary:
:func:`~hyper_parallel.models.common.loss.cross_entropy_loss` works on the shards.
The attention core runs as a ``local_map`` region on each rank's heads. With fewer
key/value heads than ranks (where the family allows it) ``wk`` and ``wv`` are
replicated and their heads repeated per query head. Qwen3's ``q_norm`` and ``k_norm``
normalize each head over ``head_dim``, so they run on head-sharded activations
unchanged (their replicated scale's gradient is ``Partial`` on ``tp``).

Sequence parallel (Korthikanti et al., 2022) adds: the residual stream and the
norms are sharded on the sequence dim; each attention and feed-forward block
all-gathers its input once and reduce-scatters its output.

Context parallel: every activation is sharded on the sequence dim over ``cp`` (a
head-tail split, see :mod:`hyper_parallel.distributed.context_parallel`) and the
states are replicated on ``cp``. The attention core is the one place that needs other
tokens: its queries stay local while keys and values are all-gathered over ``cp`` on
the way in, and its ``in_grad_placements`` declare their gradients ``Partial`` on
``cp``, so backward reduce-scatters them. No mask: the model's root takes ``positions``
as this rank's slice (``Shard`` on ``cp``, no communication); the rotary tables read
them, and the mask module, seeing positions sharded over ``cp``, hands every layer the
chunks of the sequence this rank's queries and the gathered keys hold, which the
attention core computes block by block (causal diagonal, full earlier blocks, merged
by log-sum-exp; :mod:`~hyper_parallel.models.common.chunked_attention`).

The layouts compose: each writes placements for its own axis and joins the configs a
module already has (:func:`~hyper_parallel.distributed.compose.merge_sharding_configs`),
so ``cp(tp(config))`` and ``tp(cp(config))`` are the same (cp, tp) layout.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.distributed.compose import ComposeError, merge_sharding_configs
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.models.common.layers import Linear

__all__ = [
    "Placements",
    "attention_heads",
    "colwise",
    "context_parallel",
    "cp_linear",
    "cp_norm",
    "put",
    "rowwise",
    "swiglu_cp",
    "swiglu_tp",
    "tensor_parallel",
    "tp_norm",
]

# Activation layouts inside an attention block: (batch, seq, heads, head_dim).
_HEADS_DIM = 2
_SEQ_DIM = 1

Axis = MeshAxisName | str


@dataclass(frozen=True, slots=True)
class Placements:
    """The layouts one axis' sharding uses, handed to a family's feed-forward placement.

    Attributes:
        axis: The mesh axis.
        residual: The residual stream between blocks (``Replicate``; ``Shard(seq)``
            under sequence or context parallelism).
        replicated: ``{axis: Replicate()}``.
        seq: ``{axis: Shard(seq)}``.
        hand_off: Norms hand their output on as local tensors (plain tensor parallel,
            see :func:`tp_norm`).
    """

    axis: Axis
    residual: NamedPlacement
    replicated: NamedPlacement
    seq: NamedPlacement
    hand_off: bool = False


FfnPlacement = Callable[[Any, Placements, str], None]
"""``(block config, placements, block path) -> None``: places a block's ``ffn_norm``
and feed-forward in place (with :func:`put`)."""


def tensor_parallel(
    config: Any,
    axis: Axis,
    tp_size: int | None,
    *,
    sequence_parallel: bool,
    ffn: FfnPlacement,
    repeat_kv: bool = False,
) -> Any:
    """Megatron tensor parallelism (plus sequence parallelism) of a decoder config.

    Args:
        config: The model config; it is not changed.
        axis: The tensor-parallel mesh axis.
        tp_size: When given, checked to divide the head counts (a head is never split).
        sequence_parallel: The residual stream ``Shard(seq)`` instead of replicated.
        ffn: How the family places each block's feed-forward.
        repeat_kv: Allow fewer key/value heads than ``tp_size`` (keys and values then
            computed whole on every rank and repeated per query head, as Megatron-LM
            does); otherwise ``tp_size`` must divide them.

    Raises:
        ValueError: ``tp_size`` does not divide the heads, or ``axis`` is already placed.
    """
    split_kv = tp_size is None or _check_heads(config, tp_size, repeat_kv)
    _check_not_applied(config, axis, "apply_tp_sp" if sequence_parallel else "apply_tp")
    replicated: NamedPlacement = {axis: Replicate()}
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    residual = seq if sequence_parallel else replicated
    hand_off = not sequence_parallel
    where = Placements(axis, residual, replicated, seq, hand_off)
    new = copy.deepcopy(config)
    put(
        new.tok_embeddings,
        ShardingConfig(
            state_shardings={"weight": {axis: Shard(0)}},
            in_dst_shardings={"input": replicated},
            out_dst_shardings=residual,
        ),
        "tok_embeddings",
    )
    put(new.rope, ShardingConfig(state_shardings={"cos": replicated, "sin": replicated}), "rope")
    for i, layer in enumerate(new.layers):
        p = f"layers.{i}"
        put(layer.attention_norm, tp_norm(where), f"{p}.attention_norm")
        _attention_tp(layer.attention, where, split_kv, f"{p}.attention")
        ffn(layer, where, p)
    put(new.norm, tp_norm(where), "norm")
    put(new.output, colwise(new.output, axis, in_src={"input": residual}), "output")
    return new


def _attention_tp(attention: Any, where: Placements, split_kv: bool, path: str) -> None:
    axis, replicated = where.axis, where.replicated
    # Each block gathers its input once, for all its column projections; under SP that
    # makes the Shard(seq) -> Replicate all-gather a declared redistribution.
    put(
        attention,
        ShardingConfig(in_src_shardings={"x": where.residual}, in_dst_shardings={"x": replicated}),
        path,
    )
    put(attention.wq, colwise(attention.wq, axis), f"{path}.wq")
    for name in ("wk", "wv"):
        linear = getattr(attention, name)
        kv = colwise(linear, axis) if split_kv else _replicated_linear(axis)
        put(linear, kv, f"{path}.{name}")
    attention.repeat_kv = attention.repeat_kv or not split_kv
    put(attention.wo, rowwise(axis, where.residual), f"{path}.wo")
    heads: NamedPlacement = {axis: Shard(_HEADS_DIM)}
    if attention.q_norm is not None:
        # Per head, so each runs on this rank's heads (keys replicated when not split).
        for name, layout in (("q_norm", heads), ("k_norm", heads if split_kv else replicated)):
            put(
                getattr(attention, name),
                ShardingConfig(
                    state_shardings={"weight": replicated}, in_dst_shardings={"x": layout}
                ),
                f"{path}.{name}",
            )
    put(
        attention.inner_attention,
        ShardingConfig(
            in_dst_shardings={"q": heads, "k": heads, "v": heads},
            out_src_shardings=heads,
            local_map=LocalMapConfig(in_grad_placements=(heads, heads, heads)),
        ),
        f"{path}.inner_attention",
    )


def swiglu_tp(layer: Any, where: Placements, path: str) -> None:
    """A dense SwiGLU block under tensor parallelism: ``w1``, ``w3`` column-, ``w2``
    row-parallel, the block gathering its input once (an :data:`FfnPlacement`)."""
    ffn = layer.feed_forward
    put(layer.ffn_norm, tp_norm(where), f"{path}.ffn_norm")
    put(
        ffn,
        ShardingConfig(
            in_src_shardings={"x": where.residual}, in_dst_shardings={"x": where.replicated}
        ),
        f"{path}.feed_forward",
    )
    for name in ("w1", "w3"):
        put(
            getattr(ffn, name),
            colwise(getattr(ffn, name), where.axis),
            f"{path}.feed_forward.{name}",
        )
    put(ffn.w2, rowwise(where.axis, where.residual), f"{path}.feed_forward.w2")


def swiglu_cp(layer: Any, where: Placements, path: str) -> None:
    """A dense SwiGLU block under context parallelism: token-wise on each rank's tokens
    (an :data:`FfnPlacement`)."""
    ffn = layer.feed_forward
    put(layer.ffn_norm, cp_norm(where), f"{path}.ffn_norm")
    put(ffn, ShardingConfig(in_dst_shardings={"x": where.seq}), f"{path}.feed_forward")
    for name in ("w1", "w2", "w3"):
        put(getattr(ffn, name), cp_linear(getattr(ffn, name), where), f"{path}.feed_forward.{name}")


def colwise(
    linear: Linear.Config, axis: Axis, in_src: dict[str, NamedPlacement] | None = None
) -> ShardingConfig:
    """A column-parallel projection: weight ``Shard(0)``, input replicated, output
    sharded on its last dim."""
    states: dict[str, NamedPlacement] = {"weight": {axis: Shard(0)}}
    if linear.bias:
        states["bias"] = {axis: Shard(0)}
    return ShardingConfig(
        state_shardings=states,
        in_src_shardings=in_src,
        in_dst_shardings={"input": {axis: Replicate()}},
        out_dst_shardings={axis: Shard(-1)},
    )


def rowwise(axis: Axis, output: NamedPlacement) -> ShardingConfig:
    """A row-parallel projection whose partial sums are reduced into ``output``."""
    # The matmul of Shard(-1) input by Shard(1) weight is Partial: reduced into `output`
    # (all-reduce to Replicate, or reduce-scatter to Shard(seq)).
    return ShardingConfig(
        state_shardings={"weight": {axis: Shard(1)}},
        in_dst_shardings={"input": {axis: Shard(-1)}},
        out_dst_shardings=output,
    )


def tp_norm(where: Placements) -> ShardingConfig:
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
        state_shardings={"weight": where.replicated},
        in_dst_shardings={"x": where.residual},
        use_local_output=where.hand_off,
    )


def _replicated_linear(axis: Axis) -> ShardingConfig:
    """A projection every ``axis`` rank computes whole (key/value heads fewer than ranks)."""
    replicated: NamedPlacement = {axis: Replicate()}
    return ShardingConfig(
        state_shardings={"weight": replicated},
        in_dst_shardings={"input": replicated},
        out_dst_shardings=replicated,
    )


def _check_heads(config: Any, tp_size: int, repeat_kv: bool) -> bool:
    """Raise unless ``tp_size`` divides the query heads (and, without ``repeat_kv``, the
    key/value heads); return whether it divides the key/value heads."""
    split_kv = True
    for i, layer in enumerate(config.layers):
        attention = layer.attention
        kinds = [("query", attention.wq)] + ([] if repeat_kv else [("key/value", attention.wk)])
        for kind, proj in kinds:
            num_heads = proj.out_features // attention.head_dim
            if num_heads % tp_size:
                raise ValueError(
                    f"layers.{i}.attention: {num_heads} {kind} heads cannot be split over "
                    f"tp_size={tp_size} ranks (each rank holds whole heads); use a tp size "
                    f"that divides {num_heads}, or more heads."
                )
        split_kv = split_kv and (attention.wk.out_features // attention.head_dim) % tp_size == 0
    return split_kv


def context_parallel(config: Any, cp_size: int, axis: Axis, *, ffn: FfnPlacement) -> Any:
    """Context parallelism of a decoder config on mesh axis ``axis``.

    Every activation is ``Shard(seq)`` on ``axis``; states are replicated on it. In each
    attention block the queries stay local and the keys and values are all-gathered on
    the way into the attention core (a ``local_map`` region) — ``2 x num_layers``
    all-gathers per forward, and their gradients reduce-scattered in backward (declared
    ``Partial`` by ``in_grad_placements``). The attention core computes this rank's
    query chunks against the key chunks block by block, without a mask. The model must
    then be called as ``model(tokens, positions=positions)``.

    Raises:
        ValueError: ``cp_size`` is not an integer >= 1, or the layout was already applied.
    """
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(
            f"apply_cp: cp_size={cp_size!r}; it must be an integer >= 1 (the size of the "
            f"{_axis_name(axis)!r} mesh axis)."
        )
    _check_not_applied(config, axis, "apply_cp")
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    where = Placements(axis, seq, {axis: Replicate()}, seq)
    new = copy.deepcopy(config)
    _cp_model_inputs(new, axis)
    for i, layer in enumerate(new.layers):
        p = f"layers.{i}"
        attention = layer.attention
        put(layer.attention_norm, cp_norm(where), f"{p}.attention_norm")
        put(attention, ShardingConfig(in_dst_shardings={"x": seq}), f"{p}.attention")
        for name in ("wq", "wk", "wv", "wo"):
            put(
                getattr(attention, name),
                cp_linear(getattr(attention, name), where),
                f"{p}.attention.{name}",
            )
        if attention.q_norm is not None:
            for name in ("q_norm", "k_norm"):
                put(getattr(attention, name), cp_norm(where), f"{p}.attention.{name}")
        _cp_attention_core(attention.inner_attention, axis, f"{p}.attention.inner_attention")
        ffn(layer, where, p)
    put(new.norm, cp_norm(where), "norm")
    put(new.output, cp_linear(new.output, where), "output")
    return new


def _cp_model_inputs(new: Module.Config, axis: Axis) -> None:
    """The context-parallel entry of a decoder: positions in as this rank's slice (never
    gathered), the embedding's output sequence-sharded, the rotary tables indexed by
    local positions. The mask module needs no placement: it reads the split from the
    positions' placement."""
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    replicated: NamedPlacement = {axis: Replicate()}
    local_positions: NamedPlacement = {axis: Shard(-1)}  # positions are [S] or [B, S]
    put(new, ShardingConfig(in_src_shardings={"positions": local_positions}), "")
    put(
        new.tok_embeddings,
        ShardingConfig(
            state_shardings={"weight": replicated},
            in_dst_shardings={"input": seq},
            out_dst_shardings=seq,
        ),
        "tok_embeddings",
    )
    put(
        new.rope,
        ShardingConfig(
            state_shardings={"cos": replicated, "sin": replicated},
            in_dst_shardings={"positions": local_positions},
        ),
        "rope",
    )


def _cp_attention_core(inner: Module.Config, axis: Axis, path: str) -> None:
    """The attention core under cp: this rank's queries against every key and value
    (k and v gathered on ``axis``; their gradients leave as partial sums). The chunks
    (``mask``) are not a tensor and pass into the region as they are."""
    seq: NamedPlacement = {axis: Shard(_SEQ_DIM)}
    gathered: NamedPlacement = {axis: Replicate()}
    partial: NamedPlacement = {axis: Partial()}
    put(
        inner,
        ShardingConfig(
            in_src_shardings={"k": seq, "v": seq},
            in_dst_shardings={"q": seq, "k": gathered, "v": gathered},
            out_src_shardings=seq,
            local_map=LocalMapConfig(in_grad_placements=(seq, partial, partial)),
        ),
        path,
    )


def cp_linear(linear: Linear.Config, where: Placements) -> ShardingConfig:
    """A projection under cp: token-wise on the rank's tokens, states replicated."""
    states = {"weight": where.replicated}
    if linear.bias:
        states["bias"] = where.replicated
    return ShardingConfig(
        state_shardings=states, in_dst_shardings={"input": where.seq}, out_dst_shardings=where.seq
    )


def cp_norm(where: Placements) -> ShardingConfig:
    """A norm under cp: token-wise on the rank's tokens."""
    # The weight's gradient is a partial sum over the rank's tokens (Partial on cp),
    # reduced where it is consumed.
    return ShardingConfig(
        state_shardings={"weight": where.replicated}, in_dst_shardings={"x": where.seq}
    )


def _axis_name(axis: Axis) -> str:
    return str(getattr(axis, "value", axis))


def put(node: Module.Config, config: ShardingConfig, path: str) -> None:
    """Join ``config`` to the sharding config ``node`` already carries (another axis')."""
    owner: Any = type(node).__dict__.get("_owner") or getattr(type(node), "_owner", None)
    order = list(inspect.signature(owner.forward).parameters)[1:] if owner is not None else []
    try:
        node.sharding_config = merge_sharding_configs(
            node.sharding_config, config, input_order=order, where=path or "<root>"
        )
    except ComposeError as e:
        raise ValueError(str(e)) from None


def _check_not_applied(config: Any, axis: Axis, fn: str) -> None:
    name = _axis_name(axis)
    existing = config.tok_embeddings.sharding_config
    placed = (
        set()
        if existing is None
        else {_axis_name(k) for k in existing.state_shardings.get("weight", {})}
    )
    if name in placed:
        raise ValueError(
            f"{fn}: the config already places axis {name!r} (a layout for it was applied); "
            "apply each axis' layout once, to a config without it (e.g. "
            f"apply_cp(apply_tp(preset_config(...)))), and give different axes different "
            "names."
        )


def attention_heads(config: Any) -> list[tuple[str, int, int]]:
    """``(path, query heads, key/value heads)`` of each attention of a decoder config.

    An attention that repeats its key/value heads per query head before the core
    (``repeat_kv``, e.g. a tensor-parallel layout with fewer key/value heads than
    ranks) counts as having as many key/value heads as query heads.

    Example:
        >>> from hyper_parallel.models.llama import preset_config
        >>> attention_heads(preset_config("llama3-debug"))[0]
        ('layers.0.attention', 8, 4)
    """
    out = []
    for i, layer in enumerate(config.layers):
        attention = layer.attention
        num_heads = attention.wq.out_features // attention.head_dim
        repeated = attention.repeat_kv
        num_kv_heads = num_heads if repeated else attention.wk.out_features // attention.head_dim
        out.append((f"layers.{i}.attention", num_heads, num_kv_heads))
    return out
