"""A Llama-3-style decoder with declarative tensor-, sequence- and context-parallel layouts.

Importing this package registers one :class:`~hyper_parallel.dmodule.ModelSpec` per
preset (``llama3-debug``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``, and
``llama3.1-8b``, ``llama3.1-70b``, ``llama3.1-405b``: rope scaled to 131,072 positions). Each spec's
``config(**overrides)`` returns a ``Transformer.Config``; its ``family`` (:data:`FAMILY`,
a :class:`~hyper_parallel.dmodule.ModelFamily`) declares the sharding functions (``tp``,
``tp_sp``, ``cp``; no ``ep``), the loss, ``num_params``, the blocks and the pipeline stages.

Example::

    import torch
    from hyper_parallel.dmodule import get_spec
    from hyper_parallel.models.llama import apply_tp, cross_entropy_loss

    spec = get_spec("llama3-debug")
    config = spec.sharding("tp")(spec.config())   # or apply_tp(preset_config("llama3-debug"))
    with torch.device("meta"):
        model = config.build()
    # model.parallelize(mesh["tp"]); model.to_empty(device="cpu"); model.init_states()
    # loss = cross_entropy_loss(model(tokens), targets); loss.backward()
"""

from __future__ import annotations

from hyper_parallel.models.common.decoder import TransformerStage as TransformerStage
from hyper_parallel.models.common.family import dense_family, register_hf_spec, register_presets
from hyper_parallel.models.common.layers import Attention as Attention
from hyper_parallel.models.common.layers import FeedForward as FeedForward
from hyper_parallel.models.common.layers import RMSNorm as RMSNorm
from hyper_parallel.models.common.layers import RotaryEmbedding as RotaryEmbedding
from hyper_parallel.models.common.layers import (
    ScaledDotProductAttention as ScaledDotProductAttention,
)
from hyper_parallel.models.common.layers import apply_rotary_emb as apply_rotary_emb
from hyper_parallel.models.common.layers import causal_mask as causal_mask
from hyper_parallel.models.common.loss import cross_entropy_loss as cross_entropy_loss
from hyper_parallel.models.common.sharding import attention_heads as attention_heads
from hyper_parallel.models.llama.config import LLAMA31_ROPE_SCALING as LLAMA31_ROPE_SCALING
from hyper_parallel.models.llama.config import PRESETS as PRESETS
from hyper_parallel.models.llama.config import llama3_config as llama3_config
from hyper_parallel.models.llama.config import num_params as num_params
from hyper_parallel.models.llama.config import preset_config as preset_config
from hyper_parallel.models.llama.hf import HF as HF
from hyper_parallel.models.llama.hf import llama_hf_config as llama_hf_config
from hyper_parallel.models.llama.model import Transformer as Transformer
from hyper_parallel.models.llama.model import TransformerBlock as TransformerBlock
from hyper_parallel.models.llama.rope import Llama3RotaryEmbedding as Llama3RotaryEmbedding
from hyper_parallel.models.llama.sharding import apply_cp as apply_cp
from hyper_parallel.models.llama.sharding import apply_tp as apply_tp
from hyper_parallel.models.llama.sharding import apply_tp_sp as apply_tp_sp

__all__ = [
    "FAMILY",
    "HF",
    "LLAMA31_ROPE_SCALING",
    "PIPELINE",
    "PRESETS",
    "Attention",
    "FeedForward",
    "Llama3RotaryEmbedding",
    "RMSNorm",
    "RotaryEmbedding",
    "ScaledDotProductAttention",
    "Transformer",
    "TransformerBlock",
    "TransformerStage",
    "apply_cp",
    "apply_rotary_emb",
    "apply_tp",
    "apply_tp_sp",
    "attention_heads",
    "causal_mask",
    "cross_entropy_loss",
    "llama3_config",
    "llama_hf_config",
    "num_params",
    "preset_config",
]

FAMILY = dense_family(
    "llama3",
    (apply_tp, apply_tp_sp, apply_cp),
    num_params,
    why_no_ep="Llama is dense: it has no routed experts to place on ep",
    hf=HF,
)
"""What the infrastructure needs to know about the Llama family (shared by its presets)."""

PIPELINE = FAMILY.pipeline
"""How the model is cut into pipeline stages (the shared decoder's units)."""

register_presets(
    FAMILY,
    PRESETS,
    preset_config,
    {
        "llama3-debug": "Llama-3-style decoder, debug size (trains in seconds on CPU)",
        "llama3-8b": "Llama 3 8B shapes",
        "llama3-70b": "Llama 3 70B shapes",
        "llama3-405b": "Llama 3 405B shapes",
        "llama3.1-8b": "Llama 3.1 8B: rope scaled to 131,072 positions",
        "llama3.1-70b": "Llama 3.1 70B: rope scaled to 131,072 positions",
        "llama3.1-405b": "Llama 3.1 405B: rope scaled to 131,072 positions",
    },
)
register_hf_spec(FAMILY, llama_hf_config)
