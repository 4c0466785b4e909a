"""Causal attention by chunks (context parallelism's attention core), without a process
group: every rank's chunks against the gathered keys equal one causal attention, outputs
and every gradient, and nothing the size of the scores is saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.distributed import context_parallel as cp
from hyper_parallel.models.common.chunked_attention import CausalChunks, chunked_causal_attention

B, H, S, D = 2, 4, 16, 8


def _rank_chunks(rank: int, cp_size: int) -> CausalChunks:
    return CausalChunks(queries=(rank, 2 * cp_size - 1 - rank), keys=tuple(cp.chunk_order(cp_size)))


def _gathered(t: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Every rank's part of ``t`` (B, H, S, D) in rank order: what the all-gather holds."""
    return torch.cat([cp.shard_sequence(t, r, cp_size, dim=2) for r in range(cp_size)], dim=2)


# fp64 over every cp size and key/value head count (1: multi-query); fp32 at two corners.
CASES = [(cp, kv, torch.float64, 1e-12) for cp in (1, 2, 4) for kv in (1, 2, 4)] + [
    (4, 1, torch.float32, 2e-6),
    (2, 4, torch.float32, 2e-6),
]


@pytest.mark.parametrize(("cp_size", "num_kv_heads", "dtype", "tol"), CASES)
def test_every_rank_together_equals_one_causal_attention(cp_size, num_kv_heads, dtype, tol):
    gen = torch.Generator().manual_seed(cp_size * 10 + num_kv_heads)
    q = torch.randn(B, H, S, D, dtype=dtype, generator=gen).requires_grad_()
    k, v = (
        torch.randn(B, num_kv_heads, S, D, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(2)
    )
    grad_out = torch.randn(B, H, S, D, dtype=dtype, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    keys, values = _gathered(k, cp_size), _gathered(v, cp_size)
    loss = torch.zeros((), dtype=dtype)
    for rank in range(cp_size):
        pos = cp.positions(S, rank, cp_size)
        out = chunked_causal_attention(q[:, :, pos], keys, values, _rank_chunks(rank, cp_size))
        torch.testing.assert_close(out, ref[:, :, pos], atol=tol, rtol=0)
        loss = loss + (out * grad_out[:, :, pos]).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, r, atol=tol * 10, rtol=0, msg=name)


def test_blocks_are_the_diagonal_and_the_earlier_chunks():
    chunks = _rank_chunks(1, 2)  # queries: chunks 1 and 2; keys: 0, 3, 1, 2
    assert chunks.blocks() == [
        (0, 0, False),  # chunk 1 attends chunk 0 in full
        (0, 2, True),  # and itself causally
        (1, 0, False),
        (1, 2, False),
        (1, 3, True),  # chunk 2: chunks 0, 1 in full, itself causally; chunk 3 skipped
    ]
    work = sum(1 if not causal else 0.5 for *_, causal in chunks.blocks())
    assert work == sum(1 if not c else 0.5 for *_, c in _rank_chunks(0, 2).blocks())  # balanced


def test_saves_outputs_and_log_sum_exp_not_scores():
    """What backward keeps: q, k, v, the output and the (B, H, Sq) log-sum-exp."""
    cp_size, sq = 4, S // 4
    q = torch.randn(B, H, sq, D, requires_grad=True)
    k, v = (torch.randn(B, 1, S, D, requires_grad=True) for _ in range(2))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_causal_attention(q, k, v, _rank_chunks(0, cp_size))
    assert sorted(shapes) == sorted(
        [(B, H, sq, D), (B, 1, S, D), (B, 1, S, D), (B, H, sq, D), (B, H, sq)]
    )


def test_unequal_chunks_are_refused():
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="6 queries in 2 chunks and 16 keys in 4 chunks"):
        chunked_causal_attention(q, k, k, _rank_chunks(0, 2))


