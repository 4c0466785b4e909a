"""What one forward does, counted: Python function calls and torch dispatcher ops.

Wall-clock ratios on a shared machine swing by tens of percent between runs of the
same code; counts do not. Per forward call (after warm-up, ``torch.no_grad``), on
PyTorch's fake process group (one process, collectives cost nothing; the fast path
runs exactly as on real ranks):

- ``python_calls``: Python function calls (``sys.setprofile`` "call" events);
- ``dispatch_ops``: ATen/c10d operators seen by a ``TorchDispatchMode``.

Cases: the column→row MLP of ``bench_boundary.py`` (ours on the fast path vs the
hand-written local ``F.linear`` + ``all_reduce``, and ours on the DTensor path), the debug Llama's feed-forward
(SwiGLU: w1, w3 column-wise, w2 row-wise) and one whole Llama block, each under TP
and TP+SP on the fast path, plus the same feed-forward written by hand (TP).
``tests/unit/test_op_counts.py`` holds every count at or below a measured budget.

Run::

    .venv/bin/python benchmarks/bench_op_counts.py [--tp 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["count_dispatch_ops", "count_python_calls", "measure"]

BATCH, SEQ = 2, 16


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _collision_eq_codes() -> frozenset[Any]:
    from torch.distributed.device_mesh import DeviceMesh

    from hyper_parallel._torch_private import DTensorSpec

    return frozenset(
        f.__code__
        for f in (DTensorSpec.__eq__, DTensorSpec._check_equals, DeviceMesh.__eq__)
        if hasattr(f, "__code__")
    )


# Equality checks torch's sharding-propagation caches make on a hash-bucket collision: how
# many depends on memory addresses, so it changes from process to process (0-15 calls per
# Llama block measured) and is not the forward's cost. They are left out of the count.
_COLLISION_EQ = _collision_eq_codes()


def count_python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls made by one ``fn()`` (``sys.setprofile``)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code not in _COLLISION_EQ:
            calls += 1

    # A garbage collection during the count runs finalizers and weakref callbacks that
    # are not the forward's cost (and come and go from run to run): collect first, and
    # keep the collector off while counting.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls - 1  # fn itself


def count_dispatch_ops(fn: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """Dispatcher operators run by one ``fn()``: the total and per operator."""
    with _OpCounter() as counter:
        fn()
    return sum(counter.ops.values()), dict(counter.ops)


def _counted(fn: Callable[[], Any], warmup: int = 3) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    # The fewest of several counts: a few calls come and go between runs (caches
    # refilled in torch), the forward's own cost does not.
    calls = [count_python_calls(fn) for _ in range(5)]
    ops, by_op = count_dispatch_ops(fn)
    return {"python_calls": min(calls), "dispatch_ops": ops, "ops": by_op}


class _HandSwiGLU(nn.Module):
    """The debug Llama's feed-forward by hand: local shards, one all-reduce (TP)."""

    def __init__(self, ffn: nn.Module, rank: int, tp: int) -> None:
        super().__init__()
        rows = ffn.w1.weight.shape[0] // tp
        part = slice(rank * rows, (rank + 1) * rows)
        self.w1 = ffn.w1.weight.detach()[part].clone()
        self.w3 = ffn.w3.weight.detach()[part].clone()
        self.w2 = ffn.w2.weight.detach()[:, part].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)
        dist.all_reduce(y)
        return y


def _block_call(model: nn.Module, tokens: torch.Tensor, which: str) -> Callable[[], Any]:
    """A call of ``model.layers[0]`` (or its feed-forward) with the inputs it really gets."""
    target = model.layers[0] if which == "block" else model.layers[0].feed_forward
    seen: dict[str, Any] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("args", (args, kwargs))

    handle = target.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.no_grad():
        model(tokens)
    handle.remove()
    args, kwargs = seen["args"]

    def call() -> None:
        with torch.no_grad():
            target(*args, **kwargs)

    return call


def _llama(layout: str, mesh: Any) -> nn.Module:
    from hyper_parallel.dmodule import fast_path
    from hyper_parallel.models.llama import apply_tp, apply_tp_sp, preset_config

    config = preset_config("llama3-debug")
    apply = apply_tp if layout == "tp" else apply_tp_sp
    with torch.device("meta"):
        model = apply(config, tp_size=mesh.size()).build()
    with fast_path(True):
        model.parallelize(mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()
    return model


def measure(tp: int = 2) -> dict[str, dict[str, dict[str, Any]]]:
    """Counts per case and contender: ``{case: {contender: {python_calls, dispatch_ops}}}``.

    Initializes (and destroys) a fake process group of ``tp`` ranks unless one exists.
    """
    from bench_boundary import MLP, HandWritten, our_plan
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.dmodule import fast_path, parallelize_module

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        out: dict[str, dict[str, dict[str, Any]]] = {}
        torch.manual_seed(0)
        base = MLP(64, 256)
        x = torch.randn(BATCH, SEQ, 64)
        with fast_path(True):
            ours = parallelize_module(copy.deepcopy(base), mesh, our_plan())
        with fast_path(False):
            ours_dtensor = parallelize_module(copy.deepcopy(base), mesh, our_plan())
        hand = HandWritten(base, 0, tp)

        def run(model: nn.Module) -> Callable[[], None]:
            def call() -> None:
                with torch.no_grad():
                    model(x)

            return call

        out["mlp tp"] = {
            "ours (fast)": _counted(run(ours)),
            "hand-written": _counted(run(hand)),
            "ours (DTensor)": _counted(run(ours_dtensor)),
        }
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        for layout in ("tp", "tp_sp"):
            model = _llama(layout, mesh)
            name = "TP" if layout == "tp" else "TP+SP"
            ffn = {"ours (fast)": _counted(_block_call(model, tokens, "ffn"))}
            if layout == "tp":
                reference = preset_config_model()
                hand_ffn = _HandSwiGLU(reference.layers[0].feed_forward, 0, tp)
                h = torch.randn(BATCH, SEQ, reference.layers[0].feed_forward.w1.weight.shape[1])
                ffn["hand-written"] = _counted(run_with(hand_ffn, h))
            out[f"llama feed-forward {name}"] = ffn
            out[f"llama block {name}"] = {
                "ours (fast)": _counted(_block_call(model, tokens, "block"))
            }
        return out
    finally:
        if own_group:
            dist.destroy_process_group()


def preset_config_model() -> nn.Module:
    """The one-device debug Llama (seeded)."""
    from hyper_parallel.models.llama import preset_config

    torch.manual_seed(0)
    model = preset_config("llama3-debug").build()
    model.init_states()
    return model


def run_with(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def call() -> None:
        with torch.no_grad():
            model(x)

    return call


def format_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """A markdown table: one row per case, ours and hand-written side by side."""
    lines = [
        "| case | ours: Python calls | ours: dispatcher ops | hand-written: Python calls "
        "| hand-written: dispatcher ops |",
        "|---|---:|---:|---:|---:|",
    ]
    for case, contenders in results.items():
        ours, hand = contenders["ours (fast)"], contenders.get("hand-written")
        h_calls = str(hand["python_calls"]) if hand else "—"
        h_ops = str(hand["dispatch_ops"]) if hand else "—"
        lines.append(
            f"| {case} | {ours['python_calls']} | {ours['dispatch_ops']} | {h_calls} | {h_ops} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    results = measure(args.tp)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"tp": args.tp, "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
