"""The layers every decoder family shares: the maths only.

Every layer is a :class:`~hyper_parallel.dmodule.module.Module` built from its
``Config``; where the layers are placed on a mesh lives in
:mod:`hyper_parallel.models.common.sharding`. The code runs unchanged on plain tensors
and on DTensors (shapes are global there); the attention core runs on local tensors
when a sharding makes it a ``local_map`` region, so it reads head counts from its
inputs.

Positions: the rotary tables are read at each token's place in the global sequence
when ``positions`` are given. On one device the causal mask compares query positions
with key positions, so the tokens may arrive in any order; that mask is built once per
forward (:class:`CausalMask`, additive, in the activations' dtype) and shared by every
layer, so backward holds one copy of it, not one per layer. A sequence split across
ranks by context parallelism (positions sharded over a mesh axis, head-tail) gets no
mask: :class:`CausalMask` returns the chunks each rank's queries and the gathered keys
hold (:class:`~hyper_parallel.models.common.chunked_attention.CausalChunks`), and the
attention core computes block by block, merging by log-sum-exp
(:mod:`~hyper_parallel.models.common.chunked_attention`): nothing of size
``S / cp x S`` exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel._torch_private import is_fake
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed.context_parallel import chunk_order
from hyper_parallel.distributed.context_parallel import positions as cp_positions
from hyper_parallel.dmodule import tokenwise_norm
from hyper_parallel.dmodule.module import Module
from hyper_parallel.models.common.chunked_attention import CausalChunks, chunked_causal_attention

__all__ = [
    "Attention",
    "CausalMask",
    "Embedding",
    "FeedForward",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "ScaledDotProductAttention",
    "apply_rotary_emb",
    "causal_mask",
    "repeat_heads",
    "rms_norm",
    "swiglu",
]

Linear = Module.from_nn_module(nn.Linear)
Embedding = Module.from_nn_module(nn.Embedding)


def _opmath(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype torch computes it in: fp32 for bf16/fp16, else its own."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNormFunction(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight``, keeping only ``x`` and ``rstd``.

    The values of torch's composite ``rms_norm`` (the same operations forward: fp32 for
    bf16/fp16 inputs, the result cast to the input's dtype); what it keeps for backward is
    what CUDA's fused kernel (``aten::_fused_rms_norm``) keeps: the input in its own dtype
    and one fp32 ``rstd`` per token. The composite, which CPU and a weight of another dtype
    take, keeps two fp32 copies of the activation (the upcast input and the normalized
    one): 8 bytes per element where this keeps 2 in bf16, 4 in fp32. Backward normalizes
    again (one elementwise pass).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: tuple[int, ...], eps: float
    ) -> torch.Tensor:
        upcast = _opmath(x)
        rstd = torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)
        y = upcast * rstd
        ctx.dims = dims
        ctx.save_for_backward(x, weight, rstd)
        return (y if weight is None else y * weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        normalized = _opmath(x) * rstd
        g = grad.to(normalized.dtype)
        grad_weight = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                lead = tuple(range(g.ndim - weight.ndim))
                grad_weight = (g * normalized).sum(lead).to(weight.dtype)
            g = g * weight
        grad_x = None
        if ctx.needs_input_grad[0]:
            mean = (g * normalized).mean(ctx.dims, keepdim=True)
            grad_x = (rstd * (g - normalized * mean)).to(x.dtype)
        return grad_x, grad_weight, None, None


def rms_norm(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """torch's ``rms_norm`` (given ``eps``) that keeps ``x`` and ``rstd`` for backward.

    See :class:`_RMSNormFunction`. Plain tensors and DTensors alike (every operation is
    token-wise or a reduction over the normalized trailing dims).
    """
    dims = tuple(range(-len(normalized_shape), 0))
    return _RMSNormFunction.apply(x, weight, dims, eps)


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(a) * b`` keeping ``a`` and ``b`` for backward, not ``silu(a)`` too.

    Autograd through ``F.silu(a) * b`` keeps ``a`` (silu's input), ``silu(a)`` and ``b``
    (the product's): three tensors of the feed-forward width. Backward here computes
    ``silu(a)`` again and then the very kernels autograd would (``aten.silu_backward``
    and the product's two multiplies), so the gradients are bit for bit the same.
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.ops.aten.silu_backward(grad * b, a)
        if ctx.needs_input_grad[1]:
            grad_b = grad * F.silu(a)
        return grad_a, grad_b


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b``, keeping two of the feed-forward's wide tensors for backward, not
    three (:class:`_SwiGLUFunction`)."""
    return _SwiGLUFunction.apply(a, b)


