"""Where the Qwen3-MoE decoder's states live: sharding configs only.

:func:`apply_ep` returns a copy of a ``Transformer.Config`` whose routed experts are
split over the expert-parallel axis: each ``GroupedExperts`` gets
:func:`~hyper_parallel.distributed.expert_parallel.expert_parallel` (``w1, w2, w3``
``Shard(0)`` on ``ep``, tokens dispatched to the rank holding their expert). Every
other state stays an ordinary (data-parallel) tensor; ``model.parallelize(mesh)`` on
a mesh with an ``ep`` axis applies it.
"""

from __future__ import annotations

import copy

from hyper_parallel.distributed.expert_parallel import expert_parallel
from hyper_parallel.dmodule.types import MeshAxisName
from hyper_parallel.models.qwen3_moe.model import Transformer

__all__ = ["EXPERT_PARAMS", "apply_ep", "check_ep"]

EXPERT_PARAMS = ("w1", "w2", "w3")
"""The stacked weights of one layer's experts."""


def apply_ep(
    config: Transformer.Config,
    *,
    axis: MeshAxisName | str = MeshAxisName.EP,
) -> Transformer.Config:
    """Expert parallelism on mesh axis ``axis``: each rank holds ``num_experts / ep`` experts.

    Args:
        config: The model config; it is not changed.
        axis: Name of the expert-parallel mesh axis.

    Returns:
        A new config with sharding configs on every ``layers.*.moe.experts``. Whether
        an ``ep`` size divides the experts is checked where the mesh is known:
        :func:`check_ep`, ``expert_parallel.ep_findings``, and ``parallelize`` itself.

    Example:
        >>> from hyper_parallel.models.qwen3_moe import preset_config
        >>> model = apply_ep(preset_config("qwen3-moe-debug")).build()
        >>> # model.parallelize(mesh["ep"])
    """
    new = copy.deepcopy(config)
    for layer in new.layers:
        layer.moe.experts.sharding_config = expert_parallel(EXPERT_PARAMS, axis=axis)
    return new


def check_ep(config: Transformer.Config, ep_size: int) -> None:
    """Raise if ``ep_size`` does not divide every layer's number of experts.

    Raises:
        ValueError: Naming the layer, the counts and the fix.
    """
    for i, layer in enumerate(config.layers):
        num_experts = layer.moe.experts.num_experts
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"layers.{i}.moe.experts: {num_experts} experts cannot be split over "
                f"ep={ep_size} ranks (each rank holds whole experts); use an ep size that "
                f"divides {num_experts}."
            )
