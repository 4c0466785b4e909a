"""Building blocks of a decoder family's config factory, and its parameter count.

A family's factory (``llama3_config``, ``qwen3_config``, ...) assembles the full
config tree from these pieces: every ``Linear`` without bias and with its initializer,
RMSNorms, the grouped-query attention (Qwen3's per-head norms optional), the SwiGLU
feed-forward, and :func:`decoder_config` for the embedding, rotary tables, final norm
and output projection. Initialization follows torchtitan: embeddings ``N(0, 1)``;
input projections truncated normal with ``init_std``; output projections of layer
``i`` with ``init_std / sqrt(2 (i + 1))`` (:func:`depth_std`); the output head with
``dim ** -0.5``; norm scales one.

:func:`preset` looks a preset up and applies overrides; :func:`decoder_num_params`
counts parameters from a config alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from hyper_parallel.models.common.decoder import TransformerBlock
from hyper_parallel.models.common.layers import (
    Attention,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    ScaledDotProductAttention,
)

__all__ = [
    "attention_config",
    "block_fields",
    "decoder_config",
    "decoder_num_params",
    "dense_block_config",
    "depth_std",
    "linear_config",
    "linear_params",
    "norm_config",
    "preset",
    "swiglu_config",
    "swiglu_params",
    "truncated_normal",
]


def truncated_normal(std: float) -> functools.partial:
    """``N(0, std)`` truncated at three standard deviations (torchtitan's initialization)."""
    return functools.partial(nn.init.trunc_normal_, mean=0.0, std=std, a=-3 * std, b=3 * std)


def depth_std(init_std: float, layer_id: int) -> float:
    """The standard deviation of layer ``layer_id``'s output projections."""
    return init_std / math.sqrt(2 * (layer_id + 1))


def linear_config(in_features: int, out_features: int, std: float) -> Linear.Config:
    """A projection without bias, initialized :func:`truncated_normal` with ``std``."""
    return Linear.Config(
        in_features=in_features,
        out_features=out_features,
        bias=False,
        param_init={"weight": truncated_normal(std)},
    )


def norm_config(dim: int, eps: float) -> RMSNorm.Config:
    """An RMSNorm over ``dim`` features, scale initialized to one."""
    return RMSNorm.Config(dim=dim, eps=eps, param_init={"weight": nn.init.ones_})


def attention_config(
    *,
    dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    init_std: float,
    out_std: float,
    qk_norm_eps: float | None = None,
) -> Attention.Config:
    """Grouped-query attention; with ``qk_norm_eps`` an RMSNorm per query and key head."""
    norms = {}
    if qk_norm_eps is not None:
        norms = {"q_norm": norm_config(head_dim, qk_norm_eps)}
        norms["k_norm"] = norm_config(head_dim, qk_norm_eps)
    return Attention.Config(
        head_dim=head_dim,
        wq=linear_config(dim, num_heads * head_dim, init_std),
        wk=linear_config(dim, num_kv_heads * head_dim, init_std),
        wv=linear_config(dim, num_kv_heads * head_dim, init_std),
        wo=linear_config(num_heads * head_dim, dim, out_std),
        inner_attention=ScaledDotProductAttention.Config(),
        **norms,
    )


def swiglu_config(dim: int, hidden_dim: int, init_std: float, out_std: float) -> FeedForward.Config:
    """A SwiGLU feed-forward: ``w1`` with ``init_std``, ``w2`` and ``w3`` with ``out_std``."""
    return FeedForward.Config(
        w1=linear_config(dim, hidden_dim, init_std),
        w2=linear_config(hidden_dim, dim, out_std),
        w3=linear_config(dim, hidden_dim, out_std),
    )


def block_fields(
    layer_id: int,
    *,
    dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norm_eps: float,
    init_std: float,
    qk_norm: bool = False,
) -> dict[str, Any]:
    """The fields every block ``layer_id`` has: the attention (Qwen3's per-head norms
    with ``qk_norm``) and the two RMSNorms; a family adds its feed-forward."""
    return {
        "attention_norm": norm_config(dim, norm_eps),
        "attention": attention_config(
            dim=dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            init_std=init_std,
            out_std=depth_std(init_std, layer_id),
            qk_norm_eps=norm_eps if qk_norm else None,
        ),
        "ffn_norm": norm_config(dim, norm_eps),
    }


def dense_block_config(layer_id: int, *, ffn_dim: int, **shape: Any) -> TransformerBlock.Config:
    """Block ``layer_id`` of a dense decoder: :func:`block_fields` (``shape`` is their
    keyword arguments) and a SwiGLU feed-forward of width ``ffn_dim``."""
    init_std, dim = shape["init_std"], shape["dim"]
    return TransformerBlock.Config(
        **block_fields(layer_id, **shape),
        feed_forward=swiglu_config(dim, ffn_dim, init_std, depth_std(init_std, layer_id)),
    )


def decoder_config(
    config_cls: type,
    layers: list[Any],
    *,
    vocab_size: int,
    dim: int,
    head_dim: int,
    norm_eps: float,
    rope_theta: float,
    max_seq_len: int,
    **fields: Any,
) -> Any:
    """A :class:`~hyper_parallel.models.common.decoder.Decoder` config of class
    ``config_cls``: the embedding, rotary tables, ``layers``, final norm and output head
    around the family's blocks (``fields``: the family's own config fields)."""
    return config_cls(
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size,
            embedding_dim=dim,
            param_init={"weight": functools.partial(nn.init.normal_, mean=0.0, std=1.0)},
        ),
        rope=RotaryEmbedding.Config(head_dim=head_dim, max_seq_len=max_seq_len, theta=rope_theta),
        layers=layers,
        norm=norm_config(dim, norm_eps),
        output=linear_config(dim, vocab_size, dim**-0.5),
        **fields,
    )


