"""Unit tests for the spec layer: resolve_placements, ShardingConfig, LocalMapConfig."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule.sharding import (
    LocalMapConfig,
    ShardingConfig,
    placement_from_str,
    placement_to_str,
    resolve_placements,
)
from hyper_parallel.dmodule.types import MeshAxisName

# --------------------------------------------------------------------------- resolve_placements


def test_resolve_returns_one_placement_per_axis_in_mesh_order():
    placements = resolve_placements(
        {"tp": Shard(0), "dp": Partial("avg")}, ("dp", "cp", "tp", "pp")
    )
    assert isinstance(placements, list)
    assert placements == [Partial("avg"), Replicate(), Shard(0), Replicate()]


def test_resolve_fills_omitted_axes_with_replicate():
    assert resolve_placements({}, ("dp", "tp")) == [Replicate(), Replicate()]
    assert resolve_placements({"dp": Shard(1)}, ("dp", "tp")) == [Shard(1), Replicate()]


def test_resolve_empty_named_on_empty_mesh_is_empty_list():
    assert resolve_placements({}, ()) == []


def test_resolve_accepts_mesh_axis_name_and_string_keys_alike():
    by_enum = resolve_placements({MeshAxisName.TP: Shard(0)}, ("dp", "tp"))
    by_str = resolve_placements({"tp": Shard(0)}, ("dp", "tp"))
    assert by_enum == by_str == [Replicate(), Shard(0)]


def test_resolve_accepts_mesh_axis_names_given_as_enum_members():
    placements = resolve_placements({"tp": Shard(1)}, (MeshAxisName.DP, MeshAxisName.TP))
    assert placements == [Replicate(), Shard(1)]


def test_resolve_keeps_the_given_placement_objects():
    shard = Shard(-1)
    assert resolve_placements({"tp": shard}, ("tp",))[0] is shard


def test_resolve_rejects_key_not_on_mesh_naming_key_and_mesh_axes():
    with pytest.raises(ValueError) as excinfo:
        resolve_placements({MeshAxisName.EP: Shard(0)}, ("dp", "tp"))
    message = str(excinfo.value)
    assert "not in mesh" in message
    assert "'ep'" in message
    assert "'dp'" in message and "'tp'" in message  # the mesh's axes, so the user can fix it
    assert "Use only the mesh's axis names" in message


def test_resolve_rejects_every_offending_key_at_once():
    named = {"tp": Shard(0), "TP": Shard(0), "expert": Replicate(), "sp": Shard(1)}
    with pytest.raises(ValueError, match="not in mesh") as excinfo:
        resolve_placements(named, ("dp", "tp"))
    message = str(excinfo.value)
    for key in ("'TP'", "'expert'", "'sp'"):
        assert key in message
    assert "['dp', 'tp']" in message


def test_resolve_is_case_sensitive_and_hints_at_the_right_case():
    with pytest.raises(ValueError, match="not in mesh") as excinfo:
        resolve_placements({"Tp": Shard(0)}, ("dp", "tp"))
    message = str(excinfo.value)
    assert "'Tp'" in message
    assert "case-sensitive" in message
    assert "'tp'" in message


def test_resolve_rejects_any_key_on_an_empty_mesh():
    with pytest.raises(ValueError, match="not in mesh"):
        resolve_placements({"tp": Shard(0)}, ())


def test_resolve_rejects_a_bare_string_for_the_mesh_axis_names():
    # "tp" is a sequence of characters; it must not be read as the mesh ("t", "p").
    with pytest.raises(TypeError) as excinfo:
        resolve_placements({}, "tp")
    message = str(excinfo.value)
    assert "'tp'" in message
    assert "('tp',)" in message


def test_resolve_rejects_a_value_that_is_not_a_placement():
    with pytest.raises(TypeError) as excinfo:
        resolve_placements({"tp": "Shard(0)"}, ("tp",))
    message = str(excinfo.value)
    assert "'tp'" in message
    assert "expected a Placement such as Shard(0)" in message


def test_resolve_rejects_a_key_that_is_not_an_axis_name():
    with pytest.raises(TypeError) as excinfo:
        resolve_placements({1: Shard(0)}, ("tp",))
    message = str(excinfo.value)
    assert "key 1" in message
    assert "MeshAxisName members or axis-name strings" in message


def test_resolve_rejects_named_that_is_not_a_mapping():
    with pytest.raises(TypeError) as excinfo:
        resolve_placements([Shard(0)], ("tp",))
    message = str(excinfo.value)
    assert "named" in message
    assert "expected a NamedPlacement" in message


# --------------------------------------------------------------------------- with a DeviceMesh


@pytest.fixture(scope="module")
def fake_world():
    """A 4-rank fake process group for the whole module: meshes without real ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_tp_mesh(fake_world) -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_resolve_accepts_a_device_mesh(dp_tp_mesh):
    assert resolve_placements({MeshAxisName.TP: Shard(0)}, dp_tp_mesh) == [Replicate(), Shard(0)]
    assert resolve_placements({"dp": Shard(1)}, dp_tp_mesh) == [Shard(1), Replicate()]


