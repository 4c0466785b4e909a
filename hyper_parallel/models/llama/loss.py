"""Next-token cross entropy that never gathers the vocabulary.

With the output projection column-parallel, logits arrive as a DTensor sharded on
the vocabulary dim; PyTorch's ``loss_parallel`` computes the loss from the shards
(all-reduces of one value per token instead of a full-vocab all-gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from hyper_parallel.core.dtensor.dtensor import DTensor

__all__ = ["cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits`` ``(B, S, V)`` against token ids ``targets`` ``(B, S)``.

    Logits sharded on the vocabulary dim (a DTensor on a 1-D mesh, as the
    column-parallel output projection leaves them) go through PyTorch's
    ``loss_parallel``, forward *and* backward, so ``loss.backward()`` may be called
    anywhere. Replicated DTensor logits are used through their local copy; plain
    tensors through ``F.cross_entropy``.

    Args:
        logits: Plain tensor, or DTensor sharded on its last dim or replicated.
        targets: Plain tensor of token ids.

    Returns:
        The scalar loss: a replicated DTensor for vocab-sharded logits, else a tensor.

    Raises:
        ValueError: For DTensor logits placed any other way; the message names them.

    Example:
        >>> logits = torch.randn(2, 3, 5, requires_grad=True)
        >>> loss = cross_entropy_loss(logits, torch.tensor([[0, 1, 2], [3, 4, 0]]))
        >>> loss.backward()
    """
    if isinstance(logits, DTensor):
        placements = tuple(logits.placements)
        if len(placements) == 1 and placements[0].is_shard(logits.ndim - 1):
            return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten())
        if not all(p.is_replicate() for p in placements):
            raise ValueError(
                f"cross_entropy_loss: logits are a DTensor placed {list(placements)} on a "
                f"{logits.device_mesh.ndim}-D mesh; expected Shard({logits.ndim - 1}) (the "
                "vocabulary) on a 1-D mesh, or Replicate. Redistribute the logits, or "
                "parallelize the model on its tensor-parallel mesh only (mesh['tp'])."
            )
        logits = logits.to_local()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``loss_parallel`` cross entropy whose backward also runs under ``loss_parallel``.

    ``loss_parallel`` must be active while its ops run in both passes; wrapping it
    here (as ``torch.utils.checkpoint`` wraps a region) frees the caller from holding
    the context around ``backward()``.
    """

    @staticmethod
    def forward(ctx: Any, logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
        leaf = logits.detach().requires_grad_(logits.requires_grad)
        with torch.enable_grad(), loss_parallel():
            loss = F.cross_entropy(leaf, targets)
        ctx.leaf, ctx.loss = leaf, loss  # the inner graph, replayed in backward
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        leaf, loss = ctx.leaf, ctx.loss
        del ctx.leaf, ctx.loss
        if not leaf.requires_grad:
            return None, None
        with loss_parallel():
            (grad_logits,) = torch.autograd.grad(loss, leaf, grad_loss)
        return grad_logits, None
