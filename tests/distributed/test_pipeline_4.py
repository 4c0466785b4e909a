"""Pipeline parallelism composed with tensor parallelism and FSDP2, on 4 gloo ranks.

pp=2 x tp=2 (TP, and TP + SP, inside each stage on mesh["tp"]), pp=2 x dp_shard=2
(FSDP2 inside each stage over mesh.fsdp_mesh()), pp=2 x cp=2 (each stage holding
its cp rank's positions), pp=2 x dp_replicate=2 (HSDP) and
pp=4 (four stages of the 2-layer model: the embedding and the head alone on theirs):
the loss of every one of 5 AdamW steps and every gradient after step 1 match one
device to 1e-5. A checkpoint saved at pp=2 x tp=2 loads bitwise elsewhere. The
trainer with pp (Llama at pp=2 x tp=2; Qwen3-MoE at pp=2 x ep=2 with ep borrowing
dp_shard, cp or tp ranks) matches one process in every first-step gradient; its bf16
pipeline run is within the bf16 relative bound of the fp32 one-process gradients.
"""

from __future__ import annotations

import pytest

from hyper_parallel.train.demo import BF16_TOL
from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, check, worst_abs
from tests.distributed.pipeline_checks import (
    checkpoint_across_meshes,
    cp_stage_collectives_per_step,
    fsdp_collectives_per_step,
    train_vs_one_device,
    trainer_parity,
)
from tests.distributed.test_pipeline import NUM_STEPS, _check_parity, _param_names

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4


def _dedupe(results: list[dict], group: int) -> list[dict]:
    """One result per pp rank (ranks of one stage hold the same parameter names)."""
    return results[::group]


def _check_tp_placements(results: list[dict]) -> None:
    for r in results:
        for name, p in r["placements"].items():  # every parameter is a tp DTensor
            if name.endswith(("wq.weight", "w1.weight", "output.weight")):
                assert p == ["S(0)"], name
            elif name.endswith(("wo.weight", "w2.weight")):
                assert p == ["S(1)"], name
            else:
                assert p in (["S(0)"], ["R"]), name


# ZBVZeroBubble: the split backward detaches stage outputs in place; a tensor-parallel
# stage hands on a view of its local shard, which the stage copies.
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pp2_tp2(dist, schedule):
    results = dist.run(train_vs_one_device, "pp=2,tp=2", schedule, 4, NUM_STEPS)
    _check_parity(_dedupe(results, 2))
    _check_tp_placements(results)


def test_pp2_tp2_sequence_parallel(dist):
    # The residual stream crosses the stage boundary sequence-sharded.
    results = dist.run(train_vs_one_device, "pp=2,tp=2", "1F1B", 4, NUM_STEPS, None, None, True)
    _check_parity(_dedupe(results, 2))
    _check_tp_placements(results)


# InterleavedZeroBubble: one FSDP unit per stage (per-block units would reduce early).
@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble"])
def test_pp2_dp_shard2(dist, schedule):
    results = dist.run(train_vs_one_device, "pp=2,dp_shard=2", schedule, 2, NUM_STEPS)
    _check_parity(_dedupe(results, 2))
    assert all(p == ["S(0)"] for r in results for p in r["placements"].values())


# Context parallel: each stage holds its cp rank's global positions (set per step,
# the same for every micro-batch); FSDP2 shards over cp and averages its gradients.
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_pp2_cp2(dist, schedule):
    results = dist.run(train_vs_one_device, "pp=2,cp=2", schedule, 2, NUM_STEPS)
    _check_parity(_dedupe(results, 2))
    for r in results[1::2]:  # the other cp rank of each stage
        assert r["losses"] == results[0]["losses"]
        check(r["grad_diffs"], atol=1e-5, rtol=FP32_RTOL)
    assert all(p == ["S(0)"] for r in results for p in r["placements"].values())


# The mixture of experts: ep=2 borrows the dp_shard ranks inside each stage, the routed
# experts dispatched over this pp rank's ep group; every stage's routers also get their
# layers' balance-loss gradient (which the check shows is far above the tolerance).
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_moe_pp2_ep2_trains_like_one_device(dist, schedule):
    overrides = {"aux_loss_coef": 0.1}
    results = dist.run(
        train_vs_one_device,
        "pp=2,dp_shard=2,ep=2",
        schedule,
        2,
        NUM_STEPS,
        None,
        overrides,
        False,
        None,
        "qwen3-moe-debug",
    )
    _check_parity(_dedupe(results, 2), overrides, "qwen3-moe-debug")
    for r in results:
        check(r["grad_diffs"], atol=1e-5, rtol=FP32_RTOL)
        # Experts: (efsdp, ep) with whole experts split over ep; dense states FSDP2 only.
        experts = {n: p for n, p in r["placements"].items() if ".moe.experts." in n}
        assert experts and all(len(p) == 2 and p[1] == "S(0)" for p in experts.values())
        dense = [p for n, p in r["placements"].items() if n not in experts]
        assert all(p == ["S(0)"] for p in dense), dense
        assert min(r["router_aux"].values()) > 1e-3, r["router_aux"]
    assert [
        sorted({n.split(".")[1] for n in r["grad_diffs"] if "router" in n}) for r in results
    ] == [["0"], ["0"], ["1"], ["1"]]


