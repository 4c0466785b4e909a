"""Per-forward cost of a column→row MLP: ours vs torch's tensor-parallel styles vs hand-written.

The model is ``down(relu(up(x)))`` with ``up`` a ``Linear(d, 4d)`` split column-wise
and ``down`` a ``Linear(4d, d)`` split row-wise, output replicated. Contenders, all
built from the same weights and run interleaved (round-robin, one block of calls each
per repetition, the order rotated every repetition):

- ``ours (fast)``: ``parallelize_module`` with ShardingConfigs, fast boundary path;
- ``ours (DTensor)``: the same configs on the DTensor path (``fast_path(False)``);
- ``torch styles``: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel``;
- ``hand-written``: local ``F.linear`` on the weight shards + one ``all_reduce``
  (Megatron's ``g`` for the backward).

Both of ours hand plain local tensors between the two layers and back to the caller
(``use_local_output=True``), exactly as torch's styles do by default.

With ``--compile-tp N``, gloo at tp=N adds forward+backward cases where each contender is the
same module compiled whole (``torch.compile(fullgraph=True, dynamic=False)``,
inductor: the MLP is the block); the hand-written one (a c10d all-reduce in an ``autograd.Function``) is
left out there.

On the fake process group (``--backend fake``, one process, tp=8) collectives cost
nothing, so the times are pure framework overhead; on gloo (``--backend gloo``) the
ranks are real processes and the all-reduce is real. Reports the median, min and max
of the per-call time over repetitions and the ratios of medians.

Run::

    .venv/bin/python benchmarks/bench_boundary.py                 # fake tp=8 and gloo tp=2
    .venv/bin/python benchmarks/bench_boundary.py --backend fake --tp 8 --reps 40
    .venv/bin/python benchmarks/bench_boundary.py --backend gloo --tp 2 4 --size small medium
    .venv/bin/python benchmarks/bench_boundary.py --backend gloo --tp 2 --mode fwd+bwd --compile-tp 2

This is a measurement, not a test: it prints, and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import gloo_ranks, interleaved, slowest_rank
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

CONTENDERS = ("ours (fast)", "ours (DTensor)", "torch styles", "hand-written")


@dataclass
class Case:
    """One measured configuration."""

    backend: str
    tp: int
    batch: int
    seq: int
    dim: int
    backward: bool
    reps: int
    inner: int
    dtensor_activations: bool = False
    compiled: bool = False

    @property
    def label(self) -> str:
        mode = "fwd+bwd" if self.backward else "fwd"
        return (
            f"{self.backend} tp={self.tp} x=({self.batch},{self.seq},{self.dim}) "
            f"hidden={4 * self.dim} {mode}{' compiled' if self.compiled else ''}"
        )

    @property
    def contenders(self) -> tuple[str, ...]:
        return CONTENDERS[:-1] if self.compiled else CONTENDERS


@dataclass
class Result:
    """Per-call times in microseconds, per contender, one value per repetition."""

    case: Case
    times_us: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.times_us[name])

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": asdict(self.case),
            "label": self.case.label,
            "times_us": self.times_us,
            "median_us": {n: self.median(n) for n in self.times_us},
            "min_us": {n: min(v) for n, v in self.times_us.items()},
            "max_us": {n: max(v) for n, v in self.times_us.items()},
        }


# --------------------------------------------------------------------------- the model


class MLP(nn.Module):
    """``down(relu(up(x)))``: the column→row pair of every transformer feed-forward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def our_plan(dtensor_activations: bool = False) -> dict[str, Any]:
    """Column-wise ``up``, row-wise ``down``, as ShardingConfigs on axis ``tp``."""
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.dmodule import ShardingConfig

    local = not dtensor_activations
    return {
        "up": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
            in_dst_shardings={"input": {"tp": Replicate()}},
            out_dst_shardings={"tp": Shard(-1)},
            use_local_output=local,
        ),
        "down": ShardingConfig(
            state_shardings={"weight": {"tp": Shard(1)}},
            in_dst_shardings={"input": {"tp": Shard(-1)}},
            out_dst_shardings={"tp": Replicate()},
            use_local_output=local,
        ),
    }


