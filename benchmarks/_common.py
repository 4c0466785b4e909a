"""Shared by the benchmarks: interleaved timing, statistics, gloo ranks, torch's Llama plan.

Benchmarks run as scripts (``python benchmarks/bench_x.py``), so this module is
imported from the script's own directory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "cli_run",
    "compile_torch_blocks",
    "gloo_ranks",
    "interleaved",
    "slowest_rank",
    "summary",
    "torch_llama_plan",
]


# The CLI's own entry point, reporting its process's peak RSS (KiB on Linux) and CPU time
# on exit.
_CLI = """
import resource, sys
from hyper_parallel.cli import main
try:
    code = main(sys.argv[1:])
finally:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = usage.ru_utime + usage.ru_stime
    print(f"peak_rss_kib={usage.ru_maxrss} cpu_s={cpu_s}", file=sys.stderr)
raise SystemExit(code)
"""


def cli_run(*args: str) -> dict[str, Any]:
    """``hyper-parallel ARGS...`` in a fresh subprocess, as a user runs it.

    Returns:
        ``stdout``, ``wall_s`` (launch to exit, start-up and imports included),
        ``cpu_s`` (user + system of the process: its wall time on an idle machine, much
        less sensitive to other load) and ``peak_rss_bytes`` (its ``ru_maxrss``).

    Raises:
        RuntimeError: The command failed (its stderr's tail is in the message).
    """
    argv = [sys.executable, "-c", _CLI, *args]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"hyper-parallel {' '.join(args)} failed:\n{err[-2000:]}")
    stats = dict(item.split("=") for item in err.strip().splitlines()[-1].split())
    return {
        "stdout": out,
        "wall_s": wall,
        "cpu_s": float(stats["cpu_s"]),
        "peak_rss_bytes": int(stats["peak_rss_kib"]) * 1024,
    }


def interleaved(
    steps: Mapping[str, Callable[[], Any]],
    *,
    reps: int,
    inner: int,
    warmup: int = 3,
    barrier: Callable[[], None] = lambda: None,
    scale: float = 1e6,
) -> dict[str, list[float]]:
    """Time each contender ``inner`` calls at a time, round-robin, ``reps`` times.

    The order rotates every repetition so no contender always runs first (after a
    barrier) or last. Returns per-call times (microseconds by default), one per
    repetition, per contender.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            step = steps[name]
            barrier()
            start = time.perf_counter()
            for _ in range(inner):
                step()
            times[name].append((time.perf_counter() - start) / inner * scale)
    return times


def summary(times: Sequence[float]) -> dict[str, float]:
    """Median, min and max of one contender's per-repetition times."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def slowest_rank(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per repetition, the slowest rank's time (a collective step is as slow as it)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {
        name: [max(t[name][i] for t in gathered) for i in range(len(values))]
        for name, values in times.items()
    }


def _rank_main(
    rank: int, world_size: int, init_file: str, out_file: str, fn: Callable, args: tuple
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, *args)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(result, f)
        dist.barrier()  # no rank tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def gloo_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> Any:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned gloo ranks; rank 0's JSON result.

    ``fn`` must be a module-level function; the rendezvous is a ``file://`` URL in a
    temporary directory (no TCP port).
    """
    with tempfile.TemporaryDirectory(prefix="hp_bench_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        out_file = os.path.join(tmp, "result.json")
        mp.spawn(
            _rank_main,
            args=(world_size, init_file, out_file, fn, args),
            nprocs=world_size,
            join=True,
        )
        with open(out_file) as f:
            return json.load(f)


def torch_llama_plan(sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's tensor-parallel styles for the reference Llama (torchtitan's plan).

    Returns:
        ``(root_plan, block_plan)``: the plan for the model's top-level modules, and
        the plan applied to each transformer block.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    residual = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    block: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        "feed_forward.w3": ColwiseParallel(),
    }
    # Each block's attention and feed-forward take their input once, as a Replicate
    # DTensor (Shard(1) under SP): the column projections inside share it, so their input
    # gradients add up locally into one Partial and one collective runs per sub-block in
    # backward (torchtitan's plan). Without it each column projection reduces its own.
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
    block["attention"] = PrepareModuleInput(
        # (x, cos, sin, mask): the block passes the causal mask (None without CP).
        input_layouts=(residual, None, None, None),
        desired_input_layouts=(Replicate(), None, None, None),
    )
    block["feed_forward"] = PrepareModuleInput(
        input_layouts=(residual,), desired_input_layouts=(Replicate(),)
    )
    return root, block


def apply_torch_llama_plan(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Parallelize a plain (unsharded) Llama with :func:`torch_llama_plan`, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    root, block = torch_llama_plan(sequence_parallel)
    parallelize_module(model, tp_mesh, root)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block)


def compile_torch_blocks(model: torch.nn.Module, backend: str = "inductor") -> None:
    """``torch.compile(fullgraph=True)`` each block of a torch-styles Llama, in place.

    torch's ``RowwiseParallel`` hands the embedding's output to the first block as an
    ``AsyncCollectiveTensor`` (its all-reduce still in flight). Fed to a compiled
    region, that input makes the backward hand a plain tensor to ``Redistribute``'s
    backward, which fails (``'Tensor' object has no attribute '_local_tensor'``; torch
    2.13, aot_eager and inductor alike). A forward hook waits for it first (one copy of
    the embedding output per step, the same work its first consumer does eagerly).
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def wait_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return output.clone() if isinstance(output, AsyncCollectiveTensor) else output

    model.tok_embeddings.register_forward_hook(wait_output)
    for block in model.layers:
        block.compile(fullgraph=True, backend=backend)
