"""FSDP2 over ``fsdp`` = dp_shard x cp under context parallelism, on 4 gloo ranks.

The trainer at dp_shard=2 x cp=2 and at dp_replicate=2 x cp=2 (HSDP) against one
process: outputs, loss and every gradient of a step, then the losses and states of a
short run (fp32, 1e-5). And where the states live: each rank holds ``1 / (dp_shard x
cp)`` of every state (FSDP2's SPMD form on the model's mesh), replicated over
``dp_replicate``.
"""

from __future__ import annotations

import math

import pytest

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.train import TrainConfig, Trainer
from tests.distributed.test_train import (
    SMALL,
    _assert_step_and_training_match,
    _step_then_train,
    _step_then_train_one_process_on_rank0,
)

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4
DP_SHARD_CP = {"dp_shard": 2, "cp": 2}
HSDP_CP = {"dp_replicate": 2, "cp": 2}


def _states(cfg_dict: dict) -> dict:
    """Every parameter's global and local shape, mesh and placements on this rank."""
    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu")
    out = {}
    for name, p in trainer.model.named_parameters():
        assert isinstance(p, DTensor), name
        out[name] = {
            "global": tuple(p.shape),
            "local": tuple(p.to_local().shape),
            "mesh": p.device_mesh.mesh_dim_names,
            "placements": [type(x).__name__ for x in p.placements],
        }
    return out


@pytest.mark.parametrize("mesh", [DP_SHARD_CP, HSDP_CP], ids=["dp_shard2_cp2", "hsdp2_cp2"])
def test_step_and_training_match_one_process(dist, mesh):
    cfg = TrainConfig(mesh=mesh, steps=2, **SMALL)
    sharded = dist.run(_step_then_train, cfg.to_dict())[0]
    single = dist.run(_step_then_train_one_process_on_rank0, cfg.to_dict())[0]
    _assert_step_and_training_match(sharded, single)


@pytest.mark.parametrize("mesh", [DP_SHARD_CP, HSDP_CP], ids=["dp_shard2_cp2", "hsdp2_cp2"])
def test_each_rank_holds_one_over_dp_shard_x_cp_of_every_state(dist, mesh):
    cfg = TrainConfig(mesh=mesh, **SMALL)
    fsdp = mesh.get("dp_shard", 1) * mesh["cp"]
    ranks = dist.run(_states, cfg.to_dict())
    for states in ranks:
        assert len(states) > 10
        for name, s in states.items():
            # Sharded on dim 0 over fsdp (every dim-0 size here divides by it).
            assert s["local"][0] * fsdp == s["global"][0], (name, s)
            assert s["local"][1:] == s["global"][1:], (name, s)
            if "dp_replicate" in mesh:  # HSDP: (dp_replicate, fsdp) = (Replicate, Shard)
                assert s["mesh"][0] == "dp_replicate" and s["placements"][0] == "Replicate"
            assert "Shard" in s["placements"][-1] or "StridedShard" in s["placements"][-1]
        local = sum(math.prod(s["local"]) for s in states.values())
        assert local * fsdp == sum(math.prod(s["global"]) for s in states.values())
