"""A parallelized Llama under ``torch.compile(fullgraph=True)`` on 2 gloo ranks.

Covered: the fast path (local shards, functional collectives) and the DTensor
boundaries it keeps (the blocks' sequence-parallel entry), TP and TP+SP, every
boundary kind (column/row-wise, sequence-parallel entry and exit, vocab-parallel
embedding, norms, the attention ``local_map`` region), per block (as torchtitan
compiles) and whole model, with ``aot_eager``.
Each case: compiled loss and every gradient equal eager to 1e-5 over two
accumulating steps; no graph break (``fullgraph=True`` raises on one, dynamo's
counter stays 0); no recompile on a second step of the same shape; at most one
recompile for new sequence lengths. Compile is slow on CPU: one layer of a narrow
``llama3-debug``.
"""

from __future__ import annotations

import pytest

from tests.distributed.compile_checks import backward_twice, compiled_matches_eager

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 2
RANK_TIMEOUT_S = 600.0  # compiling on a busy 2-core machine takes minutes
TOL = 1e-5

# (layout, fast path, backend, scope). Inductor is exercised by the demo
# (``--compile``) rather than here: its C++ kernels take minutes on this machine.
CASES = [
    ("tp_sp", True, "aot_eager", "blocks"),
    ("tp", True, "aot_eager", "model"),
]


@pytest.mark.parametrize(("layout", "fast", "backend", "scope"), CASES)
def test_compiled_equals_eager_without_breaks_or_recompiles(dist, layout, fast, backend, scope):
    for r in dist.run(compiled_matches_eager, layout, fast, backend, scope):
        assert r["graph_breaks"] == 0
        assert max(r["loss_diffs"]) <= TOL, r["loss_diffs"]
        assert r["grad_diff_two_steps"] <= TOL
        assert r["grad_diff_new_seq"] <= TOL
        graphs = r["graphs"]
        assert graphs["step0"] == 1  # one compiled unit (one block, or the model)
        assert graphs["step1"] == graphs["step0"]  # same shapes: no recompile
        assert graphs["seq24"] <= graphs["step1"] + 1  # a new length: one dynamic graph
        assert graphs["seq32"] == graphs["seq24"]  # and no more after it


def test_compiled_block_backward_twice(dist):
    for r in dist.run(backward_twice, "tp_sp", True, "aot_eager"):
        assert r["graphs"] == 1
        assert r["grad_diff"] <= TOL
