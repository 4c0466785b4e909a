"""Toy models for the parallelize tests, and the helpers that compare them.

Each model is small, built from a ``Config`` like a real hyper_parallel model, and
exercises one part of the runtime: a column→row MLP, a sequence-parallel norm, a
sharded buffer, a tied embedding, keyword and non-tensor arguments, a tuple output,
a ``local_map`` region. The ``*_config`` functions return the configs with their
sharding; the comparison helpers check a parallelized model against its
single-device twin.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.dmodule import LocalMapConfig, Module, ShardingConfig, fast_path
from hyper_parallel.dmodule._boundary import Boundary, installed_forward
from hyper_parallel.dmodule._fast import FastPath
from hyper_parallel.dmodule.types import NamedPlacement

Linear = Module.from_nn_module(nn.Linear)
RMSNorm = Module.from_nn_module(nn.RMSNorm)
LayerNorm = Module.from_nn_module(nn.LayerNorm)


class Embedding(nn.Embedding, Module):
    """``nn.Embedding`` as a Module, declared the way a user would write it."""


# --------------------------------------------------------------------------- sharding presets


def _with_dp(named: NamedPlacement, dp: bool) -> NamedPlacement:
    return {"dp": Shard(0), **named} if dp else dict(named)


def colwise(*, dp: bool = False, bias: bool = True) -> ShardingConfig:
    """Column-parallel Linear: weight rows sharded, replicated input, output sharded last."""
    states: dict[str, NamedPlacement] = {"weight": {"tp": Shard(0)}}
    if bias:
        states["bias"] = {"tp": Shard(0)}
    return ShardingConfig(
        state_shardings=states,
        in_dst_shardings={"input": _with_dp({"tp": Replicate()}, dp)},
    )


def rowwise(*, dp: bool = False) -> ShardingConfig:
    """Row-parallel Linear: weight columns sharded, input sharded last, output replicated."""
    return ShardingConfig(
        state_shardings={"weight": {"tp": Shard(1)}, "bias": {"tp": Replicate()}},
        in_dst_shardings={"input": _with_dp({"tp": Shard(-1)}, dp)},
        out_dst_shardings=_with_dp({"tp": Replicate()}, dp),
    )


# --------------------------------------------------------------------------- models


class MLP(Module):
    """``down(gelu(up(x)))``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        up: Module.Config
        down: Module.Config

    def __init__(self, config: MLP.Config) -> None:
        super().__init__()
        self.up = config.up.build()
        self.down = config.down.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def mlp_config(dim: int, hidden: int, *, dp: bool = False) -> MLP.Config:
    """A col→row MLP: one all-reduce forward (and one backward for the input's gradient)."""
    return MLP.Config(
        up=Linear.Config(in_features=dim, out_features=hidden, sharding_config=colwise(dp=dp)),
        down=Linear.Config(in_features=hidden, out_features=dim, sharding_config=rowwise(dp=dp)),
    )


class NormBlock(Module):
    """``proj(norm(x))`` with the norm sequence-parallel (sharded on dim 1, the sequence)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        norm: Module.Config
        proj: Module.Config

    def __init__(self, config: NormBlock.Config) -> None:
        super().__init__()
        self.norm = config.norm.build()
        self.proj = config.proj.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def sequence_parallel_config(dim: int, *, norm: str = "rms") -> NormBlock.Config:
    """Norm on sequence shards (input arrives sharded on dim 1), then a column-parallel proj.

    The norm's output stays ``Shard(1)``; ``proj`` wants its input replicated, so the
    boundary all-gathers the sequence once.
    """
    seq = ShardingConfig(
        in_src_shardings={"x" if norm == "rms" else "input": {"tp": Shard(1)}},
        out_dst_shardings={"tp": Shard(1)},
    )
    norm_config = (
        RMSNorm.Config(normalized_shape=dim, sharding_config=seq)
        if norm == "rms"
        else LayerNorm.Config(normalized_shape=dim, sharding_config=seq)
    )
    return NormBlock.Config(
        norm=norm_config,
        proj=Linear.Config(in_features=dim, out_features=dim, sharding_config=colwise()),
    )


class ScaledLinear(Module):
    """A column-parallel linear with per-output-feature buffers.

    ``forward(x) = (x @ weight.T) * scale + shift``; ``scale`` is a persistent buffer,
    ``shift`` a non-persistent one; both are sharded like the weight's rows.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden: int

    def __init__(self, config: ScaledLinear.Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.hidden, config.dim))
        self.register_buffer("scale", torch.empty(config.hidden))
        self.register_buffer("shift", torch.empty(config.hidden), persistent=False)
        self.reset_parameters()
        for name, value in self.compute_buffers(self.weight.device).items():
            getattr(self, name).copy_(value)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def compute_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        hidden = self.weight.shape[0]
        steps = torch.arange(hidden, device=device, dtype=torch.float32)
        return {"scale": 1.0 + 0.1 * steps, "shift": 0.01 * steps}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) * self.scale + self.shift


