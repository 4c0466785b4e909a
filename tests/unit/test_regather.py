"""A gathered input kept as its shard for backward (``dmodule/_regather.py``), on the
fake process group: which collectives backward issues, and the in-place guard.

Values are checked on real gloo ranks against one device (``tests/distributed``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.dmodule import Module, ShardingConfig, fast_path, keep_gathered

WORLD_SIZE = 4
Linear = Module.from_nn_module(nn.Linear)


def _column_on_sequence_shards(mesh, fast: bool) -> nn.Module:
    """A column-parallel projection whose input arrives as sequence shards (Shard(0))."""
    config = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
        in_src_shardings={"input": {"tp": Shard(0)}},
        in_dst_shardings={"input": {"tp": Replicate()}},
        out_dst_shardings={"tp": Shard(-1)},
    )
    torch.manual_seed(0)
    linear = Linear.Config(in_features=8, out_features=16, sharding_config=config).build()
    with fast_path(fast):
        linear.parallelize(mesh)
    return linear


def _backward_gathers(linear: nn.Module, x: torch.Tensor) -> int:
    y = linear(x)
    with CommDebugMode() as comms:
        y.to_local().sum().backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comms.get_comm_counts().items()}
    return sum(n for name, n in counts.items() if "gather" in name)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "dtensor"])
def test_backward_gathers_the_shard_again_unless_kept_gathered(mesh, fast):
    linear = _column_on_sequence_shards(mesh, fast)
    x = torch.randn(4, 8, requires_grad=True)  # this rank's 4 of 16 tokens
    assert _backward_gathers(linear, x) == 1  # the weight gradient's input, gathered again
    with keep_gathered():
        assert _backward_gathers(linear, x) == 0


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "dtensor"])
def test_a_shard_modified_in_place_before_backward_is_refused(mesh, fast):
    linear = _column_on_sequence_shards(mesh, fast)
    x = torch.randn(4, 8)
    h = x.clone().requires_grad_()
    shard = h * 1.0  # a non-leaf input, as a block's input is
    y = linear(shard)
    with torch.no_grad():
        shard.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after the forward saved it"):
        y.to_local().sum().backward()