def test_resolved_placements_feed_distribute_tensor(dp_tp_mesh):
    placements = resolve_placements({"tp": Shard(0)}, dp_tp_mesh)
    tensor = distribute_tensor(torch.arange(16.0).reshape(4, 4), dp_tp_mesh, placements)
    assert isinstance(tensor, DTensor)
    assert tuple(tensor.placements) == (Replicate(), Shard(0))
    assert tensor.to_local().shape == (2, 4)


def test_resolve_with_device_mesh_rejects_key_not_on_mesh(dp_tp_mesh):
    with pytest.raises(ValueError, match="not in mesh") as excinfo:
        resolve_placements({"cp": Shard(0)}, dp_tp_mesh)
    message = str(excinfo.value)
    assert "'cp'" in message
    assert "['dp', 'tp']" in message


def test_resolve_rejects_a_device_mesh_without_axis_names(fake_world):
    unnamed = init_device_mesh("cpu", (4,))
    assert unnamed.mesh_dim_names is None
    with pytest.raises(ValueError) as excinfo:
        resolve_placements({}, unnamed)
    message = str(excinfo.value)
    assert "no mesh_dim_names" in message
    assert "init_device_mesh(..., mesh_dim_names=" in message


# --------------------------------------------------------------------------- config shape


def test_configs_are_keyword_only():
    with pytest.raises(TypeError):
        ShardingConfig({"weight": {"tp": Shard(0)}})
    with pytest.raises(TypeError):
        LocalMapConfig(({"tp": Replicate()},))


def test_local_map_config_requires_in_grad_placements():
    with pytest.raises(TypeError, match="in_grad_placements"):
        LocalMapConfig()


@pytest.mark.parametrize(
    "config",
    [ShardingConfig(), LocalMapConfig(in_grad_placements=())],
    ids=["ShardingConfig", "LocalMapConfig"],
)
def test_configs_are_slotted(config):
    assert "__slots__" in type(config).__dict__
    assert not hasattr(config, "__dict__")
    with pytest.raises(AttributeError):
        config.not_a_field = 1


def test_sharding_config_fields_and_defaults():
    fields = dataclasses.fields(ShardingConfig)
    assert [f.name for f in fields] == [
        "state_shardings",
        "in_src_shardings",
        "in_dst_shardings",
        "out_src_shardings",
        "out_dst_shardings",
        "local_map",
        "use_local_output",
        "dispatch",
    ]
    assert all(f.kw_only for f in fields)
    config = ShardingConfig()
    assert config.state_shardings == {}
    assert config.in_src_shardings is None
    assert config.in_dst_shardings is None
    assert config.out_src_shardings is None
    assert config.out_dst_shardings is None
    assert config.local_map is None
    assert config.use_local_output is False
    assert config.dispatch is None


