"""The module runtime in one process: ``Module`` configs, ``init_states``, ``parallelize``.

No real process group: the tests that need a mesh use PyTorch's fake process group,
where collectives are no-ops, so only placements, shapes and local values are checked.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.dmodule import (
    LocalMapConfig,
    Module,
    ModuleDict,
    ModuleList,
    Sequential,
    ShardingConfig,
    fast_path,
)
from tests.distributed.models import PathLog

WORLD_SIZE = 4
Linear = Module.from_nn_module(nn.Linear)


# --------------------------------------------------------------------------- Config rules


def test_config_must_be_a_slotted_kw_only_dataclass():
    with pytest.raises(TypeError, match="slotted dataclass"):

        class NotADataclass(Module):
            class Config(Module.Config):
                size: int = 1

    with pytest.raises(TypeError, match="slotted dataclass"):

        class NoSlots(Module):
            @dataclass(kw_only=True)
            class Config(Module.Config):
                size: int = 1

    with pytest.raises(TypeError, match="keyword-only"):

        class Positional(Module):
            @dataclass(slots=True)
            class Config(Module.Config):
                size: int = 1

    with pytest.raises(TypeError, match=r"must subclass .*Module\.Config"):

        class NotAModuleConfig(Module):
            @dataclass(kw_only=True, slots=True)
            class Config:
                size: int = 1


class Scale(Module):
    """``x * weight``, one parameter, initialized only through ``param_init``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        size: int = 4

    def __init__(self, config: Scale.Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_build_attaches_param_init_and_sharding_config():
    sharding = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}})
    config = Scale.Config(size=3, param_init={"weight": nn.init.zeros_}, sharding_config=sharding)
    module = config.build()
    assert isinstance(module, Scale) and module.weight.shape == (3,)
    assert module.sharding_config == sharding
    assert module.sharding_config is not sharding  # built from a copy of the config
    assert module.param_init == {"weight": nn.init.zeros_}
    assert Scale.Config().build().sharding_config is None


def test_sharding_config_and_param_init_are_read_only():
    module = Scale.Config(sharding_config=ShardingConfig()).build()
    with pytest.raises(AttributeError):
        module.sharding_config = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}})
    with pytest.raises(AttributeError):
        module.param_init = {}
    assert module.sharding_config == ShardingConfig()


def test_runtime_kwargs_must_not_repeat_config_fields():
    config = Linear.Config(in_features=2, out_features=3)
    with pytest.raises(ValueError, match=r"\['in_features'\]"):
        config.build(in_features=5)
    # device and dtype are runtime arguments, not fields.
    on_meta = config.build(device="meta", dtype=torch.float64)
    assert on_meta.weight.is_meta and on_meta.weight.dtype == torch.float64


# --------------------------------------------------------------------------- nn classes


def test_from_nn_module_is_cached_and_mixes_both_classes():
    assert Module.from_nn_module(nn.Linear) is Linear
    assert issubclass(Linear, nn.Linear) and issubclass(Linear, Module)
    fields = [f.name for f in dataclasses.fields(Linear.Config)]
    assert fields == ["param_init", "sharding_config", "in_features", "out_features", "bias"]
    assert Module.from_nn_module(Scale) is Scale  # already a Module
    with pytest.raises(TypeError, match=r"expected an nn\.Module subclass"):
        Module.from_nn_module(torch.Tensor)  # type: ignore[arg-type]
    layer = Linear.Config(in_features=2, out_features=3, bias=False).build()
    assert isinstance(layer, nn.Linear) and layer.bias is None


def test_containers_are_modules():
    for cls, base in ((ModuleList, nn.ModuleList), (ModuleDict, nn.ModuleDict)):
        assert issubclass(cls, Module) and issubclass(cls, base)
    assert issubclass(Sequential, Module) and issubclass(Sequential, nn.Sequential)
    seq = Sequential(Linear(2, 3), nn.ReLU(), Linear(3, 1))
    assert seq(torch.ones(5, 2)).shape == (5, 1)
    layers = ModuleList([Scale.Config().build() for _ in range(2)])
    assert len(layers) == 2 and isinstance(layers, Module)


class Embedding(nn.Embedding, Module):
    """Declared the way a user would mix an nn class in."""


def test_mixing_an_nn_class_into_module_works():
    fields = [f.name for f in dataclasses.fields(Embedding.Config)]
    assert fields[:4] == ["param_init", "sharding_config", "num_embeddings", "embedding_dim"]
    sharding = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}})
    emb = Embedding.Config(
        num_embeddings=10, embedding_dim=4, padding_idx=0, sharding_config=sharding
    ).build()
    assert isinstance(emb, nn.Embedding) and isinstance(emb, Module)
    assert emb.sharding_config == sharding and emb.padding_idx == 0
    assert emb(torch.tensor([[1, 2]])).shape == (1, 2, 4)
    assert Embedding.Config(num_embeddings=3, embedding_dim=2).to_dict()["embedding_dim"] == 2


