"""Pipeline parallelism at pp=2 on 2 gloo ranks against one device.

Each schedule trains the reference Llama for 5 AdamW steps; the stages start from
exactly the one-device values, the loss of every step and every gradient after
step 1 match one device to 1e-5, and each rank holds the stages its schedule
places there. Each schedule also runs 20 steps back to back under the pool's
timeout (a hang fails the test instead of stalling the suite).
"""

from __future__ import annotations

import pytest

from hyper_parallel.dmodule import get_spec
from hyper_parallel.train.demo import BF16_TOL
from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, check
from tests.distributed.pipeline_checks import run_back_to_back, train_vs_one_device

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
TOL = 1e-5
NUM_STEPS = 5
ALL_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# Stages each rank runs: one per rank; looped for interleaved; a V for ZBV.
EXPECTED_STAGES = {
    "GPipe": [[0], [1]],
    "1F1B": [[0], [1]],
    "Interleaved1F1B": [[0, 2], [1, 3]],
    "InterleavedZeroBubble": [[0, 2], [1, 3]],
    "ZBVZeroBubble": [[0, 3], [1, 2]],
}


def _param_names(overrides: dict, model: str = "llama3-debug") -> set[str]:
    import torch

    with torch.device("meta"):
        built = get_spec(model).config(**overrides).build()
    return {n for n, _ in built.named_parameters()}


def _check_parity(
    results: list[dict], overrides: dict | None = None, model: str = "llama3-debug"
) -> None:
    seen: set[str] = set()
    for r in results:
        assert r["init_diff"] == 0.0
        assert len(r["losses"]) == NUM_STEPS
        for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(loss - ref) <= TOL, (r["losses"], r["ref_losses"])
        check(r["grad_diffs"], atol=TOL, rtol=FP32_RTOL)
        seen |= set(r["grad_diffs"])
    assert seen == _param_names(overrides or {}, model)  # every parameter, on one stage
    assert sum(len(r["grad_diffs"]) for r in results) == len(seen)


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_schedule_trains_like_one_device(dist, schedule):
    results = dist.run(train_vs_one_device, "pp=2", schedule, 4, NUM_STEPS)
    _check_parity(results)
    assert [r["stages"] for r in results] == EXPECTED_STAGES[schedule]
    assert all(not p for r in results for p in r["placements"].values())  # plain tensors


def test_explicit_split_uneven_stages(dist):
    split = {"stages": [["tok_embeddings", "layers.0", "layers.1"], ["norm", "output"]]}
    results = dist.run(train_vs_one_device, "pp=2", "GPipe", 2, NUM_STEPS, split)
    _check_parity(results)
    assert sorted(results[1]["grad_diffs"]) == ["norm.weight", "output.weight"]


def test_balanced_split_of_a_deeper_model(dist):
    overrides = {"num_layers": 6}
    results = dist.run(train_vs_one_device, "pp=2", "1F1B", 2, NUM_STEPS, None, overrides)
    _check_parity(results, overrides)
    # Equal parameter counts: the embedding and the head weigh the same here.
    owned = [{n.split(".")[1] for n in r["grad_diffs"] if n.startswith("layers.")} for r in results]
    assert owned == [{"0", "1", "2"}, {"3", "4", "5"}]


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_twenty_steps_back_to_back_do_not_hang(dist, schedule):
    results = dist.run(run_back_to_back, "pp=2", schedule, 4, 20, {})
    losses = [r["losses"] for r in results]
    assert len(losses[0]) == 20 and losses[0] == losses[1]  # broadcast from the last stage
    # No optimizer: the same batch gives the same loss every time it comes back.
    assert losses[0][0:3] == losses[0][3:6]


# Activation checkpointing recomputes the same ops; compiled blocks (aot_eager) run the
# same ops traced; bf16 autocast per stage is the one-process bf16 run's computation.
SWITCHES = [
    ("1F1B", {"ac": "full"}, 1e-6),
    ("Interleaved1F1B", {"ac": "selective"}, 1e-6),
    ("ZBVZeroBubble", {"ac": "full"}, 1e-6),
    ("1F1B", {"compile_backend": "aot_eager"}, 1e-5),
    ("InterleavedZeroBubble", {"compile_backend": "aot_eager"}, 1e-5),
    ("GPipe", {"dtype": "bf16"}, BF16_TOL),
]


@pytest.mark.parametrize(("schedule", "switches", "tol"), SWITCHES)
def test_switches_inside_the_stages_match_one_device(dist, schedule, switches, tol):
    results = dist.run(
        train_vs_one_device, "pp=2", schedule, 4, NUM_STEPS, None, None, False, switches
    )
    for r in results:
        for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(loss - ref) <= tol, (r["losses"], r["ref_losses"])
        if tol == BF16_TOL:  # bf16: relative error of each gradient (a 2x or zero one fails)
            check(r["grad_diffs"], rtol=BF16_GRAD_RTOL)
            # ... against the same bf16 autocast on one device, and against fp32 there.
            check(r["fp32_grad_diffs"], rtol=BF16_GRAD_RTOL, expect_count=len(r["grad_diffs"]))
        else:
            check(r["grad_diffs"], atol=tol, rtol=FP32_RTOL)
    assert sum(len(r["grad_diffs"]) for r in results) == len(_param_names({}))
    bf16 = switches.get("dtype") == "bf16"
    assert all(
        r["linear_dtypes"] == [f"torch.{'bfloat16' if bf16 else 'float32'}"] for r in results
    )