def test_sharding_config_default_state_shardings_is_not_shared():
    first, second = ShardingConfig(), ShardingConfig()
    first.state_shardings["weight"] = {"tp": Shard(0)}
    assert second.state_shardings == {}


def test_local_map_config_fields():
    fields = dataclasses.fields(LocalMapConfig)
    assert [f.name for f in fields] == ["in_grad_placements"]
    assert fields[0].kw_only


def test_configs_compare_by_value_across_key_spellings():
    by_enum = ShardingConfig(state_shardings={"weight": {MeshAxisName.TP: Shard(0)}})
    by_str = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}})
    assert by_enum == by_str
    assert by_enum != ShardingConfig(state_shardings={"weight": {"tp": Shard(1)}})


# --------------------------------------------------------------------------- type errors


TYPE_ERROR_CASES = [
    pytest.param(
        {"state_shardings": {"weight": {"tp": "Shard(0)"}}},
        ["state_shardings['weight']['tp']", "'Shard(0)'", "expected a Placement such as Shard(0)"],
        id="state-value-is-text",
    ),
    pytest.param(
        {"state_shardings": {"weight": {0: Shard(0)}}},
        ["state_shardings['weight']", "key 0", "MeshAxisName members or axis-name strings"],
        id="state-axis-key-is-int",
    ),
    pytest.param(
        {"state_shardings": {0: {"tp": Shard(0)}}},
        ["state_shardings", "key 0", "keys are state path strings"],
        id="state-path-key-is-int",
    ),
    pytest.param(
        {"state_shardings": {"weight": Shard(0)}},
        ["state_shardings['weight']", "expected a NamedPlacement (a dict mesh axis -> Placement)"],
        id="state-entry-is-bare-placement",
    ),
    pytest.param(
        {"state_shardings": [("weight", {"tp": Shard(0)})]},
        ["state_shardings", "expected a dict state path -> NamedPlacement"],
        id="state-shardings-is-list",
    ),
    pytest.param(
        {"in_src_shardings": {"x": {"tp": "R"}}},
        ["in_src_shardings['x']['tp']", "'R'", "expected a Placement"],
        id="in-src-value-is-text",
    ),
    pytest.param(
        {"in_dst_shardings": {"x": {MeshAxisName.TP: None}}},
        ["in_dst_shardings['x']['tp']", "NoneType", "expected a Placement"],
        id="in-dst-value-is-none",
    ),
    pytest.param(
        {"in_dst_shardings": {1: {"tp": Replicate()}}},
        ["in_dst_shardings", "key 1", "forward argument name strings"],
        id="in-dst-key-is-int",
    ),
    pytest.param(
        {"out_src_shardings": [{"tp": Shard(0)}]},
        ["out_src_shardings", "list", "a NamedPlacement or a tuple of NamedPlacement"],
        id="out-src-is-list",
    ),
    pytest.param(
        {"out_src_shardings": Shard(0)},
        ["out_src_shardings", "Shard", "a NamedPlacement or a tuple of NamedPlacement"],
        id="out-src-is-bare-placement",
    ),
    pytest.param(
        {"out_src_shardings": ({"tp": Shard(0)}, "Shard(0)")},
        ["out_src_shardings[1]", "expected a NamedPlacement"],
        id="out-src-tuple-holds-text",
    ),
    pytest.param(
        {"out_src_shardings": ({"tp": "S(0)"},)},
        ["out_src_shardings[0]['tp']", "'S(0)'", "expected a Placement"],
        id="out-src-tuple-value-is-text",
    ),
    pytest.param(
        {"out_src_shardings": {"tp": 0}},
        ["out_src_shardings['tp']", "int", "expected a Placement"],
        id="out-src-value-is-int",
    ),
    pytest.param(
        {"out_dst_shardings": {"tp": "Shard(-1)"}},
        ["out_dst_shardings['tp']", "'Shard(-1)'", "expected a Placement"],
        id="out-dst-value-is-text",
    ),
    pytest.param(
        {"out_dst_shardings": {0: Shard(-1)}},
        ["out_dst_shardings", "key 0", "MeshAxisName members or axis-name strings"],
        id="out-dst-key-is-int",
    ),
    pytest.param(
        {"local_map": {"in_grad_placements": ()}},
        ["local_map", "expected a LocalMapConfig or None"],
        id="local-map-is-dict",
    ),
    pytest.param(
        {"use_local_output": "yes"},
        ["use_local_output", "expected a bool", "'yes'"],
        id="use-local-output-is-text",
    ),
]