def test_moe_interleaved_1f1b_with_ep_trains_like_one_device(dist):
    # Two stages per pp rank, each dispatching over that rank's ep group.
    overrides = {"aux_loss_coef": 0.1, "num_layers": 4}
    results = dist.run(
        train_vs_one_device,
        "pp=2,dp_shard=2,ep=2",
        "Interleaved1F1B",
        2,
        NUM_STEPS,
        None,
        overrides,
        False,
        None,
        "qwen3-moe-debug",
    )
    _check_parity(_dedupe(results, 2), overrides, "qwen3-moe-debug")
    assert [len(r["stages"]) for r in results] == [2, 2, 2, 2]


def test_pp2_dp_replicate2_hsdp(dist):
    results = dist.run(train_vs_one_device, "pp=2,dp_replicate=2", "1F1B", 2, NUM_STEPS)
    _check_parity(_dedupe(results, 2))
    assert all(p == ["R", "S(0)"] for r in results for p in r["placements"].values())


def test_pp4_one_unit_per_stage(dist):
    results = dist.run(train_vs_one_device, "pp=4", "1F1B", 4, NUM_STEPS)
    _check_parity(results)
    assert [sorted({n.split(".")[0] for n in r["grad_diffs"]}) for r in results] == [
        ["tok_embeddings"],
        ["layers"],
        ["layers"],
        ["norm", "output"],
    ]


def test_checkpoint_saved_at_pp2_tp2_loads_anywhere_bitwise(dist, tmp_path):
    results = dist.run(checkpoint_across_meshes, str(tmp_path / "step_000002"))
    num_params = len(_param_names({}))
    for r in results:
        assert r["num_saved"] == 2 * num_params  # every weight and its AdamW exp_avg
        assert r["train_state"] == {"step": 2}
        assert r["tp4"] == (0.0, 2 * num_params)
        diff, count = r["interleaved"]
        assert diff == 0.0 and count > 0
    assert sum(r["interleaved"][1] for r in results[::2]) == 2 * num_params
    assert results[0]["one_process"] == (0.0, num_params)


