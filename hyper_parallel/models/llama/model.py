"""A Llama-3-style decoder: the shared decoder with dense SwiGLU blocks.

The layers, the block and the decoder loop live in :mod:`hyper_parallel.models.common`
(re-exported here); how they are placed on a mesh lives in ``sharding.py``, the presets
in ``config.py``. ``Transformer.forward(tokens, positions=None)``: without
``positions`` the tokens are the whole sequence ``0..S-1`` and attention is causal by
index; with them (a sequence split across ranks by context parallelism) the rotary
tables and the causal mask read each token's global position.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.models.common.decoder import Decoder, TransformerBlock

__all__ = ["Transformer", "TransformerBlock"]


class Transformer(Decoder):
    """Llama-3-style decoder: ``forward(tokens (B, S)) -> logits (B, S, vocab)``.

    Build one from a preset with :func:`~hyper_parallel.models.llama.llama3_config`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        layers: list[TransformerBlock.Config]
