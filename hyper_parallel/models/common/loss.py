"""Next-token cross entropy that never gathers the vocabulary.

With the output projection column-parallel, logits arrive as a DTensor sharded on
the vocabulary dim; PyTorch's ``loss_parallel`` computes the loss from the shards
(all-reduces of one value per token instead of a full-vocab all-gather).

With the sequence split across ranks (context parallelism: logits ``Shard(1)`` on
``cp``), each rank scores its own tokens against its own targets, and the sum is divided
by the non-ignored tokens of the *whole* sequence (one all-reduce of a count over
``cp``), times ``cp``: the mean of the ranks' losses is the global mean, and the
data-parallel average of the gradients over ``cp`` (FSDP2 over ``dp_shard x cp``) is the
one-device gradient — also when targets hold ``ignore_index`` (-100, padding or a
prompt), which the ranks' parts of a sequence hold in different numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard

__all__ = ["cross_entropy_loss"]

_IGNORE_INDEX = -100
"""Targets ``F.cross_entropy`` leaves out (its default ``ignore_index``)."""


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits`` ``(B, S, V)`` against token ids ``targets`` ``(B, S)``.

    Logits sharded on the vocabulary dim (a DTensor on a 1-D mesh, as the
    column-parallel output projection leaves them) go through PyTorch's
    ``loss_parallel``, forward *and* backward, so ``loss.backward()`` may be called
    anywhere. Replicated DTensor logits are used through their local copy; plain
    tensors through ``F.cross_entropy``. Logits sharded on the sequence dim (``Shard(1)``
    on ``cp``: context parallelism) are scored on this rank's tokens against
    this rank's ``targets``: the result is the rank's sum over its tokens divided by the
    mean count of non-ignored tokens per rank over the sequence-splitting axes, so the
    ranks' mean is one device's mean over the whole sequence, targets of -100
    (``ignore_index``) left out as ``F.cross_entropy`` leaves them (vocab-parallel over
    the one axis, if any, that shards the vocabulary).

    Args:
        logits: Plain tensor, or DTensor sharded on its last dim (one mesh axis), on
            the sequence dim, or replicated.
        targets: Plain tensor of token ids (this rank's, when logits are sequence-sharded).

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
        if _token_split(logits):
            return _local_tokens_loss(logits, targets)
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
    def forward(
        ctx: Any, logits: DTensor, targets: torch.Tensor, reduction: str = "mean"
    ) -> torch.Tensor:
        leaf = logits.detach().requires_grad_(logits.requires_grad)
        with torch.enable_grad(), loss_parallel():
            loss = F.cross_entropy(leaf, targets, reduction=reduction)
        ctx.leaf, ctx.loss = leaf, loss  # the inner graph, replayed in backward
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        leaf, loss = ctx.leaf, ctx.loss
        del ctx.leaf, ctx.loss
        if not leaf.requires_grad:
            return None, None, None
        with loss_parallel():
            (grad_logits,) = torch.autograd.grad(loss, leaf, grad_loss)
        return grad_logits, None, None


def _token_split(logits: DTensor) -> bool:
    """Sharded on the sequence dim on some axis, else only Shard(vocab) (one axis) or Replicate."""
    vocab, seq = logits.ndim - 1, logits.ndim - 2
    placements = logits.placements
    allowed = all(p.is_replicate() or p.is_shard(seq) or p.is_shard(vocab) for p in placements)
    num_vocab = sum(p.is_shard(vocab) for p in placements)
    return seq > 0 and any(p.is_shard(seq) for p in placements) and allowed and num_vocab <= 1


def _local_tokens_loss(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """This rank's share of the mean cross entropy over the whole (sequence-split) batch.

    The rank's sum over its tokens, divided by the non-ignored tokens of every rank on
    the sequence-splitting axes and multiplied by their number: the ranks' mean is then
    the one-device mean, whatever share of ignored targets each rank holds (a mean of the
    ranks' own means weighs a rank's tokens by how few it kept).
    """
    placements = tuple(logits.placements)
    local = logits.to_local(grad_placements=placements)
    if targets.shape != local.shape[:-1]:
        raise ValueError(
            f"cross_entropy_loss: logits are split over the sequence ({list(placements)}), so "
            f"targets must be this rank's: shape {tuple(local.shape[:-1])}, got "
            f"{tuple(targets.shape)}. Cut targets like the tokens "
            "(context_parallel.shard_sequence(targets, cp_rank, cp_size))."
        )
    vocab, seq = logits.ndim - 1, logits.ndim - 2
    mesh = logits.device_mesh
    num_seq_ranks = math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_shard(seq))
    # The non-ignored targets of every rank that holds a part of these sequences.
    # Counted in fp32 at least: bf16 holds integers exactly only up to 256.
    count = (targets != _IGNORE_INDEX).sum().to(torch.promote_types(local.dtype, torch.float32))
    count = DTensor.from_local(
        count,
        mesh,
        [Partial() if p.is_shard(seq) else Replicate() for p in placements],
        run_check=False,
    ).full_tensor()
    scale = num_seq_ranks / count
    vocab_axes = [i for i, p in enumerate(placements) if p.is_shard(vocab)]
    if not vocab_axes:
        total = F.cross_entropy(local.flatten(0, -2), targets.flatten(), reduction="sum")
        return (total * scale).to(total.dtype)
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "cross_entropy_loss: vocab- and token-sharded logits need a mesh with "
            "mesh_dim_names; build the mesh with names (MeshLayout.build does)."
        )
    vocab_mesh = mesh[names[vocab_axes[0]]]
    shape = (*local.shape[:-1], logits.shape[-1])
    shards = DTensor.from_local(
        local, vocab_mesh, [Shard(vocab)], run_check=False, shape=shape, stride=_strides(shape)
    )
    total = _VocabParallelCrossEntropy.apply(shards.flatten(0, -2), targets.flatten(), "sum")
    scale = DTensor.from_local(scale, vocab_mesh, [Replicate()], run_check=False)
    return (total * scale).to(total.dtype)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))
