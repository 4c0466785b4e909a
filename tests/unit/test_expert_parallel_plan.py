"""The routed-experts dispatch as a plan entry: config, plan files, and every refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.distributed.expert_parallel import RoutedExpertsDispatch, expert_parallel
from hyper_parallel.dmodule import ParallelizeError, ShardingConfig, load_plan, parallelize_module
from hyper_parallel.dmodule.dispatch import DispatchConfig
from hyper_parallel.dmodule.plan_file import plan_from_dict, plan_to_dict
from hyper_parallel.models.qwen3_moe import GroupedExperts, apply_ep, preset_config

PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"


@pytest.fixture(scope="module")
def ep_mesh() -> Iterator[DeviceMesh]:
    """A 1-D ``ep`` mesh of 4 ranks on the fake process group (this process is rank 0)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def _model(**overrides):
    torch.manual_seed(0)
    model = preset_config("qwen3-moe-debug", num_layers=1, **overrides).build()
    model.init_states()
    return model


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _refused(model, mesh, plan, *fragments: str) -> None:
    before = _snapshot(model)
    forward = model.layers[0].moe.experts.forward
    with pytest.raises(ParallelizeError) as info:
        parallelize_module(model, mesh, plan)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    after = _snapshot(model)
    assert all(not isinstance(p, DTensor) for p in model.parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert model.layers[0].moe.experts.forward == forward


def test_config_places_experts_and_names_the_dispatch() -> None:
    config = expert_parallel(("w1", "w2"), axis="ep")
    assert config.state_shardings == {"w1": {"ep": Shard(0)}, "w2": {"ep": Shard(0)}}
    assert config.dispatch == DispatchConfig(kind="routed_experts", axis="ep")
    assert ShardingConfig.from_dict(config.to_dict()) == config
    assert plan_from_dict(plan_to_dict({"e": config})) == {"e": config}
    with pytest.raises(ValueError, match="non-empty sequence"):
        expert_parallel("w1")


def test_dispatch_config_type_errors_name_the_field() -> None:
    with pytest.raises(TypeError, match=r"DispatchConfig.axis: expected a non-empty str"):
        DispatchConfig(kind="routed_experts", axis=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ShardingConfig.dispatch: expected a DispatchConfig"):
        ShardingConfig(dispatch="routed_experts")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"entry 'e': dispatch: .*missing key\(s\) \['axis'\]"):
        plan_from_dict({"e": {"dispatch": {"kind": "routed_experts"}}})
    with pytest.raises(TypeError, match=r"entry 'e': dispatch: expected a mapping"):
        plan_from_dict({"e": {"dispatch": "routed_experts"}})


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_plan_files_equal_the_python_plans(family: str) -> None:
    from hyper_parallel.hf import hf_ep_plan

    assert load_plan(PLANS / f"hf_{family}_ep.yaml") == hf_ep_plan(family)


def test_hf_plans_refuse_the_wrong_kind_of_model() -> None:
    from hyper_parallel.hf import hf_ep_plan, hf_tp_plan

    with pytest.raises(ValueError, match=r"llama has no routed experts.*hf_tp_plan"):
        hf_ep_plan("llama")
    with pytest.raises(ValueError, match=r"hf_ep_plan\('mixtral'\)"):
        hf_tp_plan("mixtral")


def test_parallelize_installs_the_dispatch_and_splits_whole_experts(ep_mesh) -> None:
    model = _model()
    plan = {"layers.*.moe.experts": expert_parallel(("w1", "w2", "w3"))}
    parallelize_module(model, ep_mesh, plan)
    experts = model.layers[0].moe.experts
    assert isinstance(experts.forward, RoutedExpertsDispatch)
    assert experts.forward.num_local == 2
    for name in ("w1", "w2", "w3"):
        w = getattr(experts, name)
        assert isinstance(w, DTensor) and w.placements == (Shard(0),)
        assert w.to_local().shape[0] == 2
    assert not isinstance(model.layers[0].moe.router.weight, DTensor)


def test_model_config_route_gives_the_same_plan(ep_mesh) -> None:
    model = apply_ep(preset_config("qwen3-moe-debug", num_layers=1)).build()
    model.init_states()
    model.parallelize(ep_mesh)
    assert isinstance(model.layers[0].moe.experts.forward, RoutedExpertsDispatch)


def test_experts_not_divisible_by_ep_are_refused(ep_mesh) -> None:
    model = _model(num_experts=6)
    plan = {"layers.*.moe.experts": expert_parallel(("w1", "w2", "w3"))}
    _refused(model, ep_mesh, plan, "6 experts cannot be split over ep=4", "divides 6")


def test_expert_weights_must_be_whole_experts_on_the_axis(ep_mesh) -> None:
    config = ShardingConfig(
        state_shardings={"w1": {"ep": Shard(1)}, "w2": {"ep": Shard(0)}},
        dispatch=DispatchConfig(kind="routed_experts", axis="ep"),
    )
    _refused(_model(), ep_mesh, {"layers.*.moe.experts": config}, "state_shardings['w1']",
             "Shard(0) on 'ep'")  # fmt: skip


def test_every_state_of_the_experts_module_must_be_named(ep_mesh) -> None:
    # An unnamed state was replicated whole and met the local experts' plain tensors
    # in forward: torch's "got mixed torch.Tensor and DTensor" at the first call.
    plan = {"layers.*.moe.experts": expert_parallel(("w1", "w2"))}
    fix = "{'w3': {'ep': Shard(0)}}"
    _refused(_model(), ep_mesh, plan, "layers.0.moe.experts: state_shardings",
             "does not name GroupedExperts.w3 (shape [8, 32, 64])", fix)  # fmt: skip
    model = _model()
    model.layers[0].moe.experts.register_buffer("scale", torch.ones(3))
    plan = {"layers.*.moe.experts": expert_parallel(("w1", "w2", "w3"))}
    _refused(model, ep_mesh, plan, "GroupedExperts.scale (shape [3])",
             "move it to the module around the experts")  # fmt: skip


def test_experts_fsdp_placement_takes_a_dim_efsdp_divides() -> None:
    from hyper_parallel.distributed.expert_parallel import expert_shard_placement

    def experts(hidden: int, dim: int, num_experts: int = 1) -> torch.nn.Module:
        config = GroupedExperts.Config(num_experts=num_experts, dim=dim, hidden_dim=hidden)
        with torch.device("meta"):
            return config.build()

    assert expert_shard_placement(experts(15, 64, num_experts=2), 2) is None  # dim 0 divides
    # One local expert over efsdp=2: w1, w3 (1, 15, 64) on dim 2, w2 (1, 64, 15) on dim 1;
    # dim 1 for all (FSDP2: "does not support uneven sharding on dim 1") was the rule.
    module = experts(15, 64)
    placement = expert_shard_placement(module, 2)
    assert {n: placement(p) for n, p in module.named_parameters()} == {
        "w1": Shard(2),
        "w2": Shard(1),
        "w3": Shard(2),
    }
    # No later dim divides: dim 0, which FSDP2 pads.
    module = experts(15, 33)
    placement = expert_shard_placement(module, 2)
    assert {placement(p) for p in module.parameters()} == {Shard(0)}


def test_router_and_expert_shapes_must_agree(ep_mesh) -> None:
    model = _model()
    experts = model.layers[0].moe.experts
    experts.w3 = torch.nn.Parameter(torch.zeros(4, *experts.w3.shape[1:]))
    plan = {"layers.*.moe.experts": expert_parallel(("w1", "w2", "w3"))}
    _refused(model, ep_mesh, plan, "disagree on the number of experts")


def test_unknown_kind_wrong_axis_extra_fields_and_wrong_module_are_refused(ep_mesh) -> None:
    bad_kind = ShardingConfig(
        state_shardings={"w1": {"ep": Shard(0)}},
        dispatch=DispatchConfig(kind="routed_expert", axis="ep"),
    )
    _refused(_model(), ep_mesh, {"layers.0.moe.experts": bad_kind},
             "no token dispatch of kind 'routed_expert'", "routed_experts")  # fmt: skip
    wrong_axis = ShardingConfig(
        state_shardings={"w1": {"ep": Replicate()}},
        dispatch=DispatchConfig(kind="routed_experts", axis="expert"),
    )
    _refused(_model(), ep_mesh, {"layers.0.moe.experts": wrong_axis},
             "axis 'expert' is not in mesh ('ep',)")  # fmt: skip
    extra = ShardingConfig(
        state_shardings={"w1": {"ep": Shard(0)}},
        in_dst_shardings={"x": {"ep": Replicate()}},
        dispatch=DispatchConfig(kind="routed_experts", axis="ep"),
    )
    _refused(_model(), ep_mesh, {"layers.0.moe.experts": extra}, "['in_dst_shardings']")
    block = ShardingConfig(
        state_shardings={"router.weight": {"ep": Shard(0)}},
        dispatch=DispatchConfig(kind="routed_experts", axis="ep"),
    )
    _refused(_model(), ep_mesh, {"layers.0.moe": block}, "takes (x, top_k_index, top_k_weights)")


def test_ep_findings_of_a_clean_layout_are_empty() -> None:
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.expert_parallel import ep_findings

    assert ep_findings(preset_config("qwen3-moe-debug"), MeshLayout.parse("dp_shard=4,ep=4")) == []


def test_ep_findings_report_every_problem_with_path_and_fix() -> None:
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.expert_parallel import ep_findings

    config = preset_config("qwen3-moe-debug")
    config.layers[0].moe.router.top_k = 9
    config.layers[1].moe.experts.num_experts = 4
    found = ep_findings(config, MeshLayout(dp_shard=6, ep=3))
    by_path = {(f.path, f.field): f for f in found}
    assert set(by_path) == {
        ("layers.0.moe.router", "top_k"),
        ("layers.0.moe.experts", "ep"),
        ("layers.1.moe.experts", "num_experts"),
    }
    assert "top_k=9 is more than the 8 experts" in by_path[("layers.0.moe.router", "top_k")].message
    assert "8 experts cannot be split over ep=3" in by_path[("layers.0.moe.experts", "ep")].message
    assert "1, 2, 4, 8" in by_path[("layers.0.moe.experts", "ep")].fix
    mismatch = by_path[("layers.1.moe.experts", "num_experts")]
    assert "scores 8 experts" in mismatch.message and "same num_experts" in mismatch.fix
    assert all(f.severity == "error" for f in found)
    # ep must divide dp_shard x cp x tp: the layout's own finding comes along.
    layout_found = ep_findings(preset_config("qwen3-moe-debug"), MeshLayout(dp_shard=4, ep=8))
    assert [(f.path, f.field) for f in layout_found] == [("mesh", "ep")]


def test_ep_findings_on_a_hugging_face_moe() -> None:
    pytest.importorskip("transformers")
    from hyper_parallel.distributed.expert_parallel import ep_findings, moe_layers
    from hyper_parallel.hf import build_hf_model

    model = build_hf_model("qwen3_moe", device="meta")
    assert [r for r, *_ in moe_layers(model)] == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    found = ep_findings(model, 3)
    assert [(f.path, f.field) for f in found] == [
        ("model.layers.0.mlp.experts", "ep"),
        ("model.layers.1.mlp.experts", "ep"),
    ]
    assert ep_findings(build_hf_model("mixtral", device="meta"), 4) == []


def test_ep_findings_on_experts_with_per_expert_biases() -> None:
    """GPT-OSS's experts hold 2-D biases ``[num_experts, out]`` beside their 3-D weights:
    they were not recognised as experts, so validate skipped every ep/top_k check."""
    import transformers

    from hyper_parallel.distributed.expert_parallel import ep_findings, moe_layers

    config = transformers.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=64, layer_types=["full_attention"] * 2,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    assert [(r, e) for r, _, e, _ in moe_layers(model)] == [
        ("model.layers.0.mlp.router", "model.layers.0.mlp.experts"),
        ("model.layers.1.mlp.router", "model.layers.1.mlp.experts"),
    ]
    assert ep_findings(model, 2) == []
    assert [(f.path, f.field) for f in ep_findings(model, 3)] == [
        ("model.layers.0.mlp.experts", "ep"),
        ("model.layers.1.mlp.experts", "ep"),
    ]
    # A 2-D parameter that is not per expert (another first dim): not taken for experts.
    experts = model.model.layers[0].mlp.experts
    experts.other = torch.nn.Parameter(torch.empty(5, 32, device="meta"))
    assert [r for r, *_ in moe_layers(model)] == ["model.layers.1.mlp.router"]


def test_validate_reports_expert_problems_once_each() -> None:
    from hyper_parallel.analysis import validate

    config = preset_config("qwen3-moe-debug")
    config.layers[0].moe.router.top_k = 9
    report = validate(apply_ep(config), {"dp_shard": 3, "ep": 3}, trace=False)
    assert not report.ok
    errors = [(f.path, f.field) for f in report.findings if f.severity == "error"]
    assert sorted(errors) == [
        ("layers.0.moe.experts", "ep"),
        ("layers.0.moe.router", "top_k"),
        ("layers.1.moe.experts", "ep"),
    ]
