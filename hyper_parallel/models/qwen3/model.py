"""Qwen3 dense: the shared decoder with QK-norm attention and, optionally, tied embeddings."""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.models.common.decoder import Decoder, TransformerBlock

__all__ = ["Transformer"]


class Transformer(Decoder):
    """Qwen3 dense decoder: ``forward(tokens (B, S)) -> logits (B, S, vocab)``.

    With ``tie_embeddings`` the output projection is the token embedding's weight (one
    parameter, which pipeline stages cannot split). Built by
    :func:`~hyper_parallel.models.qwen3.qwen3_config`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        layers: list[TransformerBlock.Config]
        tie_embeddings: bool = False

    def __init__(self, config: Transformer.Config) -> None:
        super().__init__(config)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
