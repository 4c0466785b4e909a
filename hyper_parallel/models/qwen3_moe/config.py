"""Presets and the config factory for the Qwen3-MoE decoder.

:func:`qwen3_moe_config` turns a handful of hyperparameters into the full
``Transformer.Config`` tree; :data:`PRESETS` holds Qwen's published shapes and a
debug size; :func:`num_params` counts parameters from a config without building
anything.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch import nn

# Truncated normal at three standard deviations, as the Llama presets (torchtitan's init).
from hyper_parallel.models.llama.config import _normal
from hyper_parallel.models.qwen3_moe.model import (
    Attention,
    Embedding,
    GroupedExperts,
    Linear,
    MoE,
    RMSNorm,
    RotaryEmbedding,
    Router,
    ScaledDotProductAttention,
    Transformer,
    TransformerBlock,
)

__all__ = ["PRESETS", "num_expert_params", "num_params", "preset_config", "qwen3_moe_config"]

# Published shapes: the Qwen3 technical report (Yang et al., 2025), Table 2, and the
# released configs of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (head_dim 128,
# untied embeddings, every layer a mixture of experts, max_position_embeddings 40960).
PRESETS: dict[str, dict[str, Any]] = {
    # Byte vocabulary; 8 experts (divisible by ep = 1, 2, 4, 8), top-2; heads divisible
    # by 1, 2 and 4 tensor-parallel ranks.
    "qwen3-moe-debug": dict(
        vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
        num_experts=8, top_k=2, moe_hidden_dim=32, max_seq_len=512,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936, dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        num_experts=128, top_k=8, moe_hidden_dim=768, max_seq_len=40960,
    ),
    "qwen3-235b-a22b": dict(
        vocab_size=151936, dim=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
        num_experts=128, top_k=8, moe_hidden_dim=1536, max_seq_len=40960,
    ),
}  # fmt: skip


def qwen3_moe_config(
    *,
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_experts: int,
    top_k: int,
    moe_hidden_dim: int,
    norm_eps: float = 1e-6,
    rope_theta: float = 1000000.0,
    max_seq_len: int = 4096,
    init_std: float = 0.02,
    aux_loss_coef: float = 0.001,
    use_grouped_mm: bool = True,
) -> Transformer.Config:
    """The ``Transformer.Config`` tree of a Qwen3-MoE decoder.

    Initialization: embeddings ``N(0, 1)``; projections, router and ``w1`` truncated
    normal with ``init_std``; ``wo``, ``w2``, ``w3`` of layer ``i`` with
    ``init_std / sqrt(2 (i + 1))``; output ``dim ** -0.5``; norm scales one.

    Args:
        vocab_size: Number of token ids.
        dim: Model (residual stream) width.
        num_layers: Number of transformer blocks (each with a mixture of experts).
        num_heads: Query heads.
        num_kv_heads: Key/value heads; ``num_heads`` must be divisible by it.
        head_dim: Width of one head (Qwen3 decouples it from ``dim``); even.
        num_experts: Routed experts per layer.
        top_k: Experts each token is sent to; at most ``num_experts``.
        moe_hidden_dim: Hidden width of one SwiGLU expert.
        norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        max_seq_len: Longest sequence the RoPE tables cover.
        init_std: Standard deviation of the input projections.
        aux_loss_coef: Weight of the router balance loss (0 disables it).
        use_grouped_mm: Run experts with ``torch._grouped_mm`` where it runs.

    Returns:
        A config; ``.build()`` constructs the model (initialize with ``init_states()``).

    Raises:
        ValueError: For head counts that do not divide each other, an odd ``head_dim``,
            or ``top_k`` outside ``1..num_experts``.

    Example:
        >>> from hyper_parallel.models.qwen3_moe import PRESETS, qwen3_moe_config
        >>> model = qwen3_moe_config(**PRESETS["qwen3-moe-debug"]).build()
        >>> model.init_states()
    """
    if num_heads % num_kv_heads or head_dim % 2:
        raise ValueError(
            f"qwen3_moe_config: num_heads={num_heads} must be divisible by num_kv_heads="
            f"{num_kv_heads} and head_dim={head_dim} even; choose sizes that divide."
        )
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"qwen3_moe_config: top_k={top_k} must be between 1 and num_experts="
            f"{num_experts}; route each token to at most as many experts as there are."
        )

    def linear(in_features: int, out_features: int, std: float) -> Linear.Config:
        return Linear.Config(
            in_features=in_features,
            out_features=out_features,
            bias=False,
            param_init={"weight": _normal(std)},
        )

    def norm(width: int) -> RMSNorm.Config:
        return RMSNorm.Config(dim=width, eps=norm_eps, param_init={"weight": nn.init.ones_})

    def block(layer_id: int) -> TransformerBlock.Config:
        out_std = init_std / math.sqrt(2 * (layer_id + 1))
        return TransformerBlock.Config(
            attention_norm=norm(dim),
            attention=Attention.Config(
                head_dim=head_dim,
                wq=linear(dim, num_heads * head_dim, init_std),
                wk=linear(dim, num_kv_heads * head_dim, init_std),
                wv=linear(dim, num_kv_heads * head_dim, init_std),
                wo=linear(num_heads * head_dim, dim, out_std),
                q_norm=norm(head_dim),
                k_norm=norm(head_dim),
                inner_attention=ScaledDotProductAttention.Config(),
            ),
            ffn_norm=norm(dim),
            moe=MoE.Config(
                router=Router.Config(
                    dim=dim,
                    num_experts=num_experts,
                    top_k=top_k,
                    param_init={"weight": _normal(init_std)},
                ),
                experts=GroupedExperts.Config(
                    num_experts=num_experts,
                    dim=dim,
                    hidden_dim=moe_hidden_dim,
                    use_grouped_mm=use_grouped_mm,
                    param_init={
                        "w1": _normal(init_std),
                        "w2": _normal(out_std),
                        "w3": _normal(out_std),
                    },
                ),
                aux_loss_coef=aux_loss_coef,
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
        norm=norm(dim),
        output=linear(dim, vocab_size, dim**-0.5),
    )


def preset_config(name: str, **overrides: Any) -> Transformer.Config:
    """The config of preset ``name`` with some hyperparameters changed.

    Example:
        >>> len(preset_config("qwen3-30b-a3b", num_layers=2).layers)
        2

    Raises:
        ValueError: For an unknown preset (the message lists the known ones) or an
            override that is not an argument of :func:`qwen3_moe_config`.
    """
    if name not in PRESETS:
        raise ValueError(f"preset_config: no preset {name!r}; known presets: {sorted(PRESETS)}.")
    try:
        return qwen3_moe_config(**{**PRESETS[name], **overrides})
    except TypeError as e:
        raise ValueError(
            f"preset_config({name!r}): {e}; overrides are arguments of qwen3_moe_config."
        ) from None


def _linear(c: Linear.Config) -> int:
    return c.in_features * c.out_features + (c.out_features if c.bias else 0)


def num_expert_params(config: Transformer.Config) -> int:
    """Parameters of the routed experts alone (the states expert parallelism splits).

    Example:
        >>> num_expert_params(preset_config("qwen3-30b-a3b"))
        28991029248
    """
    return sum(
        3 * layer.moe.experts.num_experts * layer.moe.experts.dim * layer.moe.experts.hidden_dim
        for layer in config.layers
    )


def num_params(config: Transformer.Config) -> int:
    """Number of parameters of the model ``config`` builds, counted from the config alone.

    Example:
        >>> num_params(preset_config("qwen3-30b-a3b"))
        30532122624
    """
    total = config.tok_embeddings.num_embeddings * config.tok_embeddings.embedding_dim
    for layer in config.layers:
        attention, router = layer.attention, layer.moe.router
        total += layer.attention_norm.dim + layer.ffn_norm.dim
        total += attention.q_norm.dim + attention.k_norm.dim
        total += sum(_linear(c) for c in (attention.wq, attention.wk, attention.wv, attention.wo))
        total += router.num_experts * router.dim
    return total + num_expert_params(config) + config.norm.dim + _linear(config.output)