def preset(
    presets: dict[str, dict[str, Any]], factory: Callable[..., Any], name: str, **overrides: Any
) -> Any:
    """``factory(**presets[name], **overrides)``, with errors that name the fix.

    Raises:
        ValueError: For an unknown preset (the message lists the known ones) or an
            override that is not an argument of ``factory``.
    """
    if name not in presets:
        raise ValueError(f"preset_config: no preset {name!r}; known presets: {sorted(presets)}.")
    try:
        return factory(**{**presets[name], **overrides})
    except TypeError as e:
        raise ValueError(
            f"preset_config({name!r}): {e}; overrides are arguments of {factory.__name__}."
        ) from None


def linear_params(c: Linear.Config) -> int:
    """Parameters of one ``Linear`` config."""
    return c.in_features * c.out_features + (c.out_features if c.bias else 0)


def swiglu_params(ffn: FeedForward.Config) -> int:
    """Parameters of one SwiGLU feed-forward config."""
    return sum(linear_params(c) for c in (ffn.w1, ffn.w2, ffn.w3))


def decoder_num_params(
    config: Any, ffn_params: Callable[[Any], int], *, tied_output: bool = False
) -> int:
    """Parameters of a decoder config, counted without building anything.

    Args:
        config: A :class:`~hyper_parallel.models.common.decoder.Decoder` config.
        ffn_params: ``block config -> int``: the family's feed-forward parameters.
        tied_output: The output head shares the embedding's weight (counted once).
    """
    total = config.tok_embeddings.num_embeddings * config.tok_embeddings.embedding_dim
    for layer in config.layers:
        attention = layer.attention
        total += layer.attention_norm.dim + layer.ffn_norm.dim + ffn_params(layer)
        total += sum(linear_params(c) for c in (attention.wq, attention.wk, attention.wv))
        total += linear_params(attention.wo)
        if attention.q_norm is not None and attention.k_norm is not None:
            total += attention.q_norm.dim + attention.k_norm.dim
    head = 0 if tied_output else linear_params(config.output)
    return total + config.norm.dim + head