# --------------------------------------------------------------------------- init_states


class Core(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        size: int = 3

    def __init__(self, config: Core.Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.size))
        self.gate = nn.Parameter(torch.ones(config.size))


class Block(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        core: Module.Config = dataclasses.field(default_factory=Core.Config)

    def __init__(self, config: Block.Config) -> None:
        super().__init__()
        self.core = config.core.build()


class Net(Module):
    """``blocks.<i>.core`` under a plain ``nn.Sequential``, plus a plain ``nn.Linear``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        blocks: list[Module.Config] = dataclasses.field(default_factory=list)

    def __init__(self, config: Net.Config) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(c.build() for c in config.blocks))
        self.head = nn.Linear(3, 2)
        self.bias = nn.Parameter(torch.zeros(2))


def _net(core_init: dict | None, net_init: dict | None = None) -> Net:
    cores = [Core.Config(param_init=core_init), Core.Config(param_init=core_init)]
    return Net.Config(blocks=[Block.Config(core=c) for c in cores], param_init=net_init).build()


def test_init_states_missing_initializer_names_module_path_and_parameter():
    net = _net({"weight": nn.init.zeros_}, {"bias": nn.init.zeros_})
    with pytest.raises(ValueError) as info:
        net.init_states()
    message = str(info.value)
    assert message.startswith("blocks.0.core: Core has no initializer")
    assert "['gate']" in message and "Config.param_init" in message


def test_init_states_children_first_through_plain_wrappers():
    order: list[str] = []

    def record(name: str, value: float):
        def init(t: torch.Tensor) -> None:
            order.append(name)
            nn.init.constant_(t, value)

        return init

    net = _net(
        {"weight": record("core.weight", 2.0), "gate": record("core.gate", 3.0)},
        {"bias": record("net.bias", 5.0)},
    )
    with torch.no_grad():
        net.head.weight.fill_(100.0)
    torch.manual_seed(0)
    net.init_states()
    assert order == ["core.weight", "core.gate"] * 2 + ["net.bias"]
    assert torch.equal(net.blocks[1].core.weight, torch.full((3,), 2.0))
    assert torch.equal(net.blocks[0].core.gate, torch.full((3,), 3.0))
    assert torch.equal(net.bias, torch.full((2,), 5.0))
    # The plain nn.Linear was reset by its own reset_parameters (bound 1/sqrt(3)).
    assert net.head.weight.abs().max() <= 3**-0.5


class _PlainScale(nn.Module):
    """A plain module with a parameter and no ``reset_parameters`` (nothing can init it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_init_states_refuses_plain_child_it_cannot_initialize():
    """A plain child's parameters without reset_parameters were passed over: after a meta
    build and to_empty() they kept uninitialized memory (NaN here, where one device has
    ones), silently. Refused before anything is initialized, naming path and parameter."""
    with torch.device("meta"):
        net = _net({"weight": nn.init.zeros_, "gate": nn.init.zeros_}, {"bias": nn.init.zeros_})
        net.blocks.append(_PlainScale())
    net.to_empty(device="cpu")
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float("nan"))
    with pytest.raises(ValueError) as info:
        net.init_states()
    message = str(info.value)
    assert message.startswith("init_states: blocks.2 (_PlainScale: scale): plain nn.Module")
    assert "reset_parameters()" in message and "Config.param_init" in message
    assert all(p.isnan().all() for p in net.parameters())  # nothing initialized


def test_init_states_param_init_overrides_reset_parameters():
    layer = Linear.Config(in_features=4, out_features=2, param_init={"bias": nn.init.ones_}).build()
    with torch.no_grad():
        layer.weight.zero_()
    torch.manual_seed(0)
    layer.init_states()
    assert torch.equal(layer.bias, torch.ones(2))
    assert layer.weight.abs().sum() > 0  # reset_parameters drew the weight


class WithBuffers(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        size: int = 4

    def __init__(self, config: WithBuffers.Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.size))
        self.register_buffer("table", torch.empty(config.size))
        self.register_buffer("scratch", torch.empty(config.size), persistent=False)
        self.register_buffer("untouched", torch.full((1,), 7.0))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def compute_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        size = self.weight.shape[0]
        return {
            "table": torch.arange(size, device=device, dtype=torch.float64),
            "scratch": torch.ones(size, device=device),
        }


def test_init_states_recomputes_buffers_keeping_dtype_and_persistence():
    module = WithBuffers.Config().build()
    module.init_states()
    assert module.table.dtype == torch.float32  # the buffer's dtype, not the computed one
    assert torch.equal(module.table, torch.arange(4.0))
    assert torch.equal(module.scratch, torch.ones(4))
    assert torch.equal(module.untouched, torch.full((1,), 7.0))
    assert sorted(module.state_dict()) == ["table", "untouched", "weight"]


def test_meta_build_to_empty_init_states_equals_eager_init():
    config = Net.Config(
        blocks=[
            Block.Config(
                core=Core.Config(param_init={"weight": nn.init.normal_, "gate": nn.init.uniform_})
            )
        ],
        param_init={"bias": nn.init.normal_},
    )
    with torch.device("meta"):
        lazy = config.build()
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_states()
    eager = config.build()
    torch.manual_seed(3)
    eager.init_states()
    for (name, a), (_, b) in zip(lazy.named_parameters(), eager.named_parameters()):
        assert torch.equal(a, b), name


def test_buffers_on_meta_are_recomputed_on_buffer_device():
    with torch.device("meta"):
        module = WithBuffers.Config().build()
    module.to_empty(device="cpu")
    module.init_states(buffer_device="cpu")
    assert module.table.device.type == "cpu"
    assert torch.equal(module.table, torch.arange(4.0))


# --------------------------------------------------------------------------- parallelize (fake PG)


def test_parallelize_places_states_and_keeps_flags(mesh):
    module = WithBuffers.Config(
        size=8,
        sharding_config=ShardingConfig(
            state_shardings={"table": {"tp": Shard(0)}, "scratch": {"tp": Shard(0)}},
        ),
    ).build()
    module.weight.requires_grad_(False)  # a frozen parameter stays frozen
    assert module.parallelize(mesh) is module
    assert isinstance(module.weight, nn.Parameter) and isinstance(module.weight.data, DTensor)
    assert module.weight.placements == (Replicate(),)  # own state not named: replicated
    assert not module.weight.requires_grad
    assert module.table.placements == (Shard(0),) and module.table.to_local().shape == (2,)
    assert module.untouched.placements == (Replicate(),)
    assert sorted(module.state_dict()) == ["table", "untouched", "weight"]
    assert not isinstance(module.table, nn.Parameter)


def test_init_states_on_sharded_parameters_equals_single_device_shard(mesh):
    config = Linear.Config(
        in_features=6,
        out_features=8,
        sharding_config=ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}
        ),
    )
    sharded = config.build().parallelize(mesh)
    torch.manual_seed(11)
    sharded.init_states()
    single = config.build()
    torch.manual_seed(11)
    single.init_states()
    for name in ("weight", "bias"):
        expected = distribute_tensor(
            getattr(single, name).detach(), mesh, [Shard(0)], src_data_rank=None
        )
        assert torch.equal(getattr(sharded, name).to_local(), expected.to_local()), name


