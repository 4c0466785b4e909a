"""A corpus of malformed configs, models, meshes and plans, refused before anything changes.

Each case makes a fresh model, calls ``parallelize`` / ``parallelize_module`` with
one thing wrong, and checks three things: the error names the module path and the
fix; every parameter and buffer is exactly as before (same objects, same values,
same kind, no ``forward`` replaced); and the same model, given a corrected call,
parallelizes. Meshes live on a fake process group (one process, no communication).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule import (
    LocalMapConfig,
    Module,
    ModuleList,
    ParallelizeError,
    ShardingConfig,
    parallelize_module,
    presets,
)
from hyper_parallel.dmodule._fast import ENV_VAR
from tests.distributed.models import (
    AttentionCore,
    Linear,
    PlainMLP,
    ScaledLinear,
    attention_core_config,
    colwise,
    mlp_config,
    rowwise,
    sharded_buffer_config,
    tied_lm_config,
)

WORLD_SIZE = 4


@pytest.fixture(scope="module")
def meshes() -> Iterator[dict[str, DeviceMesh]]:
    """A 1-D ``tp`` mesh, a 2-D ``dp x tp`` mesh and an unnamed mesh on a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield {
            "tp": init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",)),
            "dp_tp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            "unnamed": init_device_mesh("cpu", (WORLD_SIZE,)),
            # DeviceMesh accepts what init_device_mesh refuses: an axis named twice.
            "same_axis_twice": DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("tp", "tp")),
            # Ranks 1-3: this process (rank 0) is not one of them.
            "without_this_rank": DeviceMesh("cpu", [1, 2, 3], mesh_dim_names=("tp",)),
        }
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- models


class Stack(Module):
    """``layers.<i>`` blocks in a row, built from configs."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        layers: list[Module.Config] = field(default_factory=list)

    def __init__(self, config: Stack.Config) -> None:
        super().__init__()
        self.layers = ModuleList([c.build() for c in config.layers])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def stack(**bad: ShardingConfig | None) -> Stack:
    """Two col→row MLPs; ``bad`` replaces configs by path, e.g. ``layers_1_up=...``."""
    config = Stack.Config(layers=[mlp_config(8, 16), mlp_config(8, 16)])
    for key, sharding in bad.items():
        _, index, name = key.split("_")
        block = config.layers[int(index)]
        setattr(block, name, getattr(block, name).replace(sharding_config=sharding))
    torch.manual_seed(0)
    return config.build()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wq(x) + self.wk(x) + self.wv(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.mlp = PlainMLP(8, 16)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("rope", torch.arange(8.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(self.attention(x))) + self.rope


class Toy(nn.Module):
    """A plain model as found elsewhere: ``layers.<i>.attention.wq`` and so on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class GroupedQueryAttention(nn.Module):
    """4 query heads and 2 key/value heads of ``head_dim`` 4 (attention's declared field)."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 4
        self.wq = nn.Linear(16, 16)
        self.wk = nn.Linear(16, 8)
        self.wv = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wq(x) + (self.wk(x) * self.wv(x)).repeat(1, 2)


QKV_PLAN = {"wq": colwise(), "wk": colwise(), "wv": colwise()}

GOOD_PLAN = {"layers.*.mlp.up": colwise(), "layers.*.mlp.down": rowwise()}
STACK_PLAN = {"layers.*.up": colwise(), "layers.*.down": rowwise()}


def _module_fix(model: nn.Module, meshes: dict[str, DeviceMesh]) -> None:
    """The Module-built stack is corrected by applying a good plan to the same object."""
    parallelize_module(model, meshes["tp"], STACK_PLAN)


def _parallelize(mesh: str = "tp") -> Callable[[nn.Module, dict[str, DeviceMesh]], Any]:
    return lambda model, meshes: model.parallelize(meshes[mesh])


def _distribute_tied(model: nn.Module, mesh: DeviceMesh) -> None:
    """The tied embedding weight made a DTensor by hand, the tie kept (a first step)."""
    from hyper_parallel.core.dtensor.dtensor import distribute_tensor

    weight = nn.Parameter(distribute_tensor(model.emb.weight.detach(), mesh, [Shard(0)]))
    model.emb.weight = weight
    model.out.weight = weight


def _torch_colwise(model: nn.Module, mesh: DeviceMesh, path: str) -> None:
    """torch's own tensor parallelism on one module (its ColwiseParallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    torch_parallelize(model, mesh, {path: ColwiseParallel()})


def _untied_configs(config: Any) -> Any:
    """``config`` with no sharding config on its ``emb`` and ``out`` (the plan gives them)."""
    return config.replace(
        emb=config.emb.replace(sharding_config=None), out=config.out.replace(sharding_config=None)
    )


def _local_colwise(input_grad: Any) -> ShardingConfig:
    """A column-wise Linear written as a local_map region, its input's gradient as given."""
    return _cfg(
        state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
        in_dst_shardings={"input": TP_R},
        out_src_shardings={"tp": Shard(-1)},
        local_map=LocalMapConfig(in_grad_placements=(input_grad,)),
    )


