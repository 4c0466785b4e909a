"""Expert parallelism through the command line and the trainer's gate (no process group)."""

from __future__ import annotations

import json

import pytest

from hyper_parallel.cli import main
from hyper_parallel.dmodule import get_spec
from hyper_parallel.models.qwen3_moe import num_expert_params, num_params, preset_config
from hyper_parallel.train import TrainConfig
from hyper_parallel.train.trainer import check_config


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _plan_json(capsys, mesh: str) -> dict:
    code, out, _ = _run(
        capsys,
        ["plan", "--model", "qwen3-moe-debug", "--mesh", mesh, "--batch", "2", "--seq", "16",
         "--format", "json"],
    )  # fmt: skip
    assert code == 0
    return json.loads(out)


def test_plan_json_lists_experts_apart_and_the_all_to_alls(capsys) -> None:
    report = _plan_json(capsys, "dp_shard=4,ep=2")
    config = preset_config("qwen3-moe-debug")
    assert report["num_params"] == num_params(config)
    memory = report["per_rank_bytes"]
    # Experts: Shard(0) over ep=2, then FSDP2 over efsdp=2; dense: FSDP2 over dp_shard=4.
    assert memory["experts"]["params"] == num_expert_params(config) * 4 // 4
    dense = (num_params(config) - num_expert_params(config)) * 4
    assert memory["dense"]["params"] == pytest.approx(dense / 4, rel=0.01)  # FSDP pads
    assert memory["params"] == memory["experts"]["params"] + memory["dense"]["params"]
    a2a = {c["phase"]: c for c in report["collectives"] if c["kind"] == "all_to_all"}
    assert {c["axis"] for c in a2a.values()} == {"ep"}
    assert (a2a["forward"]["count"], a2a["backward"]["count"]) == (6, 4)
    routed = 2 * 16 * 2 * 64 * 4  # batch x seq x top_k x dim, fp32
    assert a2a["backward"]["bytes"] == 2 * 2 * routed
    assert any("uniform routing" in a for a in report["assumptions"])


def test_plan_with_cp_shards_experts_over_efsdp_spanning_cp_ranks(capsys) -> None:
    # cp=4, ep=2: efsdp=2 are cp ranks; FSDP2 shards the dense states over cp (fsdp = cp).
    report = _plan_json(capsys, "cp=4,ep=2")
    config = preset_config("qwen3-moe-debug")
    assert report["mesh"]["efsdp"] == 2
    assert report["per_rank_bytes"]["experts"]["params"] == num_expert_params(config) * 4 // 4
    dense = (num_params(config) - num_expert_params(config)) * 4
    assert report["per_rank_bytes"]["dense"]["params"] == dense // 4
    a2a = {c["phase"]: c["count"] for c in report["collectives"] if c["kind"] == "all_to_all"}
    assert a2a == {"forward": 6, "backward": 4}


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("dp_shard=3,ep=3", "8 experts cannot be split over ep=3 ranks"),
        ("dp_shard=2,tp=4,ep=2", "ep=2 with tp=4: expert parallelism borrows whole"),
    ],
)
def test_trainer_gate_refuses_what_expert_parallelism_does_not_run(mesh, message) -> None:
    from hyper_parallel.distributed import MeshLayout

    cfg = TrainConfig(model="qwen3-moe-debug", mesh=MeshLayout.parse(mesh).active(), batch_size=12)
    findings = check_config(cfg)
    assert any(message in f.message for f in findings), [str(f) for f in findings]
    assert all(f.fix for f in findings)