class Recorder(Module):
    """Records the placements its forward sees; binds like any Python function."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Recorder.Config) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def forward(self, a, b=None, *rest, scale: float = 1.0, **extra):
        def kind(v: Any) -> Any:
            return tuple(v.placements) if isinstance(v, DTensor) else type(v).__name__

        self.seen = {
            "a": kind(a),
            "b": kind(b),
            "rest": [kind(r) for r in rest],
            "scale": scale,
            **{k: kind(v) for k, v in extra.items()},
        }
        return a


def _recorder() -> Recorder:
    return Recorder.Config(
        sharding_config=ShardingConfig(
            in_src_shardings={"extra_mask": {"tp": Replicate()}},
            in_dst_shardings={
                "a": {"tp": Replicate()},
                "b": {"tp": Shard(0)},
                "rest": {"tp": Shard(-1)},
                "extra_mask": {"tp": Shard(1)},
            },
        )
    ).build()


def test_arguments_bind_like_python(mesh):
    """Positional, keyword, defaults, ``*args`` and ``**kwargs`` each get their entry."""
    rec = _recorder()
    rec.parallelize(mesh)
    x = torch.ones(4, 8)
    rec(x, x, x, x, scale=2.0, extra_mask=x, other=3)
    assert rec.seen == {
        "a": (Replicate(),),
        "b": (Shard(0),),
        "rest": [(Shard(1),), (Shard(1),)],
        "scale": 2.0,
        "extra_mask": (Shard(1),),
        "other": "int",
    }
    rec(b=x, a=x)
    assert rec.seen["a"] == (Replicate(),) and rec.seen["b"] == (Shard(0),)
    rec(x)  # b left at its default, None: untouched
    assert rec.seen["b"] == "NoneType" and rec.seen["rest"] == []


def test_plain_input_without_src_is_wrapped_with_dst(mesh):
    """A plain tensor is taken as this rank's piece in the ``in_dst`` layout when no src."""
    rec = _recorder()
    rec.parallelize(mesh)
    local = torch.ones(2, 8)
    out = rec(local, local)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    assert rec.seen["b"] == (Shard(0),)


