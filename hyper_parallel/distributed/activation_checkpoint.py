"""Activation checkpointing per transformer block: ``none``, ``full`` or ``selective``.

``full`` recomputes every block's forward in backward: only each block's input is
kept. ``selective`` is layer-wise: every second block (blocks 1, 3, 5, ...) is
checkpointed and the others keep their activations, which trades about half the
activation memory for half the recomputation (torchtitan's layer-wise selective AC
with frequency 2). Both use PyTorch's non-reentrant ``torch.utils.checkpoint``,
which composes with DTensor, tensor/sequence parallel boundaries, FSDP2 and
``torch.compile`` (around the compiled block). The block stays the same module:
only its ``forward`` is wrapped, so ``model.layers``, parameter names and
checkpoints are unchanged. Recomputation repeats the forward's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import checkpoint

__all__ = [
    "AC_MODES",
    "SELECTIVE_EVERY",
    "check_mode",
    "checkpointed_blocks",
]

AC_MODES = ("none", "full", "selective")
SELECTIVE_EVERY = 2
"""Under ``selective``, every this-many-th block is checkpointed (blocks 1, 3, 5, ...)."""


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`AC_MODES`."""
    if mode not in AC_MODES:
        raise ValueError(
            f"activation checkpointing mode {mode!r} is not one of {list(AC_MODES)}; "
            "use 'full' (every block) or 'selective' (every second block)."
        )


def checkpointed_blocks(num_blocks: int, mode: str) -> list[int]:
    """Indices of the blocks that ``mode`` checkpoints, out of ``num_blocks``.

    Example::

        checkpointed_blocks(4, "selective")  # [1, 3]
    """
    check_mode(mode)
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_blocks))
    return [i for i in range(num_blocks) if (i + 1) % SELECTIVE_EVERY == 0]


class _Checkpointed:
    """A block's ``forward`` run under non-reentrant activation checkpointing."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