def test_the_cuda_backward_gets_outputs_in_the_kernels_memory_order():
    # torch's memory-efficient backward reads ``out`` and ``dout`` as (B, S, H, D) in memory
    # (stride order 3, 1, 2, 0); a (B, H, S, D)-contiguous merged output read out of
    # bounds on an H200. The same values, relaid once; already so: passed as is.
    from hyper_parallel.models.common.chunked_attention import _kernel_layout

    t = torch.randn(2, 3, 5, 4)
    u = _kernel_layout(t)
    assert torch.equal(u, t) and u.shape == t.shape
    assert u.transpose(1, 2).is_contiguous() and not t.transpose(1, 2).is_contiguous()
    assert _kernel_layout(u) is u


# --------------------------------------------------------------------------- CUDA kernels
# This machine has no GPU. Meta tensors run torch's shape functions of the CUDA kernels, so
# the first test checks what the blocks pass each kernel (arguments, the forward's returns
# its backward takes, head groups) and what comes back, not the kernels' numbers
# (``benchmarks/bench_gpu.py --parts chunked`` checks those on a GPU); the second asks
# the choice of kernel of fake CUDA tensors.


def _fake_cuda(num_kv_heads: int):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        q = torch.empty(1, 4, 64, 32, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(1, num_kv_heads, 64, 32, device="cuda", dtype=torch.bfloat16)
    return mode, q, k


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_each_cuda_kernel_gets_what_it_takes(monkeypatch, kernel, num_kv_heads):
    from hyper_parallel.models.common import chunked_attention as ca

    monkeypatch.setattr(ca, "_kernel", lambda q, k: kernel)
    calls = []
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
    ):
        op = getattr(torch.ops.aten, name)

        def spy(*a, _op=op, _name=name, **kw):
            key = a[2] if _name.endswith("backward") else a[1]  # after dout, q in backward
            calls.append((_name, key.shape[1]))  # the key heads it was given
            return _op(*a, **kw)

        monkeypatch.setattr(torch.ops.aten, name, spy, raising=False)
    meta = {"device": "meta", "dtype": torch.bfloat16, "requires_grad": True}
    q = torch.empty(1, 4, 64, 32, **meta)
    k, v = (torch.empty(1, num_kv_heads, 128, 32, **meta) for _ in range(2))
    out = chunked_causal_attention(q, k, v, _rank_chunks(0, 2))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dk.dtype == dv.dtype == torch.bfloat16
    # Rank 0 of cp=2: two forward blocks (chunk 0 causal; chunk 3 against 0, 3, 1 in
    # full and itself causally: 1 + 4 blocks), each again in backward.
    want = "_scaled_dot_product_" + ("flash" if kernel == "flash" else "efficient") + "_attention"
    assert [c[0] for c in calls] == [want] * 5 + [want + "_backward"] * 5
    # flash takes the key/value head groups as they are; the memory-efficient kernel
    # gets them expanded to the query heads.
    assert {c[1] for c in calls} == {num_kv_heads if kernel == "flash" else 4}


def test_the_cuda_kernel_is_flash_where_torch_allows_it_else_memory_efficient(monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hyper_parallel.models.common.chunked_attention import _kernel

    mode, q, k = _fake_cuda(2)
    seen = []

    def can_use_flash(params, debug):
        seen.append((params.query.shape[1], params.key.shape[1], params.enable_gqa))
        return flash_ok

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", can_use_flash)
    with mode:
        flash_ok = True
        assert _kernel(q, k) == "flash"
        assert seen == [(4, 2, True)]  # asked with the groups as they are
        flash_ok = False  # e.g. fp32 inputs or a GPU before Ampere
        assert _kernel(q, k) == "efficient"
        flash_ok = True
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            assert _kernel(q, k) == "efficient"
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            assert _kernel(q, k) == "flash"
            flash_ok = False
            with pytest.raises(
                ValueError, match="needs a fused CUDA kernel that returns the log-sum-exp"
            ):
                _kernel(q, k)
        with sdpa_kernel([SDPBackend.MATH]), pytest.raises(ValueError, match="sdpa_kernel"):
            _kernel(q, k)
    assert _kernel(torch.empty(1, 2, 4, 8), torch.empty(1, 2, 4, 8)) == "cpu"
