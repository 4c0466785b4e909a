"""The toy Helium decoder: the shared decoder with dense SwiGLU blocks (maths only)."""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.models.common.config import (
    decoder_config,
    decoder_num_params,
    dense_block_config,
    swiglu_params,
)
from hyper_parallel.models.common.decoder import Decoder, TransformerBlock

__all__ = ["Transformer", "helium_config", "num_params"]


class Transformer(Decoder):
    """A Helium-shaped decoder: ``forward(tokens (B, S)) -> logits (B, S, vocab)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        layers: list[TransformerBlock.Config]


def helium_config(
    *,
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    ffn_dim: int,
    norm_eps: float = 1e-8,
    rope_theta: float = 10000.0,
    max_seq_len: int = 64,
    init_std: float = 0.02,
) -> Transformer.Config:
    """The ``Transformer.Config`` of a toy Helium decoder."""
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    norms = dict(dim=dim, norm_eps=norm_eps)
    blocks = [
        dense_block_config(i, ffn_dim=ffn_dim, init_std=init_std, **heads, **norms)
        for i in range(num_layers)
    ]
    return decoder_config(
        Transformer.Config,
        blocks,
        vocab_size=vocab_size,
        head_dim=head_dim,
        rope_theta=rope_theta,
        max_seq_len=max_seq_len,
        **norms,
    )


def num_params(config: Transformer.Config) -> int:
    """Parameters of the model ``config`` builds."""
    return decoder_num_params(config, lambda layer: swiglu_params(layer.feed_forward))