class RMSNorm(nn.RMSNorm, Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019) with a learned per-feature scale.

    torch's ``nn.RMSNorm`` over the last dim, computed by :func:`rms_norm`: the same
    values, and backward keeps what CUDA's fused kernel keeps (the input and one fp32
    scale per token), on every device. Its forward is declared token-wise
    (:func:`~hyper_parallel.dmodule._fast.tokenwise_norm`), so the fast path runs it on
    sequence shards as it runs ``nn.RMSNorm``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-5

    def __init__(self, config: RMSNorm.Config) -> None:
        nn.RMSNorm.__init__(self, config.dim, eps=config.eps)

    @tokenwise_norm
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return rms_norm(x, self.normalized_shape, self.weight, eps)


class RotaryEmbedding(Module):
    """Rotary position embedding tables (Su et al., 2021): ``cos`` and ``sin`` per position.

    The tables are non-persistent buffers of shape ``(max_seq_len, head_dim // 2)``, never
    stored in a checkpoint: computed when built (``Config.build``) on a real device, again
    after a ``load_state_dict``, and by ``init_states`` (a meta build, after ``to_empty``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        head_dim: int
        max_seq_len: int
        theta: float = 500000.0

    def __init__(self, config: RotaryEmbedding.Config) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = (
            config.head_dim,
            config.max_seq_len,
            config.theta,
        )
        shape = (config.max_seq_len, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)

    def compute_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        return {"cos": angles.cos(), "sin": angles.sin()}

    def forward(
        self, seq_len: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of shape ``(seq_len, head_dim // 2)``, or at ``positions``.

        Args:
            seq_len: Length of the (global) sequence; it must fit the tables.
            positions: Token positions ``[..., S]``; the result is ``[..., S, head_dim // 2]``.
        """
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"RotaryEmbedding: sequence of {seq_len} tokens exceeds max_seq_len="
                f"{self.max_seq_len}; build the model with a larger max_seq_len."
            )
        if positions is None:
            return self.cos[:seq_len], self.sin[:seq_len]
        # A row lookup (exact copies of the table rows), written as an embedding so a
        # sequence-sharded ``positions`` keeps its sharding.
        return F.embedding(positions, self.cos), F.embedding(positions, self.sin)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x[..., 2i], x[..., 2i+1])`` of ``x`` ``(B, S, H, D)`` by its angle.

    ``cos`` and ``sin`` are ``(S, D/2)`` (one table for the batch) or ``(B, S, D/2)``.
    """
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., S, 1, D/2): broadcast over heads
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)  # the tables are fp32; keep x's dtype


class ScaledDotProductAttention(Module):
    """Causal attention over ``(B, S, H, D)`` inputs; keys/values may have fewer heads (GQA).

    Head counts come from the inputs, so the same code runs on a rank's local heads.
    Without a mask, query ``i`` attends to keys ``0..i`` (``is_causal``). With ``mask``
    (additive, ``[Sq, Sk]`` or ``[B, 1, Sq, Sk]``, from :class:`CausalMask`) a query
    attends where the mask is 0, so the queries may be a subset of the keys, in any
    order. The mask is used as given (it is the one tensor every layer shares); one of
    another dtype than the queries is cast, which makes a copy per layer. With
    :class:`~hyper_parallel.models.common.chunked_attention.CausalChunks` instead of a
    mask (context parallelism), the queries' chunks attend to the keys' chunks block by
    block, the diagonal block on the fused causal kernel, without a mask.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: ScaledDotProductAttention.Config) -> None:
        super().__init__()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | CausalChunks | None = None,
    ) -> torch.Tensor:
        if isinstance(mask, CausalChunks):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return chunked_causal_attention(q, k, v, mask).transpose(1, 2).contiguous()
        if mask is None and q.shape[1] != k.shape[1]:
            raise ValueError(
                f"ScaledDotProductAttention: {q.shape[1]} queries and {k.shape[1]} keys "
                "cannot be masked causally by index; pass a mask (CausalMask of their "
                "positions)."
            )
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if mask.dtype != q.dtype:
                mask = mask.to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).contiguous()