def test_trainer_gate_accepts_expert_parallel_meshes() -> None:
    for mesh in (
        {"dp_shard": 2, "ep": 2},
        {"dp_shard": 4, "ep": 2},
        {"dp_shard": 8, "ep": 8},
        {"dp_shard": 2, "tp": 2, "ep": 2},
        {"dp_shard": 2, "tp": 2, "ep": 4},
        {"tp": 2},
        {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
        {"cp": 2, "ep": 2},
        {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4},
        {"pp": 2, "dp_shard": 2, "ep": 2},
        {"pp": 2, "dp_shard": 2, "tp": 2, "ep": 2},
    ):
        assert check_config(TrainConfig(model="qwen3-moe-debug", mesh=mesh)) == []


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_ep_with_a_split_backward_schedule_is_refused_by_trainer_and_validate(schedule) -> None:
    from hyper_parallel.analysis import validate

    mesh = {"pp": 2, "dp_shard": 2, "ep": 2}
    cfg = TrainConfig(model="qwen3-moe-debug", mesh=mesh, schedule=schedule, microbatches=4)
    findings = check_config(cfg)
    assert [(f.field, f.path) for f in findings] == [("ep", "mesh")], [str(f) for f in findings]
    assert "input- and weight-gradient steps" in findings[0].message
    assert "use 1F1B, GPipe or Interleaved1F1B" in findings[0].fix
    config = get_spec("qwen3-moe-debug").sharding("ep")(preset_config("qwen3-moe-debug"))
    report = validate(config, mesh, schedule=schedule, num_microbatches=4, trace=False)
    assert [f.message for f in report.errors] == [findings[0].message]
    # The same mesh with a full-backward schedule, and the schedule without ep, run.
    assert check_config(cfg.replace(schedule="Interleaved1F1B")) == []
    assert check_config(cfg.replace(mesh={"pp": 2, "dp_shard": 2})) == []


def test_validate_cli_reports_the_expert_split(capsys) -> None:
    code, out, _ = _run(
        capsys, ["validate", "--model", "qwen3-moe-debug", "--mesh", "dp_shard=6,ep=3"]
    )
    assert code == 1
    assert "8 experts cannot be split over ep=3 ranks" in out
    assert "use an ep size that divides 8 (1, 2, 4, 8)" in out


def test_plan_json_with_tp_and_ep_borrowing_tp(capsys) -> None:
    report = _plan_json(capsys, "dp_shard=2,tp=2,ep=2")
    config = preset_config("qwen3-moe-debug")
    assert report["num_params"] == num_params(config)
    assert report["plan_axes"] == ["tp"]
    memory = report["per_rank_bytes"]
    # Experts: Shard(0) over ep=2 (the tp ranks), FSDP2 over efsdp=2 (dp_shard).
    assert memory["experts"]["params"] == num_expert_params(config) * 4 // 4
    a2a = {c["phase"]: c for c in report["collectives"] if c["kind"] == "all_to_all"}
    assert (a2a["forward"]["count"], a2a["backward"]["count"]) == (6, 4)
    # Each tp rank dispatches its half of the sequence: half the routed bytes of tp=1.
    routed = 2 * 8 * 2 * 64 * 4  # batch x seq per tp rank x top_k x dim, fp32
    assert a2a["backward"]["bytes"] == 2 * 2 * routed
    tp = {(c["kind"], c["phase"]) for c in report["collectives"] if c["axis"] == "tp"}
    assert ("all_reduce", "forward") in tp  # row-parallel outputs and balance statistics


def test_plan_with_replicas_all_reduces_expert_gradients_over_them(capsys) -> None:
    report = _plan_json(capsys, "dp_replicate=2,dp_shard=2,ep=2")
    reduce = {c["axis"]: c for c in report["collectives"] if c["kind"] == "all_reduce"}
    # Expert gradients (HSDP over edp_replicate x efsdp): one all-reduce per MoE layer of
    # its local experts' gradients; dense ones over dp_replicate (HSDP of the blocks).
    config = preset_config("qwen3-moe-debug")
    assert reduce["edp_replicate"]["count"] == len(config.layers)
    assert reduce["edp_replicate"]["bytes"] == num_expert_params(config) * 4 // 2
    assert "dp_replicate" in reduce


def test_plan_counts_each_stages_dispatch_once_per_microbatch() -> None:
    # pp=2 x dp_shard=2 x ep=2: each stage's MoE layer dispatches every micro-batch
    # (3 all-to-alls forward, their 2 transposes backward), on its own pp rank's ep group.
    from hyper_parallel.analysis.pipeline_cost import stage_collectives
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.pipeline import plan_pipeline
    from hyper_parallel.models.qwen3_moe import PIPELINE, apply_ep

    config = preset_config("qwen3-moe-debug")
    layout = MeshLayout.parse("pp=2,dp_shard=2,ep=2")
    plan = plan_pipeline(PIPELINE.units(config), pp=2, schedule="1F1B", num_microbatches=4)
    stages = stage_collectives(
        plan, PIPELINE, apply_ep(config), layout, microbatch_size=1, seq_len=16
    )
    assert [list(s) for s in plan.stages] == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "norm+output"],
    ]
    for stage in stages:
        a2a = {c["phase"]: c["count"] for c in stage["collectives"] if c["kind"] == "all_to_all"}
        assert a2a == {"forward": 3 * 4, "backward": 2 * 4}, stage["collectives"]
