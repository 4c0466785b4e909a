"""The N-D mesh layout: parsing, every bad mesh as one error, derived axes on a fake group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.distributed import LayoutError, MeshLayout


def test_parse_any_order_and_alias():
    layout = MeshLayout.parse("tp=2, dp=4,pp=2")
    assert (layout.pp, layout.dp_shard, layout.tp) == (2, 4, 2)
    assert layout.world_size == 16
    assert str(layout) == "pp=2,dp_shard=4,tp=2"
    assert MeshLayout.parse("") == MeshLayout()
    assert MeshLayout.parse("").world_size == 1


def test_derived_sizes():
    layout = MeshLayout.parse("dp_replicate=2,dp_shard=4,cp=2,tp=2,ep=8")
    assert layout.world_size == 32
    assert layout.fsdp == 8
    assert layout.efsdp == 2  # 4 * 2 * 2 / 8
    assert layout.size("batch") == 8 and layout.size("loss") == 16
    assert layout.active() == {"dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 2, "ep": 8}


def test_every_problem_in_one_error():
    with pytest.raises(LayoutError) as info:
        MeshLayout.parse("dp=2,dp_shard=2,tpp=2,cp=0,garbage")
    text = str(info.value)
    assert len(info.value.findings) == 4
    assert "'dp' and 'dp_shard' both name the dp_shard axis" in text
    assert "Did you mean 'tp'?" in text
    assert "axis 'cp' has size 0" in text
    assert "'garbage'" in text and "axis=size" in text


def test_repeated_axis_and_derived_axis():
    with pytest.raises(LayoutError, match="'tp' is given more than once"):
        MeshLayout.parse("tp=2,tp=2")
    with pytest.raises(LayoutError, match="fsdp is derived"):
        MeshLayout.parse("fsdp=2")
    with pytest.raises(LayoutError, match="not an integer"):
        MeshLayout.from_sizes({"tp": 2.0})


def test_ep_must_divide_borrowed_axes():
    with pytest.raises(LayoutError) as info:
        MeshLayout.parse("dp_shard=2,tp=3,ep=4")
    assert "ep=4 does not divide dp_shard x cp x tp = 2 x 1 x 3 = 6" in str(info.value)
    assert "1, 2, 3, 6" in str(info.value)


def test_world_size_mismatch_names_both_numbers():
    (finding,) = MeshLayout.parse("tp=2").findings(world_size=4)
    assert "needs pp x dp_replicate x dp_shard x cp x tp = 2 ranks" in finding.message
    assert "world has 4" in finding.message
    assert "--nproc-per-node 2" in finding.fix


@pytest.mark.parametrize(
    ("mesh", "world", "example"),
    [
        ("tp=4", 2, "(e.g. tp=2)"),
        ("tp=2", 4, "(e.g. dp_shard=2,tp=2 or tp=4)"),
        ("tp=4,cp=3", 2, "(e.g. tp=2)"),
        ("pp=2,dp_shard=2,tp=2", 6, "(e.g. pp=2,dp_shard=3)"),
        ("dp_shard=4,ep=4", 2, "(e.g. dp_shard=2,ep=2)"),
    ],
)
def test_world_size_mismatch_example_multiplies_to_the_world(mesh, world, example):
    # It said "e.g. dp_shard=1" for tp=4 on 2 ranks: still 4 ranks.
    (finding,) = MeshLayout.parse(mesh).findings(world_size=world)
    assert f"make the sizes multiply to {world} {example}" in finding.fix
    said = finding.fix.split("(e.g. ")[1].split(")")[0].split(" or ")
    for text in said:
        assert MeshLayout.parse(text).findings(world_size=world) == []


def test_build_without_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(LayoutError, match="no process group is running"):
        MeshLayout.parse("tp=2").build("cpu")


@pytest.mark.parametrize("rank", [0, 5, 13])
def test_views_on_fake_group(rank):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout = MeshLayout.parse("pp=2,dp_replicate=2,dp_shard=2,cp=1,tp=2,ep=4")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        mesh = layout.build("cpu")
        sizes = {a: mesh[a].size() for a in ("pp", "dp_replicate", "dp", "cp", "tp")}
        assert sizes == {"pp": 2, "dp_replicate": 2, "dp": 2, "cp": 1, "tp": 2}
        assert (mesh["fsdp"].size(), mesh["efsdp"].size(), mesh["ep"].size()) == (2, 1, 4)
        assert (mesh["batch"].size(), mesh["loss"].size()) == (4, 4)
        # Row-major layout: tp innermost, pp outermost; ep takes dp_shard x tp's ranks.
        pp, dpr, dps, tp = rank // 8, rank // 4 % 2, rank // 2 % 2, rank % 2
        assert mesh.local_rank("pp") == pp and mesh.local_rank("tp") == tp
        assert mesh.local_rank("dp_replicate") == dpr and mesh.local_rank("dp_shard") == dps
        assert mesh.local_rank("ep") == dps * 2 + tp
        # ep and the expert replicas stay inside this rank's pipeline stage (pp block).
        block = pp * 8 + dpr * 4
        assert sorted(mesh["ep"].mesh.flatten().tolist()) == [block + i for i in range(4)]
        assert mesh["efsdp"].mesh.flatten().tolist() == [rank]
        replicas = mesh.expert_fsdp_mesh().mesh.flatten().tolist()
        assert sorted(replicas) == [pp * 8 + r * 4 + dps * 2 + tp for r in (0, 1)]
        assert mesh.local_rank("batch") == dpr * 2 + dps
        hsdp = mesh.fsdp_mesh()
        assert hsdp.mesh_dim_names == ("dp_replicate", "fsdp") and tuple(hsdp.shape) == (2, 2)
        assert mesh.submesh(("tp", "cp")).mesh_dim_names == ("cp", "tp")
        with pytest.raises(KeyError, match="not an axis of this mesh"):
            mesh["model"]
    finally:
        dist.destroy_process_group()


def test_fsdp_mesh_is_1d_without_replicate():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout = MeshLayout.parse("dp_shard=2,cp=2")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = layout.build("cpu")
        assert mesh.fsdp_mesh().mesh_dim_names == ("fsdp",)
        assert mesh.fsdp_mesh().size() == 4
    finally:
        dist.destroy_process_group()
    assert MeshLayout.parse("tp=2").fsdp == 1


@pytest.mark.parametrize(
    "mesh, plan_axes",
    [
        ("tp=2", ("tp",)),
        ("pp=2", ()),
        ("dp_shard=2", ()),
        ("dp_replicate=2", ()),
        ("dp_replicate=2,dp_shard=2", ("tp",)),
        ("cp=2", ()),
        ("cp=2", ("cp",)),
        ("cp=2,tp=2", ("cp", "tp")),
        ("dp_shard=2,cp=2", ("cp",)),
        ("dp_shard=2,ep=2", ()),
        ("pp=2,tp=2", ("tp",)),
    ],
)
def test_shards_dense_states_says_what_fsdp_mesh_for_builds(mesh, plan_axes):
    # The one-process reference asks the layout alone (no process group) whether FSDP2
    # wraps the run's dense states; the builder asks the mesh. They must agree.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.distributed.fsdp import fsdp_mesh_for, shards_dense_states

    layout = MeshLayout.parse(mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        built = fsdp_mesh_for(layout.build("cpu"), plan_axes) is not None
    finally:
        dist.destroy_process_group()
    assert shards_dense_states(layout, plan_axes) == built


# ---------------------------------------------------------------------- plans on the mesh


def test_declared_axes_and_plan_submesh():
    from hyper_parallel.distributed import declared_axes, plan_axis_findings
    from hyper_parallel.dmodule import get_spec
    from hyper_parallel.dmodule.module import Module

    spec = get_spec("llama3-debug")
    config = spec.sharding("tp")(spec.config(num_layers=1))
    configs = [c.sharding_config for _, c, _, _ in config.traverse(Module.Config)]
    assert declared_axes(configs) == ("tp",)
    assert declared_axes([spec.config().sharding_config]) == ()
    # A cp axis the plan does not declare would read sequence shards as whole sequences.
    (error,) = plan_axis_findings(MeshLayout.parse("cp=2,tp=2"), ("tp",), fsdp=True)
    assert error.severity == "error" and "declares no 'cp' placement" in error.message
    assert "apply_cp" in error.fix
    assert plan_axis_findings(MeshLayout.parse("cp=2,tp=2"), ("cp", "tp"), fsdp=True) == []


def test_plan_on_a_data_axis_refuses_states_and_warns_about_activations():
    from hyper_parallel.distributed import plan_axis_findings

    layout = MeshLayout.parse("dp_shard=2,tp=2")
    # States there: FSDP2 would be handed states already on a data axis (refused).
    (error,) = plan_axis_findings(layout, ("dp_shard", "tp"), fsdp=True, states_on_data=["w"])
    assert error.severity == "error" and error.field == "dp_shard"
    assert "places states on the data axis 'dp_shard' (w)" in error.message
    assert "silently becomes HSDP" in error.message and "('dp_shard', 'tp')" in error.message
    assert "fsdp_mesh()" in error.fix and "--no-fsdp" in error.fix
    # Activations only, or no data rank for FSDP2 to shard over: a warning.
    (warning,) = plan_axis_findings(layout, ("dp_shard", "tp"), fsdp=True)
    assert warning.severity == "warning" and "places tensors" in warning.message
    (warning,) = plan_axis_findings(
        MeshLayout.parse("tp=2"), ("dp_shard", "tp"), fsdp=True, states_on_data=["w"]
    )
    assert warning.severity == "warning"
    assert plan_axis_findings(MeshLayout.parse("dp_shard=2"), ("dp_shard",), fsdp=False) == []


def test_fsdp_mesh_findings_name_the_hsdp_trap():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.distributed import apply_fsdp, fsdp_mesh_findings

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = MeshLayout.parse("dp_replicate=2,dp_shard=2,tp=2").build("cpu")
        assert fsdp_mesh_findings(mesh.fsdp_mesh()) == []
        assert fsdp_mesh_findings(mesh["fsdp"]) == []
        (trap,) = fsdp_mesh_findings(mesh.submesh(("dp_shard", "tp")))
        assert trap.severity == "warning" and "silently becomes HSDP" in trap.message
        assert "replicated over 'dp_shard' and sharded over 'tp'" in trap.message
        three = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        (error,) = fsdp_mesh_findings(three)
        assert error.severity == "error" and "1-D (FSDP) or 2-D (HSDP)" in error.message
        with pytest.raises(ValueError, match="1-D \\(FSDP\\) or 2-D \\(HSDP\\)"):
            apply_fsdp(torch.nn.Linear(2, 2), three)
    finally:
        dist.destroy_process_group()


def test_validate_refuses_the_hsdp_trap():
    from hyper_parallel.analysis import validate
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule import ShardingConfig, get_spec

    config = get_spec("llama3-debug").config(num_layers=1)
    plan = {
        "output": ShardingConfig(
            state_shardings={"weight": {"dp_shard": Shard(0)}},
            in_dst_shardings={"input": {"dp_shard": Replicate()}},
            out_dst_shardings={"dp_shard": Replicate()},
            use_local_output=True,
        )
    }
    report = validate(config, {"dp_shard": 2, "tp": 2}, plan, trace=False)
    (trap,) = [f for f in report.errors if "HSDP" in f.message]
    assert trap.path == "plan" and "(output)" in trap.message
    # A user's own 2-D DeviceMesh that puts a data axis beside tp: the same trap.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        user_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        report = validate(get_spec("llama3-debug").sharding("tp")(config), user_mesh, trace=False)
    finally:
        dist.destroy_process_group()
    (trap,) = [f for f in report.warnings if "HSDP" in f.message]
    assert trap.path == "mesh" and "('dp', 'tp')" in trap.message
    assert report.layout == MeshLayout(dp_shard=2, tp=2)


def _fsdp_meshes(text: str, axes: tuple[str, ...]):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.distributed import plan_mesh
    from hyper_parallel.distributed.fsdp import fsdp_mesh_dims, fsdp_mesh_findings, fsdp_mesh_for

    layout = MeshLayout.parse(text)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        mesh = layout.build("cpu")
        model, fsdp = plan_mesh(mesh, axes), fsdp_mesh_for(mesh, axes)
        dims = fsdp_mesh_dims(fsdp) if fsdp is not None else None
        return (
            model.mesh_dim_names,
            None if fsdp is None else fsdp.mesh_dim_names,
            None if dims is None else (dims.shard_names, dims.replicate_names),
            [] if fsdp is None else fsdp_mesh_findings(fsdp),
            mesh.fsdp_mesh() is fsdp,
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("text", "axes", "model_mesh", "shard", "replicate"),
    [
        ("cp=2,tp=2", ("cp", "tp"), ("cp", "tp"), ("cp",), ()),
        ("dp_shard=2,cp=2", ("cp",), ("dp_shard", "cp"), ("dp_shard", "cp"), ()),
        ("dp_replicate=2,cp=2", ("cp",), ("dp_replicate", "cp"), ("cp",), ("dp_replicate",)),
    ],
)
def test_fsdp_shards_over_cp_on_the_model_mesh(text, axes, model_mesh, shard, replicate):
    # The plan runs on a mesh holding the data axes (Replicate there); FSDP2's SPMD form
    # shards over dp_shard x cp on it and replicates over dp_replicate.
    got_model, got_fsdp, dims, findings, _ = _fsdp_meshes(text, axes)
    assert got_model == got_fsdp == model_mesh
    assert dims == (shard, replicate) and findings == []


def test_fsdp_shards_over_cp_on_a_model_mesh_of_three_dims_or_more():
    # dp_shard x cp x tp and HSDP x cp x tp: FSDP2's SPMD form on the model's own mesh.
    model, fsdp, dims, findings, _ = _fsdp_meshes("dp_shard=2,cp=2,tp=2", ("cp", "tp"))
    assert model == fsdp == ("dp_shard", "cp", "tp")
    assert dims == (("dp_shard", "cp"), ()) and findings == []
    text = "dp_replicate=2,dp_shard=2,cp=2,tp=2"
    model, fsdp, dims, findings, _ = _fsdp_meshes(text, ("cp", "tp"))
    assert model == fsdp == ("dp_replicate", "dp_shard", "cp", "tp")
    assert dims == (("dp_shard", "cp"), ("dp_replicate",)) and findings == []
    # Without cp in the plan: the plain fsdp mesh.
    *_, plain = _fsdp_meshes("dp_replicate=2,dp_shard=2,tp=2", ("tp",))
    assert plain


def test_fsdp_over_cp_refuses_a_plain_parameter_and_a_foreign_mesh_dim():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.distributed import apply_fsdp, fsdp_mesh_findings

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = MeshLayout.parse("dp_shard=2,cp=2").build("cpu")
        plain = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="every parameter must be a DTensor on it") as e:
            apply_fsdp(plain, mesh.submesh(("dp_shard", "cp")))
        assert "Linear.weight is on a plain tensor" in str(e.value)
        assert "plan_mesh(mesh, axes)" in str(e.value)
        assert not hasattr(plain, "reshard")  # not wrapped
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = MeshLayout.parse("pp=2,cp=2").build("cpu")
        (error,) = fsdp_mesh_findings(mesh.submesh(("pp", "cp")))
        assert error.severity == "error" and "unexpected: ['pp']" in error.message
        assert "fsdp_mesh_for(mesh, plan_axes)" in error.fix
    finally:
        dist.destroy_process_group()
