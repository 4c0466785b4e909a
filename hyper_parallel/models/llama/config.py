"""Presets and the config factory for the Llama-3-style decoder.

:func:`llama3_config` turns a handful of hyperparameters into the full
``Transformer.Config`` tree (one config per layer, each with its initializers);
:data:`PRESETS` holds the published Llama 3 shapes and a debug size;
:func:`num_params` counts parameters from a config without building anything.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch import nn

from hyper_parallel.models.llama.model import (
    Attention,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    ScaledDotProductAttention,
    Transformer,
    TransformerBlock,
)

__all__ = ["PRESETS", "llama3_config", "num_params", "preset_config"]

# Published shapes: "The Llama 3 Herd of Models" (Dubey et al., 2024), Table 3.
PRESETS: dict[str, dict[str, Any]] = {
    # Byte vocabulary; head counts divisible by 1, 2 and 4 tensor-parallel ranks.
    "llama3-debug": dict(
        vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, ffn_dim=192,
        max_seq_len=512,
    ),
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336
    ),
    "llama3-70b": dict(
        vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672
    ),
    "llama3-405b": dict(
        vocab_size=128256, dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
        ffn_dim=53248,
    ),
}  # fmt: skip


def _normal(std: float) -> functools.partial:
    # Truncated at three standard deviations, as in torchtitan's Llama initialization.
    return functools.partial(nn.init.trunc_normal_, mean=0.0, std=std, a=-3 * std, b=3 * std)


def llama3_config(
    *,
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    ffn_dim: int,
    norm_eps: float = 1e-5,
    rope_theta: float = 500000.0,
    max_seq_len: int = 8192,
    init_std: float = 0.02,
) -> Transformer.Config:
    """The ``Transformer.Config`` tree of a Llama-3-style decoder.

    Initialization follows torchtitan: embeddings ``N(0, 1)``; ``wq, wk, wv, w1``
    truncated normal with ``init_std``; ``wo, w2, w3`` of layer ``i`` with
    ``init_std / sqrt(2 (i + 1))`` (depth-scaled); the output projection with
    ``dim ** -0.5``; norm scales one.

    Args:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        num_layers: Number of transformer blocks.
        num_heads: Query heads; ``dim`` must be divisible by it.
        num_kv_heads: Key/value heads; ``num_heads`` must be divisible by it.
        ffn_dim: Hidden width of the SwiGLU feed-forward.
        norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        max_seq_len: Longest sequence the RoPE tables cover.
        init_std: Standard deviation of the input projections.

    Returns:
        A config; ``.build()`` constructs the model (initialize with ``init_states()``).

    Raises:
        ValueError: For head counts that do not divide ``dim`` or each other.

    Example:
        >>> from hyper_parallel.models.llama import PRESETS, llama3_config
        >>> model = llama3_config(**PRESETS["llama3-debug"]).build()
        >>> model.init_states()
    """
    if dim % num_heads or num_heads % num_kv_heads or (dim // num_heads) % 2:
        raise ValueError(
            f"llama3_config: dim={dim} must be divisible by num_heads={num_heads} into an even "
            f"head_dim, and num_heads by num_kv_heads={num_kv_heads}; choose sizes that divide."
        )
    head_dim = dim // num_heads

    def linear(in_features: int, out_features: int, std: float) -> Linear.Config:
        return Linear.Config(
            in_features=in_features,
            out_features=out_features,
            bias=False,
            param_init={"weight": _normal(std)},
        )

    def norm() -> RMSNorm.Config:
        return RMSNorm.Config(dim=dim, eps=norm_eps, param_init={"weight": nn.init.ones_})

    def block(layer_id: int) -> TransformerBlock.Config:
        out_std = init_std / math.sqrt(2 * (layer_id + 1))
        return TransformerBlock.Config(
            attention_norm=norm(),
            attention=Attention.Config(
                head_dim=head_dim,
                wq=linear(dim, num_heads * head_dim, init_std),
                wk=linear(dim, num_kv_heads * head_dim, init_std),
                wv=linear(dim, num_kv_heads * head_dim, init_std),
                wo=linear(num_heads * head_dim, dim, out_std),
                inner_attention=ScaledDotProductAttention.Config(),
            ),
            ffn_norm=norm(),
            feed_forward=FeedForward.Config(
                w1=linear(dim, ffn_dim, init_std),
                w2=linear(ffn_dim, dim, out_std),
                w3=linear(dim, ffn_dim, out_std),
            ),
        )

    return Transformer.Config(
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size,
            embedding_dim=dim,
            param_init={"weight": functools.partial(nn.init.normal_, mean=0.0, std=1.0)},
        ),
        rope=RotaryEmbedding.Config(head_dim=head_dim, max_seq_len=max_seq_len, theta=rope_theta),
        layers=[block(i) for i in range(num_layers)],
        norm=norm(),
        output=linear(dim, vocab_size, dim**-0.5),
    )


def preset_config(name: str, **overrides: Any) -> Transformer.Config:
    """The config of preset ``name`` with some hyperparameters changed.

    Example:
        >>> preset_config("llama3-8b", num_layers=2).layers.__len__()
        2

    Raises:
        ValueError: For an unknown preset (the message lists the known ones) or an
            override that is not an argument of :func:`llama3_config`.
    """
    if name not in PRESETS:
        raise ValueError(f"preset_config: no preset {name!r}; known presets: {sorted(PRESETS)}.")
    try:
        return llama3_config(**{**PRESETS[name], **overrides})
    except TypeError as e:
        raise ValueError(
            f"preset_config({name!r}): {e}; overrides are arguments of llama3_config."
        ) from None


def num_params(config: Transformer.Config) -> int:
    """Number of parameters of the model ``config`` builds, counted from the config alone.

    Example:
        >>> num_params(preset_config("llama3-70b"))
        70553706496
    """

    def linear(c: Linear.Config) -> int:
        return c.in_features * c.out_features + (c.out_features if c.bias else 0)

    total = config.tok_embeddings.num_embeddings * config.tok_embeddings.embedding_dim
    for layer in config.layers:
        attention, ffn = layer.attention, layer.feed_forward
        total += layer.attention_norm.dim + layer.ffn_norm.dim
        total += sum(linear(c) for c in (attention.wq, attention.wk, attention.wv, attention.wo))
        total += sum(linear(c) for c in (ffn.w1, ffn.w2, ffn.w3))
    return total + config.norm.dim + linear(config.output)
