"""The reference Llama's TP and TP+SP layouts on 2 ranks, against one device.

Each layout runs on both runtime paths (local fast path, DTensor dispatch): the
model is built on the meta device, parallelized, materialized with ``to_empty``
and initialized; initial parameters must equal a one-device build bitwise, logits
and every gradient to fp32 tolerance, collectives per phase the analytical
minimum of ``llama_checks.expected_collectives``.
"""

from __future__ import annotations

import pytest

from tests._compare import FP32_RTOL, check
from tests.distributed.llama_checks import (
    LAYOUTS,
    compare_with_one_device,
    expected_collectives,
    loss_on_other_placements,
)
from tests.distributed.models import assert_paths

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
NUM_LAYERS = 2  # llama3-debug
SEQ_LEN = 16
TOL = 1e-5
PATHS = ("fast", "dtensor")
CASES = [(layout, path) for layout in LAYOUTS for path in PATHS]


@pytest.fixture(scope="module")
def results(dist):
    return {
        (layout, path): dist.run(compare_with_one_device, layout, path == "fast", {}, SEQ_LEN)
        for layout, path in CASES
    }


@pytest.mark.parametrize(("layout", "path"), CASES)
def test_init_on_meta_equals_one_device_bitwise(results, layout, path):
    assert [r["init_diff"] for r in results[layout, path]] == [0.0] * WORLD_SIZE


@pytest.mark.parametrize(("layout", "path"), CASES)
def test_logits_and_every_gradient_match_one_device(results, layout, path):
    for r in results[layout, path]:
        assert r["logits_diff"] <= TOL
        assert r["loss_diff"] <= TOL
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        assert len(r["grad_diffs"]) == 3 + 9 * NUM_LAYERS  # every parameter compared


@pytest.mark.parametrize(("layout", "path"), CASES)
def test_each_module_ran_the_path_it_claims(results, layout, path):
    for r in results[layout, path]:
        assert_paths(r, path)
        if path == "fast":
            kinds = {m: kind for m, (kind, _) in r["paths"].items()}
            norms = {m: k for m, k in kinds.items() if m.endswith("norm")}
            assert len(norms) == 2 * NUM_LAYERS + 1, kinds
            want = "sequence_parallel_norm" if layout == "tp_sp" else "dtensor"
            assert set(norms.values()) <= {want, "norm"}, norms


@pytest.mark.parametrize(("layout", "path"), CASES)
def test_placements(results, layout, path):
    r = results[layout, path][0]
    assert r["logits_placements"] == ["S(2)"]  # vocab-sharded: no full-vocab gather
    params = r["param_placements"]
    for name, placements in params.items():
        leaf = name.rsplit(".", 2)[-2]
        if leaf in ("tok_embeddings", "wq", "wk", "wv", "w1", "w3", "output"):
            assert placements == ["S(0)"], name
        elif leaf in ("wo", "w2"):
            assert placements == ["S(1)"], name
        else:
            assert leaf.endswith("norm") and placements == ["R"], name
    for name, grad in r["grad_placements"].items():
        if name.endswith("norm.weight") and layout == "tp_sp":
            # Summed over this rank's tokens: reduced once per step where consumed.
            assert grad == ["P(sum)"], name
        elif name == "tok_embeddings.weight" and path == "dtensor":
            # DTensor has no vocab-sharded strategy for embedding_dense_backward.
            assert grad == ["R"], name
        else:
            assert grad == params[name], name


@pytest.mark.parametrize(("layout", "path"), CASES)
def test_collectives_are_the_analytical_minimum(results, layout, path):
    expected = expected_collectives(layout, NUM_LAYERS)
    for r in results[layout, path]:
        assert r["counts"] == expected


def test_loss_on_replicated_logits_and_error_for_other_placements(dist):
    for r in dist.run(loss_on_other_placements):
        assert r["sharded_diff"] <= 1e-6 and r["replicated_diff"] <= 1e-6
        assert "placed [Shard(dim=0)]" in r["error"] and "mesh['tp']" in r["error"]


@pytest.mark.parametrize("path", PATHS)
def test_sequence_length_not_divisible_by_tp_matches_one_device(dist, path):
    """TP+SP with 15 tokens on 2 ranks: uneven sequence shards (8 and 7) stay correct.

    The fast path hands uneven shards to DTensor where it cannot split evenly, and
    keeps the true global shape where it passes a shard through (the norms).
    """
    for r in dist.run(compare_with_one_device, "tp_sp", path == "fast", {}, 15):
        assert r["logits_diff"] <= TOL
        assert r["loss_diff"] <= TOL
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
