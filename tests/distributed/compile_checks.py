"""Rank-side checks of parallelized models (Llama, Qwen3-MoE) under ``torch.compile``.

Module-level functions, run on every rank through ``dist.run`` by ``test_compile.py``.
Each builds the same model twice (same seed), compiles one of them and runs both on
the same batches: two forward+backward steps (gradients accumulate), a backward run
twice over one retained graph, then new sequence lengths. Dynamo's own counters say
how many graphs were compiled; ``fullgraph=True`` turns any graph break into an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.distributed as c10d
from torch._dynamo.utils import counters

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.distributed import MeshLayout
from hyper_parallel.distributed import context_parallel as cp
from hyper_parallel.dmodule import Module, ShardingConfig, fast_path
from hyper_parallel.dmodule.types import NamedPlacement
from hyper_parallel.models.llama import (
    apply_cp,
    apply_tp,
    apply_tp_sp,
    cross_entropy_loss,
    preset_config,
)
from tests._compare import worst_abs
from tests.distributed.models import Linear

LAYOUTS = {"tp": apply_tp, "tp_sp": apply_tp_sp}


def _build(layout: str, fast: bool, num_layers: int) -> torch.nn.Module:
    world = c10d.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    config = preset_config("llama3-debug", num_layers=num_layers, dim=32, ffn_dim=64)
    model = LAYOUTS[layout](config, tp_size=world).build()
    with fast_path(fast):
        model.parallelize(mesh)
    torch.manual_seed(0)
    model.init_states()
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: torch.nn.Module, seq_len: int, seed: int) -> torch.Tensor:
    inputs, targets = _batch(seq_len, seed)
    return cross_entropy_loss(model(inputs), targets)


def _grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    grads = dict(b.named_parameters())
    return worst_abs(
        [(_full(p.grad) - _full(grads[n].grad)).abs().max().item() for n, p in a.named_parameters()]
    )


def compiled_matches_eager(
    layout: str, fast: bool, backend: str, scope: str, new_lengths: bool = True
) -> dict[str, Any]:
    """Compile ``scope`` and compare with eager: "blocks" (each block, ``fullgraph=True``),
    "model", or "apply_compile" (the blocks, through the trainer's entry point).

    ``new_lengths=False`` stops after the two same-shape steps (one graph to compile:
    what fits inductor's code generation in a test's time on a small CPU machine).

    Returns:
        Largest loss and gradient differences per phase, and how many graphs dynamo
        had compiled after each phase (each compiled unit compiles once per shape
        class: the first static, then one dynamic graph for new sequence lengths;
        ``apply_compile`` on the DTensor path: one static graph per length). The
        lengths are 24, 32, then 24 again.
    """
    torch._dynamo.reset()
    counters.clear()
    eager = _build(layout, fast, num_layers=1)
    compiled = _build(layout, fast, num_layers=1)
    if scope == "blocks":
        for block in compiled.layers:
            block.compile(fullgraph=True, backend=backend)
    elif scope == "apply_compile":
        from hyper_parallel.distributed.compile import apply_compile

        apply_compile(compiled, backend=backend)
    else:
        compiled.compile(fullgraph=True, backend=backend)

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    out: dict[str, Any] = {"loss_diffs": [], "graphs": {}}
    # Two forward+backward steps of the same shapes, gradients accumulating.
    for step in range(2):
        a, b = _loss(eager, 16, step), _loss(compiled, 16, step)
        a.backward()
        b.backward()
        out["loss_diffs"].append(abs(_full(a).item() - _full(b).item()))
        out["graphs"][f"step{step}"] = graphs()
    out["grad_diff_two_steps"] = _grad_diff(eager, compiled)
    # New sequence lengths, then one seen before.
    new_seq_diffs: list[float] = []
    for phase, seq_len in enumerate((24, 32, 24) if new_lengths else ()):
        eager.zero_grad()
        compiled.zero_grad()
        a, b = _loss(eager, seq_len, seq_len), _loss(compiled, seq_len, seq_len)
        a.backward()
        b.backward()
        out["loss_diffs"].append(abs(_full(a).item() - _full(b).item()))
        out["graphs"][f"seq{seq_len}" + ("_again" if phase == 2 else "")] = graphs()
        new_seq_diffs.append(_grad_diff(eager, compiled))
    if new_lengths:
        out["grad_diff_new_seq"] = worst_abs(new_seq_diffs)
    out["graph_breaks"] = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return out


def backward_twice(layout: str, fast: bool, backend: str) -> dict[str, Any]:
    """A compiled block whose graph is run backward twice (``retain_graph=True``).

    AOTAutograd donates saved buffers to the backward by default, which forbids a
    second backward over the same graph; a user who needs it compiles with
    ``torch._functorch.config.patch(donated_buffer=False)`` (scoped, as here). The
    gradients must then equal eager's.

    Returns:
        The largest gradient difference and the number of graphs compiled.
    """
    torch._dynamo.reset()
    counters.clear()
    eager = _build(layout, fast, num_layers=1)
    compiled = _build(layout, fast, num_layers=1)
    for block in compiled.layers:
        block.compile(fullgraph=True, backend=backend)
    with torch._functorch.config.patch(donated_buffer=False):
        for model in (eager, compiled):
            # A plain function of the logits: the vocab-parallel loss frees its own
            # inner graph in backward.
            loss = model(_batch(16, 7)[0]).float().pow(2).mean()
            loss.backward(retain_graph=True)
            loss.backward()
    out = {"grad_diff": _grad_diff(eager, compiled), "graphs": counters["stats"]["unique_graphs"]}
    torch._dynamo.reset()
    return out


def compiled_cp_matches_eager(backend: str) -> dict[str, Any]:
    """Context parallel over every rank, each block compiled, vs the same model eager.

    Each rank feeds its part of the sequence and the global positions of its tokens
    (what the trainer does); the blocks take the positions as a graph input. Two
    forward+backward steps of the same shapes, gradients accumulating.

    Returns:
        Largest loss and gradient differences, graphs compiled after each step, and
        graph breaks.
    """
    torch._dynamo.reset()
    counters.clear()
    world = c10d.get_world_size()
    mesh = MeshLayout.parse(f"cp={world}").build("cpu")
    cp_rank = mesh.local_rank("cp")
    config = apply_cp(preset_config("llama3-debug", num_layers=1), cp_size=world)

    def build() -> torch.nn.Module:
        model = config.build()
        model.parallelize(mesh.submesh(["cp"]))
        torch.manual_seed(0)
        model.init_states()
        return model

    eager, compiled = build(), build()
    for block in compiled.layers:
        block.compile(fullgraph=True, backend=backend)
    seq_len = 16
    pos = cp.positions(seq_len, cp_rank, world)
    out: dict[str, Any] = {"loss_diffs": [], "graphs": []}
    for step in range(2):
        inputs, targets = _batch(seq_len, step)
        inputs, targets = (cp.shard_sequence(t, cp_rank, world) for t in (inputs, targets))
        a, b = (cross_entropy_loss(m(inputs, positions=pos), targets) for m in (eager, compiled))
        a.backward()
        b.backward()
        out["loss_diffs"].append(abs(_full(a).item() - _full(b).item()))
        out["graphs"].append(counters["stats"]["unique_graphs"])
    out["grad_diff"] = _grad_diff(eager, compiled)
    out["graph_breaks"] = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return out


def compiled_moe_matches_eager(backend: str) -> dict[str, Any]:
    """qwen3-moe-debug on dp_shard x ep (every rank), built by the trainer, compiled vs eager.

    The trainer's own build (its run plan through the one builder): routed experts on
    ``ep``, an FSDP2 unit of their own over ``efsdp``, blocks FSDP2 over ``dp_shard``;
    the compiled model's blocks are compiled with ``backend`` (the run plan's
    ``compile_backend``; region by region around the experts). Each rank feeds its own sequences, so the all-to-alls
    move real tokens with split sizes that change per layer and step. Two
    forward+backward steps of the same shapes, gradients accumulating.

    Returns:
        Loss differences per step, the largest gradient difference (local shards,
        placed alike in both models), graphs compiled after each step, graph breaks,
        and whether the experts are an FSDP2 unit of their own.
    """
    import dataclasses

    from torch.distributed.fsdp import FSDPModule

    from hyper_parallel.distributed.builder import build_model
    from hyper_parallel.train import trainer

    torch._dynamo.reset()
    counters.clear()
    world = c10d.get_world_size()
    cfg = trainer.TrainConfig(
        model="qwen3-moe-debug",
        model_overrides={"num_layers": 1},
        mesh={"dp_shard": world, "ep": world},
        seq_len=16,
    )
    mesh = trainer.build_mesh(cfg.mesh, "cpu")
    eager = trainer.build_parallel_model(cfg, mesh, "cpu")
    # The trainer's run plan with compile on, through the one builder, on ``backend``.
    run = trainer.run_plan(cfg.replace(compile=True), layout=mesh.layout)
    run = dataclasses.replace(run, compile_backend=backend)
    compiled = build_model(run, mesh, "cpu", cfg.seed)
    rank = c10d.get_rank()
    out: dict[str, Any] = {"loss_diffs": [], "graphs": []}
    for step in range(2):
        inputs, targets = _batch(cfg.seq_len, 10 * step + rank)
        a, b = (cross_entropy_loss(m(inputs), targets) for m in (eager, compiled))
        a.backward()
        b.backward()
        out["loss_diffs"].append(abs(a.item() - b.item()))
        out["graphs"].append(counters["stats"]["unique_graphs"])
    grads = dict(compiled.named_parameters())
    out["grad_diff"] = worst_abs(
        [
            (_local(p.grad) - _local(grads[n].grad)).abs().max().item()
            for n, p in eager.named_parameters()
        ]
    )
    out["graph_breaks"] = sum(counters["graph_break"].values())
    out["experts_fsdp_unit"] = isinstance(compiled.layers[0].moe.experts, FSDPModule)
    torch._dynamo.reset()
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _LinearPair(Module):
    """``down(up(x))``: two bias-free linears, no pointwise maths between them."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        up: Module.Config
        down: Module.Config

    def __init__(self, config: _LinearPair.Config) -> None:
        super().__init__()
        self.up = config.up.build()
        self.down = config.down.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _linear_pair(dim: int, hidden: int, sequence_parallel: bool) -> _LinearPair.Config:
    """Column- then row-parallel; with ``sequence_parallel`` the input arrives and the
    output leaves sharded on the sequence (all-gather in, reduce-scatter out)."""
    seq: NamedPlacement = {"tp": Shard(1)}
    up = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}},
        in_src_shardings={"input": seq} if sequence_parallel else None,
        in_dst_shardings={"input": {"tp": Replicate()}},
    )
    down = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(1)}},
        in_dst_shardings={"input": {"tp": Shard(-1)}},
        out_dst_shardings=seq if sequence_parallel else {"tp": Replicate()},
    )
    return _LinearPair.Config(
        up=Linear.Config(in_features=dim, out_features=hidden, bias=False, sharding_config=up),
        down=Linear.Config(in_features=hidden, out_features=dim, bias=False, sharding_config=down),
    )