def test_plain_output_without_src_is_wrapped_with_dst(mesh):
    """Outputs mirror inputs: a plain output with only ``out_dst`` is this rank's piece."""

    class Local(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Local.Config) -> None:
            super().__init__()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    m = Local.Config(sharding_config=ShardingConfig(out_dst_shardings={"tp": Shard(0)})).build()
    m.parallelize(mesh)
    out = m(torch.ones(3, 5))
    assert isinstance(out, DTensor)
    assert out.placements == (Shard(0),)
    assert tuple(out.shape) == (3 * WORLD_SIZE, 5)


def test_parallelize_is_recursive_through_plain_wrappers(mesh):
    inner = Linear.Config(
        in_features=4,
        out_features=8,
        sharding_config=ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}}),
    )
    root = Sequential(nn.Sequential(inner.build()), ModuleDict({"x": inner.build()}))
    root.parallelize(mesh)
    assert root[0][0].weight.placements == (Shard(0),)
    assert root[1]["x"].weight.placements == (Shard(0),)
    assert root[0][0].bias.placements == (Replicate(),)


def test_deepcopy_before_parallelize_is_independent(mesh):
    model = Linear.Config(
        in_features=4,
        out_features=8,
        sharding_config=ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}}),
    ).build()
    twin = copy.deepcopy(model)
    model.parallelize(mesh)
    assert not isinstance(twin.weight.data, DTensor)
    twin.parallelize(mesh)  # the copy was never parallelized
    assert twin.weight.placements == (Shard(0),)


def _qk_only_attention() -> Module:
    from tests.distributed.models import AttentionCore

    heads = {"tp": Shard(1)}
    return AttentionCore.Config(
        num_heads=4,
        sharding_config=ShardingConfig(
            state_shardings={"head_scale": {"tp": Shard(0)}},
            in_dst_shardings={"q": heads, "k": heads},
            out_src_shardings=heads,
            local_map=LocalMapConfig(in_grad_placements=(heads, heads)),
        ),
    ).build()


@pytest.mark.parametrize("fast", [False, True])
def test_local_map_region_refuses_undeclared_dtensor_and_missing_input(mesh, fast):
    """A DTensor argument without an entry, or a declared input that is not a tensor,
    is reported with the module path and the fix (never mixed into local code)."""
    core = _qk_only_attention()
    with fast_path(fast):
        core.parallelize(mesh)
    log = PathLog(core)
    assert log.installed == {"": "local_map" if fast else "dtensor"}
    q = torch.ones(1, 4, 3, 2)
    v = distribute_tensor(torch.ones(1, 4, 3, 2), mesh, [Shard(1)], src_data_rank=None)
    with pytest.raises(ValueError, match=r"<root>: local_map argument 'v' is a DTensor.*in_dst"):
        core(q, q, v)
    with pytest.raises(ValueError, match=r"<root>: local_map input 'k' is NoneType"):
        core(q, None, torch.ones(1, 1, 3, 2))
    out = core(q, q, torch.ones(1, 1, 3, 2))  # a plain v is this rank's local piece
    assert out.placements == (Shard(1),)
    # The refused calls went through the DTensor boundary (which names the problem);
    # the good one ran the path installed.
    assert log.calls[""] == ["dtensor", "dtensor", "local_map" if fast else "dtensor"]


def test_subclass_without_config_builds_itself():
    """A subclass that adds no config fields still builds its own class, not its parent."""

    class Base(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            width: int = 2

        def __init__(self, config: Base.Config) -> None:
            super().__init__()
            self.width = config.width

    class Doubled(Base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    built = Doubled.Config(width=3).build()
    assert type(built) is Doubled and built.width == 3
    assert issubclass(Doubled.Config, Base.Config) and Doubled.Config is not Base.Config
    assert type(Base.Config().build()) is Base


@pytest.mark.parametrize("fast", [False, True])
def test_local_map_region_binds_keywords_and_refuses_extra_positionals(mesh, fast):
    """Inputs given by keyword reach the region as positionally given ones do; a call
    with more positional arguments than forward takes is refused by name."""
    core = _qk_only_attention()
    with fast_path(fast):
        core.parallelize(mesh)
    q = torch.arange(24.0).reshape(1, 4, 3, 2)
    v = torch.ones(1, 1, 3, 2)
    expected = core(q, q, v).to_local()
    by_keyword = core(q, k=q, v=v, is_causal=True).to_local()
    assert torch.equal(by_keyword, expected)
    with pytest.raises(ValueError, match=r"<root>: forward takes 3 positional argument\(s\) but 4"):
        core(q, q, v, v)
