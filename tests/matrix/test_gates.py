"""Refusals the matrix found, held by every gate alike (no ranks: the gate runs in-process).

The trainer's gate, ``validate`` and ``plan`` give the same findings word for word
(:func:`tests.matrix.checks.gate`); the one-sequence variant of a refused compile run
is accepted (it compiles: the configuration matrix ran it).
"""

from __future__ import annotations

import pytest

from tests.matrix.checks import gate
from tests.matrix.configs import _EIGHT_BASE, Config

pytestmark = pytest.mark.slow


def _cfg(global_batch: int | None = None, **switches) -> dict:
    row = dict(_EIGHT_BASE, pipeline="pp1", dp_replicate=1, dp_shard=1, cp=1, tp=1)
    row.update(switches)
    cfg = Config(0, row).train_config()
    if global_batch is not None:
        cfg["batch_size"] = global_batch
    return cfg


@pytest.mark.parametrize(
    "mesh",
    [{"dp_shard": 2, "cp": 2}, {"dp_replicate": 2, "cp": 2}, {"cp": 2, "tp": 2}],
    ids=["fsdp", "hsdp", "tp"],
)
def test_compile_under_cp_with_several_sequences_is_refused_alike(mesh):
    g = gate(_cfg(family="llama3-debug", compile=True, **mesh), 4)
    assert g["refused"], g
    assert g["validate_missing"] == g["plan_missing"] == g["suggest_missing"] == [], g
    assert any("compile with cp=2" in f and "Fix: give each rank one" in f for f in g["findings"])


def test_compile_under_cp_with_one_sequence_per_rank_is_accepted():
    # dp_shard=2 x cp=2: two data-parallel ranks, one sequence each.
    g = gate(_cfg(2, family="llama3-debug", compile=True, dp_shard=2, cp=2), 4)
    assert not g["refused"] and not g["validate_extra"], g


def test_sequence_parallel_without_tp_and_an_uneven_batch_are_run_plan_findings():
    g = gate(_cfg(family="llama3-debug", dp_shard=2, dp_replicate=2, sp=True), 4)
    assert (
        g["refused"] and g["validate_missing"] == g["plan_missing"] == g["suggest_missing"] == []
    ), g
    assert "sp (sequence parallelism) needs tp > 1" in g["findings"][0]
    g = gate(_cfg(6, family="llama3-debug", dp_shard=4), 4)
    assert g["refused"], g
    assert (
        "batch_size=6 (the global batch) is not divisible by dp_replicate x dp_shard = 4"
        in g["findings"][0]
    )