def inductor_boundaries_match_eager(sequence_parallel: bool) -> dict[str, Any]:
    """Column- and row-wise boundaries (and their sequence-parallel forms) on the fast
    path, compiled whole by inductor with ``fullgraph=True``, against eager.

    Bias-free linears with nothing pointwise between them: the graphs are the two
    matmuls (library calls) and the boundaries' functional collectives, which inductor
    lowers itself — so little or no C++ needs compiling and the check fits a test's time
    (~5-13 s cold here). ``compile_threads=1`` compiles in the rank itself (its pool of
    compile workers is not needed).
    """
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        torch._dynamo.reset()
        counters.clear()
        mesh = init_device_mesh("cpu", (c10d.get_world_size(),), mesh_dim_names=("tp",))
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = _linear_pair(16, 32, sequence_parallel).build()
            with fast_path(True):
                model.parallelize(mesh)
            models.append(model)
        eager, compiled = models
        compiled.compile(fullgraph=True, backend="inductor")
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
        if sequence_parallel:
            x = x.chunk(c10d.get_world_size(), dim=1)[c10d.get_rank()]
        loss_diffs = []
        for _ in range(2):  # gradients accumulate over two steps
            a, b = eager(x).pow(2).sum(), compiled(x).pow(2).sum()
            a.backward()
            b.backward()
            loss_diffs.append((_full(a) - _full(b)).abs().item())
        out = {
            "loss_diffs": loss_diffs,
            "grad_diff": _grad_diff(eager, compiled),
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
        torch._dynamo.reset()
    return out
