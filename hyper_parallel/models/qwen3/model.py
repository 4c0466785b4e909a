"""Qwen3 dense: the shared decoder with QK-norm attention and, optionally, tied embeddings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
        self.tie_embeddings = config.tie_embeddings
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the output projection the embedding's parameter again (``tie_embeddings``).

        Moving meta parameters (``to_empty``) makes a new parameter per module, and
        FSDP2 gives a tied DTensor (context parallelism's plan) one sharded parameter per
        module; both are followed by this.
        """
        if self.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Transformer:
        # Moving meta parameters (``to_empty``) makes a new parameter per module: tie again.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self
