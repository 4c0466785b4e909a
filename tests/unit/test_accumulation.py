"""Gradient accumulation at pp=1: k micro-batches equal one batch; bad counts refused.

On one device, a step over the global batch as 4 sequential micro-batches gives the
loss and every gradient of one forward over the whole batch (fp32 rounding), for the
dense Llama and for the MoE, whose router also takes the balance loss's gradient (a
fixed-size gradient sent in backward: scaling each micro-batch's loss by 1/k instead of
the summed gradients would leave it k times too large — router gradients measured 2.1
relative error off). The run plan refuses a count that does not divide the batch per
data-parallel rank, naming the flag, the numbers and the fix, before anything builds.
"""

from __future__ import annotations

import pytest

from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.run_plan import RunPlan, accumulation_findings
from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.run import full_gradients
from hyper_parallel.train.trainer import check_config
from tests._compare import FP32_RTOL, check, diffs

SMALL = dict(steps=1, batch_size=8, seq_len=32, log_every=0, progress=False)


def _first_step(model: str, microbatches: int) -> tuple[float, dict]:
    grads: dict = {}

    def keep(step: int, parts: list) -> None:
        grads.update(full_gradients(parts))

    cfg = TrainConfig(model=model, microbatches=microbatches, **SMALL)
    trainer = Trainer(cfg, device="cpu", grad_callback=keep)
    assert trainer.run.accumulation_steps == microbatches
    loss, _ = trainer.train_step()
    return loss, grads


@pytest.mark.parametrize("model", ["llama3-debug", "qwen3-moe-debug"])
def test_four_microbatches_equal_one_batch_on_one_device(model: str) -> None:
    loss_one, grads_one = _first_step(model, 1)
    loss_acc, grads_acc = _first_step(model, 4)
    assert abs(loss_acc - loss_one) <= 1e-5
    check(diffs(grads_acc, grads_one), atol=1e-5, rtol=FP32_RTOL, expect_count=len(grads_one))


def test_accumulation_steps_are_the_microbatches_at_pp1_only() -> None:
    assert RunPlan.for_model("llama3-debug", {"dp_shard": 2}).accumulation_steps == 1
    run = RunPlan.for_model("llama3-debug", {"dp_shard": 2}, num_microbatches=4, batch_size=4)
    assert run.ok and run.num_microbatches == 4 and run.accumulation_steps == 4
    piped = RunPlan.for_model("llama3-debug", {"pp": 2}, num_microbatches=4, batch_size=4)
    assert piped.ok and piped.accumulation_steps == 1  # the schedule runs them


def test_microbatches_that_do_not_divide_the_local_batch_are_refused_before_building() -> None:
    cfg = TrainConfig(mesh={"dp_shard": 2}, batch_size=8, microbatches=3)
    errors = check_config(cfg)
    assert [f.field for f in errors] == ["num_microbatches"]
    text = str(errors[0])
    assert "--microbatches 3" in text and "4 sequences per data-parallel rank" in text
    assert "global batch 8" in text and "1, 2, 4" in text and "multiple of 6" in text
    with pytest.raises(ValueError, match="--microbatches 3"):
        Trainer(cfg, device="cpu")


def test_a_count_below_one_is_refused() -> None:
    found = accumulation_findings(0, 4, MeshLayout())
    assert [f.field for f in found] == ["num_microbatches"]
    assert "at least one" in found[0].message
    assert accumulation_findings(2, None, MeshLayout()) == []  # batch unknown: nothing to say


def test_the_dry_run_counts_one_microbatch_of_activations_and_every_microbatch_of_traffic() -> None:
    from hyper_parallel.analysis import dry_run

    mesh = {"dp_shard": 2, "tp": 2}
    config = RunPlan.for_model("llama3-debug", mesh).subject
    one = dry_run(config, mesh, batch_size=2, seq_len=64)
    four = dry_run(config, mesh, batch_size=2, seq_len=64, num_microbatches=4)
    assert four.num_microbatches == 4 and four.to_dict()["num_microbatches"] == 4
    assert four.per_rank.activations == one.per_rank.activations  # one micro-batch's
    assert four.per_rank.params == one.per_rank.params
    # FSDP2 holds each unit's unsharded gradients until the last micro-batch (fsdp = 2).
    assert four.per_rank.grads == 2 * one.per_rank.grads
    counts = {(c.phase, c.kind, c.axis): c.count for c in one.collectives}
    for c in four.collectives:
        once = (c.phase, c.kind, c.axis) == ("backward", "reduce_scatter", "fsdp")
        assert c.count == counts[(c.phase, c.kind, c.axis)] * (1 if once else 4), c
    assert any("Gradient accumulation: 4 micro-batches" in a for a in four.assumptions)
    # --reduce-each-microbatch: every reduce-scatter repeats, the gradients stay sharded.
    each = dry_run(
        config, mesh, batch_size=2, seq_len=64, num_microbatches=4, reduce_each_microbatch=True
    )
    assert each.per_rank.grads == one.per_rank.grads
    for c in each.collectives:
        assert c.count == counts[(c.phase, c.kind, c.axis)] * (
            1 if c.phase == "optimizer" else 4
        ), c
    assert any("once per micro-batch too" in a for a in each.assumptions)
