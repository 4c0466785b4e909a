"""The trainer on 8 gloo ranks: dp_shard=2 x cp=2 x tp=2 against one process.

Outputs, loss and every gradient of a step, and the losses and states of a short run,
equal a single-process run with the same seed and data (fp32, 1e-5).
"""

from __future__ import annotations

import pytest

from hyper_parallel.train import TrainConfig, Trainer
from tests._compare import FP32_RTOL, check
from tests.distributed.test_train import (
    SMALL,
    _assert_step_and_training_match,
    _step_then_train,
    _step_then_train_one_process_on_rank0,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 8


def test_dp_shard_cp_tp_step_and_training_match_one_process(dist):
    cfg = TrainConfig(mesh={"dp_shard": 2, "cp": 2, "tp": 2}, steps=2, **SMALL)
    sharded = dist.run(_step_then_train, cfg.to_dict())[0]
    single = dist.run(_step_then_train_one_process_on_rank0, cfg.to_dict())[0]
    _assert_step_and_training_match(sharded, single)


def _shard_fractions(cfg_dict: dict) -> dict[str, tuple[int, int, int]]:
    """Per parameter: full numel, local numel, and how many ways ``tp`` splits it."""
    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu")
    out = {}
    for name, p in trainer.model.named_parameters():
        names = p.device_mesh.mesh_dim_names
        tp_ways = 1
        for i, placement in enumerate(p.placements):
            if placement.is_shard() and names[i] == "tp":
                tp_ways *= p.device_mesh.size(i)
        out[name] = (p.numel(), p.to_local().numel(), tp_ways)
    return out


def test_dense_states_are_sharded_over_dp_shard_times_cp(dist):
    # FSDP2 shards every dense state over fsdp = dp_shard x cp (4 ranks), on top of tp.
    cfg = TrainConfig(mesh={"dp_shard": 2, "cp": 2, "tp": 2}, steps=1, **SMALL)
    for fractions in dist.run(_shard_fractions, cfg.to_dict()):
        for name, (full, local, tp_ways) in fractions.items():
            assert local * 2 * 2 * tp_ways == full, (name, full, local, tp_ways)


def test_moe_trainer_build_at_dp_shard4_tp2_ep4_matches_one_process(dist):
    # ep=4 takes the tp pairs of two dp_shard ranks; experts FSDP over efsdp=2, and each
    # rank routes its half of the sequence (sequence-parallel experts under tp).
    from tests.distributed import moe_checks

    for diffs in dist.run(moe_checks.trainer_parity, "dp_shard=4,tp=2,ep=4"):
        check(diffs, atol=1e-5, rtol=FP32_RTOL)