@pytest.mark.parametrize(("kwargs", "fragments"), TYPE_ERROR_CASES)
def test_sharding_config_rejects_wrong_types_naming_field_and_key(kwargs, fragments):
    with pytest.raises(TypeError) as excinfo:
        ShardingConfig(**kwargs)
    message = str(excinfo.value)
    assert message.startswith("ShardingConfig.")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize(
    ("in_grad_placements", "fragments"),
    [
        pytest.param(
            [{"tp": Replicate()}],
            ["in_grad_placements", "list", "expected a tuple of NamedPlacement", "wrap it"],
            id="list",
        ),
        pytest.param(
            {"tp": Replicate()},
            ["in_grad_placements", "expected a tuple of NamedPlacement"],
            id="bare-named-placement",
        ),
        pytest.param(
            ({"tp": "R"},),
            ["in_grad_placements[0]['tp']", "'R'", "expected a Placement"],
            id="value-is-text",
        ),
        pytest.param(
            ({"tp": Replicate()}, {0: Replicate()}),
            ["in_grad_placements[1]", "key 0", "MeshAxisName members or axis-name strings"],
            id="axis-key-is-int",
        ),
    ],
)
def test_local_map_config_rejects_wrong_types_naming_field_and_key(in_grad_placements, fragments):
    with pytest.raises(TypeError) as excinfo:
        LocalMapConfig(in_grad_placements=in_grad_placements)
    message = str(excinfo.value)
    assert message.startswith("LocalMapConfig.")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_sharding_config_accepts_every_valid_shape():
    config = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}, "norm.weight": {}},
        in_src_shardings={"x": {MeshAxisName.DP: Shard(0)}},
        in_dst_shardings={"x": {"tp": Replicate()}},
        out_src_shardings=({"tp": Partial()}, {"tp": Shard(-1)}),
        out_dst_shardings={"tp": Replicate()},
        local_map=LocalMapConfig(in_grad_placements=({"tp": Replicate()},)),
        use_local_output=True,
    )
    assert config.out_src_shardings[0] == {"tp": Partial("sum")}
    assert config.use_local_output is True
    assert ShardingConfig(out_src_shardings={"tp": Shard(0)}).out_src_shardings == {"tp": Shard(0)}
    assert ShardingConfig(out_src_shardings=()).out_src_shardings == ()


# --------------------------------------------------------------------------- to_dict / from_dict


def full_config() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={
            "weight": {MeshAxisName.TP: Shard(0)},
            "bias": {"tp": Shard(0), MeshAxisName.DP: Replicate()},
        },
        in_src_shardings={"x": {"dp": Shard(0)}},
        in_dst_shardings={"x": {MeshAxisName.TP: Replicate()}, "mask": {}},
        out_src_shardings=({"tp": Shard(-1)}, {"tp": Partial("avg")}),
        out_dst_shardings={"tp": Partial()},
        local_map=LocalMapConfig(in_grad_placements=({"tp": Replicate()}, {})),
        use_local_output=True,
    )


