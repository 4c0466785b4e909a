"""Unit tests for ``hyper_parallel.config.Configurable``."""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from hyper_parallel.config import Configurable


class Norm(enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class Attention(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        num_heads: int = 2
        dtype: torch.dtype = torch.float32

    def __init__(self, config: Attention.Config) -> None:
        self.config = config


class Block(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        dim: int = 4
        act: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu
        norm: Norm = Norm.RMS
        attention: Attention.Config = field(default_factory=Attention.Config)

    def __init__(self, config: Block.Config, *, device: str | None = None) -> None:
        self.config = config
        self.device = device
        self.attention = config.attention.build()


class Model(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        layers: list[Block.Config] = field(default_factory=list)
        extras: dict[str, Attention.Config] = field(default_factory=dict)

    def __init__(self, config: Model.Config) -> None:
        self.config = config


class WideBlock(Block):
    @dataclass(kw_only=True, slots=True)
    class Config(Block.Config):
        width: int = 8


def _model() -> Model.Config:
    return Model.Config(
        layers=[Block.Config(), Block.Config(dim=8)],
        extras={"cross": Attention.Config(num_heads=4)},
    )


def test_build_constructs_owner_from_a_copy() -> None:
    config = Block.Config(dim=6)
    block = config.build()
    assert isinstance(block, Block)
    assert block.config == config
    assert block.config is not config
    config.dim = 99
    config.attention.num_heads = 99
    assert block.config.dim == 6
    assert block.config.attention.num_heads == 2
    assert isinstance(block.attention, Attention)


def test_build_passes_runtime_kwargs() -> None:
    assert Block.Config().build(device="meta").device == "meta"


def test_build_rejects_runtime_kwargs_that_are_fields() -> None:
    with pytest.raises(ValueError, match=r"\['dim'\].*replace\(dim=\.\.\.\)"):
        Block.Config().build(dim=3, device="cpu")


def test_base_config_cannot_be_built() -> None:
    with pytest.raises(TypeError, match="not declared as `Config`"):
        Configurable.Config().build()


def test_config_subclass_outside_an_owner_cannot_be_built() -> None:
    @dataclass(kw_only=True, slots=True)
    class Loose(Block.Config):
        extra: int = 0

    with pytest.raises(TypeError, match="Loose cannot be built"):
        Loose().build()


def test_subclass_config_builds_subclass_and_inherited_config_builds_parent() -> None:
    wide = WideBlock.Config(width=16).build()
    assert type(wide) is WideBlock and wide.config.width == 16

    class PlainBlock(Block):
        pass

    assert PlainBlock.Config is Block.Config
    assert type(PlainBlock.Config().build()) is Block


def test_replace_changes_fields_and_rejects_unknown() -> None:
    config = Block.Config()
    changed = config.replace(dim=16)
    assert changed.dim == 16 and config.dim == 4
    assert changed.attention == config.attention
    with pytest.raises(TypeError, match=r"\['dims'\].*has: dim, act, norm, attention"):
        config.replace(dims=16)


def test_to_dict_is_json_serialisable_and_names_callables() -> None:
    config = Block.Config(act=functools.partial(torch.nn.functional.silu, inplace=True))
    data = Model.Config(layers=[Block.Config(), config], extras={"x": Attention.Config()}).to_dict()
    json.dumps(data)
    first = data["layers"][0]
    assert first == {
        "dim": 4,
        "act": "torch.nn.functional.silu",
        "norm": "rms",
        "attention": {"num_heads": 2, "dtype": "torch.float32"},
    }
    assert data["layers"][1]["act"] == ("functools.partial(torch.nn.functional.silu, inplace=True)")
    assert data["extras"] == {"x": {"num_heads": 2, "dtype": "torch.float32"}}


def test_to_dict_converts_classes_builtins_tuples_and_others() -> None:
    @dataclass(kw_only=True, slots=True)
    class Other:
        value: object = None

    class Holder(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            items: tuple[object, ...] = ()

    data = Holder.Config(
        items=(torch.relu, Block, (1, 2), {1: Norm.LAYER}, Other(value=1.5), object)
    ).to_dict()
    json.dumps(data)
    assert data["items"] == [
        "torch.relu",
        f"{__name__}.Block",
        [1, 2],
        {"1": "layer"},
        {"value": 1.5},
        "builtins.object",
    ]


def test_traverse_paths_through_fields_lists_and_dicts() -> None:
    model = _model()
    found = [(path, key) for path, _, _, key in model.traverse(Attention.Config)]
    assert found == [
        ("layers.0.attention", "attention"),
        ("layers.1.attention", "attention"),
        ("extras.cross", "cross"),
    ]
    blocks = [path for path, *_ in model.traverse(Block.Config)]
    assert blocks == ["layers.0", "layers.1"]


def test_traverse_yields_root_first() -> None:
    model = _model()
    path, config, parent, key = next(model.traverse(Configurable.Config))
    assert (path, config, parent, key) == ("", model, None, None)
    paths = [path for path, *_ in model.traverse(Configurable.Config)]
    assert paths == [
        "",
        "layers.0",
        "layers.0.attention",
        "layers.1",
        "layers.1.attention",
        "extras.cross",
    ]


def test_traverse_allows_in_place_replacement() -> None:
    model = _model()
    for _, config, parent, key in model.traverse(Block.Config):
        parent[key] = WideBlock.Config(dim=config.dim, attention=Attention.Config(num_heads=8))
    for _, config, parent, key in model.traverse(Attention.Config):
        if isinstance(parent, dict):
            parent[key] = config.replace(num_heads=1)
        else:
            setattr(parent, key, config.replace(num_heads=config.num_heads * 2))
    assert [type(b) for b in model.layers] == [WideBlock.Config, WideBlock.Config]
    assert [b.dim for b in model.layers] == [4, 8]
    # The walk descended into the replacement blocks, not the originals.
    assert [b.attention.num_heads for b in model.layers] == [16, 16]
    assert model.extras["cross"].num_heads == 1


def test_config_not_subclassing_parent_config_is_rejected() -> None:
    with pytest.raises(
        TypeError, match=r"Bad\.Config must subclass Block\.Config.*class Config\(Block\.Config\)"
    ):

        class Bad(Block):
            @dataclass(kw_only=True, slots=True)
            class Config(Configurable.Config):
                dim: int = 4


def test_config_must_be_slotted_keyword_only_dataclass() -> None:
    with pytest.raises(TypeError, match=r"@dataclass\(kw_only=True, slots=True\)"):

        class NotDataclass(Configurable):
            class Config(Configurable.Config):
                pass

    with pytest.raises(TypeError, match=r"\['size'\] are positional"):

        class Positional(Configurable):
            @dataclass(slots=True)
            class Config(Configurable.Config):
                size: int = 1


def test_config_cannot_be_shared_by_two_owners() -> None:
    with pytest.raises(TypeError, match="already belongs to Attention"):

        class Thief(Configurable):
            Config = Attention.Config
