"""Bubble, in-flight micro-batches, stage memory and P2P bytes from the schedule's actions."""

from __future__ import annotations

import pytest

from hyper_parallel.analysis.pipeline_cost import (
    Op,
    bubble_fraction,
    in_flight_microbatches,
    p2p_bytes_per_step,
    rank_ops,
    simulate,
    stage_costs,
)
from hyper_parallel.distributed.pipeline import PipelineUnit, plan_pipeline

SIZES = [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("pp", "m"), SIZES)
def test_single_stage_bubble_is_the_textbook_value(schedule, pp, m):
    # GPipe (Huang et al., 2019) and 1F1B (Narayanan et al., 2021): (p - 1) / (m + p - 1).
    assert bubble_fraction(schedule, pp, m) == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 8, 2)])
def test_interleaved_1f1b_divides_the_bubble_by_stages_per_rank(pp, m, v):
    # Narayanan et al., 2021, §2.2.2: v model chunks per rank shrink the bubble v times
    # (in units of a chunk's forward + backward: (p - 1) / (v m + p - 1)).
    assert bubble_fraction("Interleaved1F1B", pp, m, v) == pytest.approx(
        (pp - 1) / (v * m + pp - 1)
    )


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_schedules_beat_interleaved_1f1b(pp, m):
    interleaved = bubble_fraction("Interleaved1F1B", pp, m, 2)
    assert bubble_fraction("InterleavedZeroBubble", pp, m, 2) < interleaved
    assert bubble_fraction("ZBVZeroBubble", pp, m, 2) < interleaved


def test_every_schedule_runs_every_microbatch_through_every_stage_once():
    for schedule, v in [
        ("GPipe", 1),
        ("1F1B", 1),
        ("Interleaved1F1B", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
    ]:
        ops = rank_ops(schedule, 4, 8, v)
        forwards = sorted(
            (op.stage, op.microbatch) for rank in ops for op in rank if op.kind == "F"
        )
        assert forwards == [(s, mb) for s in range(4 * v) for mb in range(8)], schedule


def test_1f1b_follows_torch_runtime_order():
    # Schedule1F1B runs min(m, S - s) warm-up forwards on stage s, then B/F pairs.
    ops = rank_ops("1F1B", 2, 4)
    assert [f"{o.kind}{o.microbatch}" for o in ops[1]] == [
        "F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"
    ]  # fmt: skip
    assert [f"{o.kind}{o.microbatch}" for o in ops[0]][:3] == ["F0", "F1", "B0"]


def test_in_flight_microbatches():
    assert in_flight_microbatches(rank_ops("GPipe", 4, 8)) == {s: 8 for s in range(4)}
    assert in_flight_microbatches(rank_ops("1F1B", 4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}


def test_simulate_reports_a_deadlock():
    ops = [[Op("F", 0, 0), Op("B", 0, 0)], [Op("B", 1, 0), Op("F", 1, 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(ops)


def test_stage_costs_and_p2p_bytes():
    units = [PipelineUnit("tok_embeddings", ("tok_embeddings",), 100)]
    units += [PipelineUnit(f"layers.{i}", (f"layers.{i}",), 40) for i in range(4)]
    units += [PipelineUnit("norm+output", ("norm", "output"), 60)]
    plan = plan_pipeline(units, pp=2, schedule="1F1B", num_microbatches=4)
    assert plan.stages == (
        ("tok_embeddings", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm+output"),
    )
    acts = {u.name: 10 for u in units}
    costs = stage_costs(plan, units, shard_ways=2, activation_bytes_per_microbatch=acts)
    assert [c.num_params for c in costs] == [180, 140]
    assert [c.params for c in costs] == [180 // 2 * 4, 140 // 2 * 4]
    assert [c.optimizer for c in costs] == [180 // 2 * 8, 140 // 2 * 8]
    assert [c.in_flight_microbatches for c in costs] == [2, 1]
    assert [c.activations for c in costs] == [2 * 30, 1 * 30]
    # One boundary, 4 micro-batches each way.
    assert p2p_bytes_per_step(plan, 1000) == {
        "per_microbatch": 1000,
        "per_rank_max": 4000,
        "total": 8000,
    }
    sp = p2p_bytes_per_step(plan, 1000, tp=2, sequence_parallel=True)
    assert sp == {"per_microbatch": 500, "per_rank_max": 2000, "total": 8000}


SCHEDULE_GRID = [
    (schedule, pp, m, per)
    for schedule, pers in [
        ("GPipe", (1,)),
        ("1F1B", (1,)),
        ("Interleaved1F1B", (2, 3)),
        ("InterleavedZeroBubble", (2,)),
        ("ZBVZeroBubble", (2,)),
        ("DualPipeV", (2,)),
    ]
    for pp in (2, 3, 4)
    for m in (1, 2, 3, 4, 6, 8)
    for per in pers
]


def test_compute_only_actions_and_refusals_equal_torchs_full_schedule():
    # Our action lists skip the runtime schedules' lowering to communication actions;
    # the compute order and every refusal (type and text) must be torch's own.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops as full

    from hyper_parallel._torch_private import get_schedule_ops

    def answer(fn, *args):
        try:
            return fn(*args)
        except (ValueError, RuntimeError) as e:
            return ("refused", type(e).__name__, str(e))

    refused = 0
    for args in SCHEDULE_GRID:
        ours, torchs = answer(get_schedule_ops, *args), answer(full, *args)
        assert ours == torchs, args
        refused += isinstance(ours, tuple)
    assert 0 < refused < len(SCHEDULE_GRID)  # both kinds of answer were compared
