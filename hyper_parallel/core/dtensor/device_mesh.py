"""PyTorch's DeviceMesh, re-exported unchanged."""

from torch.distributed.device_mesh import DeviceMesh as DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
