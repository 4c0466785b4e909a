"""Presets and the config factory of Qwen3 dense; parameters counted from a config."""

from __future__ import annotations

from typing import Any

from hyper_parallel.models.common.config import (
    decoder_config,
    decoder_num_params,
    dense_block_config,
    preset,
    swiglu_params,
)
from hyper_parallel.models.qwen3.model import Transformer

__all__ = ["PRESETS", "num_params", "preset_config", "qwen3_config"]

# The released configs (config.json) of Qwen/Qwen3-0.6B, -8B and -32B: head_dim 128,
# rms_norm_eps 1e-6, rope_theta 1e6, max_position_embeddings 40960, no attention bias.
PRESETS: dict[str, dict[str, Any]] = {
    # Byte vocabulary; head_dim 16 != dim / num_heads (as Qwen3 allows); heads divisible
    # by 1, 2 and 4 tensor-parallel ranks; untied, so it cuts into pipeline stages.
    "qwen3-debug": dict(
        vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
        ffn_dim=128, max_seq_len=512,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936, dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, ffn_dim=3072, tie_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936, dim=4096, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_dim=12288,
    ),
    "qwen3-32b": dict(
        vocab_size=151936, dim=5120, num_layers=64, num_heads=64, num_kv_heads=8,
        head_dim=128, ffn_dim=25600,
    ),
}  # fmt: skip


def qwen3_config(
    *,
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    ffn_dim: int,
    tie_embeddings: bool = False,
    norm_eps: float = 1e-6,
    rope_theta: float = 1000000.0,
    max_seq_len: int = 40960,
    init_std: float = 0.02,
) -> Transformer.Config:
    """The ``Transformer.Config`` tree of a Qwen3 dense decoder (initialized as the Llama's).

    Args are the Llama's (:func:`~hyper_parallel.models.llama.llama3_config`) and:
        head_dim: Width of one head, independent of ``dim / num_heads``; even.
        tie_embeddings: The output projection shares the embedding's weight (which the
            output's initializer, run last, initializes).
        norm_eps: Epsilon of every RMSNorm, the per-head query/key norms' included.

    Raises:
        ValueError: For head counts that do not divide, or an odd ``head_dim``.

    Example:
        >>> from hyper_parallel.models.qwen3 import PRESETS, qwen3_config
        >>> qwen3_config(**PRESETS["qwen3-debug"]).build().init_states()
    """
    if num_heads % num_kv_heads or head_dim % 2:
        raise ValueError(
            f"qwen3_config: num_kv_heads={num_kv_heads} must divide num_heads={num_heads} "
            f"and head_dim={head_dim} be even; choose such sizes."
        )
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    norms = dict(dim=dim, norm_eps=norm_eps)
    blocks = [
        dense_block_config(i, ffn_dim=ffn_dim, init_std=init_std, qk_norm=True, **heads, **norms)
        for i in range(num_layers)
    ]
    rope = dict(rope_theta=rope_theta, max_seq_len=max_seq_len, head_dim=head_dim)
    return decoder_config(
        Transformer.Config,
        blocks,
        vocab_size=vocab_size,
        tie_embeddings=tie_embeddings,
        **norms,
        **rope,
    )


def preset_config(name: str, **overrides: Any) -> Transformer.Config:
    """Preset ``name``'s config, arguments of :func:`qwen3_config` overridden (errors name the fix)."""
    return preset(PRESETS, qwen3_config, name, **overrides)


def num_params(config: Transformer.Config) -> int:
    """Parameters of the model ``config`` builds (a tied output counted once), from the config.

    Example:
        >>> num_params(preset_config("qwen3-0.6b"))
        596049920
    """
    tied = config.tie_embeddings
    return decoder_num_params(config, lambda b: swiglu_params(b.feed_forward), tied_output=tied)
