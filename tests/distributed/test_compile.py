"""Parallelized models (the Llama, the Qwen3-MoE) under ``torch.compile(fullgraph=True)`` on 2 gloo ranks.

Covered: the fast path (local shards, functional collectives) and the DTensor
boundaries it keeps (the blocks' sequence-parallel entry), the DTensor path
(``fast_path(False)``), TP and TP+SP, context parallel (positions as a graph input,
the attention core's ``local_map`` region), every boundary kind (column/row-wise,
sequence-parallel entry and exit, vocab-parallel embedding, norms, the attention
``local_map`` region), per block (as torchtitan compiles) and whole model, with
``aot_eager``; and the Qwen3-MoE decoder with expert parallelism (dp_shard x ep),
built by the trainer, whose blocks compile region by region around the experts.
Each case: compiled loss and every gradient equal eager to 1e-5 over two
accumulating steps; no graph break (``fullgraph=True`` raises on one, dynamo's
counter stays 0); no recompile on a second step of the same shape; where new
sequence lengths run, at most one recompile for them (one per length on the DTensor
path, below). Compile is slow on CPU: one
layer of a narrow ``llama3-debug``.

New sequence lengths: on the fast path a compiled unit recompiles once, to a graph
with a dynamic length, and never again. On the DTensor path torch 2.13 cannot trace
that dynamic graph: AOTAutograd recurses without end in ``proxy_tensor.get_proxy_slot``
on ``F.linear`` of a 3-D DTensor with a symbolic length (its backward's view; the
same in torch's own parallel styles, pytorch/pytorch#159709, #152954), so
``apply_compile`` (the trainer's ``--compile``) compiles such blocks statically and
the DTensor case checks that instead: each new length one more graph, a length seen
before none, numbers equal eager.

Inductor: the column- and row-wise boundaries and their sequence-parallel forms on the
fast path (bias-free linears, nothing pointwise between them: the matmuls are library
calls and inductor lowers the functional collectives itself, so little or no C++
is compiled) are checked here, cold in ~5 and ~13 s. A whole block is not: inductor's
C++ code generation for its pointwise kernels does not fit a test's budget here. In
these daemonic rank processes set ``torch._inductor.config.compile_threads = 1``
(compile in the rank itself): an earlier run with the default (2 on this machine: a
pool of compile worker processes) got no answer within 600 s. With it, one
``llama3-debug`` block (dim 32) per rank, TP on the fast path, one shape,
``fullgraph`` — passes cold (fresh ``TORCHINDUCTOR_CACHE_DIR``) in 116 s per rank
(loss diff 0, gradients 7e-9, one graph, no break; 87 s of it the forward's compile,
most of it in the C++ compiler; the ranks' own CPU time 16 s).
``compiled_matches_eager("tp_sp", True, "inductor", "blocks")`` with new lengths
passed in 124 s; one shape takes 22 s with a warm inductor cache. The demo runs
inductor (``hyper-parallel demo --mesh dp=2,tp=2 --compile``, and
``--mesh dp_shard=2,cp=2``).
"""

from __future__ import annotations

import pytest

from tests._compare import worst_abs
from tests.distributed.compile_checks import (
    backward_twice,
    compiled_cp_matches_eager,
    compiled_matches_eager,
    compiled_moe_matches_eager,
    inductor_boundaries_match_eager,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 2
RANK_TIMEOUT_S = 600.0  # compiling on a busy 2-core machine takes minutes
TOL = 1e-5

# (layout, fast path, backend, scope, new sequence lengths).
CASES = [
    ("tp_sp", True, "aot_eager", "blocks", True),
    ("tp", True, "aot_eager", "model", True),
    # The DTensor path through the trainer's entry point: one static graph per length.
    ("tp", False, "aot_eager", "apply_compile", True),
]


@pytest.mark.parametrize(("layout", "fast", "backend", "scope", "new_lengths"), CASES)
def test_compiled_equals_eager_without_breaks_or_recompiles(
    dist, layout, fast, backend, scope, new_lengths
):
    for r in dist.run(compiled_matches_eager, layout, fast, backend, scope, new_lengths):
        assert r["graph_breaks"] == 0
        assert worst_abs(r["loss_diffs"]) <= TOL, r["loss_diffs"]
        assert len(r["loss_diffs"]) == (5 if new_lengths else 2)
        assert r["grad_diff_two_steps"] <= TOL
        graphs = r["graphs"]
        assert graphs["step0"] == 1  # one compiled unit (one block, or the model)
        assert graphs["step1"] == graphs["step0"]  # same shapes: no recompile
        if new_lengths:
            assert r["grad_diff_new_seq"] <= TOL
            if not fast and scope == "apply_compile":
                # DTensor path (torch 2.13 cannot trace it with a dynamic length): each
                # new length one static graph, a length seen before none.
                assert graphs["seq24"] == graphs["step1"] + 1
                assert graphs["seq32"] == graphs["seq24"] + 1
            else:
                assert graphs["seq24"] <= graphs["step1"] + 1  # a new length: one dynamic graph
                assert graphs["seq32"] == graphs["seq24"]  # and no more after it
            assert graphs["seq24_again"] == graphs["seq32"]


def test_compiled_block_backward_twice(dist):
    for r in dist.run(backward_twice, "tp_sp", True, "aot_eager"):
        assert r["graphs"] == 1
        assert r["grad_diff"] <= TOL


def test_compiled_context_parallel_block_equals_eager(dist):
    for r in dist.run(compiled_cp_matches_eager, "aot_eager"):
        assert r["graph_breaks"] == 0
        assert r["graphs"] == [1, 1]  # compiled once, not again on the second step
        assert worst_abs(r["loss_diffs"]) <= TOL, r["loss_diffs"]
        assert r["grad_diff"] <= TOL


def test_compiled_moe_blocks_with_expert_parallel_equal_eager(dist):
    # Compiled regions of the one MoE block: the attention, the RMSNorm (both norms share
    # one graph), the router, the balance statistics and the experts' maths; the experts
    # module (an FSDP2 unit, its dispatch's all-to-alls) runs eagerly between them.
    for r in dist.run(compiled_moe_matches_eager, "aot_eager"):
        assert r["experts_fsdp_unit"]
        assert r["graph_breaks"] == 0
        assert r["graphs"] == [5, 5], r["graphs"]  # compiled once, not again on step two
        assert worst_abs(r["loss_diffs"]) <= TOL, r["loss_diffs"]
        assert r["grad_diff"] <= TOL


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["col_row", "sp"])
def test_inductor_lowers_the_fast_path_boundaries(dist, sequence_parallel):
    for r in dist.run(inductor_boundaries_match_eager, sequence_parallel):
        assert r["graph_breaks"] == 0
        assert r["graphs"] == 1  # compiled once, not again on the second step
        assert worst_abs(r["loss_diffs"]) <= TOL, r["loss_diffs"]
        assert r["grad_diff"] <= TOL
