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
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        rope: RotaryEmbedding.Config
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
        self.layers = ModuleDict({key: c.build() for key, c in config.layers.items()})
        if config.norm is not None:
            self.norm = config.norm.build()
            self.output = config.output.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if hasattr(self, "tok_embeddings") else x
        cos, sin = self.rope(h.shape[1])
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if hasattr(self, "output"):
            return self.output(self.norm(h))
        return h


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
    shared=("rope",),
    stage=TransformerStage,
    activation_layout=_activation_layout,
    activation_elements=_activation_elements,
)
"""The Llama decoder's pipeline description (registered as ``extras["pipeline"]``)."""
