"""The fast path at tp=4: the 2-rank scenarios again on 4 gloo ranks (numerics, counts)."""

from __future__ import annotations

import pytest

from tests.distributed.test_fast_path import (
    _check,
    _local_map_runs,
    _mlp_runs,
    _sequence_parallel_runs,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 4


def test_mlp_sequence_parallel_and_local_map_at_tp4(dist):
    for runs in dist.run(_mlp_runs, True):
        _check(runs, {"up": "colwise", "down": "rowwise"}, {"all_reduce": 1}, {"all_reduce": 1})
    sequence_parallel = {
        "emb": "vocab_embedding_sequence_parallel",
        "norm": "sequence_parallel_norm",
        "mlp.up": "colwise_sequence_parallel",
        "mlp.down": "rowwise_sequence_parallel",
    }
    for runs in dist.run(_sequence_parallel_runs, False):
        # Backward: mlp.up's input gathered again (its shard kept), as at tp=2.
        _check(
            runs,
            sequence_parallel,
            {"reduce_scatter": 2, "all_gather": 1},
            {"all_gather": 3, "reduce_scatter": 1},
            same_grad_layouts=False,
        )
    for runs in dist.run(_local_map_runs):
        kinds = {"proj": "local_map", "gate": "local_map", "down": "rowwise"}
        _check(runs, kinds, {"all_reduce": 1}, {"all_reduce": 1})
