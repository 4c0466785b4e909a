"""Whole models: ``BaseModel``, ``ModelConfigConverter`` and the ``ModelSpec`` registry."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel.dmodule import (
    BaseModel,
    ModelConfigConverter,
    ModelFamily,
    ModelSpec,
    Module,
    family_of,
    get_spec,
    list_specs,
    register_spec,
)

Linear = Module.from_nn_module(nn.Linear)
_ids = itertools.count()


def _unique(prefix: str) -> str:
    """A registry name no other test uses (the registry is process-wide)."""
    return f"test-{prefix}-{next(_ids)}"


class Tiny(BaseModel):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        dim: int = 4
        plain_leaf: bool = False

    def __init__(self, config: Tiny.Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(  # a plain container without states is fine
            [Linear(config.dim, config.dim), Linear(config.dim, config.dim)]
        )
        self.blocks = nn.Sequential(nn.ReLU())
        if config.plain_leaf:
            self.layers.append(nn.Linear(config.dim, config.dim))
            self.blocks.append(nn.LayerNorm(config.dim))
            self.blocks[0].register_buffer("mask", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.blocks(x)


# --------------------------------------------------------------------------- BaseModel


def test_verify_module_protocol_accepts_modules_and_stateless_wrappers():
    Tiny.Config().build().verify_module_protocol()


def test_verify_module_protocol_names_each_offending_path():
    model = Tiny.Config(plain_leaf=True).build()
    with pytest.raises(TypeError) as info:
        model.verify_module_protocol()
    message = str(info.value)
    for path in ("layers.2 (Linear)", "blocks.0 (ReLU)", "blocks.1 (LayerNorm)"):
        assert path in message
    assert "layers.0" not in message and "layers.1" not in message
    assert "Module.from_nn_module(cls)" in message


def test_init_weights_initializes_every_state():
    model = Tiny.Config().build()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(123.0)
    torch.manual_seed(0)
    model.init_weights()
    assert all((p != 123.0).all() for p in model.parameters())


class ToTiny(ModelConfigConverter[dict, Tiny.Config]):
    def convert(self, source: dict) -> Tiny.Config:
        return Tiny.Config(dim=source["hidden_size"])


def test_model_config_converter():
    converter = ToTiny()
    assert converter({"hidden_size": 6}) == Tiny.Config(dim=6)
    assert converter.convert({"hidden_size": 2}).build().layers[0].in_features == 2
    with pytest.raises(TypeError):
        ModelConfigConverter()  # type: ignore[abstract]


# --------------------------------------------------------------------------- ModelSpec


def test_model_spec_needs_exactly_one_of_build_fn_and_model():
    with pytest.raises(ValueError, match=r"exactly one of build_model_fn and model.*neither"):
        ModelSpec(name="x")
    with pytest.raises(ValueError, match=r"exactly one of build_model_fn and model.*both"):
        ModelSpec(name="x", build_model_fn=Tiny.Config, model=Tiny.Config())
    with pytest.raises(ValueError, match="non-empty string"):
        ModelSpec(name="", model=Tiny.Config())


def test_spec_builds_from_a_config_a_function_or_an_instance():
    from_config = ModelSpec(name="a", model=Tiny.Config(dim=3))
    assert from_config.build().layers[0].in_features == 3
    assert from_config.build(dim=5).layers[0].in_features == 5  # overrides replace fields

    def factory(**overrides: Any) -> Tiny.Config:
        return Tiny.Config(**{"dim": 2, **overrides})

    from_fn = ModelSpec(name="b", build_model_fn=factory)
    assert from_fn.config(dim=7) == Tiny.Config(dim=7)
    assert isinstance(from_fn.build(), Tiny)
    instance = Tiny.Config().build()
    assert ModelSpec(name="c", model=instance).build() is instance
    with pytest.raises(ValueError, match=r"holds a built model.*\['dim'\]"):
        ModelSpec(name="c", model=instance).build(dim=3)


def test_register_and_get_spec():
    name = _unique("tiny")
    spec = ModelSpec(name=name, model=Tiny.Config(), description="a tiny model")
    assert register_spec(spec) is spec
    assert get_spec(name) is spec
    assert name in list_specs()


def test_register_spec_duplicate_is_an_error():
    name = _unique("dup")
    register_spec(ModelSpec(name=name, model=Tiny.Config()))
    with pytest.raises(ValueError, match=f"{name!r} is already registered"):
        register_spec(ModelSpec(name=name, model=Tiny.Config(dim=8)))
    assert get_spec(name).model == Tiny.Config()  # the first one stays
    with pytest.raises(TypeError, match="expected a ModelSpec"):
        register_spec(Tiny.Config())  # type: ignore[arg-type]


def test_get_spec_unknown_lists_known_names():
    known = _unique("known")
    register_spec(ModelSpec(name=known, model=Tiny.Config()))
    with pytest.raises(ValueError) as info:
        get_spec("no-such-model")
    message = str(info.value)
    assert "'no-such-model'" in message and known in message
    assert all(n in message for n in list_specs())


# --------------------------------------------------------------------------- ModelFamily


def test_a_family_without_an_axis_is_refused_naming_the_model_and_the_axis():
    family = ModelFamily(name="tiny", axis_refusals={"cp": "it has no sequence"})
    spec = ModelSpec(name=_unique("fam"), model=Tiny.Config(), family=family)
    with pytest.raises(ValueError, match=rf"model '{spec.name}' does not support cp \(it has no"):
        spec.sharding("cp")
    with pytest.raises(ValueError, match=r"does not support tp_sp \(its family declares no .*"):
        spec.sharding("tp", sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"model '{spec.name}' declares no pipeline stages"):
        spec.pipeline()
    with pytest.raises(ValueError, match="'dp' is not a model axis"):
        family.sharding("dp")
    assert ModelSpec(name="d", model=Tiny.Config()).family == ModelFamily()  # declares nothing


def test_family_fields_are_checked_where_they_are_written():
    with pytest.raises(TypeError, match=r"ModelFamily 'f': tp must be a sharding function"):
        ModelFamily(name="f", tp="apply_tp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"axis_refusals names \['pp'\]"):
        ModelFamily(name="f", axis_refusals={"pp": "no"})
    with pytest.raises(ValueError, match=r"\['tp'\] have a sharding function and a refusal"):
        ModelFamily(name="f", tp=lambda c: c, axis_refusals={"tp": "no"})
    with pytest.raises(TypeError, match=r"expert_paths must be a tuple.*\('a\.\*\.b',\)"):
        ModelFamily(name="f", expert_paths="a.*.b")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="family must be a ModelFamily"):
        ModelSpec(name="x", model=Tiny.Config(), family={"tp": None})  # type: ignore[arg-type]


def test_family_declares_blocks_and_expert_paths_by_name():
    model = Tiny.Config().build()
    family = ModelFamily(name="tiny", blocks="layers", expert_paths=("layers.*",))
    assert [p for p, _ in family.blocks_of(model)] == ["layers.0", "layers.1"]
    assert [p for p, _ in family.expert_modules(model)] == ["layers.0", "layers.1"]
    with pytest.raises(ValueError, match=r"family 'other': Tiny has no blocks \(.*'stack'"):
        ModelFamily(name="other", blocks="stack").blocks_of(model)


def test_family_of_finds_a_registered_family_by_config_class():
    class Lone(BaseModel):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            dim: int = 2

        def __init__(self, config: Lone.Config) -> None:
            super().__init__()

    assert family_of(Lone.Config()) is None
    family = ModelFamily(name="lone")
    register_spec(ModelSpec(name=_unique("lone"), model=Lone.Config(), family=family))
    assert family_of(Lone.Config(dim=3)) is family
    assert family_of(Lone.Config().build()) is family
    assert family_of(get_spec("llama3-debug").config()).name == "llama3"


def test_the_trainer_refuses_pp_with_cp_for_a_family_without_a_positions_hook():
    import dataclasses

    from hyper_parallel.train import TrainConfig
    from hyper_parallel.train.trainer import check_config

    llama = get_spec("llama3-debug")
    name = _unique("no-positions")
    family = dataclasses.replace(llama.family, set_positions=None)
    register_spec(ModelSpec(name=name, build_model_fn=llama.build_model_fn, family=family))
    findings = check_config(TrainConfig(model=name, mesh={"pp": 2, "cp": 2}))
    assert [(f.field, f.path) for f in findings] == [("cp", "mesh")]
    assert "declares no set_positions" in findings[0].message
    assert check_config(TrainConfig(model="llama3-debug", mesh={"pp": 2, "cp": 2})) == []