def _check_trainer_parity(results: list[dict]) -> None:
    """fp32: losses and grad norms of 3 steps, and every first-step gradient, as one process."""
    for r in results:
        # Every parameter's whole gradient (each rank gathered all of them).
        check(r["grad_diffs"], atol=1e-5, rtol=FP32_RTOL, expect_count=r["num_params"])
        assert len(r["losses"]) == 3
        losses = zip(r["losses"], r["ref_losses"], strict=True)
        assert worst_abs([abs(a - b) for a, b in losses]) <= 1e-5
        for a, b in zip(r["grad_norms"], r["ref_grad_norms"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, b)


def test_trainer_with_pp_matches_one_process(dist):
    # Interleaved: 2 stages per rank; gradient clipping combines the norms over pp.
    results = dist.run(trainer_parity, {"pp": 2, "tp": 2}, "Interleaved1F1B", 4)
    _check_trainer_parity(results)
    for r in results:
        assert len(r["parts"]) == 2


def test_trainer_with_four_stages_per_rank_and_fsdp_matches_one_process(dist):
    # --stages-per-rank 4: 8 stages over 8 layers + the embedding and the head, looped over
    # pp=2, each stage an FSDP2 unit over dp_shard=2 (a stage of one block, or none).
    switches = {"stages_per_rank": 4, "model_overrides": {"num_layers": 8}, "batch_size": 8}
    results = dist.run(trainer_parity, {"pp": 2, "dp_shard": 2}, "Interleaved1F1B", 4, switches)
    _check_trainer_parity(results)
    for r in results:
        assert len(r["parts"]) == 4


# The trainer's wiring: experts on each pp rank's ep mesh, their gradients scaled to the
# dense convention after the schedule (dp_shard / efsdp), clipped over pp. Under cp the
# loss is scaled by 1 / cp and the stages' FSDP2 sums over cp (the balance loss sends its
# gradient at a fixed size on every cp rank: a mean over cp would shrink it by cp). Under
# tp, ep borrows the tp ranks: each dispatches its own slice of the sequence, and the
# routers' and the stages' replicated weights get Partial-over-tp gradients.
@pytest.mark.parametrize(
    "mesh",
    [
        {"pp": 2, "dp_shard": 2, "ep": 2},
        {"pp": 2, "cp": 2, "ep": 2},
        {"pp": 2, "tp": 2, "ep": 2},
    ],
    ids=["dp", "cp", "tp"],
)
def test_trainer_with_moe_pp2_ep2_matches_one_process(dist, mesh):
    switches = {"model_overrides": {"aux_loss_coef": 0.1}}
    results = dist.run(trainer_parity, mesh, "1F1B", 2, switches, "qwen3-moe-debug")
    _check_trainer_parity(results)


def test_trainer_with_qwen3_at_pp2_cp2_matches_one_process(dist):
    # The dense Qwen3 (per-head q/k norms) through the trainer's pipeline with cp.
    results = dist.run(trainer_parity, {"pp": 2, "cp": 2}, "1F1B", 2, None, "qwen3-debug")
    _check_trainer_parity(results)


def test_trainer_with_pp_bf16_and_ac_matches_the_bf16_one_process_run(dist):
    # FSDP2's bf16 policy in each stage (fp32 master weights and reduction) against the
    # one-process bf16 run (autocast), with selective checkpointing inside the stages;
    # every first-step gradient against the fp32 one-process run's (a 2x or zero fails).
    switches = {"dtype": "bf16", "ac": "selective"}
    results = dist.run(trainer_parity, {"pp": 2, "dp_shard": 2}, "1F1B", 2, switches)
    for r in results:
        assert len(r["losses"]) == 3
        losses = zip(r["losses"], r["ref_losses"], strict=True)
        assert worst_abs([abs(a - b) for a, b in losses]) <= BF16_TOL
        assert r["linear_dtypes"] == ["torch.bfloat16"]
        check(r["fp32_grad_diffs"], rtol=BF16_GRAD_RTOL, expect_count=r["num_params"])


def test_plan_predicts_each_stages_fsdp_collectives(dist):
    # The dry run's per-stage collectives per step (traced per stage kind, FSDP2's
    # gathers replayed against the schedule's actions) against FSDP2's own calls.
    from hyper_parallel.analysis.pipeline_cost import stage_collectives
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.pipeline import plan_pipeline
    from hyper_parallel.models.llama import PIPELINE, preset_config

    schedules = ["GPipe", "1F1B"]
    results = dist.run(fsdp_collectives_per_step, schedules)
    config = preset_config("llama3-debug")
    layout = MeshLayout.from_sizes({"pp": 2, "dp_shard": 2})
    for schedule in schedules:
        plan = plan_pipeline(PIPELINE.units(config), pp=2, schedule=schedule, num_microbatches=4)
        predicted = stage_collectives(plan, PIPELINE, config, layout, microbatch_size=1, seq_len=16)
        for r in results:
            counted = r[schedule]
            stage = predicted[counted["pp_rank"]]["collectives"]
            for kind in ("all_gather", "reduce_scatter"):
                want = sum(c["count"] for c in stage if c["kind"] == kind and c["axis"] == "fsdp")
                assert counted[kind] == want, (schedule, counted, stage)


def test_plan_predicts_each_stages_cp_and_fsdp_collectives(dist):
    # pp=2 x cp=2: every collective a stage issues in one step (the blocks' key/value
    # gathers and their gradients' reduce-scatters on cp, FSDP2 over the same cp group) recorded on gloo, against the dry run's per-stage
    # prediction traced on the fake process group. (Recorded with the dry run's
    # dispatch-mode recorder: CommDebugMode's module tracker hangs torch's schedule.)
    from hyper_parallel.analysis.pipeline_cost import stage_collectives
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.pipeline import plan_pipeline
    from hyper_parallel.models.llama import PIPELINE, apply_cp, cross_entropy_loss, preset_config
    from tests.distributed.pipeline_checks import BATCH, SEQ_LEN

    results = dist.run(cp_stage_collectives_per_step, "GPipe", 2)
    config = apply_cp(preset_config("llama3-debug"), cp_size=2)
    layout = MeshLayout.from_sizes({"pp": 2, "cp": 2})
    plan = plan_pipeline(PIPELINE.units(config), pp=2, schedule="GPipe", num_microbatches=2)
    predicted = stage_collectives(
        plan,
        PIPELINE,
        config,
        layout,
        microbatch_size=BATCH // 2,
        seq_len=SEQ_LEN,
        loss_fn=cross_entropy_loss,
    )
    for r in results:
        stage = predicted[r["pp_rank"]]["collectives"]
        want: dict[str, int] = {}
        for c in stage:
            key = f"{c['kind']}/{c['axis']}"
            want[key] = want.get(key, 0) + c["count"]
        assert r["counts"] == want, (r, stage)
        # Per micro-batch (2): one block's key and value gathers, nothing else (attention
        # by chunks: positions are never gathered).
        assert r["counts"]["all_gather/cp"] == 2 * 2
