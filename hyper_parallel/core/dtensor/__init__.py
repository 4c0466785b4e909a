"""PyTorch's DTensor, DeviceMesh and placement types, re-exported unchanged."""

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh as DeviceMesh
from hyper_parallel.core.dtensor.device_mesh import init_device_mesh as init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor as DTensor
from hyper_parallel.core.dtensor.dtensor import distribute_tensor as distribute_tensor
from hyper_parallel.core.dtensor.dtensor import local_map as local_map
from hyper_parallel.core.dtensor.placement_types import Partial as Partial
from hyper_parallel.core.dtensor.placement_types import Placement as Placement
from hyper_parallel.core.dtensor.placement_types import Replicate as Replicate
from hyper_parallel.core.dtensor.placement_types import Shard as Shard

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "init_device_mesh",
    "local_map",
]
