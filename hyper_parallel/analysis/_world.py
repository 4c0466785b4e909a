"""A whole mesh in one process: PyTorch's fake process group, and mesh-shape helpers.

:func:`fake_world` builds the one N-D mesh of :mod:`hyper_parallel.distributed.layout`
(the same :class:`~hyper_parallel.distributed.ParallelMesh` the trainer builds on real
ranks) over a fake process group, so the dry run and ``validate`` slice the mesh
exactly as training does.

The fake backend (``torch.testing._internal.distributed.fake_pg``) accepts every
collective at any world size and moves no data, so a 16,384-rank ``DeviceMesh``
costs a few milliseconds. Tensors stay fake (no storage), so nothing is computed
either: only shapes, placements and the collectives issued are real.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping

import torch.distributed as dist

from hyper_parallel._torch_private import fake_store, strided_shard_sizes_concrete
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.distributed.layout import MeshLayout, ParallelMesh, as_layout

__all__ = ["MeshShape", "fake_world", "format_mesh", "mesh_shape"]

MeshShape = dict[str, int]
"""Axis name → size, in mesh order (``{"dp": 128, "tp": 8}``)."""


def mesh_shape(mesh: DeviceMesh | Mapping[str, int]) -> MeshShape:
    """Axis sizes of a ``DeviceMesh`` or of an ``{axis: size}`` mapping, checked.

    Raises:
        ValueError: For an empty mesh, a mesh without axis names, a non-string
            axis name or a size that is not an integer >= 1.
    """
    if isinstance(mesh, DeviceMesh):
        if mesh.mesh_dim_names is None:
            raise ValueError(
                "the DeviceMesh has no mesh_dim_names, so named placements cannot be "
                "resolved; create it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))."
            )
        return dict(zip(mesh.mesh_dim_names, mesh.shape))
    if not isinstance(mesh, Mapping) or not mesh:
        raise ValueError(
            f"mesh must be a DeviceMesh or a non-empty {{axis: size}} mapping such as "
            f"{{'dp': 128, 'tp': 8}}, got {mesh!r}."
        )
    shape: MeshShape = {}
    for axis, size in mesh.items():
        name = str(axis.value) if hasattr(axis, "value") else axis
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names must be non-empty strings, got {axis!r}.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are integers >= 1.")
        shape[name] = size
    return shape


def format_mesh(shape: Mapping[str, int]) -> str:
    """``{"dp": 128, "tp": 8}`` → ``"dp=128 x tp=8"``."""
    return " x ".join(f"{a}={s}" for a, s in shape.items())


@contextlib.contextmanager
def fake_world(mesh: MeshLayout | Mapping[str, int]) -> Iterator[ParallelMesh]:
    """The :class:`ParallelMesh` of ``mesh`` over a fake process group of its world size.

    This process is rank 0. A default process group is created when none exists and
    destroyed on exit; an existing *fake* group of the same world size is reused.

    Raises:
        LayoutError: For a bad mesh (every problem at once).
        RuntimeError: When a real process group already exists (a fake world
            cannot be created next to it); run the analysis before
            ``init_process_group``, or in a separate process.
    """
    layout = as_layout(mesh)
    layout.check()
    world_size = layout.world_size
    created = False
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake" or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a {backend!r} process group of {dist.get_world_size()} ranks already exists; "
                f"the analysis needs its own fake group of {world_size} ranks. Run it before "
                "init_process_group (or in a separate process)."
            )
    else:
        # init_process_group wraps sys.excepthook to prefix "[rank0]: " to every line of
        # an uncaught traceback, a wrapper per call: restored on exit, so a process that
        # traces many layouts (suggest, the benches) prints its errors once, unprefixed.
        hook = sys.excepthook
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
        created = True
    # DTensor logs (once per mesh) that a reduction over two mesh dims takes two
    # collectives; the trace counts them, and a traced layout is not the user's run.
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        # Fake tensors: a cp-sharded (batch, seq) activation flattened for a matmul has a
        # _StridedShard whose sizes torch reads with .tolist() (see the function).
        with warnings.catch_warnings(), strided_shard_sizes_concrete():
            _quiet_known_warnings()
            yield layout.build("cpu")
    finally:
        redistribute.setLevel(level)
        if created:
            dist.destroy_process_group()
            sys.excepthook = hook


def _quiet_known_warnings() -> None:
    """Silence torch's notes that every traced step repeats; they are not about the plan."""
    # DTensor calls the in-place c10d collectives that torch itself marks deprecated.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # FSDP2's notes on the model's own outputs (shown by real training runs as well).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=r"Full backward hook is firing")
    # CommDebugMode's module tracker hooks modules whose outputs are not tensors (HF outputs).
    warnings.filterwarnings("ignore", message=r"For backward hooks to be called")
