"""The decoder every family shares: pre-norm blocks, the model, its pipeline stages.

:class:`Decoder` is a decoder-only language model — token embedding, rotary tables,
one causal mask per forward, a list of blocks, final norm and output projection — and
:class:`TransformerStage` a contiguous part of it for pipeline parallelism. Both run
their blocks through one loop, :func:`run_blocks`. A family subclasses
:class:`Decoder` (its own ``Config`` class, so the registry knows the family by it)
and :class:`DecoderBlock` (its feed-forward: dense SwiGLU in :class:`TransformerBlock`,
a mixture of experts in Qwen3-MoE).

A stage holds the token embedding (first stage only), some blocks, the final norm
and output projection (last stage only), plus the rotary tables and the mask builder
every block needs. Its submodules keep the model's own names
(``layers.3.attention.wq``), so a stage's ``state_dict`` keys are the full model's and
a checkpoint loads at any pipeline size. :func:`decoder_pipeline` describes the cut
for :mod:`hyper_parallel.distributed.pipeline`; a stage is built on the meta device
from the model's (already sharded) config, never by copying a model and deleting parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from hyper_parallel.distributed.pipeline import PipelineLayout
from hyper_parallel.dmodule.model import BaseModel
from hyper_parallel.dmodule.module import Module, ModuleDict, ModuleList
from hyper_parallel.models.common.chunked_attention import CausalChunks
from hyper_parallel.models.common.layers import (
    Attention,
    CausalMask,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
    RotaryEmbedding,
)

__all__ = [
    "Decoder",
    "DecoderBlock",
    "TransformerBlock",
    "TransformerStage",
    "decoder_pipeline",
    "dense_block_elements",
    "run_blocks",
]


def run_blocks(
    blocks: Iterable[nn.Module],
    h: torch.Tensor,
    rope: RotaryEmbedding,
    mask: CausalMask,
    seq_len: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder loop: ``h`` through every block with the rotary tables and the mask.

    Without ``positions`` the tokens are the whole sequence of ``seq_len`` (attention
    causal by index); with them the tables are read there and the causal structure is
    built once for every block: an additive mask of those positions on one device, the
    chunks a context-parallel rank holds when they are sharded (no mask; see
    :class:`~hyper_parallel.models.common.layers.CausalMask`).
    """
    if positions is None:
        cos, sin = rope(seq_len)
        for block in blocks:
            h = block(h, cos, sin)
        return h
    cos, sin = rope(seq_len, positions)
    causal = mask(positions, positions, h.dtype)
    for block in blocks:
        h = block(h, cos, sin, causal)
    return h


class DecoderBlock(Module):
    """Pre-norm residual block: attention, then the feed-forward a subclass declares.

    A subclass names its feed-forward's config field and attribute in ``ffn_name`` and
    declares that field in its ``Config`` (dense SwiGLU ``feed_forward`` in
    :class:`TransformerBlock`, ``moe`` in Qwen3-MoE's block).
    """

    ffn_name: ClassVar[str] = ""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        attention_norm: RMSNorm.Config
        attention: Attention.Config
        ffn_norm: RMSNorm.Config

    def __init__(self, config: DecoderBlock.Config) -> None:
        super().__init__()
        if not self.ffn_name:
            raise TypeError(
                f"{type(self).__name__} declares no feed-forward; subclass DecoderBlock with "
                "ffn_name set to its Config's feed-forward field (e.g. TransformerBlock)."
            )
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        setattr(self, self.ffn_name, getattr(config, self.ffn_name).build())

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | CausalChunks | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: attention, then a SwiGLU feed-forward."""

    ffn_name = "feed_forward"

    @dataclass(kw_only=True, slots=True)
    class Config(DecoderBlock.Config):
        feed_forward: FeedForward.Config


class Decoder(BaseModel):
    """Decoder-only language model: ``forward(tokens (B, S)) -> logits (B, S, vocab)``.

    ``forward(tokens, positions=positions)`` takes each token's position in the global
    sequence (``[S]`` or ``[B, S]``), for a sequence split across ranks (context
    parallel): the rotary tables and the causal mask read them.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        tok_embeddings: Embedding.Config
        rope: RotaryEmbedding.Config
        layers: list[DecoderBlock.Config]
        norm: RMSNorm.Config
        output: Linear.Config
        mask: CausalMask.Config = field(default_factory=CausalMask.Config)

    def __init__(self, config: Decoder.Config) -> None:
        super().__init__()
        self.tok_embeddings = config.tok_embeddings.build()
        self.rope = config.rope.build()
        self.mask = config.mask.build()
        self.layers = ModuleList([c.build() for c in config.layers])
        self.norm = config.norm.build()
        self.output = config.output.build()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        # A context-parallel embedding hands on the whole (longer) sequence; a
        # sequence-parallel one handing local shards on is shorter and fine here.
        if positions is None and h.shape[1] > tokens.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: the {tokens.shape[1]} tokens given are part of a "
                f"{h.shape[1]}-token sequence split across ranks (context parallel), so "
                "their order says nothing about their positions; pass them: "
                "model(tokens, positions=context_parallel.positions(seq_len, cp_rank, "
                "cp_size))."
            )
        seq_len = tokens.shape[1] if positions is None else h.shape[1]
        h = run_blocks(self.layers, h, self.rope, self.mask, seq_len, positions)
        return self.output(self.norm(h))


