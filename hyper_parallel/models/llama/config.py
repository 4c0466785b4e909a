"""Presets and the config factory for the Llama-3-style decoder.

:func:`llama3_config` turns a handful of hyperparameters into the full
``Transformer.Config`` tree (one config per layer, each with its initializers);
:data:`PRESETS` holds the published Llama 3 shapes and a debug size;
:func:`num_params` counts parameters from a config without building anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyper_parallel.models.common.config import (
    decoder_config,
    decoder_num_params,
    dense_block_config,
    preset,
    swiglu_params,
)
from hyper_parallel.models.llama.model import Transformer
from hyper_parallel.models.llama.rope import llama3_rope_config

__all__ = ["LLAMA31_ROPE_SCALING", "PRESETS", "llama3_config", "num_params", "preset_config"]

LLAMA31_ROPE_SCALING: dict[str, Any] = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""Llama 3.1's rope scaling (``rope_type: "llama3"`` in its Hugging Face config.json): trained
on 8,192 positions, stretched 8x to 131,072."""

_LLAMA3_SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336
    ),
    "70b": dict(
        vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672
    ),
    "405b": dict(
        vocab_size=128256, dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
        ffn_dim=53248,
    ),
}  # fmt: skip

# Published shapes: "The Llama 3 Herd of Models" (Dubey et al., 2024), Table 3. Llama 3's
# rope was trained on 8,192 positions; Llama 3.1 (same shapes) scales it to 131,072.
PRESETS: dict[str, dict[str, Any]] = {
    # Byte vocabulary; head counts divisible by 1, 2 and 4 tensor-parallel ranks.
    "llama3-debug": dict(
        vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, ffn_dim=192,
        max_seq_len=512,
    ),
    **{f"llama3-{size}": shape for size, shape in _LLAMA3_SHAPES.items()},
    **{
        f"llama3.1-{size}": dict(
            shape, max_seq_len=131072, rope_scaling=LLAMA31_ROPE_SCALING
        )
        for size, shape in _LLAMA3_SHAPES.items()
    },
}  # fmt: skip


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
    rope_scaling: Mapping[str, Any] | None = None,
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
        max_seq_len: Longest sequence the RoPE tables cover: the positions the model
            takes (a sequence past them is refused by the run plan).
        rope_scaling: Llama 3.x frequency scaling (:data:`LLAMA31_ROPE_SCALING`'s keys;
            :mod:`hyper_parallel.models.llama.rope`), or ``None`` for plain RoPE.
        init_std: Standard deviation of the input projections.

    Returns:
        A config; ``.build()`` constructs the model (initialize with ``init_states()``).

    Raises:
        ValueError: For head counts that do not divide ``dim`` or each other, or a
            ``rope_scaling`` without Llama 3.x's keys.

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
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    norms = dict(dim=dim, norm_eps=norm_eps)
    blocks = [
        dense_block_config(i, ffn_dim=ffn_dim, init_std=init_std, **heads, **norms)
        for i in range(num_layers)
    ]
    rope = dict(rope_theta=rope_theta, max_seq_len=max_seq_len)
    config = decoder_config(
        Transformer.Config, blocks, vocab_size=vocab_size, head_dim=head_dim, **norms, **rope
    )
    if rope_scaling is not None:
        config.rope = llama3_rope_config(config.rope, rope_scaling)
    return config


def preset_config(name: str, **overrides: Any) -> Transformer.Config:
    """Preset ``name``'s config with arguments of :func:`llama3_config` overridden."""
    return preset(PRESETS, llama3_config, name, **overrides)


def num_params(config: Transformer.Config) -> int:
    """Number of parameters of the model ``config`` builds, counted from the config alone.

    Example:
        >>> num_params(preset_config("llama3-70b"))
        70553706496
    """
    return decoder_num_params(config, lambda layer: swiglu_params(layer.feed_forward))
