"""Property tests: placement resolution and the config dict round trip."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.dmodule.plan_file import plan_from_dict, plan_to_dict
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig, resolve_placements
from hyper_parallel.dmodule.types import MeshAxisName

FAST = settings(max_examples=150, deadline=None)

placements = st.one_of(
    st.builds(Shard, st.integers(min_value=-3, max_value=3)),
    st.just(Replicate()),
    st.builds(Partial, st.sampled_from(["sum", "avg", "max", "min"])),
)

axis_names = st.one_of(
    st.sampled_from([axis.value for axis in MeshAxisName]),
    st.from_regex(r"[a-z][a-z0-9_]{0,9}", fullmatch=True),
)

meshes = st.lists(axis_names, unique=True, max_size=6).map(tuple)


def as_key(name: str, use_enum: bool) -> MeshAxisName | str:
    """The key a user might write for an axis: the enum member when there is one."""
    if use_enum and name in MeshAxisName._value2member_map_:
        return MeshAxisName(name)
    return name


@st.composite
def mesh_and_named(draw):
    mesh = draw(meshes)
    chosen = draw(st.lists(st.booleans(), min_size=len(mesh), max_size=len(mesh)))
    expected = {}
    named = {}
    for axis, is_named in zip(mesh, chosen):
        if is_named:
            placement = draw(placements)
            expected[axis] = placement
            named[as_key(axis, draw(st.booleans()))] = placement
    return mesh, named, expected


@FAST
@given(mesh_and_named())
def test_resolution_follows_the_mesh(case):
    mesh, named, expected = case
    result = resolve_placements(named, mesh)
    assert isinstance(result, list)
    assert len(result) == len(mesh)
    for axis, placement in zip(mesh, result):
        assert isinstance(placement, Placement)
        assert placement == expected.get(axis, Replicate())
        if axis in expected:
            assert placement is expected[axis]


@FAST
@given(mesh_and_named(), st.data())
def test_resolution_rejects_any_key_not_on_the_mesh(case, data):
    mesh, named, _ = case
    extra_keys = data.draw(
        st.lists(
            st.one_of(axis_names, axis_names.map(str.upper), st.text(max_size=8)).filter(
                lambda key: key not in mesh
            ),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    bad_named = dict(named)
    for key in extra_keys:
        bad_named[as_key(key, data.draw(st.booleans()))] = data.draw(placements)
    with pytest.raises(ValueError) as excinfo:
        resolve_placements(bad_named, mesh)
    message = str(excinfo.value)
    assert "not in mesh" in message
    for key in extra_keys:
        assert repr(key) in message
    assert repr(list(mesh)) in message


def without_repr(data: dict) -> dict:
    out = {k: v for k, v in data.items() if k != "repr"}
    if out.get("local_map") is not None:
        out["local_map"] = without_repr(out["local_map"])
    return out


named_placements = st.dictionaries(
    st.one_of(axis_names, st.sampled_from(list(MeshAxisName))), placements, max_size=4
)
name_maps = st.dictionaries(st.text(max_size=12), named_placements, max_size=3)
local_maps = st.builds(
    LocalMapConfig, in_grad_placements=st.lists(named_placements, max_size=3).map(tuple)
)
configs = st.builds(
    ShardingConfig,
    state_shardings=name_maps,
    in_src_shardings=st.none() | name_maps,
    in_dst_shardings=st.none() | name_maps,
    out_src_shardings=st.one_of(
        st.none(), named_placements, st.lists(named_placements, max_size=3).map(tuple)
    ),
    out_dst_shardings=st.none() | named_placements,
    local_map=st.none() | local_maps,
    use_local_output=st.booleans(),
)


@FAST
@given(configs)
def test_any_config_survives_the_json_round_trip(config):
    data = config.to_dict()
    assert data["repr"] == repr(config)
    rebuilt = ShardingConfig.from_dict(json.loads(json.dumps(data)))
    assert rebuilt == config
    assert type(rebuilt.out_src_shardings) is type(config.out_src_shardings)
    # The structured content is stable; only "repr" may differ (enum keys come back as str).
    assert without_repr(rebuilt.to_dict()) == without_repr(json.loads(json.dumps(data)))


@FAST
@given(local_maps)
def test_any_local_map_config_survives_the_json_round_trip(config):
    data = config.to_dict()
    assert data["repr"] == repr(config)
    assert LocalMapConfig.from_dict(json.loads(json.dumps(data))) == config


@FAST
@given(st.dictionaries(st.text(min_size=1, max_size=12), configs, max_size=3))
def test_any_plan_survives_the_yaml_round_trip(plan):
    text = yaml.safe_dump(plan_to_dict(plan), sort_keys=False)
    assert plan_from_dict(yaml.safe_load(text)) == plan
