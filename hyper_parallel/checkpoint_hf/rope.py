"""Llama 3.x's frequency-scaled rotary tables (``rope_type: "llama3"``) for checkpoints read
from Hugging Face: the Llama family's own (:mod:`hyper_parallel.models.llama.rope`)."""

from __future__ import annotations

from hyper_parallel.models.llama.rope import Llama3RotaryEmbedding as Llama3RotaryEmbedding
from hyper_parallel.models.llama.rope import llama3_rope_config as llama3_rope_config

__all__ = ["Llama3RotaryEmbedding", "llama3_rope_config"]
