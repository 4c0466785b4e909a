"""Sampling from a model on one process, with a KV cache.

:func:`generate` runs one of our decoders (a shared ``Decoder`` of any family, unsharded) token by
token: the prompt once, then one token per step, each layer's keys and values kept
(:class:`KVCache`) so a step costs one token's compute. It uses the model's own
modules (norms, projections, rotary tables, feed-forward or experts) in the order
of their ``forward``; only the attention over the cached keys is written here, as
``scaled_dot_product_attention`` with the causal mask of the new positions — the
training forward is untouched. Greedy by default; ``temperature`` and ``top_k``
sample with a seeded generator. Stops after ``max_new_tokens`` or at an EOS id.

``hyper-parallel generate (--hf-checkpoint DIR | --checkpoint CKPT) --prompt TEXT``
loads the model and the checkpoint's ``tokenizer.json`` (``tokenizers``) and prints
the continuation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.models.common.layers import apply_rotary_emb

__all__ = ["KVCache", "forward_cached", "generate"]


@dataclasses.dataclass
class KVCache:
    """Per layer: keys and values ``(B, S_cached, H_kv, D)`` of the positions seen so far."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls([None] * num_layers, [None] * num_layers)

    @property
    def length(self) -> int:
        """Positions cached."""
        return 0 if self.keys[0] is None else self.keys[0].shape[1]


def _attention(attn: nn.Module, x: torch.Tensor, cos, sin, cache: KVCache, i: int, start: int):
    bsz, seq_len, _ = x.shape
    q, k, v = (w(x).view(bsz, seq_len, -1, attn.head_dim) for w in (attn.wq, attn.wk, attn.wv))
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    if cache.keys[i] is not None:
        k = torch.cat((cache.keys[i], k), dim=1)
        v = torch.cat((cache.values[i], v), dim=1)
    cache.keys[i], cache.values[i] = k, v
    q_pos = torch.arange(start, start + seq_len, device=x.device)
    k_pos = torch.arange(k.shape[1], device=x.device)
    mask = q_pos[:, None] >= k_pos[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return attn.wo(out.transpose(1, 2).flatten(-2))


def forward_cached(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of ``tokens`` ``(B, S)`` following the cached positions; extends ``cache``."""
    start = cache.length
    h = model.tok_embeddings(tokens)
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    cos, sin = model.rope(start + tokens.shape[1], positions)
    for i, layer in enumerate(model.layers):
        h = h + _attention(layer.attention, layer.attention_norm(h), cos, sin, cache, i, start)
        ffn = getattr(layer, layer.ffn_name)  # the block's declared feed-forward
        h = h + ffn(layer.ffn_norm(h))
    return model.output(model.norm(h))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """The new token ids after ``prompt`` (greedy when ``temperature`` is 0).

    Works for the decoders of every family: the blocks'
    attention (with or without per-head norms) and feed-forward or experts.

    Args:
        model: One of our decoders, unsharded, in this process.
        prompt: Token ids (at least one).
        max_new_tokens: Most tokens to add.
        temperature: Softmax temperature; ``0`` picks the most likely token.
        top_k: Sample among the ``top_k`` most likely tokens only.
        seed: Seeds the sampling generator.
        eos_token_ids: Stop after emitting one of these.

    Raises:
        ValueError: An empty prompt, or prompt plus new tokens longer than the
            model's rotary tables.
    """
    if not prompt:
        raise ValueError("generate: the prompt encodes to no tokens; give some text.")
    if len(prompt) + max_new_tokens > model.rope.max_seq_len:
        raise ValueError(
            f"generate: {len(prompt)} prompt tokens + {max_new_tokens} new exceed the model's "
            f"max_seq_len={model.rope.max_seq_len}; ask for fewer tokens."
        )
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache.empty(len(model.layers))
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt)], device=device)
    out: list[int] = []
    try:
        for _ in range(max_new_tokens):
            logits = forward_cached(model, tokens, cache)[0, -1].float()
            if temperature <= 0:
                next_id = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    kth = logits.topk(top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = logits.softmax(-1).cpu()
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            out.append(next_id)
            if next_id in eos_token_ids:
                break
            tokens = torch.tensor([[next_id]], device=device)
    finally:
        model.train(was_training)
    return out
