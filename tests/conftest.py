"""Shared fixtures: the per-module distributed pool; under ``CI=true`` a skip or an xfail fails the run."""

from __future__ import annotations

import pytest

from tests.ci_skips import pytest_make_collect_report as pytest_make_collect_report
from tests.ci_skips import pytest_runtest_makereport as pytest_runtest_makereport
from tests.distributed.harness import DistributedPool


@pytest.fixture(scope="module")
def dist(request: pytest.FixtureRequest):
    """A gloo process group of ``WORLD_SIZE`` ranks (module attribute), one per test module.

    A module whose test failed on a rank gets a fresh pool for its next test.
    """
    world_size = getattr(request.module, "WORLD_SIZE", 2)
    # A module whose rank functions compile (torch.compile) may allow them longer.
    timeout = getattr(request.module, "RANK_TIMEOUT_S", 240.0)
    holder = {"pool": DistributedPool(world_size, timeout=timeout)}

    class _Handle:
        world_size = holder["pool"].world_size

        def run(self, fn, *args):
            if not holder["pool"]._procs:
                holder["pool"] = DistributedPool(world_size, timeout=timeout)
            return holder["pool"].run(fn, *args)

    yield _Handle()
    holder["pool"].close()
