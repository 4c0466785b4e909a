"""Llama 3.x's frequency-scaled rotary tables, as a drop-in ``RotaryEmbedding``.

Llama 3.1 and later stretch the rotary frequencies of long wavelengths by ``factor``
and blend the middle band smoothly ("The Llama 3 Herd of Models", Dubey et al., 2024;
Hugging Face's ``rope_type: "llama3"``): for each frequency ``f`` of the plain table,
with wavelength ``w = 2 pi / f`` and ``L = original_max_position_embeddings``,

- ``w < L / high_freq_factor``: ``f`` unchanged;
- ``w > L / low_freq_factor``: ``f / factor``;
- in between: ``(1 - s) f / factor + s f`` with
  ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

Only the tables change; the model's forward, sharding and pipeline stages are those
of :class:`~hyper_parallel.models.common.layers.RotaryEmbedding`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyper_parallel.models.common.layers import RotaryEmbedding

__all__ = ["Llama3RotaryEmbedding"]


class Llama3RotaryEmbedding(RotaryEmbedding):
    """:class:`RotaryEmbedding` with Llama 3.x frequency scaling (``rope_type: llama3``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RotaryEmbedding.Config):
        factor: float
        low_freq_factor: float
        high_freq_factor: float
        original_max_position_embeddings: int

    def __init__(self, config: Llama3RotaryEmbedding.Config) -> None:
        super().__init__(config)
        self.factor = config.factor
        self.low_freq_factor = config.low_freq_factor
        self.high_freq_factor = config.high_freq_factor
        self.original_max_position_embeddings = config.original_max_position_embeddings

    def compute_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        old_len = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(
            wavelen > old_len / self.low_freq_factor, inv_freq / self.factor, inv_freq
        )
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= old_len / self.high_freq_factor) & (
            wavelen <= old_len / self.low_freq_factor
        )
        inv_freq = torch.where(medium, smoothed, scaled)
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        return {"cos": angles.cos(), "sin": angles.sin()}
