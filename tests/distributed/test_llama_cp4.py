"""Context parallelism on 4 ranks: cp=4 (also with one key/value head), and cp=2 x tp=2
with TP and TP+SP, vs one device.

cp x tp runs on the 2-D ``(cp, tp)`` mesh (``mesh.submesh(("cp", "tp"))``): collectives
on ``cp`` are exactly the attention core's declared ones, and those on ``tp`` are
Megatron's minimum, the same as tensor parallelism alone
(``llama_checks.expected_collectives``). Applying the layouts in the other order gives
identical configs (``tests/unit/test_context_parallel.py``); on the 2-D mesh every module
but the plain-TP norms runs on DTensor whichever path is chosen.
"""

from __future__ import annotations

import pytest

from tests._compare import FP32_RTOL, check
from tests.distributed.cp_checks import (
    compare_with_fsdp,
    compare_with_one_device,
    expected_cp_collectives,
)
from tests.distributed.llama_checks import expected_collectives

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4
NUM_LAYERS = 2  # llama3-debug: 8 query and 4 key/value heads
SEQ_LEN = 16
TOL = 1e-5

# (mesh, tensor-parallel layout, fast path, order in which the layouts are applied)
CASES = {
    "cp4": ("cp=4", None, True, "cp_last"),
    "cp4_one_kv_head": ("cp=4", None, True, "cp_last", 1),
    "cp2_tp2": ("cp=2,tp=2", "tp", True, "cp_last"),
    "cp2_tp2_sp": ("cp=2,tp=2", "tp_sp", True, "cp_last"),
    # Targets 0..9 ignored: the ranks keep 2, 2, 2 and none of their 4 per sequence at
    # cp=4; 4 and 2 of 8 at cp=2 (the loss vocab-parallel on tp).
    "cp4_ignored_targets": ("cp=4", None, True, "cp_last", None, 10),
    "cp2_tp2_ignored_targets": ("cp=2,tp=2", "tp", True, "cp_last", None, 10),
}


@pytest.fixture(scope="module")
def results(dist):
    return {
        name: dist.run(compare_with_one_device, mesh, tp, fast, SEQ_LEN, False, order, *rest)
        for name, (mesh, tp, fast, order, *rest) in CASES.items()
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_and_every_gradient_match_one_device(results, case):
    cp_size = 4 if case.startswith("cp4") else 2
    for r in results[case]:
        assert r["local_seq"] == SEQ_LEN // cp_size
        assert r["logits_diff"] <= TOL
        assert r["loss_diff"] <= TOL
        assert r["local_loss_diff_to_local_reference"] <= TOL
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        assert len(r["grad_diffs"]) == 3 + 9 * NUM_LAYERS


@pytest.mark.parametrize("case", sorted(CASES))
def test_collectives_per_axis(results, case):
    cp_expected = expected_cp_collectives(NUM_LAYERS)
    tp_layout = CASES[case][1]
    for r in results[case]:
        for phase in ("forward", "loss", "backward"):
            counts = r["counts"][phase]
            assert counts.get("cp", {}) == cp_expected[phase], (phase, counts)
            if tp_layout is None:
                assert set(counts) <= {"cp"}, counts
            else:
                assert counts.get("tp", {}) == expected_collectives(tp_layout, NUM_LAYERS)[phase]
                assert set(counts) <= {"cp", "tp"}, counts


@pytest.mark.parametrize("case", ["cp2_tp2", "cp2_tp2_sp"])
def test_placements_on_the_2d_mesh(results, case):
    r = results[case][0]
    assert r["logits_placements"] == ["S(1)", "S(2)"]  # sequence on cp, vocab on tp
    params = r["param_placements"]
    assert params["layers.0.attention.wq.weight"] == ["R", "S(0)"]
    assert params["layers.0.attention.wo.weight"] == ["R", "S(1)"]
    assert params["norm.weight"] == ["R", "R"]
    grads = r["grad_placements"]
    assert grads["layers.0.attention.wq.weight"] == ["P(sum)", "S(0)"]
    # Placements on both axes: the fast path steps aside except for token-wise norms
    # whose only split is the cp sequence (plain TP); those give the same numbers. The
    # mask module has no placement (it reads the split from the positions').
    paths = r["fast_paths"]
    sp = CASES[case][1] == "tp_sp"
    assert "mask" not in paths
    for path, kind in paths.items():
        if path.endswith("norm") and not sp:
            assert kind == "sequence_parallel_norm", path
        else:
            assert kind == "dtensor", (path, kind)


def test_fsdp_over_cp_with_tp_sp_gives_one_device_gradients(dist):
    for r in dist.run(compare_with_fsdp, "cp=2,tp=2", "tp_sp", SEQ_LEN):
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        assert len(r["grad_diffs"]) == 3 + 9 * NUM_LAYERS