class _ReduceFromGroup(torch.autograd.Function):
    """Hand-written Megatron ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class HandWritten(nn.Module):
    """Plain tensors: each rank holds its weight shards; one all-reduce per forward."""

    def __init__(self, base: MLP, rank: int, tp: int) -> None:
        super().__init__()
        rows = base.up.out_features // tp
        part = slice(rank * rows, (rank + 1) * rows)
        self.up_weight = nn.Parameter(base.up.weight.detach()[part].clone())
        self.up_bias = nn.Parameter(base.up.bias.detach()[part].clone())
        self.down_weight = nn.Parameter(base.down.weight.detach()[:, part].clone())
        self.down_bias = nn.Parameter(base.down.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(F.linear(x, self.up_weight, self.up_bias))
        y = F.linear(h, self.down_weight)
        y = _ReduceFromGroup.apply(y) if torch.is_grad_enabled() else _all_reduce(y)
        return y + self.down_bias


def _all_reduce(y: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(y)
    return y


def build_contenders(case: Case, mesh: Any, rank: int) -> dict[str, nn.Module]:
    """Every contender, from the same seeded weights."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from hyper_parallel.dmodule import fast_path, parallelize_module

    torch.manual_seed(0)
    base = MLP(case.dim, 4 * case.dim)
    models: dict[str, nn.Module] = {}
    with fast_path(True):
        models["ours (fast)"] = parallelize_module(
            copy.deepcopy(base), mesh, our_plan(case.dtensor_activations)
        )
    with fast_path(False):
        models["ours (DTensor)"] = parallelize_module(
            copy.deepcopy(base), mesh, our_plan(case.dtensor_activations)
        )
    models["torch styles"] = torch_parallelize(
        copy.deepcopy(base), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    if case.compiled:
        # One static graph per case: a second shape's recompile with dynamic shapes
        # fails in inductor for both DTensor contenders (RecursionError, torch 2.13).
        for model in models.values():
            model.compile(fullgraph=True, backend="inductor", dynamic=False)
    else:
        models["hand-written"] = HandWritten(base, rank, case.tp)
    return models


def _step(model: nn.Module, x: torch.Tensor, backward: bool) -> Callable[[], None]:
    if not backward:

        def forward_only() -> None:
            with torch.no_grad():
                y = model(x)
            # torch's styles return an AsyncCollectiveTensor whose all-reduce is still in
            # flight; a forward is done when its result is, so wait for it.
            if isinstance(y, DTensor):
                y = y.to_local()
            if isinstance(y, AsyncCollectiveTensor):
                y.wait()

        return forward_only

    params = list(model.parameters())

    def forward_backward() -> None:
        for p in params:  # as optimizer.zero_grad() does: the step's grads are fresh
            p.grad = None
        y = model(x)
        if isinstance(y, DTensor):
            y = y.to_local()
        y.sum().backward()

    return forward_backward


def measure(case: Case, rank: int, mesh: Any, barrier: Callable[[], None]) -> Result:
    """Run the contenders interleaved; per repetition, time ``inner`` calls of each."""
    models = build_contenders(case, mesh, rank)
    x = torch.randn(case.batch, case.seq, case.dim)
    steps = {name: _step(models[name], x, case.backward) for name in case.contenders}
    times = interleaved(
        steps, reps=case.reps, inner=case.inner, warmup=max(3, case.inner // 4), barrier=barrier
    )
    return Result(case, times)


# --------------------------------------------------------------------------- backends


def run_fake(case: Case) -> Result:
    """One process, fake process group of ``case.tp`` ranks: collectives are free."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.tp)
    mesh = init_device_mesh("cpu", (case.tp,), mesh_dim_names=("tp",))
    return measure(case, 0, mesh, lambda: None)


def _gloo_rank(rank: int, case_dicts: list[dict[str, Any]]) -> list[dict[str, list[float]]]:
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh

    out = []
    for case_dict in case_dicts:
        case = Case(**case_dict)
        mesh = init_device_mesh("cpu", (case.tp,), mesh_dim_names=("tp",))
        out.append(slowest_rank(measure(case, rank, mesh, dist.barrier).times_us))
    return out


def run_gloo(cases: list[Case]) -> list[Result]:
    """Cases of one tp size on that many gloo ranks (one spawn), ``file://`` rendezvous."""
    (tp,) = {c.tp for c in cases}
    times = gloo_ranks(_gloo_rank, tp, [asdict(c) for c in cases])
    return [Result(c, t) for c, t in zip(cases, times)]


# --------------------------------------------------------------------------- report


def format_result(result: Result) -> str:
    """A table: median, min-max and ratios of medians for one case."""
    ours = result.median("ours (fast)")
    lines = [
        result.case.label,
        f"  {'contender':<16} {'median µs':>10} {'min-max µs':>19} {'ours/this':>10}",
    ]
    for name in result.case.contenders:
        ts = result.times_us[name]
        med = result.median(name)
        lines.append(
            f"  {name:<16} {med:>10.1f} {min(ts):>9.1f}-{max(ts):<9.1f} {ours / med:>10.2f}"
        )
    torch_med = result.median("torch styles")
    dtensor_med = result.median("ours (DTensor)")
    ratios = [f"ours(fast)/torch = {ours / torch_med:.2f}"]
    if "hand-written" in result.times_us:
        hand_med = result.median("hand-written")
        ratios.append(f"ours(fast)/hand = {ours / hand_med:.2f}")
    ratios.append(f"ours(DTensor)/torch = {dtensor_med / torch_med:.2f}")
    if "hand-written" in result.times_us:
        ratios.append(f"torch/hand = {torch_med / hand_med:.2f}")
    lines.append("  ratios: " + ", ".join(ratios))
    return "\n".join(lines)


SIZES = {"small": (2, 16, 256), "medium": (4, 64, 512)}  # (batch, seq, dim); hidden = 4 dim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("fake", "gloo", "both"), default="both")
    parser.add_argument(
        "--tp", type=int, nargs="+", default=None, help="default: 8 on fake, 2 on gloo"
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        nargs="+",
        default=["small"],
        help=f"activation sizes (batch, seq, dim): {SIZES}",
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--inner", type=int, default=20, help="calls per timed block")
    parser.add_argument(
        "--mode", choices=("fwd", "fwd+bwd", "both"), default="both", help="what one call is"
    )
    parser.add_argument(
        "--dtensor-activations",
        action="store_true",
        help="ours hands DTensors between the layers (use_local_output=False)",
    )
    parser.add_argument(
        "--compile-tp",
        type=int,
        nargs="*",
        default=[],
        help="on gloo at these tp sizes, also forward+backward with every contender "
        "compiled (inductor)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    backends = ("fake", "gloo") if args.backend == "both" else (args.backend,)
    modes = (False, True) if args.mode == "both" else (args.mode == "fwd+bwd",)
    results = []
    for backend in backends:
        for tp in args.tp or ([8] if backend == "fake" else [2]):
            cases = [
                Case(
                    backend,
                    tp,
                    *SIZES[size],
                    backward,
                    args.reps,
                    # Bigger activations: fewer calls per block keep the run short.
                    args.inner if size == "small" else max(2, args.inner // 5),
                    args.dtensor_activations,
                )
                for size in args.size
                for backward in modes
            ]
            if backend == "gloo" and tp in args.compile_tp:
                cases += [
                    dataclasses.replace(c, compiled=True)
                    for c in cases
                    if c.backward and not c.dtensor_activations
                ]
            done = [run_fake(c) for c in cases] if backend == "fake" else run_gloo(cases)
            for result in done:
                print(format_result(result), flush=True)
            results.extend(done)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in results], f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
