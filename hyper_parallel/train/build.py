"""What the trainer builds from a run plan: the mesh (:func:`build_mesh`), the whole model
at pp=1 (:func:`build_parallel_model`) and a rank's pipeline stages
(:func:`build_pipeline_stages`), each through the one builder
(:mod:`hyper_parallel.distributed.builder`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hyper_parallel.distributed.builder import build_model, build_stages
from hyper_parallel.distributed.layout import MeshLayout, ParallelMesh
from hyper_parallel.distributed.process_group import default_device as default_device
from hyper_parallel.train.config import TrainConfig, run_plan

__all__ = ["build_mesh", "build_parallel_model", "build_pipeline_stages"]


def build_mesh(
    sizes: Mapping[str, int] | MeshLayout, device: torch.device | str | None = None
) -> ParallelMesh | None:
    """The :class:`~hyper_parallel.distributed.ParallelMesh` of ``sizes`` on the running group.

    Args:
        sizes: Axis sizes (``{"dp_shard": 2, "tp": 2}``, ``dp`` = ``dp_shard``) or a
            layout; missing axes are 1.
        device: Device whose type the mesh uses; defaults to :func:`default_device`.

    Returns:
        The mesh, or ``None`` when the sizes multiply to 1 (one device, no mesh).

    Raises:
        ValueError: A bad mesh (every problem at once), sizes that need more than one
            rank without a process group, or a process group of another size.
    """
    layout = MeshLayout.from_sizes(sizes)
    if layout.world_size == 1:
        return None
    device_type = torch.device(device if device is not None else default_device()).type
    return layout.build(device_type)


def build_parallel_model(
    cfg: TrainConfig, mesh: ParallelMesh | None, device: torch.device | str | None = None
) -> nn.Module:
    """Build ``cfg.model`` on meta, parallelize, ``fully_shard``, materialize and initialize.

    The run plan of ``cfg`` on ``mesh`` (:func:`run_plan`) applied by the one builder
    (:func:`~hyper_parallel.distributed.builder.build_model`): the model built on the
    meta device with the sharding of every active model axis (:func:`model_config`) →
    the plan on the submesh of the axes it declares (routed experts on ``ep``, each an
    FSDP2 unit over ``efsdp``) → ``torch.compile`` per block (``cfg.compile``) →
    activation checkpointing (``cfg.ac``) → ``fully_shard`` (with ``cfg.dtype``'s mixed
    precision) each block of the model and the root, on the FSDP (or HSDP) mesh the plan
    decides → ``to_empty(device)`` → initialization under ``cfg.seed``. With
    ``mesh=None`` the same model is built for one device, through the same steps, so it
    gets the same initial values.

    Args:
        cfg: The run's config (model name, overrides, sequence parallel, seed).
        mesh: A mesh from :func:`build_mesh`, or ``None`` for one device.
        device: Where states live; defaults to :func:`default_device`.

    Returns:
        The initialized model.

    Raises:
        ValueError: The run plan's errors (e.g. no sharding function for an active
            axis), or a model without blocks to shard.

    Example:
        >>> model = build_parallel_model(TrainConfig(), mesh=None)
    """
    device = torch.device(device if device is not None else default_device())
    layout = mesh.layout if mesh is not None else MeshLayout()
    if layout.pp > 1:
        raise ValueError(
            "build_parallel_model: the mesh has pp > 1; build this rank's pipeline stages "
            "with build_pipeline_stages."
        )
    return build_model(run_plan(cfg, layout=layout), mesh, device, cfg.seed)


def build_pipeline_stages(
    cfg: TrainConfig, mesh: ParallelMesh, device: torch.device | str | None = None
) -> tuple[list[nn.Module], Any]:
    """This rank's pipeline stages of ``cfg.model`` and their plan (``pp > 1``).

    The run plan of ``cfg`` on ``mesh`` applied to each stage by the same builder as
    the whole model at pp=1 (:func:`~hyper_parallel.distributed.builder.build_stages`):
    the same plan submesh, experts on this pp rank's ``ep`` (FSDP2 over its ``efsdp``
    with ``cfg.dtype``'s policy), compile, checkpointing, FSDP2 and the cp divide factor.
    """
    device = torch.device(device if device is not None else default_device())
    run = run_plan(cfg, layout=mesh.layout)
    return build_stages(run, mesh, device, cfg.seed), run.pipeline
