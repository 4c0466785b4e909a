"""Mesh axis names and the named-placement type.

A :data:`NamedPlacement` says, per named mesh axis, how a tensor is placed::

    from hyper_parallel.core.dtensor.placement_types import Shard
    from hyper_parallel.dmodule.types import MeshAxisName

    named = {MeshAxisName.TP: Shard(0)}  # or {"tp": Shard(0)}
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from hyper_parallel.core.dtensor.placement_types import Placement

__all__ = ["MeshAxisName", "NamedPlacement"]


class MeshAxisName(str, enum.Enum):
    """Conventional mesh axis names. Each member equals its lowercase string.

    Example::

        from hyper_parallel.dmodule.types import MeshAxisName

        assert MeshAxisName.TP == "tp" and MeshAxisName("dp_shard") is MeshAxisName.DP_SHARD
    """

    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    FSDP = "fsdp"
    TP = "tp"
    CP = "cp"
    PP = "pp"
    EP = "ep"
    EFSDP = "efsdp"

    def __str__(self) -> str:
        return self.value


NamedPlacement = Mapping[MeshAxisName | str, Placement]
"""Placement per mesh axis name (a :class:`MeshAxisName` or its string)."""
