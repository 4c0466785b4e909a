"""Context parallelism (cp=2) on the reference Llama, against one device.

The model is built on the meta device with ``apply_cp``, parallelized on the ``cp``
mesh, materialized and initialized; each rank runs its head-tail part of the sequence
with its global positions. Compared with one device: logits (gathered back in sequence
order), the loss (the ranks' mean) and every gradient (the ranks' mean, as FSDP2 over
``dp_shard x cp`` averages them), at fp32 tolerance; collectives on ``cp`` per phase
against ``expected_cp_collectives``; placements; which runtime path each module took.
"""

from __future__ import annotations

import pytest

from tests._compare import FP32_RTOL, check
from tests.distributed.cp_checks import (
    compare_with_fsdp,
    compare_with_one_device,
    expected_cp_collectives,
    forward_without_positions,
    positions_not_the_split,
    unshard_placed_otherwise,
    unshard_round_trip,
)

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
NUM_LAYERS = 2  # llama3-debug
SEQ_LEN = 16
TOL = 1e-5
PATHS = ("fast", "dtensor")


@pytest.fixture(scope="module")
def results(dist):
    out = {
        path: dist.run(compare_with_one_device, "cp=2", None, path == "fast", SEQ_LEN)
        for path in PATHS
    }
    out["batch_positions"] = dist.run(compare_with_one_device, "cp=2", None, True, SEQ_LEN, True)
    out["one_kv_head"] = dist.run(
        compare_with_one_device, "cp=2", None, True, SEQ_LEN, False, "cp_last", 1
    )
    # Targets 0..9 ignored: rank 0 (positions 0-3, 12-15) keeps 4 per sequence, rank 1
    # (4-11) 2; a mean of the ranks' own means weighs rank 1's tokens twice.
    out["ignored_targets"] = dist.run(
        compare_with_one_device, "cp=2", None, True, SEQ_LEN, False, "cp_last", None, 10
    )
    return out


@pytest.mark.parametrize("case", [*PATHS, "batch_positions", "one_kv_head", "ignored_targets"])
def test_logits_loss_and_every_gradient_match_one_device(results, case):
    for r in results[case]:
        assert r["local_seq"] == SEQ_LEN // 2
        assert r["logits_diff"] <= TOL
        assert r["loss_diff"] <= TOL
        assert r["local_loss_diff_to_local_reference"] <= TOL
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        assert len(r["grad_diffs"]) == 3 + 9 * NUM_LAYERS  # every parameter compared


@pytest.mark.parametrize("case", PATHS)
def test_collectives_on_cp_are_the_declared_ones(results, case):
    expected = expected_cp_collectives(NUM_LAYERS)
    for r in results[case]:
        counts = r["counts"]
        assert set(counts["forward"]) == {"cp"}
        assert counts["forward"]["cp"] == expected["forward"]
        assert counts["loss"] == {"cp": expected["loss"]}
        assert counts["backward"] == {"cp": expected["backward"]}


@pytest.mark.parametrize("case", PATHS)
def test_placements_and_runtime_path(results, case):
    r = results[case][0]
    assert r["logits_placements"] == ["S(1)"]
    assert all(p == ["R"] for p in r["param_placements"].values())
    # Each rank's gradient covers its own tokens: a partial sum over cp.
    assert all(g == ["P(sum)"] for g in r["grad_placements"].values()), r["grad_placements"]
    paths = r["fast_paths"]
    norms = {p for p in paths if p.endswith("norm")}
    assert len(norms) == 2 * NUM_LAYERS + 1
    if case == "fast":
        # Token-wise norms on sequence shards are the pattern the fast path knows on cp;
        # everything else (replicated weights, the k/v gather) runs on DTensor. The mask
        # module has no placement (it reads the split from the positions').
        assert all(paths[p] == "sequence_parallel_norm" for p in norms)
        assert "mask" not in paths
        assert all(v == "dtensor" for p, v in paths.items() if p not in norms)
    else:
        assert set(paths.values()) == {"dtensor"}


def test_forward_without_positions_is_a_clear_error_on_every_rank(dist):
    for message in dist.run(forward_without_positions, "cp=2", None):
        assert "8 tokens given are part of a 16-token sequence" in message
        assert "positions=context_parallel.positions(" in message


def test_positions_that_are_not_the_head_tail_split_are_refused(dist):
    for rank, message in enumerate(dist.run(positions_not_the_split, "cp=2")):
        assert f"rank {rank} of cp=2 holds positions" in message
        assert "not its head-tail part of the sequence" in message
        assert "positions=context_parallel.positions(seq_len, cp_rank, cp_size)" in message


def test_shard_then_unshard_round_trip_with_gradients(dist):
    seq_len = 12
    results = dist.run(unshard_round_trip, seq_len)
    assert [r["mine"] for r in results] == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]
    for r in results:
        assert r["equal"]
        assert r["positions"] == list(range(seq_len))
    # Each rank's part got its gradient (the position) through the gather.
    for r in results:
        grad = r["grad"][0]
        for pos in r["mine"]:
            assert grad[pos] == [float(pos)] * 3
        others = [p for p in range(seq_len) if p not in r["mine"]]
        assert all(grad[p] == [0.0] * 3 for p in others)


def test_unshard_refuses_a_dtensor_that_is_not_split_on_cp(dist):
    # A replicated DTensor was already whole; "undoing" the head-tail order scrambled it
    # ([0, 1, 4, 5, 6, 7, 2, 3] for arange(8)).
    for r in dist.run(unshard_placed_otherwise):
        for name, dim in (("replicated", 1), ("batch_split", 1), ("wrong_dim", 0)):
            assert f"not Shard({dim}) on the cp axis ('cp',)" in r[name], r[name]
        assert "placed [Replicate()]" in r["replicated"]
        assert "full_tensor()" in r["replicated"]


def test_fsdp_over_cp_averages_the_gradients_to_one_device(dist):
    for r in dist.run(compare_with_fsdp, "cp=2", None, SEQ_LEN):
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        assert len(r["grad_diffs"]) == 3 + 9 * NUM_LAYERS
        # States sharded over cp by FSDP (the model's own cp placement was Replicate).
        assert r["param_placements"]["layers.0.attention.wq.weight"] == ["S(0)"]
