"""PyTorch's DTensor, ``distribute_tensor`` and ``local_map``, re-exported unchanged."""

from torch.distributed.tensor import DTensor as DTensor
from torch.distributed.tensor import distribute_tensor as distribute_tensor
from torch.distributed.tensor.experimental import local_map as local_map

__all__ = ["DTensor", "distribute_tensor", "local_map"]
