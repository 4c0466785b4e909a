"""What the decoder's norms and SwiGLU keep for backward, and that they compute the same.

:func:`~hyper_parallel.models.common.layers.rms_norm` keeps the input and one fp32
``rstd`` per token (what CUDA's fused ``_fused_rms_norm`` keeps), where torch's composite
(CPU, or a weight of another dtype) keeps two fp32 copies of the activation;
:func:`~hyper_parallel.models.common.layers.swiglu` keeps ``a`` and ``b``, not
``silu(a)`` too. Values are checked against torch's own functions, the saved bytes
against the count derived by hand from the shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.analysis.memory import SavedActivations
from hyper_parallel.models.common import layers
from hyper_parallel.models.common.layers import rms_norm, swiglu
from hyper_parallel.models.llama import cross_entropy_loss, preset_config

DIM = 64


def _saved(fn, *args) -> list[torch.Tensor]:
    """The tensors autograd keeps for backward while ``fn(*args)`` runs (as saved:
    one storage may be saved more than once)."""
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return kept


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_rms_norm_forward_is_torchs_bit_for_bit(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, DIM, generator=gen).to(dtype)
    w = (torch.randn(DIM, generator=gen) + 1).to(weight_dtype)
    with torch.no_grad():
        ours = rms_norm(x, (DIM,), w, 1e-5)
        theirs = F.rms_norm(x, (DIM,), w, 1e-5)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


def test_rms_norm_gradients_match_autograd_through_torchs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, (DIM,), w, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda x: rms_norm(x, (DIM,), None, 1e-5), (x,))
    # fp32: the same formula in another order of operations. Each input gradient is a
    # few products plus one mean over DIM terms, so the two differ by at most a few
    # roundings per term: bounded by DIM * eps times the largest term.
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    g = torch.randn(4, 7, DIM, generator=gen)
    ours = torch.autograd.grad(rms_norm(x32, (DIM,), w32, 1e-5), (x32, w32), g)
    theirs = torch.autograd.grad(F.rms_norm(x32, (DIM,), w32, 1e-5), (x32, w32), g)
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= DIM * eps * b.abs().max()


def test_rms_norm_keeps_the_input_and_one_fp32_scale_per_token():
    x = torch.randn(2, 16, DIM, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(DIM, dtype=torch.bfloat16, requires_grad=True)

    def storages(fn) -> dict[int, int]:
        kept = (t.untyped_storage() for t in _saved(fn, x, (DIM,), w, 1e-5))
        return {s.data_ptr(): s.nbytes() for s in kept if s.data_ptr() != w.data_ptr()}

    ours = storages(rms_norm)
    assert x.untyped_storage().data_ptr() in ours
    assert sum(ours.values()) == x.nbytes + 2 * 16 * 4  # x, and fp32 rstd per token
    # torch's composite on this CPU: the fp32 upcast input, the normalized output and
    # rstd.
    assert sum(storages(F.rms_norm).values()) == 2 * (2 * 16 * DIM * 4) + 2 * 16 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_autograds_bit_for_bit_and_keeps_two_tensors(dtype):
    gen = torch.Generator().manual_seed(2)
    a, b, g = (torch.randn(3, 5, 48, generator=gen).to(dtype) for _ in range(3))
    a.requires_grad_(), b.requires_grad_()
    ours, theirs = swiglu(a, b), F.silu(a) * b
    assert torch.equal(ours, theirs)
    for u, v in zip(torch.autograd.grad(ours, (a, b), g), torch.autograd.grad(theirs, (a, b), g)):
        assert torch.equal(u, v)
    kept = _saved(swiglu, a, b)
    assert [t.untyped_storage().data_ptr() for t in kept] == [
        a.untyped_storage().data_ptr(),
        b.untyped_storage().data_ptr(),
    ]
    assert len(_saved(lambda a, b: F.silu(a) * b, a, b)) == 3


def _saved_bytes(model) -> int:
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    with SavedActivations(model, list(model.layers)) as saved:
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    return saved.peak_bytes("none")


def test_the_llama_keeps_what_the_shapes_say_less_than_with_torchs_norm_and_silu(monkeypatch):
    torch.manual_seed(0)
    model = preset_config("llama3-debug").build()
    model.init_states()
    ours = _saved_bytes(model)
    monkeypatch.setattr(layers.RMSNorm, "forward", nn.RMSNorm.forward)
    monkeypatch.setattr(layers, "swiglu", lambda a, b: F.silu(a) * b)
    theirs = _saved_bytes(model)
    # Per norm (fp32): torch's keeps the input, rstd and the normalized tensor, ours the
    # input and rstd; per block two norms and one SwiGLU's silu(a); the final norm once.
    tokens = 2 * 32
    first = model.layers[0]
    dim, ffn = first.attention_norm.weight.shape[0], first.feed_forward.w1.weight.shape[0]
    per_norm = 4 * tokens * dim
    per_block = 2 * per_norm + 4 * tokens * ffn
    assert theirs - ours == len(model.layers) * per_block + per_norm