def causal_mask(q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask, ``True`` where a query may attend: key position <= query position.

    Args:
        q_positions: ``[Sq]`` or ``[B, Sq]``.
        kv_positions: ``[Sk]`` or ``[B, Sk]``.

    Returns:
        ``[Sq, Sk]`` for 1-D positions, else ``[B, 1, Sq, Sk]`` (broadcast over heads).
    """
    mask = q_positions.unsqueeze(-1) >= kv_positions.unsqueeze(-2)
    return mask if mask.ndim == 2 else mask.unsqueeze(-3)


class CausalMask(Module):
    """The causal structure of a forward, built once from the token positions.

    On one device: the additive causal mask, 0 where a query may attend and ``-inf``
    elsewhere, handed to every layer's attention core (autograd saves that one tensor
    for all layers' backward; a mask built inside each core, or a boolean one that
    attention converts, would be saved once per layer). ``[Sq, Sk]`` for 1-D positions,
    ``[B, 1, Sq, Sk]`` for 2-D.

    Under context parallelism (``q_positions`` a DTensor sharded over a mesh axis, each
    rank holding chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``): the
    :class:`~hyper_parallel.models.common.chunked_attention.CausalChunks` of this rank's
    queries and of the keys gathered over that axis, and no mask. On CPU tensors the
    positions are checked to be that split (:func:`context_parallel.positions
    <hyper_parallel.distributed.context_parallel.positions>`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: CausalMask.Config) -> None:
        super().__init__()

    def forward(
        self,
        q_positions: torch.Tensor,
        kv_positions: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | CausalChunks:
        chunks = _sequence_chunks(q_positions)
        if chunks is not None:
            return chunks
        allowed = causal_mask(q_positions, kv_positions)
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill_(allowed.logical_not(), float("-inf"))


def _sequence_chunks(positions: torch.Tensor) -> CausalChunks | None:
    """The chunks of a head-tail split whose positions are sharded over a mesh axis."""
    if not isinstance(positions, DTensor):
        return None
    split = [i for i, p in enumerate(positions.placements) if p.is_shard()]
    if not split:
        return None
    mesh = positions.device_mesh
    rank, size = mesh.get_local_rank(split[0]), mesh.size(split[0])
    local = positions.to_local()
    if local.device.type == "cpu" and not is_fake(local):
        expected = cp_positions(positions.shape[-1], rank, size)
        if local.shape[-1] != expected.numel() or not bool((local == expected).all()):
            axis = (mesh.mesh_dim_names or ("?",) * mesh.ndim)[split[0]]
            raise ValueError(
                f"CausalMask: rank {rank} of {axis}={size} holds positions "
                f"{local.flatten()[:8].tolist()}..., not its head-tail part of the sequence; "
                "pass positions=context_parallel.positions(seq_len, cp_rank, cp_size) with "
                "tokens cut by context_parallel.shard_sequence."
            )
    return CausalChunks(queries=(rank, 2 * size - 1 - rank), keys=tuple(chunk_order(size)))


class Attention(Module):
    """Grouped-query self-attention with rotary position embeddings (Llama, Qwen3).

    With ``q_norm`` and ``k_norm`` (Qwen3) each query and key head is RMS-normalized
    over ``head_dim`` before the rotation. With ``repeat_kv`` each key/value head is
    materialized once per query head it serves before the attention core
    (grouped-query attention written as multi-head attention: the same numbers); a
    tensor-parallel layout with more ranks than key/value heads needs it, so that
    every rank's query heads find their keys.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        head_dim: int
        wq: Linear.Config
        wk: Linear.Config
        wv: Linear.Config
        wo: Linear.Config
        q_norm: RMSNorm.Config | None = None
        k_norm: RMSNorm.Config | None = None
        inner_attention: ScaledDotProductAttention.Config
        repeat_kv: bool = False

    def __init__(self, config: Attention.Config) -> None:
        super().__init__()
        if (config.q_norm is None) != (config.k_norm is None):
            raise ValueError(
                "Attention: q_norm and k_norm come together (Qwen3's per-head norms); got "
                f"q_norm={'set' if config.q_norm else 'None'}, k_norm="
                f"{'set' if config.k_norm else 'None'}. Give both or neither."
            )
        self.head_dim = config.head_dim
        self.repeat_kv = config.repeat_kv
        self.wq, self.wk, self.wv, self.wo = (
            c.build() for c in (config.wq, config.wk, config.wv, config.wo)
        )
        self.qk_norm = config.q_norm is not None
        if config.q_norm is not None and config.k_norm is not None:
            self.q_norm, self.k_norm = config.q_norm.build(), config.k_norm.build()
        self.inner_attention = config.inner_attention.build()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | CausalChunks | None = None,
    ) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q, k, v = (w(x).view(bsz, seq_len, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        if self.repeat_kv:
            k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])
        out = self.inner_attention(q, k, v) if mask is None else self.inner_attention(q, k, v, mask)
        return self.wo(out.flatten(-2))


def repeat_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, S, H_kv, D) -> (B, S, num_heads, D)``: head ``h`` serves query heads
    ``h * g .. (h + 1) * g - 1`` with ``g = num_heads / H_kv`` (grouped-query order)."""
    bsz, seq_len, kv_heads, head_dim = x.shape
    groups = num_heads // kv_heads
    x = x.unsqueeze(3).expand(bsz, seq_len, kv_heads, groups, head_dim)
    return x.reshape(bsz, seq_len, num_heads, head_dim)


class FeedForward(Module):
    """SwiGLU feed-forward (Shazeer, 2020): ``w2(silu(w1 x) * w3 x)``, the gate by
    :func:`swiglu`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        w1: Linear.Config
        w2: Linear.Config
        w3: Linear.Config

    def __init__(self, config: FeedForward.Config) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (c.build() for c in (config.w1, config.w2, config.w3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))
