"""Presets and the config factory for the Qwen3-MoE decoder.

:func:`qwen3_moe_config` turns a handful of hyperparameters into the full
``Transformer.Config`` tree; :data:`PRESETS` holds Qwen's published shapes and a
debug size; :func:`num_params` counts parameters from a config without building
anything.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.models.common.config import (
    block_fields,
    decoder_config,
    decoder_num_params,
    depth_std,
    preset,
    truncated_normal,
)
from hyper_parallel.models.qwen3_moe.model import (
    GroupedExperts,
    MoE,
    Router,
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


def preset_config(name: str, **overrides: Any) -> Transformer.Config:
    """Preset ``name``'s config with arguments of :func:`qwen3_moe_config` overridden."""
    return preset(PRESETS, qwen3_moe_config, name, **overrides)


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
    use_grouped_mm: bool = True,
    aux_loss_coef: float = 0.001,
    norm_eps: float = 1e-6,
    rope_theta: float = 1000000.0,
    max_seq_len: int = 4096,
    init_std: float = 0.02,
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
            ``top_k`` outside ``1..num_experts``, or a negative ``aux_loss_coef``.

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
    if not aux_loss_coef >= 0:  # NaN too
        raise ValueError(
            f"qwen3_moe_config: aux_loss_coef={aux_loss_coef} must be >= 0; the router's balance "
            "loss is weighted by it (0 turns it off, a negative weight would reward imbalance): "
            "give a value >= 0, e.g. 0.001."
        )

    shape = dict(dim=dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def block(layer_id: int) -> TransformerBlock.Config:
        out_std = depth_std(init_std, layer_id)
        return TransformerBlock.Config(
            **block_fields(layer_id, **shape, norm_eps=norm_eps, init_std=init_std, qk_norm=True),
            moe=MoE.Config(
                router=Router.Config(
                    dim=dim,
                    num_experts=num_experts,
                    top_k=top_k,
                    param_init={"weight": truncated_normal(init_std)},
                ),
                experts=GroupedExperts.Config(
                    num_experts=num_experts,
                    dim=dim,
                    hidden_dim=moe_hidden_dim,
                    use_grouped_mm=use_grouped_mm,
                    param_init={
                        "w1": truncated_normal(init_std),
                        "w2": truncated_normal(out_std),
                        "w3": truncated_normal(out_std),
                    },
                ),
                aux_loss_coef=aux_loss_coef,
            ),
        )

    layers = [block(i) for i in range(num_layers)]
    return decoder_config(
        Transformer.Config,
        layers,
        vocab_size=vocab_size,
        dim=dim,
        head_dim=head_dim,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        max_seq_len=max_seq_len,
    )


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


def num_experts(config: Transformer.Config) -> int:
    """The routed experts of each block (every block holds the same number).

    Example:
        >>> num_experts(preset_config("qwen3-30b-a3b"))
        128
    """
    return config.layers[0].moe.experts.num_experts if config.layers else 0


def num_params(config: Transformer.Config) -> int:
    """Number of parameters of the model ``config`` builds, counted from the config alone.

    Example:
        >>> num_params(preset_config("qwen3-30b-a3b"))
        30532122624
    """

    def moe_params(layer: TransformerBlock.Config) -> int:
        router = layer.moe.router
        return router.num_experts * router.dim

    return decoder_num_params(config, moe_params) + num_expert_params(config)
