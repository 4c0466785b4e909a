"""PyTorch's placement types, re-exported unchanged."""

from torch.distributed.tensor.placement_types import Partial as Partial
from torch.distributed.tensor.placement_types import Placement as Placement
from torch.distributed.tensor.placement_types import Replicate as Replicate
from torch.distributed.tensor.placement_types import Shard as Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]
