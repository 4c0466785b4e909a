"""Each pipeline stage's own collectives, traced on a fake process group."""

from __future__ import annotations

import dataclasses

import pytest

from hyper_parallel.analysis import dry_run
from hyper_parallel.analysis.pipeline_cost import (
    _block_gathers,
    _by_key,
    rank_ops,
    stage_collectives,
)
from hyper_parallel.distributed import MeshLayout
from hyper_parallel.distributed.axes import apply_model_axes
from hyper_parallel.distributed.pipeline import plan_pipeline
from hyper_parallel.dmodule import get_spec
from hyper_parallel.models.llama import PIPELINE

LAYOUT = MeshLayout.from_sizes({"pp": 2, "dp_shard": 2, "tp": 2})
CP_LAYOUT = MeshLayout.from_sizes({"pp": 2, "cp": 2, "tp": 2})


@pytest.fixture(scope="module")
def sharded():
    """A 4-layer debug Llama, tensor parallel as the trainer shards it."""
    spec = get_spec("llama3-debug")
    return apply_model_axes(spec, spec.config(num_layers=4), LAYOUT)


M = 4


@pytest.fixture(scope="module")
def plan(sharded):
    return plan_pipeline(PIPELINE.units(sharded), pp=2, schedule="GPipe", num_microbatches=M)


@pytest.fixture(scope="module")
def traced(sharded, plan):
    return stage_collectives(plan, PIPELINE, sharded, LAYOUT, microbatch_size=1, seq_len=16)


def _keyed(rows):
    return {(r["kind"], r["axis"], r["phase"]): (r["count"], r["bytes"]) for r in rows}


def test_per_microbatch_equals_tracing_the_whole_stage(sharded, plan, traced):
    # 6 units over 2 stages: the embedding + 2 blocks, and 2 blocks + the head; the
    # blocks are extrapolated from tracing the stage with none and with one.
    assert [len(s) for s in plan.stages] == [3, 3]
    for s, names in enumerate(plan.stages):
        # The stage itself, all of its blocks traced (no extrapolation from one block).
        first = s == 0
        example = None if first else [_hidden(sharded)]
        report = dry_run(
            PIPELINE.stage_config(sharded, names),
            dataclasses.replace(LAYOUT, pp=1),
            batch_size=1,
            seq_len=16,
            inputs=example,
        )
        direct = {k: (v["count"], v["bytes"]) for k, v in _by_key(report.collectives).items()}
        assert _keyed(traced[s]["collectives_per_microbatch"]) == direct
        assert {axis for _, axis, _ in direct} == {"tp", "fsdp"}


def _hidden(config, seq_len=16):
    import torch

    return torch.zeros(1, seq_len, config.norm.dim)


def test_per_step_scales_activation_collectives_and_reduces_gradients_once(plan, traced):
    m = M
    for s, row in enumerate(traced):
        mb, step = _keyed(row["collectives_per_microbatch"]), _keyed(row["collectives"])
        for key in ("forward", "backward"):
            count, size = mb[("all_reduce", "tp", key)]
            assert step[("all_reduce", "tp", key)] == (m * count, m * size)
        assert (
            step[("reduce_scatter", "fsdp", "backward")]
            == mb[("reduce_scatter", "fsdp", "backward")]
        )
        # Stage parameters stay gathered across the step's micro-batches (the builder's
        # reshard_after_forward=False under pp): the first forward gathers the stage root
        # and each block once; no backward gathers again.
        blocks = len(plan.stages[s]) - 1
        fwd_count, _ = step[("all_gather", "fsdp", "forward")]
        bwd_count, _ = step.get(("all_gather", "fsdp", "backward"), (0, 0))
        assert fwd_count == 1 + blocks
        assert bwd_count == 0


@pytest.mark.parametrize(
    ("schedule", "stage", "expected"),
    [
        # Gathered by the step's first forward, kept until REDUCE_GRAD, whatever the order.
        ("GPipe", 0, (1, 0)),
        ("1F1B", 1, (1, 0)),
        ("1F1B", 0, (1, 0)),
    ],
)
def test_block_gathers_follow_the_schedule(schedule, stage, expected):
    ops = rank_ops(schedule, 2, 4)
    assert _block_gathers(ops[stage], stage) == expected


def test_cp_stages_extrapolate_to_tracing_the_whole_stage():
    """pp=2 x cp=2 x tp=2, 3 blocks per stage: each stage's collectives per micro-batch
    and its saved activations, extrapolated from 1 and 2 traced blocks, equal tracing
    the whole stage with its cp part of the sequence and its positions."""
    import torch

    from hyper_parallel.distributed import context_parallel
    from hyper_parallel.models.llama import cross_entropy_loss

    spec = get_spec("llama3-debug")
    sharded = apply_model_axes(spec, spec.config(num_layers=6), CP_LAYOUT)
    plan = plan_pipeline(PIPELINE.units(sharded), pp=2, schedule="GPipe", num_microbatches=2)
    traced = stage_collectives(
        plan,
        PIPELINE,
        sharded,
        CP_LAYOUT,
        microbatch_size=1,
        seq_len=32,
        loss_fn=cross_entropy_loss,
    )
    assert [len(s) for s in plan.stages] == [4, 4]
    local = 32 // 2  # rank 0's head-tail part of the sequence
    for s, names in enumerate(plan.stages):
        first = s == 0
        example = torch.zeros(1, local, dtype=torch.long) if first else _hidden(sharded, local)

        def loss(logits, *_):
            return cross_entropy_loss(logits, torch.zeros(1, local, dtype=torch.long))

        report = dry_run(
            PIPELINE.stage_config(sharded, names),
            dataclasses.replace(CP_LAYOUT, pp=1),
            batch_size=1,
            seq_len=32,
            inputs=[example],
            loss_fn=None if first else loss,
        )
        direct = {k: (v["count"], v["bytes"]) for k, v in _by_key(report.collectives).items()}
        assert _keyed(traced[s]["collectives_per_microbatch"]) == direct
        assert traced[s]["activations_per_microbatch"] == report.per_rank.activations
        # Each block gathers its keys and values over cp; nothing else (no positions).
        assert direct[("all_gather", "cp", "forward")][0] == 2 * 3
        assert direct[("reduce_scatter", "cp", "backward")][0] == 2 * 3
        assert context_parallel.positions(32, 0, 2).numel() == local


def test_a_stage_input_larger_than_this_machine_is_traced_without_storage(sharded, plan):
    """The dry run reads only a stage input's shape and dtype, so a micro-batch whose
    residual stream no machine holds (here 2**30 sequences x 512 tokens of the debug
    Llama's width: petabytes) is traced, not allocated; its bytes scale exactly with
    the micro-batch size."""
    big, small = 1 << 30, 1
    seq = 512
    large = stage_collectives(plan, PIPELINE, sharded, LAYOUT, microbatch_size=big, seq_len=seq)
    one = stage_collectives(plan, PIPELINE, sharded, LAYOUT, microbatch_size=small, seq_len=seq)
    for a, b in zip(large, one):
        assert a["activations_per_microbatch"] == big * b["activations_per_microbatch"]
