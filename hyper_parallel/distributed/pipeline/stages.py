"""A rank's stages initialized unit by unit (the builder builds them:
:func:`~hyper_parallel.distributed.builder.build_stages`).

Initialization is per unit: each unit is initialized under its own seed derived from
the run's seed and the unit's name (:func:`init_states_by_unit`), so a one-device model
initialized the same way equals the union of the stages at any split.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from hyper_parallel.distributed.pipeline.units import PipelineLayout

__all__ = ["init_states_by_unit", "unit_seed"]


def unit_seed(seed: int, unit: str) -> int:
    """The seed unit ``unit`` is initialized with: a stable mix of the run seed and its name."""
    return (seed * 1_000_003 + zlib.crc32(unit.encode())) % (2**63)


def init_states_by_unit(model: nn.Module, layout: PipelineLayout, seed: int) -> None:
    """Initialize a full model or a stage unit by unit, each under :func:`unit_seed`.

    The same unit gets the same values whichever stage holds it and whatever the
    tensor or data parallel sharding (``init_states`` is shard-consistent), so the
    stages of a pipeline equal a one-device model initialized this way.

    Args:
        model: A model or a stage built from ``layout`` (after ``to_empty``).
        layout: The model's pipeline description.
        seed: The run's seed.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []

    def seeded(name: str, modules: list[nn.Module]) -> None:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(unit_seed(seed, name))
            for m in modules:
                m.init_states()

    first = [getattr(model, f) for f in layout.first if hasattr(model, f)]
    if first:
        seeded(layout.first_name, first)
    blocks = getattr(model, layout.layers)
    items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    for key, block in items:
        seeded(f"{layout.layers}.{key}", [block])
    last = [getattr(model, f) for f in layout.last if hasattr(model, f)]
    if last:
        seeded(layout.last_name, last)
    for f in layout.shared:
        seeded(f, [getattr(model, f)])
