"""Plan files: YAML/JSON round trip, no code execution, errors that name the entry."""

from __future__ import annotations

import json

import pytest
import yaml

from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule.plan_file import dump_plan, load_plan, plan_from_dict, plan_to_dict
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName


def sample_plan() -> dict[str, ShardingConfig]:
    return {
        "layers.*.attention.wq": ShardingConfig(
            state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
            in_dst_shardings={"x": {"tp": Replicate()}},
            out_dst_shardings={"tp": Shard(-1)},
        ),
        "layers.*.attention.wo": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(1)}},
            out_src_shardings={"tp": Partial()},
            out_dst_shardings={"tp": Replicate()},
        ),
        "layers.*.feed_forward": ShardingConfig(
            state_shardings={"w1.weight": {"tp": Shard(0)}, "norm.weight": {}},
            out_src_shardings=({"tp": Shard(-1)}, {"dp": Partial("avg")}),
            local_map=LocalMapConfig(in_grad_placements=({"tp": Replicate()},)),
            use_local_output=True,
        ),
        "*": ShardingConfig(),
    }


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_dump_then_load_round_trips(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    plan = sample_plan()
    dump_plan(plan, path)
    loaded = load_plan(path)
    assert loaded == plan
    assert list(loaded) == list(plan)  # entry order is kept
    assert load_plan(str(path)) == plan  # str paths work too


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_dumped_file_holds_plain_data_with_placements_as_text(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    dump_plan(sample_plan(), path)
    text = path.read_text()
    assert "!!" not in text  # no YAML tags
    assert "repr" not in text
    data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    assert data["layers.*.attention.wq"] == {
        "state_shardings": {"weight": {"tp": "Shard(0)"}},
        "in_dst_shardings": {"x": {"tp": "Replicate()"}},
        "out_dst_shardings": {"tp": "Shard(-1)"},
    }
    assert data["layers.*.feed_forward"]["out_src_shardings"] == [
        {"tp": "Shard(-1)"},
        {"dp": "Partial(avg)"},
    ]
    assert data["layers.*.feed_forward"]["use_local_output"] is True
    assert data["*"] == {}  # defaults are left out


def test_plan_to_dict_and_back():
    plan = sample_plan()
    data = plan_to_dict(plan)
    assert json.loads(json.dumps(data)) == data
    assert plan_from_dict(data) == plan


def test_hand_written_yaml_with_short_forms_loads(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "layers.*.attention.wq:\n"
        "  state_shardings: {weight: {tp: S(0)}, bias: {tp: 'Shard(0)'}}\n"
        "  in_dst_shardings: {x: {tp: R}}\n"
        "  out_src_shardings: {tp: P}\n"
        "  out_dst_shardings: {tp: Replicate()}\n"
        "norm:\n"
    )
    assert load_plan(path) == {
        "layers.*.attention.wq": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
            in_dst_shardings={"x": {"tp": Replicate()}},
            out_src_shardings={"tp": Partial("sum")},
            out_dst_shardings={"tp": Replicate()},
        ),
        "norm": ShardingConfig(),
    }


def test_hand_written_json_loads(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps(
            {
                "lm_head": {
                    "state_shardings": {"weight": {"tp": "Shard(0)"}},
                    "out_src_shardings": [{"tp": "S(-1)"}],
                    "local_map": {"in_grad_placements": [{"tp": "R"}]},
                }
            }
        )
    )
    assert load_plan(path) == {
        "lm_head": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}},
            out_src_shardings=({"tp": Shard(-1)},),
            local_map=LocalMapConfig(in_grad_placements=({"tp": Replicate()},)),
        )
    }


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_empty_file_is_an_empty_plan(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    path.write_text("" if suffix == ".yaml" else "{}")
    assert load_plan(path) == {}


# --------------------------------------------------------------------------- no code execution


UNSAFE_YAML = [
    pytest.param('layers.0: !!python/object/apply:os.system ["touch {marker}"]\n', id="apply"),
    pytest.param("layers.0: !!python/name:os.system\n", id="name"),
    pytest.param(
        "layers.0:\n"
        '  state_shardings: {{weight: {{tp: !!python/object/apply:os.system ["touch {marker}"]}}}}\n',
        id="apply-nested-in-placement",
    ),
    pytest.param(
        '!!python/object/new:os.system ["touch {marker}"]\n',
        id="new-at-top-level",
    ),
]


@pytest.mark.parametrize("template", UNSAFE_YAML)
def test_yaml_python_tags_are_rejected_and_nothing_runs(tmp_path, template):
    marker = tmp_path / "pwned"
    path = tmp_path / "plan.yaml"
    path.write_text(template.format(marker=marker))
    with pytest.raises(ValueError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert "tag not allowed" in message
    assert "python/" in message  # names the offending tag
    assert "plain data only" in message
    assert not marker.exists()


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("suffix", [".txt", ".toml", ""])
def test_unknown_suffix_is_rejected(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    with pytest.raises(ValueError) as excinfo:
        dump_plan(sample_plan(), path)
    message = str(excinfo.value)
    assert f"unknown suffix {suffix!r}" in message
    assert "use .yaml, .yml or .json" in message
    assert not path.exists()

    path.write_text("{}")
    with pytest.raises(ValueError, match=r"use \.yaml, \.yml or \.json"):
        load_plan(path)


@pytest.mark.parametrize(
    ("suffix", "text", "field_path", "bad"),
    [
        (
            ".yaml",
            "layers.0.attention.wq:\n  state_shardings: {weight: {tp: Shard(x)}}\n",
            "state_shardings['weight']['tp']",
            "'Shard(x)'",
        ),
        (
            ".yml",
            "layers.0.attention.wq:\n  out_src_shardings: [{tp: R}, {tp: Sharded}]\n",
            "out_src_shardings[1]['tp']",
            "'Sharded'",
        ),
        (
            ".yaml",
            "layers.0.attention.wq:\n  local_map: {in_grad_placements: [{tp: Q}]}\n",
            "local_map: in_grad_placements[0]['tp']",
            "'Q'",
        ),
        (
            ".json",
            '{"layers.0.attention.wq": {"in_dst_shardings": {"x": {"tp": "Partial(mean)"}}}}',
            "in_dst_shardings['x']['tp']",
            "'Partial(mean)'",
        ),
    ],
)
def test_invalid_placement_in_file_names_the_entry(tmp_path, suffix, text, field_path, bad):
    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert "entry 'layers.0.attention.wq'" in message
    assert field_path in message
    assert bad in message


def test_unknown_key_in_file_names_the_entry_and_allowed_keys(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("lm_head:\n  state_sharding: {weight: {tp: S(0)}}\n")
    with pytest.raises(ValueError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert "entry 'lm_head'" in message
    assert "'state_sharding'" in message
    assert "allowed keys" in message


def test_wrong_shape_in_file_names_the_entry(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("lm_head:\n  state_shardings: {weight: [Shard(0)]}\n")
    with pytest.raises(TypeError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert "entry 'lm_head'" in message
    assert "state_shardings['weight']" in message


@pytest.mark.parametrize(
    ("suffix", "text"),
    [(".yaml", "lm_head: {state_shardings: [\n"), (".json", '{"lm_head": ')],
)
def test_syntax_error_is_a_value_error_naming_the_file(tmp_path, suffix, text):
    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert "cannot parse" in message


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("- lm_head\n- norm\n")
    with pytest.raises(ValueError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert "expected a mapping of module path -> sharding config" in message


def test_dump_rejects_a_value_that_is_not_a_sharding_config(tmp_path):
    path = tmp_path / "plan.yaml"
    with pytest.raises(TypeError) as excinfo:
        dump_plan({"lm_head": {"state_shardings": {}}}, path)
    message = str(excinfo.value)
    assert "plan['lm_head']" in message
    assert "expected a ShardingConfig" in message
    assert not path.exists()


@pytest.mark.parametrize(
    ("suffix", "text", "key"),
    [
        # Two entries for one module: yaml.safe_load / json kept the second silently.
        (
            ".yaml",
            "'2':\n  state_shardings: {weight: {tp: S(1)}}\n'2':\n  use_local_output: true\n",
            "'2'",
        ),
        (".json", '{"2": {"state_shardings": {"weight": {"tp": "S(1)"}}}, "2": {}}', "'2'"),
        # ... and a state named twice inside one entry.
        (".yaml", "up:\n  state_shardings: {weight: {tp: S(0)}, weight: {tp: R}}\n", "'weight'"),
    ],
    ids=["yaml-entry", "json-entry", "yaml-state"],
)
def test_a_key_given_twice_is_refused_naming_it(tmp_path, suffix, text, key):
    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        load_plan(path)
    message = str(excinfo.value)
    assert str(path) in message and f"key {key} is given twice" in message, message
    if suffix == ".yaml":  # where: both lines, or one line's columns (flow style)
        assert "lines 1 and 3" in message or "line 2, columns 21 and 41" in message, message


def test_an_entry_of_only_its_repr_is_refused_not_read_as_empty(tmp_path):
    """to_dict writes a 'repr' beside the fields; an entry holding only the repr was read
    as ShardingConfig() (every state replicated), silently."""
    from hyper_parallel.dmodule import colwise

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"0": {"repr": colwise().to_dict()["repr"]}}))
    with pytest.raises(ValueError, match=r"entry '0': .*holds only 'repr'.*not read"):
        load_plan(path)
    # The repr of an empty config is what it says; the full to_dict form still loads.
    assert ShardingConfig.from_dict({"repr": repr(ShardingConfig())}) == ShardingConfig()
    assert ShardingConfig.from_dict(colwise().to_dict()) == colwise()


def test_hardware_files_and_json_options_refuse_a_key_given_twice(tmp_path):
    import argparse

    from hyper_parallel.analysis.cost_model import load_hardware
    from hyper_parallel.train.arguments import json_object

    path = tmp_path / "hw.yaml"
    path.write_text("memory_bytes: 16e9\npeak_flops: 1e14\nmemory_bytes: 80e9\n")
    with pytest.raises(ValueError, match=r"hardware file .*key 'memory_bytes' is given twice"):
        load_hardware(path)
    with pytest.raises(argparse.ArgumentTypeError, match="key 'num_layers' is given twice"):
        json_object('{"num_layers": 2, "num_layers": 4}')
