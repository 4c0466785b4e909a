"""Causal attention by chunks: the queries of some chunks of a sequence against the keys
of others, without a mask the size of the scores.

Under context parallelism a rank holds two chunks of the sequence (head-tail, see
:mod:`hyper_parallel.distributed.context_parallel`) and every key, gathered in rank
order. Query chunk ``c`` attends to key chunk ``c`` causally (the same positions: the
fused ``is_causal`` path), to every earlier key chunk in full (no mask) and to no later
one. Each such block yields its output and its log-sum-exp ``lse``; blocks of the same
queries merge exactly by ``lse`` (Milakov & Gimelshein, 2018, "Online normalizer
calculation for softmax"; Dao et al., 2022, FlashAttention, §3.1)::

    lse = log(exp(lse_1) + exp(lse_2))
    out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2

Backward (Dao et al., 2022, Algorithm 4) needs, per block, only the *merged* output and
log-sum-exp of its queries: ``P = exp(q k^T scale - lse)`` and
``D = rowsum(dout * out)`` are then those of the whole row, so each block's gradients
are its exact share, summed over blocks. :class:`ChunkedCausalAttention` saves the
inputs, the merged output and ``lse`` (what a fused kernel keeps: no probabilities) and
recomputes the blocks in backward.

A block runs on a fused kernel that returns ``lse``: on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward); on CUDA torch's
FlashAttention-2 kernel ``aten._scaled_dot_product_flash_attention`` where torch says it
takes the inputs (``torch.backends.cuda.can_use_flash_attention``: half precision, head
size, GPU generation) and it is enabled, else the memory-efficient kernel
``aten._scaled_dot_product_efficient_attention`` — the two kernels torch's own context
parallelism runs per block, chosen as ``torch.nn.attention.sdpa_kernel`` allows (other
devices are refused, naming the alternative). Grouped-query attention (fewer key/value
heads) is passed to the CPU and the flash kernels as it is and expanded per block for the
memory-efficient one; nothing expanded is saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CausalChunks", "ChunkedCausalAttention", "chunked_causal_attention"]


@dataclass(frozen=True, slots=True)
class CausalChunks:
    """The causal structure of queries and keys cut into equal chunks of one sequence.

    Attributes:
        queries: The index in the global sequence of each query chunk, in the order the
            queries hold them (``(r, 2 cp - 1 - r)`` on context-parallel rank ``r``).
        keys: The same for the key (and value) chunks (every chunk, in the order the
            ranks' parts are gathered: ``(0, 2 cp - 1, 1, 2 cp - 2, ...)``).

    Example:
        >>> CausalChunks(queries=(1, 2), keys=(0, 3, 1, 2)).blocks()
        [(0, 0, False), (0, 2, True), (1, 0, False), (1, 1, False), (1, 2, False), (1, 3, True)]
    """

    queries: tuple[int, ...]
    keys: tuple[int, ...]

    def blocks(self) -> list[tuple[int, int, bool]]:
        """``(query chunk, key chunk, causal)`` of every block computed, by place in the
        queries' and the keys' order: earlier key chunks in full, the same chunk causal."""
        return [
            (i, j, kc == qc)
            for i, qc in enumerate(self.queries)
            for j, kc in enumerate(self.keys)
            if kc <= qc
        ]


# --------------------------------------------------------------------------- one block


def _expand(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, H_kv, S, D) -> (B, num_heads, S, D)``, each key/value head serving its group."""
    return t.repeat_interleave(num_heads // t.shape[1], dim=1) if t.shape[1] != num_heads else t


def _fold(t: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: each group's heads summed into its key/value head."""
    if t.shape[1] == num_kv_heads:
        return t
    b, h, s, d = t.shape
    return t.view(b, num_kv_heads, h // num_kv_heads, s, d).sum(2)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """``(out, lse, rest)`` of queries ``q`` ``(B, H, Sq, D)`` against ``k``, ``v`` on
    ``kernel`` (:func:`_kernel`); ``lse`` in the kernel's dtype (fp32 for half-precision
    inputs), which its backward reads back; ``rest``: what else the flash kernel's backward
    takes from its forward (empty for the others)."""
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, ()
    if kernel == "flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
        )
        return out, lse, (cum_q, cum_k, seed, offset)
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]], ()


_CPU_KERNEL = ("cpu", "meta")  # the CPU kernel has a meta implementation: shapes for the dry run


def _kernel(q: torch.Tensor, k: torch.Tensor) -> str:
    """The kernel the blocks of ``q`` against chunks of ``k`` run on: ``"cpu"`` (CPU and
    meta tensors), ``"flash"`` or ``"efficient"`` (CUDA), as :mod:`torch.nn.attention`'s
    backend switches allow; the same for every block of one call, forward and backward."""
    if q.device.type in _CPU_KERNEL:
        return "cpu"
    if q.device.type != "cuda":
        raise ValueError(
            f"chunked causal attention (context parallelism) runs on cpu and cuda tensors; got "
            f"{q.device.type}. Run without cp on this device (put those ranks on dp_shard)."
        )
    if torch.backends.cuda.flash_sdp_enabled():
        params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, True, k.shape[1] != q.shape[1])
        if torch.backends.cuda.can_use_flash_attention(params, False):
            return "flash"
    if torch.backends.cuda.mem_efficient_sdp_enabled():
        return "efficient"
    raise ValueError(
        "chunked causal attention (context parallelism) needs a fused CUDA kernel that "
        "returns the log-sum-exp: FlashAttention-2 (which does not take these inputs or is "
        "disabled) or the memory-efficient kernel (disabled). Enable one, e.g. "
        "torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, "
        "SDPBackend.EFFICIENT_ATTENTION])."
    )


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(B, H, S, D)`` as the CUDA block backward reads it: its memory in
    ``(B, S, H, D)`` order, the layout the fused kernels' forwards write (the flash
    kernel's backward takes it without a copy); the memory-efficient
    kernel's backward reads ``out`` and ``dout`` in it (stride order
    3, 1, 2, 0; torch's compiler forces the same for it: pytorch/pytorch#138879) — a
    merged output laid out otherwise read out of bounds (an illegal memory access on an
    H200 at 2,048-token chunks: ``benchmarks/bench_gpu.py``). A copy unless it is so."""
    return (
        t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)
    )


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: str,
    rest: tuple[Any, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of ``(dq, dk, dv)``, from the merged ``out`` and ``lse`` of its rows
    (``rest``: the flash kernel's, from :func:`_block_forward`)."""
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if kernel == "flash":
        # As torch's ring attention calls it: the merged out and lse of the block's rows,
        # and what a forward of this shape returned (no dropout, no packed batch: the
        # kernel reads neither the lengths' offsets nor the random state); the kernel sums
        # the key/value gradients of each head group itself.
        cum_q, cum_k, seed, offset = rest
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cum_q,
            cum_k,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return dq, dk, dv
    num_kv_heads = k.shape[1]
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    # ``dout`` and ``out`` come in the kernel's layout (``_kernel_layout``, once per chunk).
    # The kernel reads lse padded to a multiple of 32 rows, as its forward wrote it.
    padded = -(-q.shape[2] // 32) * 32
    lse_in = torch.nn.functional.pad(lse, (0, padded - q.shape[2]))
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        None,
        out,
        lse_in,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, _fold(dk, num_kv_heads), _fold(dv, num_kv_heads)


# --------------------------------------------------------------------------- the merge


class ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention of query chunks against key chunks, merged by log-sum-exp.

    Inputs ``(B, H, Sq, D)`` queries and ``(B, H_kv, Sk, D)`` keys and values (``H_kv``
    divides ``H``), cut into ``len(chunks.queries)`` and ``len(chunks.keys)`` equal
    chunks. Saves ``q, k, v``, the output and the log-sum-exp ``(B, H, Sq)`` (in the
    kernel's dtype).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunks: CausalChunks,
        scale: float,
    ) -> torch.Tensor:
        q_parts, k_parts, v_parts = _split(q, k, v, chunks)
        kernel = _kernel(q_parts[0], k_parts[0])
        outs, lses = [], []
        for i, q_part in enumerate(q_parts):
            out: torch.Tensor | None = None
            lse: torch.Tensor | None = None
            for j in (j for qi, j, _ in chunks.blocks() if qi == i):
                causal = chunks.keys[j] == chunks.queries[i]
                o, s, rest = _block_forward(q_part, k_parts[j], v_parts[j], causal, scale, kernel)
                lse_dtype = s.dtype
                # Merged in fp32 at least (fp64 inputs stay fp64).
                o, s = o.to(torch.promote_types(o.dtype, torch.float32)), s.to(o.dtype)
                if out is None or lse is None:
                    out, lse = o, s
                    continue
                merged = torch.logaddexp(lse, s)
                out = out * torch.exp(lse - merged).unsqueeze(-1) + o * torch.exp(
                    s - merged
                ).unsqueeze(-1)
                lse = merged
            assert out is not None and lse is not None, "a query chunk attends to itself"
            outs.append(out.to(q.dtype))
            lses.append(lse.to(lse_dtype))
        # Laid out (B, Sq, H, D) in memory, as the fused kernels write theirs: the caller's
        # transpose back to (B, Sq, H, D) is then a view, not a second copy for backward.
        out = torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale, ctx.kernel, ctx.rest = chunks, scale, kernel, rest
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        chunks: CausalChunks = ctx.chunks
        q_parts, k_parts, v_parts = _split(q, k, v, chunks)
        n = len(chunks.queries)
        # Each query chunk's output and gradient laid out for the kernel once, not per block
        # (the CPU kernel takes them dense).
        layout = torch.Tensor.contiguous if ctx.kernel == "cpu" else _kernel_layout
        dout_parts = [layout(t) for t in dout.chunk(n, dim=2)]
        out_parts = [layout(t) for t in out.chunk(n, dim=2)]
        lse_parts = [t.contiguous() for t in lse.chunk(n, dim=2)]
        acc = torch.promote_types(q.dtype, torch.float32)  # gradients summed over blocks
        dq = [torch.zeros(p.shape, dtype=acc, device=q.device) for p in q_parts]
        dk = [torch.zeros(p.shape, dtype=acc, device=k.device) for p in k_parts]
        dv = [torch.zeros(p.shape, dtype=acc, device=v.device) for p in v_parts]
        for i, j, causal in chunks.blocks():
            g = _block_backward(
                dout_parts[i],
                q_parts[i],
                k_parts[j],
                v_parts[j],
                out_parts[i],
                lse_parts[i],
                causal,
                ctx.scale,
                ctx.kernel,
                ctx.rest,
            )
            dq[i] += g[0]
            dk[j] += g[1]
            dv[j] += g[2]
        grads = (
            torch.cat(dq, dim=2).to(q.dtype),
            torch.cat(dk, dim=2).to(k.dtype),
            torch.cat(dv, dim=2).to(v.dtype),
        )
        return (*grads, None, None)


def _split(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: CausalChunks
) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    nq, nk = len(chunks.queries), len(chunks.keys)
    if q.shape[2] % nq or k.shape[2] % nk or q.shape[2] // nq != k.shape[2] // nk:
        raise ValueError(
            f"chunked causal attention: {q.shape[2]} queries in {nq} chunks and "
            f"{k.shape[2]} keys in {nk} chunks are not chunks of one size; cut the sequence "
            "into equal chunks (context_parallel.shard_sequence)."
        )
    return (
        [t.contiguous() for t in q.chunk(nq, dim=2)],
        [t.contiguous() for t in k.chunk(nk, dim=2)],
        [t.contiguous() for t in v.chunk(nk, dim=2)],
    )


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: CausalChunks
) -> torch.Tensor:
    """Causal attention of ``q`` ``(B, H, Sq, D)`` against ``k``, ``v`` ``(B, H_kv, Sk, D)``
    whose chunks ``chunks`` places in the sequence; the result is ``(B, H, Sq, D)``.

    Example:
        >>> q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 8, 8)
        >>> chunked_causal_attention(q, k, k, CausalChunks(queries=(1, 2), keys=(0, 3, 1, 2))).shape
        torch.Size([1, 2, 4, 8])
    """
    scale = q.shape[-1] ** -0.5
    return ChunkedCausalAttention.apply(q, k, v, chunks, scale)
