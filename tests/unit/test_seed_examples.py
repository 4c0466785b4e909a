"""The seed's docstring examples, written exactly as the seed writes them.

Each test body starts with the seed's own imports and code, unchanged; the
assertions after it check that the example did what its docstring says.
"""

from __future__ import annotations

import pytest


def test_module_example_column_parallel_weight_with_replicated_activations():
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule.sharding import ShardingConfig
    from hyper_parallel.dmodule.types import MeshAxisName

    config = ShardingConfig(
        state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
        in_dst_shardings={"x": {MeshAxisName.TP: Replicate()}},
    )

    assert config.state_shardings == {"weight": {"tp": Shard(0)}}
    assert config.in_dst_shardings == {"x": {"tp": Replicate()}}
    assert config.in_src_shardings is None
    assert config.out_src_shardings is None
    assert config.out_dst_shardings is None
    assert config.local_map is None


def test_local_map_config_example():
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
    from hyper_parallel.dmodule.types import MeshAxisName

    sharding = ShardingConfig(
        state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
        local_map=LocalMapConfig(
            in_grad_placements=({MeshAxisName.TP: Replicate()},),
        ),
    )

    assert isinstance(sharding.local_map, LocalMapConfig)
    assert sharding.local_map.in_grad_placements == ({"tp": Replicate()},)
    assert sharding.state_shardings == {"weight": {"tp": Shard(0)}}


def test_sharding_config_example_tp_column_parallel():
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule.sharding import ShardingConfig
    from hyper_parallel.dmodule.types import MeshAxisName

    config = ShardingConfig(
        state_shardings={
            "weight": {MeshAxisName.TP: Shard(0)},
        },
        in_dst_shardings={
            "x": {MeshAxisName.TP: Replicate()},
        },
        out_dst_shardings={MeshAxisName.TP: Shard(-1)},
    )

    assert config.out_dst_shardings == {"tp": Shard(-1)}
    assert config.in_dst_shardings == {"x": {"tp": Replicate()}}
    assert config.use_local_output is False


def test_resolve_placements_example_partial_tp_spec_on_dp_tp_mesh():
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule.sharding import resolve_placements
    from hyper_parallel.dmodule.types import MeshAxisName

    mesh_axis_names = ("dp", "tp")
    named = {MeshAxisName.TP: Shard(0)}
    placements = resolve_placements(named, mesh_axis_names)
    assert placements[0].is_replicate()
    assert placements[1].is_shard(0)

    assert placements == [Replicate(), Shard(0)]


def test_resolve_placements_example_case_sensitive_matching():
    from hyper_parallel.core.dtensor.placement_types import Shard
    from hyper_parallel.dmodule.sharding import resolve_placements

    with pytest.raises(ValueError, match="not in mesh") as excinfo:
        resolve_placements({"TP": Shard(0)}, ("tp",))  # raises ValueError

    assert "'TP'" in str(excinfo.value)
