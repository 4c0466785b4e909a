"""The reference Llama's TP and TP+SP layouts on 4 ranks, against one device (default path)."""

from __future__ import annotations

import pytest

from tests._compare import FP32_RTOL, check
from tests.distributed.llama_checks import (
    LAYOUTS,
    compare_with_one_device,
    expected_collectives,
    held_after_forward,
)

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


@pytest.mark.parametrize("local_fast_path", [True, False], ids=["fast", "dtensor"])
def test_sequence_parallel_keeps_shards_not_gathered_inputs(dist, local_fast_path):
    """Each gathered input (the attention and feed-forward blocks', the output
    projection's) is kept for backward as this rank's shard: what autograd holds after
    the forward drops by the gathered tensor less the shard, 2 per layer + 1. (The
    gradients, gathered again in backward, are compared with one device above.)"""
    seq = 32
    kept, gathered = (
        dist.run(held_after_forward, keep, local_fast_path, seq) for keep in (True, False)
    )
    for on, off in zip(kept, gathered):
        fp32_tokens = 4 * 2 * seq  # bytes per feature of one gathered input: batch 2, fp32
        per_input = fp32_tokens * on["dim"] * (1 - 1 / WORLD_SIZE)
        assert off["held"] - on["held"] == (2 * on["layers"] + 1) * per_input
