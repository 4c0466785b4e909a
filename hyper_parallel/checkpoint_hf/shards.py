"""Which global indices a rank holds of each sharded tensor (what it reads from a file).

:func:`shard_indices` needs, for a rank's shard of a DTensor, the global indices it
holds on each dim, including under ``_StridedShard`` (FSDP2 over a tensor-parallel
shard of the same dim). torch computes exactly that in
``torch.distributed.tensor._utils._get_shard_size_and_offsets`` (what
``compute_local_shape_and_global_offset`` uses, which keeps only the first offset);
we run its per-mesh-dim step in the same left-to-right order.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from hyper_parallel._torch_private import StridedShard as _StridedShard
from hyper_parallel._torch_private import (
    get_shard_size_and_offsets as _get_shard_size_and_offsets,
)

__all__ = ["shard_indices"]


def shard_indices(tensor: DTensor) -> list[torch.Tensor]:
    """Global indices (1-D ``int64``, ascending or not) of this rank's shard, per dim.

    Raises:
        RuntimeError: This rank is not in the tensor's mesh, or torch's shape disagrees
            with the local tensor's (a placement this function does not understand).
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("shard_indices: this rank is not part of the tensor's mesh.")
    global_shape = tuple(tensor.shape)
    local_shape = list(global_shape)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        dim = placement.dim
        size, index = _get_shard_size_and_offsets(
            local_shape[dim],
            mesh.size(mesh_dim),
            coordinate[mesh_dim],
            placement,
            offsets.get(dim),
            global_shape[dim],
            False,
        )
        local_shape[dim] = size
        offsets[dim] = index[:size] if size else torch.empty(0, dtype=torch.long)
    if tuple(local_shape) != tuple(tensor.to_local().shape):
        raise RuntimeError(
            f"shard_indices: computed local shape {tuple(local_shape)} but the shard is "
            f"{tuple(tensor.to_local().shape)} (placements {tensor.placements})."
        )
    return [
        offsets[d].to(torch.long) if d in offsets else torch.arange(n)
        for d, n in enumerate(global_shape)
    ]
