"""Pipeline parallelism composed with tensor parallelism and FSDP2, on 4 gloo ranks.

pp=2 x tp=2 (TP inside each stage on mesh["tp"]), pp=2 x dp_shard=2 (FSDP2 inside
each stage over mesh.fsdp_mesh()) and pp=4 (four stages of the 2-layer model: the
embedding and the head alone on theirs): the loss of every one of 5 AdamW steps and
every gradient after step 1 match one device to 1e-5.
"""

from __future__ import annotations

import pytest

from tests.distributed.pipeline_checks import checkpoint_across_meshes, train_vs_one_device
from tests.distributed.test_pipeline import NUM_STEPS, _check_parity, _param_names

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4


def _dedupe(results: list[dict], group: int) -> list[dict]:
    """One result per pp rank (ranks of one stage hold the same parameter names)."""
    return results[::group]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pp2_tp2(dist, schedule):
    results = dist.run(train_vs_one_device, "pp=2,tp=2", schedule, 4, NUM_STEPS)
    _check_parity(_dedupe(results, 2))
    for r in results:
        placements = r["placements"]
        for name, p in placements.items():  # every parameter is a tp DTensor
            if name.endswith(("wq.weight", "w1.weight", "output.weight")):
                assert p == ["S(0)"], name
            elif name.endswith(("wo.weight", "w2.weight")):
                assert p == ["S(1)"], name
            else:
                assert p in (["S(0)"], ["R"]), name


def test_pp2_dp_shard2(dist):
    results = dist.run(train_vs_one_device, "pp=2,dp_shard=2", "1F1B", 2, NUM_STEPS)
    _check_parity(_dedupe(results, 2))
    assert all(p == ["S(0)"] for r in results for p in r["placements"].values())


def test_pp4_one_unit_per_stage(dist):
    results = dist.run(train_vs_one_device, "pp=4", "1F1B", 4, NUM_STEPS)
    _check_parity(results)
    assert [sorted({n.split(".")[0] for n in r["grad_diffs"]}) for r in results] == [
        ["tok_embeddings"],
        ["layers"],
        ["layers"],
        ["norm", "output"],
    ]


def test_checkpoint_saved_at_pp2_tp2_loads_anywhere_bitwise(dist, tmp_path):
    results = dist.run(checkpoint_across_meshes, str(tmp_path / "step_000002"))
    num_params = len(_param_names({}))
    for r in results:
        assert r["num_saved"] == 2 * num_params  # every weight and its AdamW exp_avg
        assert r["train_state"] == {"step": 2}
        assert r["tp4"] == (0.0, 2 * num_params)
        diff, count = r["interleaved"]
        assert diff == 0.0 and count > 0
    assert sum(r["interleaved"][1] for r in results[::2]) == 2 * num_params
    assert results[0]["one_process"] == (0.0, num_params)