class TransformerStage(BaseModel):
    """A contiguous part of a :class:`Decoder`.

    ``forward(x)`` takes token ids ``(B, S)`` on the first stage and the residual
    stream ``(B, S, dim)`` elsewhere; it returns the residual stream, or the logits
    on the last stage. Blocks live in ``layers`` keyed by their index in the model.

    Positions (context parallelism): torch's pipeline stages receive only the
    previous stage's output, so a stage holds its tokens' global positions itself.
    They do not depend on the micro-batch (micro-batches split the batch, not the
    sequence): :meth:`set_positions` stores this rank's positions once per sequence
    length, and every forward passes them on as the model's ``positions`` input
    (rotary tables read at them, the causal mask built from them), as
    ``Decoder.forward(tokens, positions=...)`` does.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        rope: RotaryEmbedding.Config
        mask: CausalMask.Config = field(default_factory=CausalMask.Config)
        layers: dict[str, DecoderBlock.Config] = field(default_factory=dict)
        tok_embeddings: Embedding.Config | None = None
        norm: RMSNorm.Config | None = None
        output: Linear.Config | None = None

    def __init__(self, config: TransformerStage.Config) -> None:
        super().__init__()
        if (config.norm is None) != (config.output is None):
            raise ValueError(
                "TransformerStage: norm and output are one unit (the last stage's head); "
                f"got norm={'set' if config.norm else 'None'}, output="
                f"{'set' if config.output else 'None'}. Put both on the same stage."
            )
        if config.tok_embeddings is not None:
            self.tok_embeddings = config.tok_embeddings.build()
        self.rope = config.rope.build()
        self.mask = config.mask.build()
        self.positions: torch.Tensor | None = None
        self.register_forward_pre_hook(_pass_positions, with_kwargs=True)
        self.layers = ModuleDict({key: c.build() for key, c in config.layers.items()})
        if config.norm is not None:
            self.norm = config.norm.build()
            self.output = config.output.build()

    def set_positions(self, positions: torch.Tensor | None) -> None:
        """Hold this rank's global token positions (``[S]``) for every following forward.

        ``None`` clears them (tokens are then the whole sequence, causal by index).
        """
        self.positions = positions

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if hasattr(self, "tok_embeddings") else x
        h = run_blocks(self.layers.values(), h, self.rope, self.mask, h.shape[1], positions)
        if hasattr(self, "output"):
            return self.output(self.norm(h))
        return h


def _pass_positions(module: TransformerStage, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Hand the stage's held positions to its forward (before its sharding adapts inputs)."""
    if module.positions is not None and "positions" not in kwargs:
        kwargs = {**kwargs, "positions": module.positions}
    return args, kwargs


def _activation_layout(config: Any) -> dict:
    """The residual stream's layout between blocks, as the model's sharding declares it.

    The embedding's output layout is the residual stream's (the sharding writes it
    there); with no sharding the stream is a plain tensor (``{}``).
    """
    sharding = config.tok_embeddings.sharding_config
    if sharding is None or sharding.out_dst_shardings is None:
        return {}
    return dict(sharding.out_dst_shardings)


def dense_block_elements(config: Any, block: Any) -> tuple[int, int]:
    """Per token, the activation elements a dense block keeps for its backward:
    (replicated, tp-split).

    An estimate in the spirit of Korthikanti et al. (2022, §4.1), for attention whose
    score matrix is not stored (fused SDPA) and no dropout: a block keeps its two norm
    inputs and outputs and the residual (5 x dim, replicated under plain TP, split
    under SP) and q, k, v, the attention output and four feed-forward tensors
    (2 x dim + 2 x kv_dim + 4 x ffn_dim, split over tp).
    """
    dim = config.norm.dim
    kv_dim = block.attention.wk.out_features
    ffn_dim = block.feed_forward.w1.out_features
    return 5 * dim, 2 * dim + 2 * kv_dim + 4 * ffn_dim


def decoder_pipeline(
    block_elements: Callable[[Any, Any], tuple[int, int]] = dense_block_elements,
) -> PipelineLayout:
    """The pipeline description of a :class:`Decoder` family.

    Units: the token embedding, each block, the final norm + output projection; every
    stage holds the rotary tables and the mask builder.

    Args:
        block_elements: ``(model config, block config) -> (replicated, tp-split)``: per
            token, the activation elements one block keeps for its backward (an
            estimate for the dry run; default :func:`dense_block_elements`). The head
            keeps the norm's input and output and the logits; the embedding its output.
    """

    def elements(config: Any, unit: str) -> tuple[int, int]:
        dim = config.norm.dim
        if unit == "tok_embeddings":
            return dim, 0
        if unit == "norm+output":
            return 2 * dim, config.output.out_features
        return block_elements(config, config.layers[int(unit.rsplit(".", 1)[1])])

    return PipelineLayout(
        first=("tok_embeddings",),
        layers="layers",
        last=("norm", "output"),
        shared=("rope", "mask"),
        stage=TransformerStage,
        activation_layout=_activation_layout,
        activation_elements=elements,
        activation_dim=_residual_width,
    )


def _residual_width(config: Any) -> int:
    """The residual stream's width: what one stage hands the next, per token."""
    return int(config.norm.dim)
