"""Gradient accumulation at pp=1 on 4 gloo ranks, against one forward on one device.

Each run takes its first step as 4 sequential micro-batches per data-parallel rank and
is compared with one process taking the same global batch in one forward: the loss and
every parameter's gradient (gathered whole, before clipping) within fp32 rounding, at
dp_shard x tp, at cp x tp (with full activation checkpointing: the recomputed forward
of each micro-batch re-runs the k/v gathers) and with expert parallelism under HSDP
(dp_replicate x dp_shard x ep, the MoE whose router also takes the balance loss's
fixed-size gradient). FSDP2 reduces once per step: no reduce-scatter is issued before the
last micro-batch's backward — the earlier micro-batches' sums wait
unreduced in FSDP2's unsharded buffers.
"""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as c10d

from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.run import full_gradients
from tests._compare import FP32_RTOL, check, diffs

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4
MICROBATCHES = 4
SMALL = dict(steps=1, batch_size=8, seq_len=32, log_every=0, progress=False)

CASES = {
    "dp_shard_tp": dict(SMALL, mesh={"dp_shard": 2, "tp": 2}),
    "cp_tp_ac": dict(SMALL, mesh={"cp": 2, "tp": 2}, ac="full"),
    "hsdp_ep": dict(
        SMALL,
        model="qwen3-moe-debug",
        mesh={"dp_replicate": 2, "dp_shard": 2, "ep": 2},
        batch_size=16,  # 4 sequences per data-parallel rank: 4 micro-batches
        seq_len=16,
    ),
}


def _first_step(cfg_dict: dict) -> dict | None:
    """Loss and every gradient of the first step (rank 0), and the reduce-scatters FSDP2
    had issued when each micro-batch's loss was computed and once the step's gradients
    were final (FSDP2 skips HSDP's all-reduce with them: one switch for both)."""
    calls = {"reduce_scatter_single": 0}
    seen: list[int] = []
    grads: dict = {}

    def keep(step: int, parts: list) -> None:
        seen.append(calls["reduce_scatter_single"])
        grads.update(full_gradients(parts))

    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu", grad_callback=keep)
    loss_fn = trainer.loss_fn

    def noting_loss(logits, targets):
        seen.append(calls["reduce_scatter_single"])
        return loss_fn(logits, targets)

    trainer.loss_fn = noting_loss
    originals = {name: getattr(c10d, name) for name in calls}

    def counted(name: str):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(c10d, name, counted(name))
    try:
        loss, _ = trainer.train_step()
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
    if c10d.get_rank() != 0:
        return None
    return {"loss": loss, "grads": grads, "seen": seen, "steps": trainer.run.accumulation_steps}


def _one_device_on_rank0(cfg_dict: dict) -> dict | None:
    if c10d.get_rank() != 0:
        return None
    cfg = TrainConfig.from_dict(cfg_dict).replace(mesh={}, microbatches=1, ac="none")
    return _single(cfg)


def _single(cfg: TrainConfig) -> dict:
    grads: dict = {}

    def keep(step: int, parts: list) -> None:
        grads.update(full_gradients(parts))

    loss, _ = Trainer(cfg, device="cpu", grad_callback=keep).train_step()
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("case", list(CASES))
def test_four_microbatches_match_one_forward_on_one_device(dist, case: str) -> None:
    cfg = dict(CASES[case], microbatches=MICROBATCHES)
    got = dist.run(_first_step, cfg)[0]
    ref = dist.run(_one_device_on_rank0, cfg)[0]
    assert got["steps"] == MICROBATCHES
    assert abs(got["loss"] - ref["loss"]) <= 1e-5
    check(
        diffs(got["grads"], ref["grads"]), atol=1e-5, rtol=FP32_RTOL, expect_count=len(ref["grads"])
    )
    # Reduced once: no reduce-scatter before the last micro-batch's backward, then some.
    *before, after = got["seen"]
    assert before == [0] * MICROBATCHES and after > 0, got["seen"]


@pytest.mark.parametrize("case", ["dp_shard_tp", "hsdp_ep"])
def test_reducing_each_microbatch_matches_one_forward_on_one_device(dist, case: str) -> None:
    """``--reduce-each-microbatch``: FSDP2 reduce-scatters every micro-batch's gradients
    (each backward issues the same number) and accumulates the shards; the step's
    gradients are still the one-device ones."""
    cfg = dict(CASES[case], microbatches=MICROBATCHES, reduce_each_microbatch=True)
    got = dist.run(_first_step, cfg)[0]
    ref = dist.run(_one_device_on_rank0, cfg)[0]
    assert abs(got["loss"] - ref["loss"]) <= 1e-5
    check(
        diffs(got["grads"], ref["grads"]), atol=1e-5, rtol=FP32_RTOL, expect_count=len(ref["grads"])
    )
    seen = got["seen"]  # before each micro-batch's loss, then at the end
    per_backward = [b - a for a, b in itertools.pairwise(seen)]
    assert seen[0] == 0 and per_backward[0] > 0, seen
    assert per_backward == [per_backward[0]] * MICROBATCHES, seen
