"""Reversible mappings between Hugging Face tensor names and our parameters; each family's
adapter (``ModelFamily.hf``, in the family's folder) declares its own list.

A :class:`TensorMap` says which Hugging Face tensor(s) one of our parameters is made
of, and how the layout differs:

- ``hf`` is one name, or one name per expert when our parameter stacks experts on
  dim 0 (one Hugging Face tensor per expert);
- ``rotary_head_dim`` marks rows that hold rotary heads (query and key projections,
  per-head query/key norms) when Hugging Face rotates the two halves of a head
  (``rotate_half``: pairs ``(i, i + D/2)``) and
  :func:`~hyper_parallel.models.common.apply_rotary_emb` adjacent pairs
  ``(2i, 2i + 1)``: our row ``h D + 2i + j`` is Hugging Face's row
  ``h D + i + j D/2`` (:func:`rotary_rows`) — the same model, its logits equal.

Loading reads, for our rows ``r``, Hugging Face rows ``rotary_rows(r)``; saving writes
``ours[inverse]``. :func:`family_maps` lists every parameter of a model of a family;
the loader and the saver use that one list, so they invert each other exactly.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["TensorMap", "family_maps", "rotary_rows", "to_hf_tensors"]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the Hugging Face tensor(s) it is made of.

    Args:
        ours: Our parameter's path (``layers.0.attention.wq.weight``).
        hf: Hugging Face names: one, or one per expert (stacked on our dim 0).
        rotary_head_dim: Head width when dim 0 (of each Hugging Face tensor) holds
            rotary heads in ``rotate_half`` order; ``0`` for none.
    """

    ours: str
    hf: tuple[str, ...]
    rotary_head_dim: int = 0

    @property
    def stacked(self) -> bool:
        """Whether our parameter stacks several Hugging Face tensors on dim 0."""
        return len(self.hf) > 1

    def hf_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Hugging Face dim-0 indices of our dim-0 indices ``rows`` (of one tensor)."""
        if not self.rotary_head_dim:
            return rows
        return rotary_rows(rows, self.rotary_head_dim)


def rotary_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Hugging Face (``rotate_half``) rows of our (adjacent-pair) rows of rotary heads.

    Example:
        >>> rotary_rows(torch.arange(4), 4).tolist()
        [0, 2, 1, 3]
    """
    head, j = rows // head_dim, rows % head_dim
    return head * head_dim + j // 2 + (j % 2) * (head_dim // 2)


def family_maps(
    family: str, config: object, *, tie_word_embeddings: bool = False
) -> list[TensorMap]:
    """Every parameter of a model of ``family`` built from our ``config``, mapped: the
    family's adapter's :meth:`~hyper_parallel.contract.HFAdapter.tensor_maps`.

    Args:
        family: The family's name (``ModelFamily.name``) of a registered family with a
            Hugging Face adapter.
        config: Our (unsharded) model config.
        tie_word_embeddings: The output projection is the embedding in the checkpoint.

    Raises:
        ValueError: No registered family of that name ships an adapter.
    """
    from hyper_parallel.checkpoint_hf.config import hf_families

    families = {f.name: f for f in hf_families()}
    if family not in families:
        raise ValueError(
            f"family_maps: no Hugging Face adapter for family {family!r} "
            f"(families with one: {', '.join(families)})."
        )
    adapter = families[family].hf
    assert adapter is not None  # hf_families() holds only families with an adapter
    return adapter.tensor_maps(config, tie_word_embeddings=tie_word_embeddings)


def to_hf_tensors(entry: TensorMap, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of one of our full (unsharded) parameters: the inverse of loading."""
    pieces = full.unbind(0) if entry.stacked else (full,)
    out = {}
    for name, piece in zip(entry.hf, pieces, strict=True):
        if entry.rotary_head_dim:
            # ours[r] = hf[rotary_rows(r)]  =>  hf[rotary_rows(r)] = ours[r]
            rows = entry.hf_rows(torch.arange(piece.shape[0]))
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(piece.shape[0])
            piece = piece[inverse]
        out[name] = piece.contiguous()
    return out
