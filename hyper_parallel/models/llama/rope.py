"""Llama 3.x's frequency-scaled rotary tables, as a drop-in ``RotaryEmbedding``.

Llama 3.1 and later stretch the rotary frequencies of long wavelengths by ``factor``
and blend the middle band smoothly ("The Llama 3 Herd of Models", Dubey et al., 2024;
Hugging Face's ``rope_type: "llama3"``): for each frequency ``f`` of the plain table,
with wavelength ``w = 2 pi / f`` and ``L = original_max_position_embeddings``,

- ``w < L / high_freq_factor``: ``f`` unchanged;
- ``w > L / low_freq_factor``: ``f / factor``;
- in between: ``(1 - s) f / factor + s f`` with
  ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

The Llama 3.1 presets (``llama3.1-8b`` ...) and checkpoints read from Hugging Face with
``rope_type: "llama3"`` use it. Only the tables change; the model's forward, sharding and
pipeline stages are those of :class:`~hyper_parallel.models.common.layers.RotaryEmbedding`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.models.common.layers import RotaryEmbedding

__all__ = ["Llama3RotaryEmbedding", "llama3_rope_config"]


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

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The scaled rotary frequencies, ``(head_dim // 2,)`` (radians per position)."""
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
        return torch.where(medium, smoothed, scaled)

    def compute_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq(device))
        return {"cos": angles.cos(), "sin": angles.sin()}


def llama3_rope_config(
    base: RotaryEmbedding.Config, scaling: Mapping[str, Any]
) -> Llama3RotaryEmbedding.Config:
    """``base`` (head_dim, positions, theta) with Llama 3.x frequency ``scaling``: the keys
    of Hugging Face's ``rope_parameters`` (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).

    Raises:
        ValueError: A key missing or one the scaling does not have, named.
    """
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    given = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
    missing, extra = [k for k in keys if k not in given], sorted(set(given) - set(keys))
    if missing or extra:
        raise ValueError(
            f"rope_scaling: missing {missing}, unknown {extra}; Llama 3.x scaling takes "
            f"exactly {list(keys)}."
        )
    return Llama3RotaryEmbedding.Config(
        head_dim=base.head_dim,
        max_seq_len=base.max_seq_len,
        theta=base.theta,
        factor=float(given["factor"]),
        low_freq_factor=float(given["low_freq_factor"]),
        high_freq_factor=float(given["high_freq_factor"]),
        original_max_position_embeddings=int(given["original_max_position_embeddings"]),
    )
