"""The public import paths exist exactly, and re-export PyTorch's own objects."""

from __future__ import annotations

import importlib

import pytest
import torch.distributed.device_mesh as torch_device_mesh
import torch.distributed.tensor as torch_tensor
import torch.distributed.tensor.experimental as torch_tensor_experimental
import torch.distributed.tensor.placement_types as torch_placement_types

PUBLIC_MODULES = [
    "hyper_parallel.core.dtensor",
    "hyper_parallel.core.dtensor.placement_types",
    "hyper_parallel.core.dtensor.device_mesh",
    "hyper_parallel.core.dtensor.dtensor",
    "hyper_parallel.dmodule.types",
    "hyper_parallel.dmodule.sharding",
    "hyper_parallel.dmodule.plan_file",
]


@pytest.mark.parametrize(
    ("module_name", "name", "torch_object"),
    [
        (
            "hyper_parallel.core.dtensor.placement_types",
            "Placement",
            torch_placement_types.Placement,
        ),
        ("hyper_parallel.core.dtensor.placement_types", "Shard", torch_placement_types.Shard),
        (
            "hyper_parallel.core.dtensor.placement_types",
            "Replicate",
            torch_placement_types.Replicate,
        ),
        ("hyper_parallel.core.dtensor.placement_types", "Partial", torch_placement_types.Partial),
        ("hyper_parallel.core.dtensor.device_mesh", "DeviceMesh", torch_device_mesh.DeviceMesh),
        (
            "hyper_parallel.core.dtensor.device_mesh",
            "init_device_mesh",
            torch_device_mesh.init_device_mesh,
        ),
        ("hyper_parallel.core.dtensor.dtensor", "DTensor", torch_tensor.DTensor),
        (
            "hyper_parallel.core.dtensor.dtensor",
            "distribute_tensor",
            torch_tensor.distribute_tensor,
        ),
        ("hyper_parallel.core.dtensor.dtensor", "local_map", torch_tensor_experimental.local_map),
    ],
)
def test_core_dtensor_reexports_torch_objects(module_name, name, torch_object):
    module = importlib.import_module(module_name)
    assert getattr(module, name) is torch_object
    assert name in module.__all__
    # The package re-exports the same object as its submodule.
    package = importlib.import_module("hyper_parallel.core.dtensor")
    assert getattr(package, name) is torch_object


def test_placements_behave_as_torch_placements():
    from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard

    assert Shard(0).is_shard(0)
    assert not Shard(0).is_shard(1)
    assert Replicate().is_replicate()
    assert Partial().is_partial()
    assert all(isinstance(p, Placement) for p in (Shard(1), Replicate(), Partial("avg")))


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_module_all_names_resolve(module_name):
    module = importlib.import_module(module_name)
    assert isinstance(module.__all__, list)
    assert module.__all__, f"{module_name}.__all__ is empty"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == [], f"{module_name}.__all__ names missing attributes: {missing}"


def test_sharding_all_is_exactly_the_seeds():
    from hyper_parallel.dmodule import sharding

    assert sharding.__all__ == [
        "LocalMapConfig",
        "NamedPlacement",
        "ShardingConfig",
        "resolve_placements",
    ]


def test_sharding_named_placement_is_the_types_one():
    from hyper_parallel.dmodule import sharding, types

    assert sharding.NamedPlacement is types.NamedPlacement
    assert sharding.MeshAxisName is types.MeshAxisName


MESH_AXIS_MEMBERS = {
    "DP": "dp",
    "DP_REPLICATE": "dp_replicate",
    "DP_SHARD": "dp_shard",
    "FSDP": "fsdp",
    "TP": "tp",
    "CP": "cp",
    "PP": "pp",
    "EP": "ep",
    "EFSDP": "efsdp",
}


def test_mesh_axis_name_has_exactly_the_conventional_members():
    from hyper_parallel.dmodule.types import MeshAxisName

    assert {m.name: m.value for m in MeshAxisName} == MESH_AXIS_MEMBERS


@pytest.mark.parametrize(("member", "value"), sorted(MESH_AXIS_MEMBERS.items()))
def test_mesh_axis_name_member_equals_its_lowercase_string(member, value):
    from hyper_parallel.dmodule.types import MeshAxisName

    axis = MeshAxisName[member]
    assert isinstance(axis, str)
    assert axis == value
    assert value == axis
    assert hash(axis) == hash(value)  # so {"tp": ...} and {MeshAxisName.TP: ...} agree
    assert MeshAxisName(value) is axis
    assert str(axis) == value
    assert f"{axis}" == value


def test_named_placement_is_importable_from_types():
    from hyper_parallel.core.dtensor.placement_types import Shard
    from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement

    named: NamedPlacement = {MeshAxisName.TP: Shard(0)}
    assert named["tp"] == Shard(0)


def test_dmodule_package_exports_the_spec_layer():
    import hyper_parallel.dmodule as dmodule
    from hyper_parallel.dmodule import plan_file, sharding, types

    assert dmodule.ShardingConfig is sharding.ShardingConfig
    assert dmodule.LocalMapConfig is sharding.LocalMapConfig
    assert dmodule.resolve_placements is sharding.resolve_placements
    assert dmodule.MeshAxisName is types.MeshAxisName
    assert dmodule.NamedPlacement is types.NamedPlacement
    assert dmodule.load_plan is plan_file.load_plan
    assert dmodule.dump_plan is plan_file.dump_plan
