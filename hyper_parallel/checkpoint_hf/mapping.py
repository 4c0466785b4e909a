"""One declared, reversible mapping per family: Hugging Face tensor names <-> our parameters.

A :class:`TensorMap` says which Hugging Face tensor(s) one of our parameters is made
of, and how the layout differs:

- ``hf`` is one name, or one name per expert when our parameter stacks experts on
  dim 0 (``moe.experts.w1[e]`` is ``mlp.experts.{e}.gate_proj.weight``);
- ``rotary_head_dim`` marks rows that hold rotary heads (``wq``, ``wk``, and
  Qwen3's per-head ``q_norm``/``k_norm``): Hugging Face rotates the two halves of a
  head (``rotate_half``: pairs ``(i, i + D/2)``), our
  :func:`~hyper_parallel.models.llama.model.apply_rotary_emb` rotates adjacent pairs
  ``(2i, 2i + 1)``, so our row ``h D + 2i + j`` is Hugging Face's row
  ``h D + i + j D/2`` (:func:`rotary_rows`) — the same model, its logits equal.

Loading reads, for our rows ``r``, Hugging Face rows ``rotary_rows(r)``; saving writes
``ours[inverse]``. :func:`family_maps` lists every parameter of a model of the family;
the loader and the saver use that one list, so they invert each other exactly.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["HF_FAMILIES", "HFFamily", "TensorMap", "family_maps", "rotary_rows", "to_hf_tensors"]


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
    """Every parameter of a model of ``family`` built from our ``config``, mapped.

    Args:
        family: ``"llama"``, ``"qwen3"`` or ``"qwen3_moe"``.
        config: Our (unsharded) ``Transformer.Config``.
        tie_word_embeddings: The output projection is the embedding
            (``model.embed_tokens.weight``) in the checkpoint. A model whose output
            shares the embedding's parameter (Qwen3's ``tie_embeddings``) has no
            ``output.weight`` of its own, so no entry for it.
    """
    if family not in ("llama", "qwen3", "qwen3_moe"):
        raise ValueError(
            f"family_maps: no mapping for family {family!r} (llama, qwen3, qwen3_moe)."
        )
    maps = [TensorMap("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    for i, block in enumerate(config.layers):  # type: ignore[attr-defined]
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        head_dim = block.attention.head_dim
        maps += [
            TensorMap(ours + "attention_norm.weight", (hf + "input_layernorm.weight",)),
            TensorMap(ours + "ffn_norm.weight", (hf + "post_attention_layernorm.weight",)),
            TensorMap(ours + "attention.wq.weight", (hf + "self_attn.q_proj.weight",), head_dim),
            TensorMap(ours + "attention.wk.weight", (hf + "self_attn.k_proj.weight",), head_dim),
            TensorMap(ours + "attention.wv.weight", (hf + "self_attn.v_proj.weight",)),
            TensorMap(ours + "attention.wo.weight", (hf + "self_attn.o_proj.weight",)),
        ]
        if family in ("qwen3", "qwen3_moe"):  # per-head norms, rotary rows like q and k
            for norm in ("q_norm", "k_norm"):
                maps.append(
                    TensorMap(
                        f"{ours}attention.{norm}.weight",
                        (f"{hf}self_attn.{norm}.weight",),
                        head_dim,
                    )
                )
        if family in ("llama", "qwen3"):
            maps += [
                TensorMap(ours + "feed_forward.w1.weight", (hf + "mlp.gate_proj.weight",)),
                TensorMap(ours + "feed_forward.w2.weight", (hf + "mlp.down_proj.weight",)),
                TensorMap(ours + "feed_forward.w3.weight", (hf + "mlp.up_proj.weight",)),
            ]
        else:
            experts = range(block.moe.experts.num_experts)
            maps.append(TensorMap(ours + "moe.router.weight", (hf + "mlp.gate.weight",)))
            for w, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                maps.append(
                    TensorMap(
                        ours + f"moe.experts.{w}",
                        tuple(f"{hf}mlp.experts.{e}.{name}.weight" for e in experts),
                    )
                )
    output = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
    maps.append(TensorMap("norm.weight", ("model.norm.weight",)))
    if not getattr(config, "tie_embeddings", False):
        maps.append(TensorMap("output.weight", (output,)))
    return maps


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


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """A family's Hugging Face description (the ``hf`` slot of its ``ModelFamily``).

    Args:
        name: Our family name (``"llama"``, ``"qwen3"``, ``"qwen3_moe"``).
        architectures: The ``config.json`` architectures it reads.
        spec: The registered spec whose factory takes the converted config.
    """

    name: str
    architectures: tuple[str, ...]
    spec: str

    def maps(self, config: object, *, tie_word_embeddings: bool = False) -> list[TensorMap]:
        """:func:`family_maps` of this family."""
        return family_maps(self.name, config, tie_word_embeddings=tie_word_embeddings)


HF_FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily("llama", ("LlamaForCausalLM", "MistralForCausalLM"), "llama3-hf"),
    "qwen3": HFFamily("qwen3", ("Qwen3ForCausalLM",), "qwen3-hf"),
    "qwen3_moe": HFFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3-moe-hf"),
}
"""Every family with a Hugging Face mapping."""
