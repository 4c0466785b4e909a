"""Activation checkpointing per transformer block: ``none``, ``full``, ``selective`` or ``op``.

``full`` recomputes every block's forward in backward: only each block's input is
kept. ``selective`` is layer-wise: every second block (blocks 1, 3, 5, ...) is
checkpointed and the others keep their activations, which trades about half the
activation memory for half the recomputation (torchtitan's layer-wise selective AC
with frequency 2). ``op`` is per-operator selective checkpointing in every block
(torchtitan's ``selective_ac_option = "op"``, its default "selective"): each block
keeps its input and the outputs of its expensive operators — the attention kernel,
every odd-numbered matmul of the block (1st, 3rd, ...) and tensor parallel's
reduce-scatters — and backward recomputes the rest (every second matmul, norms,
activations, rotary embeddings) from them (:class:`OpPolicy`). All use PyTorch's
non-reentrant ``torch.utils.checkpoint`` (``op`` with its
``create_selective_checkpoint_contexts``), which composes with DTensor, tensor/sequence
parallel boundaries, FSDP2 and ``torch.compile`` (around the compiled block). The
block stays the same module: only its ``forward`` is wrapped, so ``model.layers``,
parameter names and checkpoints are unchanged. Recomputation repeats the forward's
collectives (under ``op``, those whose outputs are not kept).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = [
    "AC_MODES",
    "SELECTIVE_EVERY",
    "OpPolicy",
    "check_mode",
    "checkpointed_blocks",
]

AC_MODES = ("none", "full", "selective", "op")
SELECTIVE_EVERY = 2
"""Under ``selective``, every this-many-th block is checkpointed (blocks 1, 3, 5, ...)."""


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`AC_MODES`."""
    if mode not in AC_MODES:
        raise ValueError(
            f"activation checkpointing mode {mode!r} is not one of {list(AC_MODES)}; "
            "use 'full' (every block), 'selective' (every second block) or 'op' (every "
            "block keeps its attention and every second matmul's outputs)."
        )


def checkpointed_blocks(num_blocks: int, mode: str) -> list[int]:
    """Indices of the blocks that ``mode`` checkpoints, out of ``num_blocks``.

    Example::

        checkpointed_blocks(4, "selective")  # [1, 3]
    """
    check_mode(mode)
    if mode == "none":
        return []
    if mode in ("full", "op"):
        return list(range(num_blocks))
    return [i for i in range(num_blocks) if (i + 1) % SELECTIVE_EVERY == 0]


@functools.cache
def _kept_operators() -> frozenset[Any]:
    """The operators whose outputs :class:`OpPolicy` keeps besides the matmuls: every
    fused attention kernel torch has (CUDA's flash, memory-efficient and cuDNN ones, the
    CPU's flash) and the functional reduce-scatter (tensor parallel's, so backward does
    not repeat it)."""
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


class OpPolicy:
    """Which operator outputs one block keeps under ``op`` checkpointing.

    Kept: the attention kernel's outputs, tensor parallel's reduce-scatters and every
    odd-numbered ``aten.mm`` of the block's forward (the 1st, 3rd, ...; a Llama block's
    ``wq``, ``wv``, ``w1``, ``w2``); everything else is recomputed in backward (``wk``,
    ``wo``, ``w3`` and every elementwise operator, norm and rotary embedding). Counts run
    separately for the forward and for its recomputation, so both choose the same
    operators. One instance serves one call of one block: :func:`op_context` makes a
    fresh one each time. The dry run asks the same question (:meth:`keeps`) to count
    what a block keeps.

    Example::

        policy = OpPolicy()
        [policy.keeps(torch.ops.aten.mm.default) for _ in range(3)]  # [True, False, True]
    """

    def __init__(self) -> None:
        self._mm = {False: 0, True: 0}

    def keeps(self, func: Any, recompute: bool = False) -> bool:
        """Whether the output of this call of ``func`` is kept (counted in call order)."""
        if func is torch.ops.aten.mm.default:
            self._mm[recompute] += 1
            return self._mm[recompute] % 2 == 1
        return func in _kept_operators()

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.keeps(func, ctx.is_recompute):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def op_context() -> Any:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``op`` checkpointing: a fresh
    :class:`OpPolicy` per call."""
    return create_selective_checkpoint_contexts(OpPolicy())


class _Checkpointed:
    """A block's ``forward`` run under non-reentrant activation checkpointing; with
    ``context_fn`` (:func:`op_context`), selective per operator."""

    def __init__(
        self, forward: Callable[..., Any], context_fn: Callable[[], Any] | None = None
    ) -> None:
        self.forward = forward
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.context_fn is None:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            self.forward, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs
        )
