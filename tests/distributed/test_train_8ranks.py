"""The trainer on 8 gloo ranks: dp_shard=2 x cp=2 x tp=2 against one process.

Outputs, loss and every gradient of a step, and the losses and states of a short run,
equal a single-process run with the same seed and data (fp32, 1e-5).
"""

from __future__ import annotations

import pytest

from hyper_parallel.train import TrainConfig
from tests.distributed.test_train import (
    SMALL,
    _assert_step_and_training_match,
    _step_then_train,
    _step_then_train_one_process_on_rank0,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 8


def test_dp_shard_cp_tp_step_and_training_match_one_process(dist):
    cfg = TrainConfig(mesh={"dp_shard": 2, "cp": 2, "tp": 2}, num_steps=2, **SMALL)
    sharded = dist.run(_step_then_train, cfg.to_dict())[0]
    single = dist.run(_step_then_train_one_process_on_rank0, cfg.to_dict())[0]
    _assert_step_and_training_match(sharded, single)


def test_moe_trainer_build_at_dp_shard4_tp2_ep4_matches_one_process(dist):
    # ep=4 takes the tp pairs of two dp_shard ranks; experts FSDP over efsdp=2, and each
    # rank routes its half of the sequence (sequence-parallel experts under tp).
    from tests.distributed import moe_checks

    for diffs in dist.run(moe_checks.trainer_parity, "dp_shard=4,tp=2,ep=4"):
        worst = max(diffs.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
