"""Sampling from a model on one process, with a KV cache.

:func:`generate` runs one of our decoders (a shared ``Decoder`` of any family, unsharded) token by
token: the prompt once, then one token per step, each layer's keys and values kept
(:class:`KVCache`) so a step costs one token's compute. It uses the model's own
modules (norms, projections, rotary tables, feed-forward or experts) in the order
of their ``forward``; only the attention over the cached keys is written here, as
``scaled_dot_product_attention`` with the causal mask of the new positions — the
training forward is untouched. Greedy by default; ``temperature`` samples with a
seeded generator, among the ``top_k`` most likely tokens and the nucleus of mass
``top_p`` (:func:`filter_logits`: transformers' order and rule). Stops after
``max_new_tokens`` or at an EOS id.

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

__all__ = ["KVCache", "check_sampling", "filter_logits", "forward_cached", "generate"]


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


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """``logits`` (one row, after the temperature) with the tokens sampling may not pick
    set to ``-inf``: all but the ``top_k`` largest, then all but the nucleus — the most
    likely tokens whose probabilities first reach ``top_p`` (each kept token's more
    likely tokens hold less than ``top_p``; the most likely is always kept). The order
    and the rule of transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper``.
    """
    if top_k is not None and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        probs, order = logits.softmax(-1).sort(descending=True)
        before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Refuse sampling settings out of range, and ``top_k`` / ``top_p`` at temperature 0
    (greedy would not use them): :func:`generate` and the command, before the model is
    read.

    Raises:
        ValueError: Naming the setting and what it takes.
    """
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens}; give 0 or more.")
    if not temperature >= 0:  # NaN too: it reached the sampler as NaN probabilities
        raise ValueError(
            f"generate: temperature={temperature}; give 0 (greedy) or a positive temperature."
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k={top_k}; give 1 or more, or leave it out (every token).")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p}; give a share in (0, 1], e.g. 0.9.")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(
            "generate: top_k and top_p choose among tokens to sample, but temperature 0 "
            "picks the most likely token (greedy); give a temperature > 0 (e.g. 0.8) to "
            "sample, or drop them."
        )


def _check_unsharded(model: nn.Module) -> None:
    """Refuse a model with DTensor states: the cached forward calls its modules one by one
    (not the blocks' ``forward``, where FSDP2 gathers), so a sharded model would fail deep
    in a layer with torch's "mixed torch.Tensor and DTensor" error.

    Raises:
        ValueError: Naming the first sharded state, its placements and the fix.
    """
    from torch.distributed.tensor import DTensor

    for name, state in (*model.named_parameters(), *model.named_buffers()):
        if isinstance(state, DTensor):
            axes = state.device_mesh.mesh_dim_names or ()
            placed = ", ".join(f"{a}: {p}" for a, p in zip(axes, state.placements, strict=False))
            raise ValueError(
                f"generate: {name} is a DTensor ({{{placed or state.placements}}}): generate "
                "runs an unsharded model on one process. Build the model without "
                "parallelize/fully_shard and load the weights into it (load_hf(model, DIR)), "
                "or save the run and use hyper-parallel generate --checkpoint CKPT, which "
                "reads a checkpoint saved at any mesh."
            )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """The new token ids after ``prompt`` (greedy when ``temperature`` is 0).

    Works for the decoders of every family: the blocks'
    attention (with or without per-head norms) and feed-forward or experts.

    Args:
        model: One of our decoders, unsharded (no DTensor states), in this process.
        prompt: Token ids (at least one).
        max_new_tokens: Most tokens to add.
        temperature: Softmax temperature; ``0`` picks the most likely token.
        top_k: Sample among the ``top_k`` most likely tokens only.
        top_p: Sample within the nucleus of probability mass ``top_p`` only
            (:func:`filter_logits`).
        seed: Seeds the sampling generator.
        eos_token_ids: Stop after emitting one of these.

    Raises:
        ValueError: A sharded model (DTensor parameters), an empty prompt, a prompt that
            leaves no room for a new token in the model's rotary tables, prompt plus new
            tokens longer than them, or a sampling
            setting out of range (``top_k`` / ``top_p`` at temperature 0 included: they
            would not be used).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    _check_unsharded(model)
    if not prompt:
        raise ValueError("generate: the prompt encodes to no tokens; give some text.")
    limit = model.rope.max_seq_len
    room = limit - 1 if max_new_tokens else limit  # positions the prompt may take
    if len(prompt) > room:
        raise ValueError(
            f"generate: the prompt is too long: {len(prompt):,} tokens, and the model's "
            f"max_seq_len={limit:,} holds the prompt and the new tokens together; shorten "
            f"the prompt to at most {room:,} tokens (fewer leaves room for more new ones)."
        )
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(
            f"generate: {len(prompt):,} prompt tokens + {max_new_tokens:,} new exceed the "
            f"model's max_seq_len={limit:,}; ask for at most {limit - len(prompt):,} new "
            "tokens (--max-new-tokens) or shorten the prompt."
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
                logits = filter_logits(logits / temperature, top_k, top_p)
                probs = logits.softmax(-1).cpu()
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            out.append(next_id)
            if next_id in eos_token_ids:
                break
            tokens = torch.tensor([[next_id]], device=device)
    finally:
        model.train(was_training)
    return out
