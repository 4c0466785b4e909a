"""The reference Llama's TP and TP+SP layouts on 4 ranks, against one device (default path)."""

from __future__ import annotations

import pytest

from tests._compare import FP32_RTOL, check
from tests.distributed.llama_checks import LAYOUTS, compare_with_one_device, expected_collectives

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4
NUM_LAYERS = 2  # llama3-debug: 8 query and 4 key/value heads, whole heads on 4 ranks
TOL = 1e-5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_one_device_with_minimal_collectives(dist, layout):
    results = dist.run(compare_with_one_device, layout, True, {}, 16)
    expected = expected_collectives(layout, NUM_LAYERS)
    for r in results:
        assert r["init_diff"] == 0.0
        assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        assert r["logits_placements"] == ["S(2)"]
        assert r["counts"] == expected
