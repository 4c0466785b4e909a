"""Shared fixtures: the per-module distributed pool; under ``CI=true`` a skip fails the run."""

from __future__ import annotations

import pytest

from tests.ci_skips import pytest_make_collect_report as pytest_make_collect_report
from tests.ci_skips import pytest_runtest_makereport as pytest_runtest_makereport
from tests.distributed.harness import DistributedPool, reset_process_state


@pytest.fixture(scope="session")
def _pools():
    """Rank pools kept for the whole session, one per (world size, rank timeout).

    Starting a pool (spawn, import torch, gloo rendezvous) costs seconds per rank on a
    small machine; modules of the same world size take turns on one pool instead.
    """
    pools: dict[tuple[int, float], DistributedPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def dist(request: pytest.FixtureRequest, _pools):
    """A gloo process group of ``WORLD_SIZE`` ranks (module attribute).

    Modules with the same ``WORLD_SIZE`` and ``RANK_TIMEOUT_S`` share one pool of rank
    processes: each test function builds its own model and meshes, a process-wide
    switch a test turns it turns back, and DTensor's sharding caches and dynamo's
    compiled code are cleared before the next module (:func:`reset_process_state`).
    A module that sets ``SHARED_POOL = False`` gets a pool of its own, closed after
    it. A test that failed on a rank closes its pool; the next test gets a fresh one.
    """
    world_size = getattr(request.module, "WORLD_SIZE", 2)
    # A module whose rank functions compile (torch.compile) may allow them longer.
    timeout = getattr(request.module, "RANK_TIMEOUT_S", 240.0)
    shared = getattr(request.module, "SHARED_POOL", True)
    key = (world_size, timeout)
    holder: dict[tuple[int, float], DistributedPool] = _pools if shared else {}

    def pool() -> DistributedPool:
        if key not in holder or not holder[key]._procs:
            holder[key] = DistributedPool(world_size, timeout=timeout)
        return holder[key]

    if key in holder and holder[key]._procs:
        holder[key].run(reset_process_state)  # ranks an earlier module used
    pool()

    class _Handle:
        def run(self, fn, *args):
            return pool().run(fn, *args)

    _Handle.world_size = world_size
    yield _Handle()
    if not shared:
        holder[key].close()