def test_sharding_config_to_dict_keeps_repr_and_structured_content():
    config = full_config()
    data = config.to_dict()
    assert data["repr"] == repr(config)
    assert {k: v for k, v in data.items() if k != "repr"} == {
        "state_shardings": {
            "weight": {"tp": "Shard(0)"},
            "bias": {"tp": "Shard(0)", "dp": "Replicate()"},
        },
        "in_src_shardings": {"x": {"dp": "Shard(0)"}},
        "in_dst_shardings": {"x": {"tp": "Replicate()"}, "mask": {}},
        "out_src_shardings": [{"tp": "Shard(-1)"}, {"tp": "Partial(avg)"}],
        "out_dst_shardings": {"tp": "Partial(sum)"},
        "local_map": {
            "repr": repr(config.local_map),
            "in_grad_placements": [{"tp": "Replicate()"}, {}],
        },
        "use_local_output": True,
        "dispatch": None,
    }


def test_to_dict_writes_axes_as_plain_strings():
    data = ShardingConfig(state_shardings={"weight": {MeshAxisName.TP: Shard(0)}}).to_dict()
    (axis,) = data["state_shardings"]["weight"]
    assert type(axis) is str
    assert axis == "tp"


def test_default_sharding_config_to_dict():
    data = ShardingConfig().to_dict()
    assert data["repr"] == repr(ShardingConfig())
    assert data["state_shardings"] == {}
    assert data["out_src_shardings"] is None
    assert data["local_map"] is None
    assert data["use_local_output"] is False


def test_sharding_config_to_dict_is_json_serialisable_and_round_trips():
    config = full_config()
    text = json.dumps(config.to_dict())
    rebuilt = ShardingConfig.from_dict(json.loads(text))
    assert rebuilt == config
    assert isinstance(rebuilt.out_src_shardings, tuple)
    assert isinstance(rebuilt.local_map, LocalMapConfig)
    assert isinstance(rebuilt.local_map.in_grad_placements, tuple)


def test_sharding_config_round_trip_without_json():
    config = full_config()
    assert ShardingConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "config",
    [
        ShardingConfig(),
        ShardingConfig(out_src_shardings={"tp": Shard(1)}),
        ShardingConfig(out_src_shardings=()),
        ShardingConfig(in_dst_shardings={}),
        ShardingConfig(local_map=LocalMapConfig(in_grad_placements=())),
    ],
    ids=["default", "single-out-src", "empty-out-src-tuple", "empty-in-dst", "empty-local-map"],
)
def test_edge_configs_round_trip_through_json(config):
    rebuilt = ShardingConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert rebuilt == config
    assert type(rebuilt.out_src_shardings) is type(config.out_src_shardings)


def test_local_map_config_to_dict_and_round_trip():
    config = LocalMapConfig(
        in_grad_placements=({MeshAxisName.TP: Replicate()}, {"dp": Shard(0), "tp": Partial()})
    )
    data = config.to_dict()
    assert data == {
        "repr": repr(config),
        "in_grad_placements": [
            {"tp": "Replicate()"},
            {"dp": "Shard(0)", "tp": "Partial(sum)"},
        ],
    }
    assert LocalMapConfig.from_dict(json.loads(json.dumps(data))) == config


def test_from_dict_ignores_repr():
    data = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}}).to_dict()
    data["repr"] = "anything at all"
    assert ShardingConfig.from_dict(data) == ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}}
    )


def test_from_dict_fills_missing_keys_with_defaults():
    assert ShardingConfig.from_dict({}) == ShardingConfig()
    config = ShardingConfig.from_dict({"out_dst_shardings": {"tp": "Shard(-1)"}})
    assert config == ShardingConfig(out_dst_shardings={"tp": Shard(-1)})


def test_from_dict_accepts_placement_objects():
    config = ShardingConfig.from_dict({"state_shardings": {"weight": {"tp": Shard(0)}}})
    assert config.state_shardings == {"weight": {"tp": Shard(0)}}


def test_from_dict_rejects_unknown_key_naming_it_and_the_allowed_keys():
    with pytest.raises(ValueError) as excinfo:
        ShardingConfig.from_dict({"state_sharding": {}})
    message = str(excinfo.value)
    assert "'state_sharding'" in message
    assert "allowed keys" in message and "'state_shardings'" in message


