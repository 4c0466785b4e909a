"""How the Llama decoder is cut into pipeline stages: one stage module and its description.

A stage holds a contiguous run of the model's units — the token embedding (first
stage only), some transformer blocks, the final norm and output projection (last
stage only) — plus the rotary tables every block needs. Its submodules keep the
model's own names (``layers.3.attention.wq``), so a stage's ``state_dict`` keys are
the full model's keys and a checkpoint loads at any pipeline size.

:data:`PIPELINE` tells :mod:`hyper_parallel.distributed.pipeline` which config fields
are the first unit, the repeated blocks, the last unit and the shared modules, and
which module class runs a stage; the stage is built on the meta device from the
model's (already sharded) config, never by copying a model and deleting parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hyper_parallel.distributed.pipeline import PipelineLayout
from hyper_parallel.dmodule.model import BaseModel
from hyper_parallel.dmodule.module import ModuleDict
from hyper_parallel.models.llama.model import (
    CausalMask,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
)

__all__ = ["PIPELINE", "TransformerStage"]


class TransformerStage(BaseModel):
    """A contiguous part of :class:`~hyper_parallel.models.llama.model.Transformer`.

    ``forward(x)`` takes token ids ``(B, S)`` on the first stage and the residual
    stream ``(B, S, dim)`` elsewhere; it returns the residual stream, or the logits
    on the last stage. Blocks live in ``layers`` keyed by their index in the model.

    Positions (context parallelism): torch's pipeline stages receive only the
    previous stage's output, so a stage holds its tokens' global positions itself.
    They do not depend on the micro-batch (micro-batches split the batch, not the
    sequence): :meth:`set_positions` stores this rank's positions once per sequence
    length, and every forward passes them on as the model's ``positions`` input
    (rotary tables read at them, the causal mask built from them), as
    ``Transformer.forward(tokens, positions=...)`` does.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        rope: RotaryEmbedding.Config
        mask: CausalMask.Config = field(default_factory=CausalMask.Config)
        layers: dict[str, TransformerBlock.Config] = field(default_factory=dict)
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
        if positions is None:
            cos, sin = self.rope(h.shape[1])
            for layer in self.layers.values():
                h = layer(h, cos, sin)
        else:
            cos, sin = self.rope(h.shape[1], positions)
            mask = self.mask(positions, positions, h.dtype)
            for layer in self.layers.values():
                h = layer(h, cos, sin, mask)
        if hasattr(self, "output"):
            return self.output(self.norm(h))
        return h


def _pass_positions(module: TransformerStage, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Hand the stage's held positions to its forward (before its sharding adapts inputs)."""
    if module.positions is not None and "positions" not in kwargs:
        kwargs = {**kwargs, "positions": module.positions}
    return args, kwargs


def _activation_layout(config) -> dict:
    """The residual stream's layout between blocks, as the model's sharding declares it.

    The embedding's output layout is the residual stream's (``sharding.py`` writes
    it there); with no sharding the stream is a plain tensor (``{}``).
    """
    sharding = config.tok_embeddings.sharding_config
    if sharding is None or sharding.out_dst_shardings is None:
        return {}
    return dict(sharding.out_dst_shardings)


def _activation_elements(config, unit: str) -> tuple[int, int]:
    """Per token, the activation elements a unit keeps for its backward: (replicated, tp-split).

    An estimate in the spirit of Korthikanti et al. (2022, §4.1), for attention whose
    score matrix is not stored (fused SDPA) and no dropout: a block keeps its two norm
    inputs and outputs and the residual (5 x dim, replicated under plain TP, split
    under SP) and q, k, v, the attention output and four feed-forward tensors
    (2 x dim + 2 x kv_dim + 4 x ffn_dim, split over tp). The head keeps the norm's
    input and output and the logits; the embedding its output.
    """
    dim = config.norm.dim
    if unit == PIPELINE.first_name:
        return dim, 0
    if unit == PIPELINE.last_name:
        return 2 * dim, config.output.out_features
    block = config.layers[int(unit.rsplit(".", 1)[1])]
    kv_dim = block.attention.wk.out_features
    ffn_dim = block.feed_forward.w1.out_features
    return 5 * dim, 2 * dim + 2 * kv_dim + 4 * ffn_dim


PIPELINE = PipelineLayout(
    first=("tok_embeddings",),
    layers="layers",
    last=("norm", "output"),
    shared=("rope", "mask"),
    stage=TransformerStage,
    activation_layout=_activation_layout,
    activation_elements=_activation_elements,
)
"""The Llama decoder's pipeline description (its family's ``pipeline``)."""
