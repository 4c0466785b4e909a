"""The fast boundary path against the DTensor path and one device, on 2 gloo ranks.

Every scenario is parallelized twice from the same weights — fast path on and off —
and run next to a single-device deepcopy. Each asserts: the fast path was chosen
where expected, outputs and every gradient (inputs too) equal the single device,
the fast path issues the same collectives as the DTensor path (counted with
``CommDebugMode`` over forward and backward separately, c10d and functional
spellings merged), and outputs and gradients have the same type and placements.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule import (
    LocalMapConfig,
    ShardingConfig,
    fast_path,
    parallelize_module,
    set_fast_path,
)
from hyper_parallel.dmodule._boundary import installed_forward
from hyper_parallel.dmodule._fast import ENV_VAR, FastPath, explain_fast_path
from tests.distributed.models import PathLog

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
ATOL = 1e-5

# ---------------------------------------------------------------------------- helpers

_KIND = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "_allgather_base_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """Collective kind → count, merging c10d (fast path) and functional (DTensor) spellings."""
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        kind = _KIND.get(name, name)
        out[kind] = out.get(kind, 0) + n
    return {k: v for k, v in out.items() if v}


def _mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] = ("tp",)) -> Any:
    shape = shape or (torch.distributed.get_world_size(),)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _full(t: torch.Tensor, seq_dim: int | None = None) -> torch.Tensor:
    """The global value of an output/gradient: a DTensor's full tensor, or a local shard's."""
    if isinstance(t, DTensor):
        return t.full_tensor().detach()
    if seq_dim is None:
        return t.detach()
    local = t.detach()
    return DTensor.from_local(local, _mesh(), (Shard(seq_dim),), run_check=False).full_tensor()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _ran(log: PathLog) -> dict[str, str]:
    """Module path → the path its calls actually took ("colwise", "dtensor", ...)."""
    return {path: "/".join(sorted(kinds)) or "never called" for path, kinds in log.ran().items()}


def _layout(t: Any) -> str:
    return repr(tuple(t.placements)) if isinstance(t, DTensor) else type(t).__name__


def _run(
    base: nn.Module,
    plan: dict[str, ShardingConfig],
    inputs: tuple[torch.Tensor, ...],
    fast: bool,
    seq_dim: int | None = None,
) -> dict[str, Any]:
    """Parallelize a copy of ``base`` on one path; one forward and backward, recorded."""
    model = copy.deepcopy(base)
    with fast_path(fast):
        parallelize_module(model, _mesh(), plan)
    log = PathLog(model)
    inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
    with CommDebugMode() as fwd:
        out = model(*inputs)
    with CommDebugMode() as bwd:
        _local(out).pow(2).sum().backward()
    return {
        "kinds": _ran(log),
        "out": _full(out, seq_dim).detach(),
        "out_layout": _layout(out),
        "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
        "grad_layouts": {n: _layout(p.grad) for n, p in model.named_parameters()},
        "input_grads": [x.grad for x in inputs if x.requires_grad],
        "fwd": _counts(fwd),
        "bwd": _counts(bwd),
    }


def _reference(base: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    model = copy.deepcopy(base)
    inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
    out = model(*inputs)
    out.pow(2).sum().backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "input_grads": [x.grad for x in inputs if x.requires_grad],
    }


def _both_paths(
    base: nn.Module,
    plan: dict[str, ShardingConfig],
    inputs: tuple[torch.Tensor, ...],
    seq_dim: int | None = None,
) -> dict[str, Any]:
    return {
        "fast": _run(base, plan, inputs, True, seq_dim),
        "dtensor": _run(base, plan, inputs, False, seq_dim),
        "reference": _reference(base, inputs),
    }


def _check(
    runs: dict[str, Any],
    kinds: dict[str, str],
    fwd: dict[str, int],
    bwd: dict[str, int],
    same_grad_layouts: bool = True,
) -> None:
    fast, dtensor, ref = runs["fast"], runs["dtensor"], runs["reference"]
    assert fast["kinds"] == kinds
    assert set(dtensor["kinds"].values()) == {"dtensor"}
    for run in (fast, dtensor):
        torch.testing.assert_close(run["out"], ref["out"], atol=ATOL, rtol=ATOL)
        assert run["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(run["grads"][name], grad, atol=ATOL, rtol=ATOL)
        assert len(run["input_grads"]) == len(ref["input_grads"])
        for got, want in zip(run["input_grads"], ref["input_grads"]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert (fast["fwd"], fast["bwd"]) == (fwd, bwd)
    assert (dtensor["fwd"], dtensor["bwd"]) == (fwd, bwd)
    assert fast["out_layout"] == dtensor["out_layout"]
    if same_grad_layouts:
        assert fast["grad_layouts"] == dtensor["grad_layouts"]


# ---------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _colwise(local: bool, arrives: Any = None) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
        in_src_shardings=None if arrives is None else {"input": {"tp": arrives}},
        in_dst_shardings={"input": {"tp": Replicate()}},
        out_dst_shardings={"tp": Shard(-1)},
        use_local_output=local,
    )


def _rowwise(local: bool, output: Any = None) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {"tp": Shard(1)}},
        in_dst_shardings={"input": {"tp": Shard(-1)}},
        out_dst_shardings={"tp": output if output is not None else Replicate()},
        use_local_output=local,
    )


class SequenceParallelBlock(nn.Module):
    """Vocab-parallel embedding → SP norm → all-gather → col → row → reduce-scatter, residual."""

    def __init__(self, vocab: int = 32, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return h + self.mlp(self.norm(h))


def _sequence_parallel_plan(local: bool) -> dict[str, ShardingConfig]:
    seq = {"tp": Shard(1)}
    return {
        "emb": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}},
            in_dst_shardings={"input": {"tp": Replicate()}},
            out_dst_shardings=seq,
            use_local_output=local,
        ),
        "norm": ShardingConfig(
            in_dst_shardings={"input": seq}, out_dst_shardings=seq, use_local_output=local
        ),
        "mlp.up": _colwise(local, arrives=Shard(1)),
        "mlp.down": _rowwise(local, output=Shard(1)),
    }


class Projection(nn.Module):
    """``x @ weight.T`` written for local tensors (a ``local_map`` body)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Gate(nn.Module):
    """Element-wise ``x * sigmoid(scale)`` on feature shards (a ``local_map`` body)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.scale)


class LocalMapModel(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.proj = Projection(dim, hidden)
        self.gate = Gate(hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate(self.proj(x)))


def _local_map_plan() -> dict[str, ShardingConfig]:
    features = {"tp": Shard(-1)}
    return {
        # Replicated input, column shards out; its input gradient is a partial sum.
        "proj": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}},
            in_dst_shardings={"x": {"tp": Replicate()}},
            out_src_shardings=features,
            local_map=LocalMapConfig(in_grad_placements=({"tp": Partial()},)),
            use_local_output=True,
        ),
        "gate": ShardingConfig(
            state_shardings={"scale": {"tp": Shard(0)}},
            in_dst_shardings={"x": features},
            out_src_shardings=features,
            local_map=LocalMapConfig(in_grad_placements=(features,)),
            use_local_output=True,
        ),
        "down": _rowwise(True),
    }


class ConvNeXtLayerNorm(nn.Module):
    """A channels-first LayerNorm (ConvNeXt's): normalizes dim 1 of ``(N, C, L)``.

    Named like a norm with 1-D states, but not token-wise over the last dim: only its
    type's contract could tell, so the fast path must leave it to DTensor.
    """

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels))
        self.bias = nn.Parameter(torch.randn(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        return self.weight[:, None] * (x - mean) / torch.sqrt(var + self.eps) + self.bias[:, None]


class TorchNormSubclass(nn.RMSNorm):
    """A subclass that keeps ``nn.RMSNorm.forward``: token-wise by contract."""


# ---------------------------------------------------------------------------- rank functions


def _channels_first_norm_runs() -> dict[str, Any]:
    """Channels arrive and leave sharded (``Shard(1)``); both paths vs one device."""
    torch.manual_seed(0)
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base = ConvNeXtLayerNorm(8)
    x = torch.randn(2, 8, 5)
    ref = copy.deepcopy(base)
    ref_x = x.clone().requires_grad_()
    ref_out = ref(ref_x)
    ref_out.pow(2).sum().backward()
    channels = {"tp": Shard(1)}
    plan = {"": ShardingConfig(in_dst_shardings={"x": channels}, out_dst_shardings=channels)}
    out: dict[str, Any] = {}
    for fast in (True, False):
        model = copy.deepcopy(base)
        with fast_path(fast):
            parallelize_module(model, _mesh(), plan)
        log = PathLog(model)
        mine = x.chunk(size, 1)[rank].clone().requires_grad_()
        y = model(mine)
        y.to_local().pow(2).sum().backward()
        out["fast" if fast else "dtensor"] = {
            "ran": _ran(log),
            "out": (y.full_tensor() - ref_out).abs().max().item(),
            "grads": {
                n: (_full(p.grad) - ref.get_parameter(n).grad).abs().max().item()
                for n, p in model.named_parameters()
            },
            "input_grad": (mine.grad - ref_x.grad.chunk(size, 1)[rank]).abs().max().item(),
        }
    return out


def _swapped_plan_errors() -> dict[str, Any]:
    """colwise/rowwise swapped (a plan mistake ``parallelize`` cannot see: a plain input's
    layout is known at the call); what each path raises at the first call."""
    from hyper_parallel.dmodule import presets

    out: dict[str, Any] = {}
    for fast in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        with fast_path(fast):
            parallelize_module(model, _mesh(), {"0": presets.rowwise(), "2": presets.colwise()})
        kind = "fast" if isinstance(installed_forward(model[0]), FastPath) else "dtensor"
        try:
            model(torch.randn(4, 8))
        except Exception as e:  # recorded, asserted in the test
            out["fast" if fast else "dtensor"] = (kind, type(e).__name__, str(e), repr(e.__cause__))
    return out


def _mlp_runs(local: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(2, 4, 8, requires_grad=True)
    return _both_paths(base, {"up": _colwise(local), "down": _rowwise(local)}, (x,))


def _sequence_parallel_runs(local: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = SequenceParallelBlock()
    ids = torch.randint(0, 32, (2, 8))
    return _both_paths(base, _sequence_parallel_plan(local), (ids,), seq_dim=1)


def _embedding_runs() -> dict[str, Any]:
    torch.manual_seed(0)
    # 33 rows on 2 ranks: 17 and 16 (DTensor's uneven chunks); the padding row is on rank 1.
    base = nn.Embedding(33, 4, padding_idx=20)
    ids = torch.tensor([[0, 16, 17, 20, 32], [20, 5, 31, 16, 17]])
    plan = {
        "": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}},
            in_dst_shardings={"input": {"tp": Replicate()}},
            out_dst_shardings={"tp": Replicate()},
        )
    }
    return _both_paths(base, plan, (ids,))


def _local_map_runs() -> dict[str, Any]:
    torch.manual_seed(0)
    base = LocalMapModel()
    x = torch.randn(2, 4, 8, requires_grad=True)
    return _both_paths(base, _local_map_plan(), (x,))


def _raw_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op): n for op, n in mode.get_comm_counts().items() if n}


def _fallback_runs() -> dict[str, Any]:
    """Calls the fast path declines run on DTensor (functional collectives), same results."""
    torch.manual_seed(0)
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base = MLP()
    results: dict[str, Any] = {}
    # A sequence of 3 does not split evenly over the ranks: the reduce-scatter falls back.
    down = copy.deepcopy(base.down)
    parallelize_module(down, _mesh(), {"": _rowwise(False, output=Shard(1))})
    h = torch.randn(2, 3, 16)
    with CommDebugMode() as comm:
        out = down(h.chunk(size, -1)[rank])
    results["uneven_sequence"] = (
        out.full_tensor().detach(),
        base.down(h).detach(),
        installed_forward(down).kind,
        _raw_counts(comm),
    )
    # A DTensor sharded on the feature dim cannot feed a column-wise layer locally.
    up = copy.deepcopy(base.up)
    parallelize_module(up, _mesh(), {"": _colwise(local=True)})
    x = torch.randn(2, 3, 8)
    shard = DTensor.from_local(x.chunk(size, -1)[rank], _mesh(), (Shard(2),))
    with CommDebugMode() as comm:
        out = up(shard)
    results["feature_sharded_input"] = (
        _full(out, seq_dim=2).detach(),
        base.up(x).detach(),
        installed_forward(up).kind,
        _raw_counts(comm),
    )
    return results


def _selector_kinds() -> dict[str, str]:
    mesh = _mesh()

    def explain(module: nn.Module, config: ShardingConfig, on: Any = mesh) -> str:
        return explain_fast_path(module, config, tuple(on.mesh_dim_names), on)

    class RMSNorm(nn.Module):  # named like a norm: the name proves nothing, DTensor runs it
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class LoRALinear(nn.Linear):  # its own forward: not nn.Linear's
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) * 2

    seq = {"tp": Shard(1)}
    out = {
        "colwise": explain(nn.Linear(8, 16), _colwise(False)),
        "colwise_sp": explain(nn.Linear(8, 16), _colwise(True, arrives=Shard(1))),
        "rowwise": explain(nn.Linear(16, 8), _rowwise(False)),
        "rowwise_sp": explain(nn.Linear(16, 8), _rowwise(False, output=Shard(1))),
        "embedding": explain(nn.Embedding(32, 8), _sequence_parallel_plan(False)["emb"]),
        "layer_norm_sp": explain(nn.LayerNorm(8), ShardingConfig(in_dst_shardings={"input": seq})),
        "rms_norm_by_name": explain(RMSNorm(), ShardingConfig(in_dst_shardings={"x": seq})),
        "custom_norm": explain(TorchNormSubclass(8), ShardingConfig(in_dst_shardings={"x": seq})),
        "torch_rms_norm_replicated": explain(
            nn.RMSNorm(8), ShardingConfig(in_dst_shardings={"x": {"tp": Replicate()}})
        ),
        "local_map": explain(Gate(16), _local_map_plan()["gate"]),
        # rejected
        "colwise_gathered": explain(
            nn.Linear(8, 16),
            ShardingConfig(
                state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
                in_dst_shardings={"input": {"tp": Replicate()}},
                out_dst_shardings={"tp": Replicate()},
            ),
        ),
        "rowwise_partial": explain(
            nn.Linear(16, 8),
            ShardingConfig(
                state_shardings={"weight": {"tp": Shard(1)}},
                in_dst_shardings={"input": {"tp": Shard(-1)}},
            ),
        ),
        "uneven_columns": explain(nn.Linear(8, 15), _colwise(False)),
        "own_forward": explain(LoRALinear(8, 16), _colwise(False)),
        "embedding_max_norm": explain(
            nn.Embedding(32, 8, max_norm=1.0), _sequence_parallel_plan(False)["emb"]
        ),
        "batch_norm": explain(nn.BatchNorm1d(8), ShardingConfig(in_dst_shardings={"input": seq})),
        "norm_sharded_feature": explain(
            nn.LayerNorm(8), ShardingConfig(in_dst_shardings={"input": {"tp": Shard(-1)}})
        ),
        "two_axes": explain(
            nn.Linear(8, 16),
            ShardingConfig(
                state_shardings={"weight": {"dp": Shard(1), "tp": Shard(0)}},
                in_dst_shardings={"input": {"tp": Replicate()}},
            ),
            on=_mesh((1, torch.distributed.get_world_size()), ("dp", "tp")),
        ),
        "second_axis_replicated": explain(
            nn.Linear(8, 16),
            _colwise(False),
            on=_mesh((1, torch.distributed.get_world_size()), ("dp", "tp")),
        ),
    }
    return out


def _switch_installs() -> dict[str, bool]:
    """What parallelize installs under each switch setting."""

    def installed() -> bool:
        model = MLP()
        parallelize_module(model, _mesh(), {"up": _colwise(False), "down": _rowwise(False)})
        return isinstance(installed_forward(model.up), FastPath)

    previous = os.environ.pop(ENV_VAR, None)
    out = {"default": installed()}
    with fast_path(False):
        out["context_off"] = installed()
        with fast_path(True):
            out["nested_on"] = installed()
    try:
        os.environ[ENV_VAR] = "0"
        out["env_off"] = installed()
        set_fast_path(True)
        out["switch_over_env"] = installed()
        set_fast_path(None)
        os.environ[ENV_VAR] = "1"
        out["env_on"] = installed()
    finally:
        set_fast_path(None)
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous
    return out


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("local", [True, False], ids=["local_output", "dtensor_output"])
def test_colwise_rowwise_mlp(dist, local):
    for runs in dist.run(_mlp_runs, local):
        # forward: one all-reduce (row-wise output); backward: one all-reduce of the
        # replicated input's gradient (Megatron's f).
        _check(runs, {"up": "colwise", "down": "rowwise"}, {"all_reduce": 1}, {"all_reduce": 1})


@pytest.mark.parametrize("local", [True, False], ids=["local_output", "dtensor_output"])
def test_sequence_parallel_block(dist, local):
    for runs in dist.run(_sequence_parallel_runs, local):
        kinds = {
            "emb": "vocab_embedding_sequence_parallel",
            "norm": "sequence_parallel_norm",
            "mlp.up": "colwise_sequence_parallel",
            "mlp.down": "rowwise_sequence_parallel",
        }
        # The vocab-parallel embedding's weight gradient keeps the weight's Shard(0) on
        # the fast path, where DTensor computes it replicated (same values). Backward:
        # the embedding's all-gather, and mlp.up's input gathered again for its weight
        # gradient (the shard kept, not the gathered input) before its reduce-scatter.
        _check(
            runs,
            kinds,
            {"reduce_scatter": 2, "all_gather": 1},
            {"all_gather": 3, "reduce_scatter": 1},
            same_grad_layouts=False,
        )
        fast, dtensor = runs["fast"]["grad_layouts"], runs["dtensor"]["grad_layouts"]
        assert fast.pop("emb.weight") == "(Shard(dim=0),)"
        dtensor.pop("emb.weight")
        assert fast == dtensor
        # Replicated norm weights on sequence shards: Partial gradients on both paths.
        assert fast["norm.weight"] == "(Partial(sum),)"


def test_vocab_parallel_embedding_uneven_rows_and_padding(dist):
    for runs in dist.run(_embedding_runs):
        _check(runs, {"": "vocab_embedding"}, {"all_reduce": 1}, {}, same_grad_layouts=False)
        assert runs["fast"]["grad_layouts"] == {"weight": "(Shard(dim=0),)"}
        assert runs["fast"]["grads"]["weight"][20].abs().sum() == 0  # the padding row


def test_local_map_regions(dist):
    for runs in dist.run(_local_map_runs):
        kinds = {"proj": "local_map", "gate": "local_map", "down": "rowwise"}
        _check(runs, kinds, {"all_reduce": 1}, {"all_reduce": 1})


def test_declined_calls_fall_back_to_dtensor(dist):
    for results in dist.run(_fallback_runs):
        got, want, kind, counts = results["uneven_sequence"]
        assert kind == "rowwise_sequence_parallel"
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
        # DTensor's functional reduce-scatter ran, then full_tensor's all-gather.
        assert "c10d_functional.reduce_scatter_tensor" in counts, counts
        assert not any(op.startswith("c10d.") for op in counts), counts
        got, want, kind, counts = results["feature_sharded_input"]
        assert kind == "colwise"
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
        assert counts == {"c10d_functional.all_gather_into_tensor": 1}


def test_selector_picks_and_rejects(dist):
    kinds = dist.run(_selector_kinds)[0]
    assert kinds["colwise"] == "colwise"
    assert kinds["colwise_sp"] == "colwise_sequence_parallel"
    assert kinds["rowwise"] == "rowwise"
    assert kinds["rowwise_sp"] == "rowwise_sequence_parallel"
    assert kinds["embedding"] == "vocab_embedding_sequence_parallel"
    assert kinds["layer_norm_sp"] == "sequence_parallel_norm"
    assert kinds["custom_norm"] == "sequence_parallel_norm"
    assert kinds["torch_rms_norm_replicated"] == "norm"
    assert kinds["local_map"] == "local_map"
    assert kinds["second_axis_replicated"] == "colwise"
    rejected = {
        "colwise_gathered": "gathered to Replicate",
        "rowwise_partial": "left Partial",
        "uneven_columns": "not divisible",
        "own_forward": "not a pattern",
        "embedding_max_norm": "max_norm",
        "batch_norm": "not a pattern",
        "norm_sharded_feature": "normalized dim",
        "rms_norm_by_name": "not a pattern",
        "two_axes": "more than one mesh axis",
    }
    for name, reason in rejected.items():
        assert kinds[name].startswith("dtensor: ") and reason in kinds[name], (name, kinds[name])


def test_switch_and_environment(dist):
    installs = dist.run(_switch_installs)[0]
    assert installs == {
        "default": True,
        "context_off": False,
        "nested_on": True,
        "env_off": False,
        "switch_over_env": True,
        "env_on": True,
    }


def test_channels_first_norm_keeps_the_dtensor_path(dist):
    """A norm over dim 1 named ``*LayerNorm`` runs on DTensor on both switches, correctly."""
    for runs in dist.run(_channels_first_norm_runs):
        for path, run in runs.items():
            assert run["ran"] == {"": "dtensor"}, path
            assert run["out"] < ATOL and run["input_grad"] < ATOL, (path, run)
            assert set(run["grads"]) == {"weight", "bias"}
            assert max(run["grads"].values()) < ATOL, (path, run["grads"])


def test_a_plan_mistake_at_the_first_call_names_the_module_on_both_paths(dist):
    """torch's own error named no module, placement or input, and differed by path (the
    fast path's "mat1 and mat2 shapes cannot be multiplied", DTensor's "Sharding
    propagation failed"). A failing fast call steps aside to the DTensor path; both raise
    the same type and message, naming them, torch's error kept in it and as the cause."""
    for runs in dist.run(_swapped_plan_errors):
        assert runs["fast"][0] == "fast" and runs["dtensor"][0] == "dtensor", runs
        fast, dtensor = runs["fast"][1:], runs["dtensor"][1:]
        assert fast == dtensor, runs
        kind, message, cause = fast
        assert kind == "RuntimeError" and "Sharding propagation failed" in cause
        assert message.startswith(
            "the call of parallelized module '0' (Linear; weight S(1) on tp; "
            "in_dst_shardings['input'] S(-1) on tp) on inputs [tensor(4, 8)] failed: "
            "RuntimeError: a and b must have same reduction dim"
        ), message
        assert "hyper_parallel.analysis.validate(model, mesh, plan)" in message