def test_from_dict_rejects_a_non_mapping_entry():
    with pytest.raises(TypeError) as excinfo:
        ShardingConfig.from_dict({"state_shardings": {"weight": ["Shard(0)"]}})
    message = str(excinfo.value)
    assert "state_shardings['weight']" in message
    assert "expected a mapping axis -> placement" in message


def test_local_map_from_dict_requires_in_grad_placements():
    with pytest.raises(ValueError) as excinfo:
        LocalMapConfig.from_dict({})
    assert "missing key 'in_grad_placements'" in str(excinfo.value)


def test_from_dict_error_inside_local_map_names_the_field_path():
    with pytest.raises(ValueError) as excinfo:
        ShardingConfig.from_dict({"local_map": {"in_grad_placements": [{"tp": "Q"}]}})
    message = str(excinfo.value)
    assert "local_map: in_grad_placements[0]['tp']" in message
    assert "'Q'" in message


# --------------------------------------------------------------------------- placement text


@pytest.mark.parametrize(
    ("placement", "text"),
    [
        (Shard(0), "Shard(0)"),
        (Shard(-1), "Shard(-1)"),
        (Replicate(), "Replicate()"),
        (Partial(), "Partial(sum)"),
        (Partial("sum"), "Partial(sum)"),
        (Partial("avg"), "Partial(avg)"),
    ],
)
def test_placement_text_forms(placement, text):
    assert placement_to_str(placement) == text
    assert placement_from_str(text) == placement
    data = ShardingConfig(out_dst_shardings={"tp": placement}).to_dict()
    assert data["out_dst_shardings"] == {"tp": text}
    assert ShardingConfig.from_dict({"out_dst_shardings": {"tp": text}}).out_dst_shardings == {
        "tp": placement
    }


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("S(0)", Shard(0)),
        ("S(-1)", Shard(-1)),
        ("R", Replicate()),
        ("P", Partial("sum")),
        ("Partial(max)", Partial("max")),
        ("Partial(min)", Partial("min")),
        # torch's reprs, as a printed DTensor shows them (were refused)
        (repr(Shard(0)), Shard(0)),
        ("Shard(dim = -1)", Shard(-1)),
        (repr(Partial("avg")), Partial("avg")),
        ("Partial(reduce_op=sum)", Partial("sum")),
    ],
)
def test_short_placement_forms_are_accepted(text, placement):
    assert placement_from_str(text) == placement
    config = ShardingConfig.from_dict({"state_shardings": {"weight": {"tp": text}}})
    assert config.state_shardings == {"weight": {"tp": placement}}


@pytest.mark.parametrize(
    "text",
    ["Shard(zero)", "shard(0)", "Shard(0", "S0", "Replicated", "X", "", "Shard(1.5)"],
)
def test_invalid_placement_text_is_rejected_quoting_it(text):
    with pytest.raises(ValueError) as excinfo:
        placement_from_str(text)
    message = str(excinfo.value)
    assert repr(text) in message
    assert "write Shard(<dim>), Replicate() or Partial(<op>)" in message


def test_invalid_partial_reduce_op_is_rejected_naming_the_allowed_ops():
    with pytest.raises(ValueError) as excinfo:
        placement_from_str("Partial(mean)")
    message = str(excinfo.value)
    assert "'Partial(mean)'" in message
    assert "'mean'" in message
    assert "'sum'" in message and "'avg'" in message


def test_invalid_placement_text_in_from_dict_names_the_entry():
    with pytest.raises(ValueError) as excinfo:
        ShardingConfig.from_dict({"in_dst_shardings": {"x": {"tp": "Shard(zero)"}}})
    message = str(excinfo.value)
    assert "in_dst_shardings['x']['tp']" in message
    assert "'Shard(zero)'" in message


def test_placement_text_must_be_a_string():
    with pytest.raises(TypeError) as excinfo:
        placement_from_str(0)
    assert "placement text must be a str" in str(excinfo.value)
