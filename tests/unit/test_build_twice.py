"""Models built one after another in one process, on equal meshes, each shard under FSDP2.

DTensor caches sharding decisions by mesh *equality*: a parameter re-wrapped for
FSDP2's SPMD form (context parallel) could come back on an equal mesh object built
for an earlier model, which FSDP2 (comparing by identity) refuses. A notebook or an
evaluation loop that builds a second model must not hit that.
"""

from __future__ import annotations

from hyper_parallel.analysis._world import fake_world
from hyper_parallel.distributed.fsdp import fsdp_units
from hyper_parallel.train import TrainConfig
from hyper_parallel.train.trainer import build_parallel_model

MESH = {"dp_shard": 2, "cp": 2}


def _build(model: str, mesh) -> list[str]:
    cfg = TrainConfig(model=model, mesh=MESH, batch_size=4, seq_len=16)
    model = build_parallel_model(cfg, mesh, "cpu")
    return [path for path, _ in fsdp_units(model)]


def test_a_second_model_on_an_equal_mesh_builds_under_context_parallel():
    with fake_world(MESH) as mesh:
        first = _build("qwen3-moe-debug", mesh)
    with fake_world(MESH) as mesh:
        second = _build("llama3-debug", mesh)
        again = _build("llama3-debug", mesh)
    assert first and second == again and second


def test_fake_worlds_one_after_another_leave_the_excepthook_as_it_was():
    """torch's init_process_group wraps sys.excepthook (a "[rank0]: " prefix per line,
    one wrapper per call): after any number of traced layouts, and after one that
    raised, an uncaught error prints as it would have without them."""
    import sys

    import pytest

    before = sys.excepthook
    for _ in range(3):
        with fake_world(MESH):
            assert sys.excepthook is not before  # torch's wrapper, while the world is up
    with pytest.raises(RuntimeError, match="in the world"), fake_world(MESH):
        raise RuntimeError("in the world")
    assert sys.excepthook is before


def test_a_fake_world_quiets_dtensors_two_collectives_note_and_restores_it():
    """DTensor logs a warning (once per mesh) when a reduction over two mesh dims takes two
    collectives; under a traced layout it reached suggest's output as a '[rank0]:W...'
    line. Quiet inside the world, as it was after."""
    import logging

    log = logging.getLogger("torch.distributed.tensor._redistribute")
    assert log.isEnabledFor(logging.WARNING)
    with fake_world(MESH):
        assert not log.isEnabledFor(logging.WARNING)
    assert log.isEnabledFor(logging.WARNING)