def sharded_buffer_config(dim: int, hidden: int) -> ScaledLinear.Config:
    """Weight and both buffers ``Shard(0)``; output gathered to replicated."""
    return ScaledLinear.Config(
        dim=dim,
        hidden=hidden,
        sharding_config=ShardingConfig(
            state_shardings={
                "weight": {"tp": Shard(0)},
                "scale": {"tp": Shard(0)},
                "shift": {"tp": Shard(0)},
            },
            in_dst_shardings={"x": {"tp": Replicate()}},
            out_dst_shardings={"tp": Replicate()},
        ),
    )


class TiedLM(Module):
    """``out(emb(tokens))`` with ``out.weight`` tied to ``emb.weight``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        emb: Module.Config
        out: Module.Config

    def __init__(self, config: TiedLM.Config) -> None:
        super().__init__()
        self.emb = config.emb.build()
        self.out = config.out.build()
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def tied_lm_config(vocab: int, dim: int) -> TiedLM.Config:
    """Vocab-parallel embedding and output projection sharing one ``Shard(0)`` weight."""
    return TiedLM.Config(
        emb=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            sharding_config=ShardingConfig(
                state_shardings={"weight": {"tp": Shard(0)}},
                in_dst_shardings={"input": {"tp": Replicate()}},
                out_dst_shardings={"tp": Replicate()},
            ),
        ),
        out=Linear.Config(
            in_features=dim,
            out_features=vocab,
            bias=False,
            sharding_config=ShardingConfig(
                state_shardings={"weight": {"tp": Shard(0)}},
                in_dst_shardings={"input": {"tp": Replicate()}},
                out_dst_shardings={"tp": Replicate()},
            ),
        ),
    )


class Gated(Module):
    """A column-parallel linear with a keyword-only float and an optional mask."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden: int

    def __init__(self, config: Gated.Config) -> None:
        super().__init__()
        self.proj = nn.Linear(config.dim, config.hidden)

    def forward(
        self, x: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = F.linear(x, self.proj.weight, self.proj.bias) * scale
        return h if mask is None else h * mask


def gated_config(dim: int, hidden: int) -> Gated.Config:
    """States reached by dotted path; ``x`` replicated; ``mask`` split to match the output."""
    return Gated.Config(
        dim=dim,
        hidden=hidden,
        sharding_config=ShardingConfig(
            state_shardings={"proj.weight": {"tp": Shard(0)}, "proj.bias": {"tp": Shard(0)}},
            in_src_shardings={"mask": {"tp": Replicate()}},
            in_dst_shardings={"x": {"tp": Replicate()}, "mask": {"tp": Shard(-1)}},
            out_dst_shardings={"tp": Replicate()},
        ),
    )


class TwoOutputs(Module):
    """Returns ``(h, (h * h).sum(-1))`` computed on plain local tensors.

    The child projection hands back its local shard (``use_local_output``); this
    module's ``out_src_shardings`` says what each plain output is: the first a
    ``Shard(-1)`` piece, the second a per-rank partial sum.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        proj: Module.Config

    def __init__(self, config: TwoOutputs.Config) -> None:
        super().__init__()
        self.proj = config.proj.build()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x)
        return h, (h * h).sum(-1)


def two_outputs_config(dim: int, hidden: int) -> TwoOutputs.Config:
    """Per-element ``out_src_shardings``; both outputs gathered/reduced to replicated."""
    proj = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
        in_dst_shardings={"input": {"tp": Replicate()}},
        use_local_output=True,
    )
    return TwoOutputs.Config(
        proj=Linear.Config(in_features=dim, out_features=hidden, sharding_config=proj),
        sharding_config=ShardingConfig(
            out_src_shardings=({"tp": Shard(-1)}, {"tp": Partial()}),
            out_dst_shardings={"tp": Replicate()},
        ),
    )


class AttentionCore(Module):
    """``sdpa(q, k, v) * head_scale`` per head; runs on local head shards under local_map."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_heads: int

    def __init__(self, config: AttentionCore.Config) -> None:
        super().__init__()
        self.head_scale = nn.Parameter(torch.empty(config.num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.head_scale.copy_(torch.linspace(0.5, 1.5, self.head_scale.numel()))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = True
    ) -> torch.Tensor:
        assert not isinstance(q, DTensor), "local_map hands the body local tensors"
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return out * self.head_scale.view(1, -1, 1, 1)


class TemperedAttentionCore(AttentionCore):
    """:class:`AttentionCore` times a replicated scalar ``temperature``."""

    @dataclass(kw_only=True, slots=True)
    class Config(AttentionCore.Config):
        pass

    def __init__(self, config: TemperedAttentionCore.Config) -> None:
        super().__init__(config)
        self.temperature = nn.Parameter(torch.tensor([0.7]))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = True
    ) -> torch.Tensor:
        return super().forward(q, k, v, is_causal=is_causal) * self.temperature


def tempered_attention_config(num_heads: int) -> TemperedAttentionCore.Config:
    """q, k, v arrive as this rank's heads; ``temperature`` is not named, so replicated.

    Each rank's gradient of ``temperature`` covers only its heads: it must be summed.
    """
    heads = {"tp": Shard(1)}
    return TemperedAttentionCore.Config(
        num_heads=num_heads,
        sharding_config=ShardingConfig(
            state_shardings={"head_scale": {"tp": Shard(0)}},
            in_dst_shardings={"q": heads, "k": heads, "v": heads},
            out_src_shardings=heads,
            local_map=LocalMapConfig(in_grad_placements=(heads, heads, heads)),
        ),
    )


class ProjectedAttentionCore(AttentionCore):
    """:class:`AttentionCore` followed by ``post``, a plain ``nn.Linear`` child on each head.

    ``post`` has no config of its own (none is allowed inside a local_map region).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AttentionCore.Config):
        head_dim: int

    def __init__(self, config: ProjectedAttentionCore.Config) -> None:
        super().__init__(config)
        self.post = nn.Linear(config.head_dim, config.head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = True
    ) -> torch.Tensor:
        return self.post(super().forward(q, k, v, is_causal=is_causal))


def projected_attention_config(num_heads: int, head_dim: int) -> ProjectedAttentionCore.Config:
    """q, k, v arrive as this rank's heads; the child ``post``'s states are not named.

    Each rank's gradient of ``post.weight`` and ``post.bias`` covers only its heads: it
    must be summed, as for the module's own unnamed states.
    """
    heads = {"tp": Shard(1)}
    return ProjectedAttentionCore.Config(
        num_heads=num_heads,
        head_dim=head_dim,
        sharding_config=ShardingConfig(
            state_shardings={"head_scale": {"tp": Shard(0)}},
            in_dst_shardings={"q": heads, "k": heads, "v": heads},
            out_src_shardings=heads,
            local_map=LocalMapConfig(in_grad_placements=(heads, heads, heads)),
        ),
    )


def attention_core_config(num_heads: int) -> AttentionCore.Config:
    """q, k, v arrive replicated, are split by head (dim 1); the output is gathered."""
    heads = {"tp": Shard(1)}
    return AttentionCore.Config(
        num_heads=num_heads,
        sharding_config=ShardingConfig(
            state_shardings={"head_scale": {"tp": Shard(0)}},
            in_src_shardings={"q": {"tp": Replicate()}, "k": {"tp": Replicate()}},
            in_dst_shardings={"q": heads, "k": heads, "v": heads},
            out_src_shardings=heads,
            out_dst_shardings={"tp": Replicate()},
            local_map=LocalMapConfig(in_grad_placements=(heads, heads, heads)),
        ),
    )


class PlainMLP(nn.Module):
    """A plain ``nn.Module`` MLP, as a model from elsewhere (Hugging Face) would be."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class PlainFanOut(nn.Module):
    """``o(q(x) * k(x) + v(x))``: one activation read by three projections, as in attention."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * self.k(x) + self.v(x))


def fan_out_plan() -> dict[str, ShardingConfig]:
    """Each block takes its input replicated once; q, k, v column-, o row-parallel."""
    return {
        "layers.*": ShardingConfig(in_dst_shardings={"x": {"tp": Replicate()}}),
        "layers.*.q": colwise(),
        "layers.*.k": colwise(),
        "layers.*.v": colwise(),
        "layers.*.o": rowwise(),
    }


class PlainStack(nn.Module):
    """``num_layers`` plain blocks (MLPs by default) in a row, under ``layers.<i>``."""

    def __init__(self, dim: int, hidden: int, num_layers: int, block: type = PlainMLP) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(dim, hidden) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# --------------------------------------------------------------------------- comparison helpers


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a (D)Tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def placements_of(module: nn.Module) -> dict[str, tuple[Placement, ...] | None]:
    """State name → DTensor placements (``None`` for a plain tensor), tied names included."""
    states = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    return {n: tuple(t.placements) if isinstance(t, DTensor) else None for n, t in states.items()}


def grad_like(out: DTensor, grad: torch.Tensor) -> DTensor:
    """``grad`` (a full tensor, equal on every rank) laid out like ``out``; no communication."""
    return distribute_tensor(grad, out.device_mesh, out.placements, src_data_rank=None)


# c10d's in-place collectives (what plain ``torch.distributed`` calls issue) under the
# names of their functional counterparts (what DTensor issues), so counts compare.
_C10D_NAMES = {
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "allgather_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all_single",
}


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """Collective name (``all_reduce``, ``all_gather_into_tensor``...) → count."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        name = _C10D_NAMES.get(name, name)
        if n:
            counts[name] = counts.get(name, 0) + n
    return counts


def max_grad_diffs(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Parameter name → largest |grad - reference grad|; every parameter must have a grad."""
    ref = dict(reference.named_parameters())
    diffs = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        assert ref[name].grad is not None, f"reference {name} has no gradient"
        diffs[name] = (full(p.grad) - ref[name].grad).abs().max().item()
    return diffs


def compare(
    model: nn.Module,
    reference: nn.Module,
    args: Sequence[Any],
    ref_args: Sequence[Any] | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    local_grad: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    input_grads: bool = True,
    seed: int = 1234,
) -> dict[str, Any]:
    """Forward and backward of a parallelized model and its single-device twin.

    Both get the same upstream gradient (a seeded random tensor per output, laid out
    like the parallel output, so no collective is spent on it). Collectives are
    counted separately for forward and backward.

    Args:
        model: The parallelized model.
        reference: A deepcopy of it taken before ``parallelize``.
        args: This rank's positional arguments to ``model``.
        ref_args: The full arguments for ``reference`` (default: ``args``).
        kwargs: Keyword arguments, the same for both.
        local_grad: ``(i, full grad of ref_args[i]) -> this rank's expected grad of
            args[i]``; default: the full grad (a replicated input).
        input_grads: Whether floating-point tensor arguments require grad.
        seed: Seed of the upstream gradients.

    Returns:
        A picklable dict: ``fwd``/``bwd`` collective counts, ``out`` (max |diff| per
        output), ``out_placements``, ``grads`` (max |diff| per parameter),
        ``grad_placements``, ``input_grads`` (max |diff| per grad-requiring argument),
        ``paths`` (module path → (path installed, paths its forward calls ran); see
        :class:`PathLog` and :func:`assert_paths`).
    """
    kwargs = dict(kwargs or {})
    ref_args = args if ref_args is None else ref_args

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            return x.requires_grad_(input_grads and x.is_floating_point())
        return x

    xs = [leaf(a) for a in args]
    refs = [leaf(a) for a in ref_args]
    log = PathLog(model)
    with CommDebugMode() as fwd:
        out = model(*xs, **kwargs)
    log.close()
    ref_out = reference(*refs, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    ref_outs = list(ref_out) if isinstance(ref_out, tuple) else [ref_out]
    generator = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(r.shape, generator=generator, dtype=r.dtype) for r in ref_outs]
    parallel_upstream = [grad_like(o, g) for o, g in zip(outs, upstream)]
    with CommDebugMode() as bwd:
        torch.autograd.backward(outs, parallel_upstream)
    torch.autograd.backward(ref_outs, upstream)
    input_diffs = []
    for i, (x, r) in enumerate(zip(xs, refs)):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            expected = r.grad if local_grad is None else local_grad(i, r.grad)
            input_diffs.append((x.grad - expected).abs().max().item())
    return {
        "fwd": comm_counts(fwd),
        "bwd": comm_counts(bwd),
        "out": [(full(o) - r).abs().max().item() for o, r in zip(outs, ref_outs)],
        "out_placements": [tuple(o.placements) for o in outs],
        "grads": max_grad_diffs(model, reference),
        "grad_placements": {
            n: tuple(p.grad.placements) if isinstance(p.grad, DTensor) else None
            for n, p in model.named_parameters()
        },
        "input_grads": input_diffs,
        "paths": {p: (log.installed[p], sorted(k)) for p, k in log.ran().items()},
    }


def assert_numerics(result: Mapping[str, Any], where: str = "", tol: float = 1e-5) -> None:
    """Outputs, parameter gradients and input gradients of :func:`compare` all within ``tol``.

    ``where`` (e.g. the boundary path) is added to the failure message.
    """
    diffs = {
        **{f"out[{i}]": d for i, d in enumerate(result["out"])},
        **{f"grad {n}": d for n, d in result["grads"].items()},
        **{f"input grad [{i}]": d for i, d in enumerate(result["input_grads"])},
    }
    bad = {k: v for k, v in diffs.items() if not v <= tol}
    assert not bad, f"{where}: differences from the single-device model above {tol}: {bad}"


def assert_paths(result: Mapping[str, Any], path: str, *, expect_fast: bool = True) -> None:
    """The runtime path ``path`` ("fast"/"dtensor") of a :func:`compare` result is the one that ran.

    DTensor runs: every module installed and ran the DTensor boundary. Fast runs:
    every module's calls ran the path it installed (no call handed to the DTensor
    fallback unnoticed) and, with ``expect_fast``, at least one module is fast.
    """
    paths = result["paths"]
    if path == "dtensor":
        assert all(kind == "dtensor" for kind, _ in paths.values()), paths
    elif expect_fast:
        assert any(kind != "dtensor" for kind, _ in paths.values()), f"nothing fast: {paths}"
    for module, (kind, ran) in paths.items():
        assert ran in ([], [kind]), f"{path}: {module!r} installed {kind} but ran {ran}"


def mesh_1d(world_size: int) -> DeviceMesh:
    """A 1-D CPU mesh of ``world_size`` ranks with the one axis named ``tp``."""
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


# --------------------------------------------------------------------------- both runtime paths

PATHS = ("dtensor", "fast")


def build_with_twin(config: Any, seed: int = 0) -> tuple[Any, Any]:
    """The model built from ``config`` and its single-device twin (same weights)."""
    torch.manual_seed(seed)
    model = config.build()
    return model, copy.deepcopy(model)


def parallelize_on(model: Any, mesh: Any, fast: bool) -> None:
    """``model.parallelize(mesh)`` with the fast path on or off."""
    with fast_path(fast):
        model.parallelize(mesh)


def on_both_paths(case: Callable[[bool], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``case`` run with the DTensor boundary and with the fast path (same process group)."""
    return {path: case(path == "fast") for path in PATHS}


class PathLog:
    """Which path each call of each parallelized module of ``model`` actually ran.

    A module whose installed forward (``installed_forward``) is a :class:`FastPath` ran ``"<kind>"`` unless the call
    was handed to its DTensor fallback (recorded as ``"dtensor"``); a module whose
    ``forward`` is the DTensor :class:`Boundary` always runs ``"dtensor"``. Installed
    through public hooks only: a forward pre-hook per module and ``FastPath.attach``.

    Example::

        log = PathLog(model)
        model(x)
        log.ran()  # {"up": {"colwise"}, "down": {"rowwise"}}
    """

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, list[str]] = {}
        self.installed: dict[str, str] = {}  # module path → the path installed at parallelize
        self._undo: list[Callable[[], Any]] = []
        for path, module in model.named_modules():
            forward = installed_forward(module)
            if isinstance(forward, FastPath):
                self._watch(path, module, forward.kind)
                fallback = forward.fallback
                forward.attach(self._fallback(path, fallback))
                self._undo.append(lambda f=forward, fb=fallback: f.attach(fb))
            elif isinstance(forward, Boundary):
                self._watch(path, module, "dtensor")

    def _watch(self, path: str, module: nn.Module, kind: str) -> None:
        self.calls[path] = []
        self.installed[path] = kind

        def pre_hook(_module: nn.Module, _args: Any) -> None:
            self.calls[path].append(kind)

        self._undo.append(module.register_forward_pre_hook(pre_hook).remove)

    def close(self) -> None:
        """Remove the hooks and restore each fast path's own fallback."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _fallback(self, path: str, fallback: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls[path][-1] = "dtensor"
            return fallback(*args, **kwargs)

        return run

    def ran(self) -> dict[str, set[str]]:
        """Module path → the set of paths its calls took (empty: never called)."""
        return {path: set(kinds) for path, kinds in self.calls.items()}

    def clear(self) -> None:
        for kinds in self.calls.values():
            kinds.clear()
