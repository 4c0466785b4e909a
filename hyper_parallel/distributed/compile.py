"""``torch.compile`` per transformer block, as torchtitan applies it.

Each block's ``forward`` of ``model.layers`` is compiled with ``fullgraph=True``,
after the tensor-parallel plan and before FSDP2 wraps the block: the blocks share one
compiled graph per shape class (same code, parameters as graph inputs), a graph break
is an error rather than a silent slowdown, and module hooks (FSDP's all-gathers) stay
outside the compiled region. Both boundary paths (the fast path and DTensor dispatch)
trace without a break (see ``hyper_parallel.dmodule._fast``).

Activation checkpointing is applied after compile, around the compiled forward: its
recomputation reruns the compiled graph. (A checkpoint region traced inside the
graph — torchtitan's order — fails in this torch's AOTAutograd when the block's
activations are DTensors: it saves the DeviceMesh as a tensor.)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BACKENDS", "apply_compile", "blocks_of"]

BACKENDS = ("inductor", "aot_eager", "eager")
"""Backends the trainer accepts: torch's default code generator, and two for debugging."""


def blocks_of(model: nn.Module, *, what: str) -> list[nn.Module]:
    """The transformer blocks of ``model.layers`` (a ``ModuleList`` or ``ModuleDict``).

    Raises:
        ValueError: The model has no ``layers`` container; ``what`` names the caller.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"{what}: {type(model).__name__} has no `layers` ModuleList of transformer "
            "blocks; the trainer applies it to each block of model.layers."
        )
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    """Compile every block of ``model.layers`` in place with ``fullgraph=True``.

    The blocks stay the same modules (only ``forward`` is replaced by its compiled
    form), so ``model.layers``, parameter names and checkpoints are unchanged.

    Args:
        model: A model with a ``layers`` container, already parallelized.
        backend: A ``torch.compile`` backend from :data:`BACKENDS`.

    Raises:
        ValueError: For an unknown backend, or a model without ``layers``.

    Example::

        model.parallelize(mesh)
        apply_compile(model)  # then activation checkpointing, fully_shard
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"apply_compile: backend {backend!r} is not one of {list(BACKENDS)}; use "
            "'inductor' (default) or 'aot_eager' to debug."
        )
    for block in blocks_of(model, what="apply_compile"):
        block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)
