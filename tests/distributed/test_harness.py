"""The harness itself: ranks, one process group, failures reported with tracebacks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist_c10d

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist_c10d.get_rank() + 1)])
    dist_c10d.all_reduce(t)
    return dist_c10d.get_rank(), t.item()


def _fail_on_rank_one() -> None:
    if dist_c10d.get_rank() == 1:
        raise RuntimeError("planted failure")


def test_runs_on_every_rank(dist):
    assert dist.run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_failure_names_rank_and_traceback(dist):
    with pytest.raises(AssertionError, match=r"(?s)rank 1.*planted failure"):
        dist.run(_fail_on_rank_one)
    # The next call gets a fresh pool.
    assert dist.run(_rank_and_sum)[0] == (0, 3.0)