class _Sum(nn.Module):
    """Sums any number of positional tensors."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return sum(xs)


def _batch_region(placed: Any, input_grad: Any, name: str = "x") -> ShardingConfig:
    """A local_map region over a block, its input and output placed ``placed``."""
    return _cfg(
        in_dst_shardings={name: placed},
        out_src_shardings=placed,
        local_map=LocalMapConfig(in_grad_placements=(input_grad,)),
    )


def _plan(plan: Any, mesh: str = "tp") -> Callable[[nn.Module, dict[str, DeviceMesh]], Any]:
    return lambda model, meshes: parallelize_module(model, meshes[mesh], plan)


# --------------------------------------------------------------------------- the corpus


@dataclass
class Case:
    """One malformed call.

    Attributes:
        make: A fresh model.
        call: The call that must be refused.
        expect: Substrings of the message: the module path, what is wrong, the fix.
        fix: A corrected call on the same model, which must succeed.
        error: The exception type.
        prepare: Run on the fresh model before the snapshot (a first, valid parallelize).
        num_problems: How many problems the one error lists.
    """

    make: Callable[[], nn.Module]
    call: Callable[[nn.Module, dict[str, DeviceMesh]], Any]
    expect: list[str]
    fix: Callable[[nn.Module, dict[str, DeviceMesh]], Any] | None = None
    error: type[Exception] = ParallelizeError
    prepare: Callable[[nn.Module, dict[str, DeviceMesh]], Any] | None = None
    num_problems: int = 1


def _cfg(**kw: Any) -> ShardingConfig:
    return ShardingConfig(**kw)


TP_R = {"tp": Replicate()}
TP_S0 = {"tp": Shard(0)}


def _shared_toy() -> Toy:
    model = Toy()
    model.layers[1] = model.layers[0]
    return model


def _changed_colwise() -> ShardingConfig:
    config = colwise()
    config.state_shardings["weight"] = {"tp": 0}  # type: ignore[dict-item]
    return config


CASES: dict[str, Case] = {
    "misspelled_state": Case(
        lambda: stack(layers_1_up=_cfg(state_shardings={"wieght": {"tp": Shard(0)}})),
        _parallelize(),
        [
            "layers.1.up:",
            "'wieght'",
            "(has: weight, bias)",
            "did you mean 'weight'? use one of the listed",
        ],
        _module_fix,
    ),
    "dotted_path_to_nothing": Case(
        lambda: Toy(),
        _plan({"layers.2.mlp": _cfg(state_shardings={"up.wieght": {"tp": Shard(0)}})}),
        [
            "layers.2.mlp:",
            "'up.wieght'",
            "did you mean 'up.weight'?",
            "dotted paths reach into submodules",
        ],
        _plan(
            {"layers.2.mlp": _cfg(state_shardings={"up.weight": {"tp": Shard(0)}, "up.bias": TP_R})}
        ),
    ),
    "dotted_path_through_missing_module": Case(
        lambda: Toy(),
        _plan({"layers.0": _cfg(state_shardings={"attn.wq.weight": {"tp": Shard(0)}})}),
        ["layers.0:", "'attn.wq.weight'", "attention.wq.weight", "use one of the listed names"],
        _plan(
            {
                "layers.0": _cfg(
                    state_shardings={
                        "attention.wq.weight": {"tp": Shard(0)},
                        "attention.wq.bias": TP_R,
                    }
                )
            }
        ),
    ),
    "none_bias_named": Case(
        lambda: Stack.Config(
            layers=[
                mlp_config(8, 16).replace(
                    up=Linear.Config(
                        in_features=8, out_features=16, bias=False, sharding_config=colwise()
                    )
                )
            ]
        ).build(),
        _parallelize(),
        ["layers.0.up:", "'bias', which is None in Linear", "drop 'bias' from state_shardings"],
        _plan({"layers.0.up": colwise(bias=False), "layers.0.down": rowwise()}),
    ),
    "child_states_named_in_part": Case(
        # A parent naming lin.weight of a child with no config of its own, not lin.bias:
        # the child's forward mixed a DTensor weight with a plain bias.
        lambda: Toy(),
        _plan({"layers.1.mlp": _cfg(state_shardings={"up.weight": {"tp": Shard(0)}})}),
        [
            "layers.1.mlp: state_shardings:",
            "names 'up.weight' of 'up' (Linear) but not 'up.bias'",
            "name 'up.bias' too",
        ],
        _plan(
            {"layers.1.mlp": _cfg(state_shardings={"up.weight": {"tp": Shard(0)}, "up.bias": TP_R})}
        ),
    ),
    "placement_that_is_no_placement": Case(
        # A config's dict changed after its checks ran (the dataclass is not frozen).
        lambda: stack(),
        lambda model, meshes: parallelize_module(
            model, meshes["tp"], {"layers.0.up": _changed_colwise()}
        ),
        ["layers.0.up: state_shardings['weight']", "got int: 0", "Shard(d), Replicate() or"],
        _module_fix,
    ),
    "state_names_a_submodule": Case(
        lambda: Toy(),
        _plan({"layers.1.mlp": _cfg(state_shardings={"up": {"tp": Shard(0)}})}),
        ["layers.1.mlp:", "'up', which is not a parameter or buffer", "use one of the listed"],
        _plan(GOOD_PLAN),
    ),
    "in_dst_key_not_forward_arg": Case(
        lambda: stack(layers_0_up=_cfg(in_dst_shardings={"x": TP_R})),
        _parallelize(),
        ["layers.0.up:", "in_dst_shardings['x']", "not an argument", "one of ['input']"],
        _module_fix,
    ),
    "in_src_key_not_forward_arg": Case(
        lambda: Toy(),
        _plan({"layers.3.attention.wq": _cfg(in_src_shardings={"hidden": TP_R})}),
        ["layers.3.attention.wq:", "in_src_shardings['hidden']", "one of ['input']"],
        _plan({"layers.3.attention.wq": _cfg(in_src_shardings={"input": TP_R})}),
    ),
    "shard_dim_out_of_range": Case(
        lambda: stack(layers_1_down=_cfg(state_shardings={"weight": {"tp": Shard(2)}})),
        _parallelize(),
        ["layers.1.down:", "axis 'tp' is", "out of range", "use a dim in [-2, 1]"],
        _module_fix,
    ),
    "negative_shard_dim_out_of_range": Case(
        lambda: Toy(),
        _plan({"layers.0.mlp.up": _cfg(state_shardings={"weight": {"tp": Shard(-3)}})}),
        ["layers.0.mlp.up:", "out of range for 'weight'", "use a dim in [-2, 1]"],
        _plan({"layers.0.mlp.up": _cfg(state_shardings={"weight": {"tp": Shard(-2)}})}),
    ),
    "shard_dim_out_of_range_for_bias": Case(
        lambda: Toy(),
        _plan({"layers.0.mlp.up": _cfg(state_shardings={"bias": {"tp": Shard(1)}})}),
        ["layers.0.mlp.up:", "'bias' with 1 dim(s)", "use a dim in [-1, 0]"],
        _plan({"layers.0.mlp.up": _cfg(state_shardings={"bias": {"tp": Shard(0)}})}),
    ),
    "partial_parameter": Case(
        lambda: stack(layers_0_down=_cfg(state_shardings={"weight": {"tp": Partial()}})),
        _parallelize(),
        ["layers.0.down:", "cannot be Partial", "use Shard(dim) or Replicate() for states"],
        _module_fix,
    ),
    "partial_buffer": Case(
        lambda: Toy(),
        _plan({"layers.1": _cfg(state_shardings={"rope": {"tp": Partial()}})}),
        ["layers.1:", "state_shardings['rope']", "cannot be Partial"],
        _plan({"layers.1": _cfg(state_shardings={"rope": {"tp": Shard(0)}})}),
    ),
    "axis_case_mismatch": Case(
        lambda: stack(layers_1_up=_cfg(state_shardings={"weight": {"TP": Shard(0)}})),
        _parallelize(),
        ["layers.1.up:", "not in mesh", "'TP' -> 'tp'", "name only the mesh's axes ['tp']"],
        _module_fix,
    ),
    "axis_not_on_mesh_in_input": Case(
        lambda: Toy(),
        _plan({"layers.2.mlp.up": _cfg(in_dst_shardings={"input": {"dp": Shard(0)}})}),
        ["layers.2.mlp.up:", "in_dst_shardings['input']", "['dp']", "mesh's axes ['tp']"],
        _plan({"layers.2.mlp.up": _cfg(in_dst_shardings={"input": {"dp": Shard(0)}})}, "dp_tp"),
    ),
    "axis_not_on_mesh_in_output": Case(
        lambda: Toy(),
        _plan({"layers.2.mlp.down": _cfg(out_dst_shardings={"cp": Replicate()})}),
        ["layers.2.mlp.down:", "out_dst_shardings", "['cp']", "mesh's axes ['tp']"],
        _plan({"layers.2.mlp.down": _cfg(out_dst_shardings=TP_R)}),
    ),
    "axis_not_on_mesh_in_tuple_output": Case(
        lambda: Toy(),
        _plan({"layers.1.attention": _cfg(out_src_shardings=(TP_R, {"ep": Shard(0)}))}),
        ["layers.1.attention:", "out_src_shardings[1]", "['ep']", "mesh's axes"],
        _plan(
            {
                "layers.1.attention": _cfg(
                    state_shardings={"wq.weight": {"tp": Shard(0)}, "wq.bias": TP_R},
                    out_src_shardings=(TP_R, TP_R),
                )
            }
        ),
    ),
    "mesh_without_axis_names": Case(
        lambda: stack(),
        _parallelize("unnamed"),
        ["<root>: mesh:", "no mesh_dim_names", "mesh_dim_names=('dp', 'tp')"],
        _parallelize("tp"),
    ),
    "mesh_names_an_axis_twice": Case(
        lambda: stack(),
        _parallelize("same_axis_twice"),
        ["<root>: mesh:", "axis 'tp' appears more than once", "name each mesh axis once"],
        _parallelize("tp"),
    ),
    "mesh_without_this_rank": Case(
        lambda: stack(),
        _parallelize("without_this_rank"),
        ["<root>: mesh:", "rank 0) is not one of the mesh's 3 ranks", "over every rank"],
        _parallelize("tp"),
    ),
    "more_ranks_than_key_value_heads": Case(
        GroupedQueryAttention,
        _plan(QKV_PLAN),
        [
            "wk: state_shardings['weight']: 2 heads (8 features / head_dim 4 of <root>)",
            "axis 'tp' of size 4, which is larger than the head count",
            "wv: state_shardings['weight']",
            "use a 'tp' size that divides 2 (2, 1)",
        ],
        _plan(QKV_PLAN, "dp_tp"),  # tp=2: one key/value head per rank
        num_problems=2,
    ),
    "state_sharded_on_a_dim_of_size_1": Case(
        lambda: nn.Linear(8, 1),
        _plan({"": colwise()}),
        [
            "<root>: state_shardings['weight']: axis 'tp' shards dim 0 of 'weight', which has "
            "size 1 (shape (1, 8))",
            "the other 3 an empty shard",
            "make 'bias' Replicate() on 'tp', or shard a dim larger than 1",
        ],
        _plan({"": rowwise()}),
        num_problems=2,
    ),
    "mesh_not_a_device_mesh": Case(
        lambda: stack(),
        lambda model, meshes: model.parallelize(("tp",)),  # type: ignore[arg-type]
        ["expected a DeviceMesh, got tuple", "init_device_mesh("],
        _parallelize("tp"),
        error=TypeError,
    ),
    "second_parallelize": Case(
        lambda: stack(),
        _parallelize(),
        ["layers.0.up:", "already parallelized", "parallelize a model once"],
        None,
        prepare=_parallelize(),
        num_problems=4,
    ),
    "parallelize_module_after_parallelize": Case(
        lambda: stack(),
        _plan({"layers.1.down": rowwise()}),
        ["layers.1.down:", "already parallelized", "build a fresh model"],
        None,
        prepare=_parallelize(),
    ),
    "local_map_without_output_placement": Case(
        lambda: (
            attention_core_config(4)
            .replace(
                sharding_config=_cfg(
                    in_dst_shardings={n: {"tp": Shard(1)} for n in "qkv"},
                    local_map=LocalMapConfig(in_grad_placements=({"tp": Shard(1)},) * 3),
                )
            )
            .build()
        ),
        _parallelize(),
        ["<root>: local_map:", "needs the placement of its output", "set out_src_shardings"],
        _plan({"": attention_core_config(4).sharding_config}),
    ),
    "local_map_in_grad_count_mismatch": Case(
        lambda: (
            attention_core_config(4)
            .replace(
                sharding_config=_cfg(
                    in_dst_shardings={n: {"tp": Shard(1)} for n in "qkv"},
                    out_src_shardings={"tp": Shard(1)},
                    local_map=LocalMapConfig(in_grad_placements=({"tp": Shard(1)},)),
                )
            )
            .build()
        ),
        _parallelize(),
        [
            "<root>: local_map.in_grad_placements:",
            "has 1 entr",
            "3 input(s) ['q', 'k', 'v']",
            "one in_grad",
        ],
        _plan({"": attention_core_config(4).sharding_config}),
    ),
    "local_map_in_grad_axis_not_on_mesh": Case(
        lambda: Toy(),
        _plan(
            {
                "layers.0.mlp": _cfg(
                    in_dst_shardings={"x": TP_R},
                    out_src_shardings=TP_R,
                    local_map=LocalMapConfig(in_grad_placements=({"cp": Replicate()},)),
                )
            }
        ),
        ["layers.0.mlp:", "local_map.in_grad_placements[0]", "['cp']", "mesh's axes"],
        _plan(GOOD_PLAN),
    ),
    "local_map_replicated_input_with_replicated_gradient": Case(
        # A column-wise Linear as a local_map region. Accepted, then every gradient
        # upstream of it was wrong: each rank kept the gradient from its own output
        # columns as the whole (the input's off by 1.4 on 2 ranks).
        lambda: Toy(),
        _plan({"layers.0.mlp.up": _local_colwise(TP_R)}),
        [
            "layers.0.mlp.up: local_map.in_grad_placements[0]:",
            "gradient of input 'input' Replicate() on axis 'tp'",
            "output is split",
            "declare it Partial() on 'tp'",
        ],
        _plan({"layers.0.mlp.up": _local_colwise({"tp": Partial()})}),
    ),
    "local_map_sharded_input_with_replicated_gradient": Case(
        # Accepted, then torch's "returned an invalid gradient ... got [2, 4] but expected
        # shape compatible with [4, 4]" in backward, naming no module.
        lambda: Toy(),
        _plan({"layers.0.mlp": _batch_region(TP_S0, TP_R)}),
        [
            "layers.0.mlp: local_map.in_grad_placements[0]:",
            "gradient of input 'x' Replicate() on axis 'tp', where 'x' enters the region Shard(0)",
            "declare it Shard(0) on 'tp'",
        ],
        _plan({"layers.0.mlp": _batch_region(TP_S0, TP_S0)}),
    ),
    "local_map_replicated_input_with_sharded_gradient": Case(
        # Accepted, then torch's "narrow unexpectedly changed concrete size" in backward.
        lambda: Toy(),
        _plan({"layers.0.mlp": _batch_region(TP_R, TP_S0)}),
        [
            "layers.0.mlp: local_map.in_grad_placements[0]:",
            "gradient of input 'x' Shard(0) on axis 'tp', where 'x' enters the region replicated",
            "declare it Replicate() on 'tp'",
        ],
        _plan({"layers.0.mlp": _batch_region(TP_R, TP_R)}),
    ),
    "local_map_input_through_var_positional": Case(
        # Accepted, then "local_map input 'xs' is NoneType" at a call passing two tensors.
        lambda: nn.Sequential(_Sum()),
        _plan({"0": _batch_region(TP_S0, TP_S0, "xs")}),
        ["0: in_dst/in_src_shardings['xs']:", "names forward's *xs", "named tensor arguments"],
        None,
    ),
    "nested_config_inside_local_map": Case(
        lambda: Toy(),
        _plan(
            {
                "layers.0.mlp": _cfg(
                    in_dst_shardings={"x": TP_R},
                    out_src_shardings=TP_R,
                    local_map=LocalMapConfig(in_grad_placements=(TP_R,)),
                ),
                "layers.0.mlp.up": colwise(),
            }
        ),
        ["layers.0.mlp.up:", "inside the local_map region of layers.0.mlp", "remove the inner"],
        _plan(GOOD_PLAN),
    ),
    "tied_weight_conflicting_placements": Case(
        lambda: tied_lm_config(12, 8).build(),
        _plan(
            {
                "emb": _cfg(state_shardings={"weight": {"tp": Shard(0)}}),
                "out": _cfg(state_shardings={"weight": {"tp": Shard(1)}}),
            }
        ),
        ["out:", "out.weight is the same tensor as emb.weight (tied)", "place tied states"],
        _plan(
            {
                "emb": _cfg(state_shardings={"weight": {"tp": Shard(0)}}),
                "out": _cfg(state_shardings={"weight": {"tp": Shard(0)}}),
            }
        ),
    ),
    "tied_weight_already_dtensor_disagrees": Case(
        lambda: tied_lm_config(12, 8).build(),
        _plan({"out": _cfg(state_shardings={"weight": {"tp": Shard(1)}})}),
        ["out:", "already a DTensor placed [Shard(dim=0)]", "make the config agree"],
        _plan({"out": _cfg(state_shardings={"weight": {"tp": Shard(0)}})}),
        prepare=lambda model, meshes: _distribute_tied(model, meshes["tp"]),
    ),
    "embedding_rows_over_two_axes": Case(
        # Accepted, then torch's "MaskBuffer has been materialized with conflicting data"
        # at the first call, naming no module.
        lambda: nn.Sequential(nn.Embedding(16, 8)),
        _plan(
            {
                "0": _cfg(
                    state_shardings={"weight": {"dp": Shard(0), "tp": Shard(0)}},
                    in_dst_shardings={"input": {"tp": Replicate()}},
                )
            },
            mesh="dp_tp",
        ),
        ["0:", "shards them over ['dp', 'tp']", "shard the rows over one axis"],
        _plan(
            {
                "0": _cfg(
                    state_shardings={"weight": {"tp": Shard(0)}},
                    in_dst_shardings={"input": {"tp": Replicate()}},
                )
            },
            mesh="dp_tp",
        ),
    ),
    "already_parallelized_by_torch": Case(
        lambda: Toy(),
        _plan({"layers.0.mlp.up": colwise()}),
        ["layers.0.mlp.up:", "already parallelized by torch's parallelize_module", "one plan"],
        _plan({"layers.0.mlp.down": rowwise()}),
        prepare=lambda model, meshes: _torch_colwise(model, meshes["tp"], "layers.0.mlp.up"),
    ),
    "tied_weight_held_by_a_module_outside_the_plan": Case(
        # HF's tp_plan {"lm_head": "colwise_rep"} on a tied model: the embedding kept the
        # tied DTensor with plain inputs, and failed at its first call ("got mixed
        # torch.Tensor and DTensor", no module named).
        lambda: _untied_configs(tied_lm_config(12, 8)).build(),
        _plan({"out": _cfg(state_shardings={"weight": {"tp": Shard(0)}})}),
        ["emb:", "emb.weight is the same tensor as out.weight (tied)", "emb has no config"],
        _plan(
            {
                "emb": _cfg(
                    state_shardings={"weight": {"tp": Shard(0)}},
                    in_dst_shardings={"input": {"tp": Replicate()}},
                    out_dst_shardings={"tp": Replicate()},
                ),
                "out": _cfg(state_shardings={"weight": {"tp": Shard(0)}}),
            }
        ),
    ),
    "pattern_matches_nothing": Case(
        lambda: Toy(),
        _plan({"layers.3.atention.wq": colwise()}),
        ["layers.3.atention.wq:", "matches no module", "'layers.3.attention.wq'", "real module"],
        _plan({"layers.3.attention.wq": colwise()}),
    ),
    "second_path_of_a_shared_module": Case(
        # One block at layers.0 and layers.1 (weights shared): torch reaches layers.1.mlp.up
        # by get_submodule; here it was "matches no module (nearest: layers.0.mlp.up)".
        lambda: _shared_toy(),
        _plan({"layers.1.mlp.up": colwise()}),
        ["layers.1.mlp.up:", "'layers.1.mlp.up' is 'layers.0.mlp.up'", "name it by its first"],
        _plan({"layers.0.mlp.up": colwise()}),
    ),
    "wildcard_matches_nothing": Case(
        lambda: Toy(),
        _plan({"layers.*.feed_forward.up": colwise()}),
        ["layers.*.feed_forward.up:", "matches no module", "'*' matches exactly one"],
        _plan({"layers.*.mlp.up": colwise()}),
    ),
    "two_patterns_claim_one_module": Case(
        lambda: Toy(),
        _plan({"layers.*.mlp.up": colwise(), "layers.2.mlp.up": colwise()}),
        ["layers.2.mlp.up:", "claimed by two plan patterns", "make the patterns disjoint"],
        _plan({"layers.*.mlp.up": colwise()}),
    ),
    "plan_value_not_a_sharding_config": Case(
        lambda: Toy(),
        _plan({"layers.0.mlp.up": {"weight": {"tp": Shard(0)}}}),
        ["layers.0.mlp.up:", "not a ShardingConfig", "map each module path to a ShardingConfig"],
        _plan({"layers.0.mlp.up": _cfg(state_shardings={"weight": {"tp": Shard(0)}})}),
    ),
    "plan_not_a_mapping": Case(
        lambda: Toy(),
        _plan([("layers.0.mlp.up", colwise())]),
        ["plan must be a dict of module path -> ShardingConfig", "got list"],
        _plan(dict([("layers.0.mlp.up", colwise())])),
        error=TypeError,
    ),
    "several_problems_in_one_error": Case(
        lambda: Toy(),
        _plan(
            {
                "layers.0.mlp.up": _cfg(state_shardings={"wieght": {"tp": Shard(0)}}),
                "layers.1.mlp.down": _cfg(state_shardings={"weight": {"TP": Shard(1)}}),
                "layers.2.attention.wq": _cfg(in_dst_shardings={"x": TP_R}),
                "layers.3.attn": colwise(),
                "layers.3.norm": _cfg(state_shardings={"weight": {"tp": Shard(1)}}),
            }
        ),
        [
            "5 problem(s)",
            "layers.0.mlp.up: state_shardings['wieght']",
            "layers.1.mlp.down: state_shardings['weight']",
            "layers.2.attention.wq: in_dst_shardings['x']",
            "layers.3.attn: plan:",
            "layers.3.norm: state_shardings['weight']",
        ],
        _plan(GOOD_PLAN),
        num_problems=5,
    ),
    "buffer_shard_out_of_range": Case(
        lambda: (
            sharded_buffer_config(8, 8)
            .replace(sharding_config=_cfg(state_shardings={"shift": {"tp": Shard(1)}}))
            .build()
        ),
        _parallelize(),
        ["<root>: state_shardings['shift']", "out of range", "use a dim in [-1, 0]"],
        _plan({"": _cfg(state_shardings={"shift": {"tp": Shard(0)}})}),
    ),
}


# --------------------------------------------------------------------------- checks


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {
            n: (p, type(p), p.detach().clone(), p.requires_grad)
            for n, p in model.named_parameters(remove_duplicate=False)
        },
        "buffers": {
            n: (b, type(b), b.detach().clone())
            for n, b in model.named_buffers(remove_duplicate=False)
        },
        "state_dict_keys": sorted(model.state_dict()),
        "forwards": {n: vars(m).get("forward") for n, m in model.named_modules()},
        # No attribute (a boundary marker) and no hook left behind on any module.
        "attributes": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "hooks": {n: [len(getattr(m, h)) for h in _HOOK_DICTS] for n, m in model.named_modules()},
    }


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = _snapshot(model)
    assert after["params"].keys() == before["params"].keys()
    for name, (p, kind, value, requires_grad) in before["params"].items():
        now = after["params"][name][0]
        assert now is p, f"parameter {name} was replaced"
        assert type(now) is kind, f"parameter {name} changed kind"
        assert now.requires_grad == requires_grad
        assert torch.equal(_local(now.detach()), _local(value)), f"parameter {name} changed"
    assert after["buffers"].keys() == before["buffers"].keys()
    for name, (b, kind, value) in before["buffers"].items():
        now = after["buffers"][name][0]
        assert now is b and type(now) is kind, f"buffer {name} was replaced"
        assert torch.equal(_local(now), _local(value)), f"buffer {name} changed"
    assert after["state_dict_keys"] == before["state_dict_keys"]
    assert after["forwards"] == before["forwards"], "a forward was replaced"
    assert after["attributes"] == before["attributes"], "a module attribute was added"
    assert after["hooks"] == before["hooks"], "a hook was left behind"


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_call_is_refused_and_changes_nothing(name: str, meshes):
    case = CASES[name]
    model = case.make()
    if case.prepare is not None:
        case.prepare(model, meshes)
    else:
        assert not any(isinstance(t, DTensor) for t in model.state_dict().values())
    before = _snapshot(model)
    with pytest.raises(case.error) as info:
        case.call(model, meshes)
    message = str(info.value)
    for text in case.expect:
        assert text in message, f"{text!r} not in:\n{message}"
    if isinstance(info.value, ParallelizeError):
        assert len(info.value.findings) == case.num_problems, message
        assert all(f.fix for f in info.value.findings)
        assert message.count("Fix: ") == case.num_problems
    _assert_unchanged(model, before)
    if case.fix is not None:
        case.fix(model, meshes)
        assert any(isinstance(t, DTensor) for t in model.state_dict().values())


@pytest.mark.parametrize("how", ["module", "plan"])
def test_bad_path_switch_is_refused_before_anything_changes(how: str, meshes, monkeypatch):
    """Path selection is part of the checks: a bad switch value changes nothing."""
    monkeypatch.setenv(ENV_VAR, "maybe")
    if how == "module":
        model: nn.Module = mlp_config(8, 16).build()
        call = _parallelize()
    else:
        model = Toy()
        call = _plan({"layers.*.mlp.up": colwise(), "layers.*.mlp.down": rowwise()})
    before = _snapshot(model)
    with pytest.raises(ValueError, match=f"{ENV_VAR}='maybe': set it to 1"):
        call(model, meshes)
    _assert_unchanged(model, before)
    monkeypatch.setenv(ENV_VAR, "1")  # the same model, with a valid switch, parallelizes
    call(model, meshes)
    assert any(isinstance(t, DTensor) for t in model.state_dict().values())


def test_corpus_is_large_enough():
    assert len(CASES) >= 20


def test_refused_model_still_runs_single_device(meshes):
    """A refused model is untouched: its forward equals that of an identical copy."""
    model = Toy()
    twin = copy.deepcopy(model)
    with pytest.raises(ParallelizeError):
        parallelize_module(
            model, meshes["tp"], {"layers.0.mlp.up": _cfg(in_dst_shardings={"x": TP_R})}
        )
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)


def test_errors_are_listed_in_model_order_with_paths(meshes):
    """``ParallelizeError.findings`` carries path, field, message and fix for tools."""
    model = Toy()
    with pytest.raises(ParallelizeError) as info:
        parallelize_module(
            model,
            meshes["tp"],
            {
                "layers.2.mlp.up": _cfg(state_shardings={"bias": {"tp": Shard(3)}}),
                "layers.0.mlp.up": _cfg(state_shardings={"bias": {"tp": Partial()}}),
            },
        )
    findings = info.value.findings
    assert [f.path for f in findings] == ["layers.0.mlp.up", "layers.2.mlp.up"]
    assert findings[0].to_dict()["field"] == "state_shardings['bias']"
    assert isinstance(info.value, ValueError)


def test_uneven_state_is_a_warning_not_an_error(meshes):
    """A state not divisible by its axis size parallelizes (uneven DTensor shards)."""
    model = Toy()
    parallelize_module(
        model, meshes["tp"], {"layers.0.mlp.up": _cfg(state_shardings={"weight": {"tp": Shard(1)}})}
    )
    weight = model.layers[0].mlp.up.weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(1),)
    assert weight.shape == (16, 8)


def test_module_types_used_by_the_corpus():
    assert issubclass(AttentionCore, Module) and issubclass(ScaledLinear, Module)


# --------------------------------------------------------------------------- at call time


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize(
    ("plan", "expect"),
    [
        # A row-wise layer without out_dst hands on a Partial output: use_local_output gave
        # each rank its own unreduced sum (the numbers were wrong, silently).
        (
            {
                "0": presets.colwise(),
                "2": _cfg(
                    state_shardings={"weight": {"tp": Shard(1)}},
                    in_dst_shardings={"input": {"tp": Shard(-1)}},
                    use_local_output=True,
                ),
            },
            ["2: forward's output is Partial over 'tp'", "out_dst_shardings={'tp': Replicate()}"],
        ),
        # Shard(d) beyond the tensor of the call: a bare IndexError/RuntimeError of torch.
        (
            {"0": presets.colwise(input=Shard(4))},
            ["0: in_src_shardings['input']: Shard(4) on axis 'tp' is out of range for the 2-d"],
        ),
        (
            {"0": presets.colwise(), "2": presets.rowwise(output=Shard(5))},
            ["2: out_dst_shardings: Shard(5) on axis 'tp' is out of range", "(dims -2..1)"],
        ),
        (
            {"0": _cfg(in_dst_shardings={"input": {"tp": Shard(-3)}})},
            ["0: in_dst_shardings['input']: Shard(-3) on axis 'tp' is out of range"],
        ),
    ],
    ids=["partial-local-output", "input-dim", "output-dim", "negative-dim"],
)
def test_call_time_layout_errors_name_the_module_and_field(plan, expect, fast, meshes, monkeypatch):
    """Errors only a call can find (the output's placements, the tensors' ranks): the same
    ValueError on the fast path (which steps aside) and the DTensor path."""
    from hyper_parallel.dmodule._boundary import Boundary, installed_forward

    monkeypatch.setenv(ENV_VAR, fast)
    model = _mlp()
    parallelize_module(model, meshes["tp"], plan)
    # The module at fault (the message's path) and the path installed on it: a fast path
    # where one applies (the Shard(d) of a column-/row-wise preset), which steps aside.
    at = expect[0].split(":")[0]
    installed = installed_forward(model[int(at)])
    fast_one = at in FAST_AT_FAULT.get(expect[0], ())
    assert isinstance(installed, Boundary) is (fast == "0" or not fast_one), installed
    with pytest.raises(ValueError) as info:
        model(torch.randn(4, 8))
    for text in expect:
        assert text in str(info.value), str(info.value)


# The cases above whose module at fault runs on a fast path when it is enabled.
FAST_AT_FAULT = {
    "0: in_src_shardings['input']: Shard(4) on axis 'tp' is out of range for the 2-d": ("0",),
    "2: out_dst_shardings: Shard(5) on axis 'tp' is out of range": ("2",),
}


class _Region(nn.Module):
    """Returns ``x * 2`` as the given structure (a local_map region's body)."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> Any:
        y = x * 2
        return {
            "one": y,
            "two": (y, y + 1),
            "three": (y, y + 1, y - 1),
            "dict": {"y": y},
            "with_none": (y, None),
        }[self.shape]


@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize(
    ("shape", "outputs", "expect"),
    [
        (
            "one",
            (TP_R, TP_R),
            "out_src_shardings has 2 entries but the local_map region returned one",
        ),
        ("two", TP_R, "returned 2 values (Tensor(4, 8), Tensor(4, 8)) but out_src_shardings is a"),
        (
            "three",
            (TP_R, TP_R),
            "out_src_shardings has 2 entries but the local_map region returned 3",
        ),
        ("dict", TP_R, "the local_map region returned dict, but a region's output must be"),
        ("with_none", (TP_R, TP_R), "output 1 is not a tensor"),
    ],
    ids=["tuple-declared", "single-declared", "count", "dict", "none"],
)
def test_local_map_region_output_mismatch_names_the_module(
    shape, outputs, expect, fast, meshes, monkeypatch
):
    """A region's output that does not fit its declared placements: the same ValueError,
    naming the module and the field, on both paths. The DTensor path stopped at torch's
    local_map assertion ("local_map requires one PlacementType be provided for each output
    value", "Non-tensor output None expects None placements"), naming no module; the fast
    path named the class, not the path, and handed a dict of local tensors on silently."""
    monkeypatch.setenv(ENV_VAR, fast)
    model = nn.Sequential(nn.Identity(), _Region(shape))
    config = _cfg(
        in_dst_shardings={"x": TP_R},
        out_src_shardings=outputs,
        local_map=LocalMapConfig(in_grad_placements=({"tp": Partial()},)),
    )
    parallelize_module(model, meshes["tp"], {"1": config})
    with pytest.raises(ValueError) as info:
        model(torch.randn(4, 8))
    assert str(info.value).startswith("1: "), str(info.value)
    assert expect in str(info.value), str(info.value)


@pytest.mark.parametrize("fast", ["1", "0"])
def test_plain_submodule_under_a_config_names_the_module(fast, meshes, monkeypatch):
    """A config on a block whose plain children keep plain parameters: its forward runs on
    DTensors, and the first child call failed with torch's bare "aten.addmm.default got
    mixed torch.Tensor and DTensor", naming no module. Now the block's path, the children
    holding plain parameters and the fix."""
    monkeypatch.setenv(ENV_VAR, fast)
    model = Toy()
    parallelize_module(model, meshes["tp"], {"layers.0.mlp": _cfg(in_dst_shardings={"x": TP_R})})
    with pytest.raises(ValueError) as info:
        model(torch.randn(4, 8))
    message = str(info.value)
    assert message.startswith("layers.0.mlp: this config makes forward run on DTensors"), message
    assert "submodule(s) up (Linear), down (Linear) hold plain parameters" in message
    assert "got mixed torch.Tensor and DTensor" in message and "config of its own" in message


def test_partial_output_handed_on_local_when_asked_for(meshes):
    """out_dst Partial() says the partial sums are wanted: no error, each rank's own part."""
    model = _mlp()
    down = _cfg(
        state_shardings={"weight": {"tp": Shard(1)}, "bias": TP_R},
        in_dst_shardings={"input": {"tp": Shard(-1)}},
        out_dst_shardings={"tp": Partial()},
        use_local_output=True,
    )
    parallelize_module(model, meshes["tp"], {"0": presets.colwise(), "2": down})
    out = model(torch.randn(4, 8))
    assert type(out) is torch.Tensor and out.shape == (4, 8)


class _KwargsBlock(nn.Module):
    """A Hugging Face style layer: named arguments, then ``**kwargs``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.proj(hidden_states)


def test_an_input_key_only_kwargs_can_carry_is_warned(meshes):
    # `in_dst_shardings={"x": ...}` on forward(hidden_states, **kwargs) was accepted
    # without a word and configured nothing (no caller passes x=).
    model = nn.Sequential(_KwargsBlock())
    plan = {"0": _cfg(in_dst_shardings={"x": {"tp": Replicate()}})}
    with pytest.warns(UserWarning, match=r"0: in_dst_shardings\['x'\]: names 'x', which is no"):
        parallelize_module(model, meshes["tp"], plan)
    model = nn.Sequential(_KwargsBlock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a named argument: nothing to say
        parallelize_module(
            model,
            meshes["tp"],
            {"0": _cfg(in_dst_shardings={"hidden_states": {"tp": Replicate()}})},
        )


def test_generate_refuses_a_parallelized_model_naming_the_state_and_the_fix(meshes):
    """generate's cached forward calls a decoder's modules one by one (not the blocks'
    forward), so a parallelized model failed deep in the embedding with torch's "mixed
    torch.Tensor and DTensor"; now one ValueError names the state, its placement and the
    fix, and the same weights unsharded generate."""
    from hyper_parallel.hf_commands.generate import generate
    from hyper_parallel.models.llama import apply_tp, preset_config

    config = preset_config("llama3-debug")
    model = apply_tp(config, tp_size=WORLD_SIZE).build()
    model.init_states()
    model.parallelize(meshes["tp"])
    message = r"generate: tok_embeddings\.weight is a DTensor \(\{tp: S\(0\)\}\).*load_hf"
    with pytest.raises(ValueError, match=message):
        generate(model, [5, 17], 4)
    single = config.build()
    single.init_states()
    assert len(generate(single, [5, 17], 4)) == 4
