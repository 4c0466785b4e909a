"""What decoder families share: layers, the decoder loop and its pipeline stages, the
config base and the tensor-, sequence- and context-parallel placements.

A family package (``llama``, ``qwen3``, ``qwen3_moe``) says only how it differs: its
config factory and presets, its odd layer (Qwen3-MoE's mixture of experts), how that
layer is placed, and its registration (a
:class:`~hyper_parallel.dmodule.ModelFamily`).
"""

from hyper_parallel.models.common.decoder import Decoder as Decoder
from hyper_parallel.models.common.decoder import DecoderBlock as DecoderBlock
from hyper_parallel.models.common.decoder import TransformerBlock as TransformerBlock
from hyper_parallel.models.common.decoder import TransformerStage as TransformerStage
from hyper_parallel.models.common.decoder import decoder_pipeline as decoder_pipeline
from hyper_parallel.models.common.decoder import run_blocks as run_blocks
from hyper_parallel.models.common.layers import Attention as Attention
from hyper_parallel.models.common.layers import CausalMask as CausalMask
from hyper_parallel.models.common.layers import Embedding as Embedding
from hyper_parallel.models.common.layers import FeedForward as FeedForward
from hyper_parallel.models.common.layers import Linear as Linear
from hyper_parallel.models.common.layers import RMSNorm as RMSNorm
from hyper_parallel.models.common.layers import RotaryEmbedding as RotaryEmbedding
from hyper_parallel.models.common.layers import (
    ScaledDotProductAttention as ScaledDotProductAttention,
)
from hyper_parallel.models.common.layers import apply_rotary_emb as apply_rotary_emb
from hyper_parallel.models.common.layers import causal_mask as causal_mask
from hyper_parallel.models.common.layers import repeat_heads as repeat_heads
from hyper_parallel.models.common.loss import cross_entropy_loss as cross_entropy_loss
from hyper_parallel.models.common.sharding import attention_heads as attention_heads

__all__ = [
    "Attention",
    "CausalMask",
    "Decoder",
    "DecoderBlock",
    "Embedding",
    "FeedForward",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "ScaledDotProductAttention",
    "TransformerBlock",
    "TransformerStage",
    "apply_rotary_emb",
    "attention_heads",
    "causal_mask",
    "cross_entropy_loss",
    "decoder_pipeline",
    "repeat_heads",
    "run_blocks",
]
