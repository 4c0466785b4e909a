"""Unit-test fixtures: a mesh on PyTorch's fake process group (no real communication)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest) -> Iterator[DeviceMesh]:
    """A 1-D ``tp`` mesh of the module's ``WORLD_SIZE`` (default 4); this process is rank 0."""
    world_size = getattr(request.module, "WORLD_SIZE", 4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
