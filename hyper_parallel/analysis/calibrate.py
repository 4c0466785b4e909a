"""Measure this machine into a hardware file: ``hyper-parallel calibrate --out FILE.yaml``.

Spawns ``ranks`` local processes on gloo (torch's ``mp.spawn``, a ``file://``
rendezvous) and measures, all ranks at once (as a training step runs them):

- **matmul FLOP/s** per dtype (fp32, bf16): square matmuls, ``2 n^3`` FLOPs each, the
  median rank's rate, written as ``peak_flops``; and ``compute_efficiency``: the rate of
  a small training step (forward and backward of an MLP stack at a CPU-sized decoder's
  width, :data:`_MLP`: width 384, hidden 1,024, 3 blocks, 384 tokens) over the fp32
  matmul rate: small matmuls, elementwise ops and autograd run below the large-matmul
  peak;
- **each collective** (all_gather, reduce_scatter, all_reduce, all_to_all, and
  point-to-point send/recv) at a small and a large size: the latency-bandwidth model
  of :mod:`~hyper_parallel.analysis.cost_model` solved for its two unknowns
  (per-step latency from the small size over the ring's steps; bandwidth from the
  large size's wire bytes over the rest of its time). Each is issued right after a
  short burst of matmuls on every rank and timed less that burst: the ranks arrive at
  it as a training step's computations let them (on a CPU with more ranks than
  cores, as the scheduler lets them), not in lock-step. Over all ranks
  (``collectives``) and, for every smaller power-of-two group size, over all groups
  of that size at once (``collectives_by_group``: every group of a mesh axis runs at
  the same time in a step, and on one host they share the cores and memory);
- **memory bandwidth** (a large copy), for the optimizer step and the operators
  without a FLOP formula (elementwise, norms, softmax, copies);
- ``op_overhead_s``: the fixed cost of one aten operator (a tiny training step's time
  over the operators it runs), and ``dtensor_op_overhead_s``: the extra cost of an
  operator on a DTensor (sharding propagation, unwrapping and wrapping): AdamW steps
  of tiny DTensor parameters on the ranks' mesh against the same on plain tensors,
  over the operators they run;
- ``comm_overlap``: the share of a collective's time that hides behind compute
  running at the same time (an asynchronous all-gather issued before matmuls and
  waited for after them, against the two run apart): about 1 where the network
  moves data on its own engines (GPUs with NCCL), less where the same cores that
  compute also run the collective (gloo on a CPU);
- ``memory_bytes``: the machine's RAM over the ranks; ``gpus_per_node``: the ranks.

Every workload has its own sizes (512 x 512 matmuls, the MLP stack above, 8 x 8
operators, 4 KiB and 8 MiB collectives, a 32 MiB copy), chosen unlike the model sizes
``benchmarks/bench_suggest.py`` then predicts and measures (a decoder of width 256 and
FFN 768, a mixture of experts of width 128, 128-token sequences, 8 per step): the
calibration is an input to the cost model, not a fit of the benchmark.

The network between nodes is not measured (one machine): ``inter_node`` repeats the
slowest local collective link, and says so.

Example::

    from hyper_parallel.analysis.calibrate import calibrate
    calibrate("this-machine.yaml", ranks=4, threads=1)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from hyper_parallel._torch_private import all_gather_single, reduce_scatter_single

__all__ = ["calibrate"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")
_SMALL = 1024  # elements (4 KiB fp32)
_LARGE = 1 << 21  # elements (8 MiB fp32)


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective(kind: str, numel: int, world: int, rank: int, group: Any = None) -> Any:
    """A callable issuing one ``kind`` whose per-rank buffer (dry run convention) is
    ``numel``, over ``group`` (``world`` ranks; default: all)."""
    if kind == "all_gather":
        shard = torch.ones(numel // world)
        out = torch.empty(numel)
        return lambda: all_gather_single(out, shard, group=group)
    if kind == "reduce_scatter":
        full = torch.ones(numel)
        out = torch.empty(numel // world)
        return lambda: reduce_scatter_single(out, full, group=group)
    if kind == "all_reduce":
        t = torch.ones(numel)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "all_to_all":
        src = torch.ones(numel)
        dst = torch.empty(numel)
        return lambda: dist.all_to_all_single(dst, src, group=group)
    buf = torch.ones(numel)  # p2p: rank 0 sends to rank 1

    def p2p() -> None:
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)

    return p2p


_BURST_S = 5e-3
"""Compute before each timed collective: a few milliseconds, as between a training
step's collectives, and longer than a scheduler's time slice, so that ranks sharing
cores arrive at the collective as the scheduler lets them (measured on 4 ranks on 2
cores: the cost of a small all-reduce after compute grows with the burst up to about a
millisecond of compute, then stays)."""


def _after_compute(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` issued right after a burst of matmuls of about
    :data:`_BURST_S` on every rank, less the burst's own median time."""
    a = torch.randn(128, 128)
    one = _timed(lambda: torch.mm(a, a), repeats)
    inner = max(1, round(_BURST_S / max(one, 1e-7)))
    # The same count on every rank (the slowest rank's), so they compute alike.
    count = torch.tensor([inner])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    inner = int(count.item())

    def burst() -> None:
        for _ in range(inner):
            torch.mm(a, a)

    def both() -> None:
        burst()
        fn()

    return _timed(both, repeats) - _timed(burst, repeats)


def _fit(kind: str, small: float, large: float, world: int) -> dict[str, float]:
    """Per-step latency and bandwidth of ``kind`` on ``world`` ranks from its small- and
    large-buffer times."""
    steps = _steps(kind, world)
    latency = max(small / steps, 1e-7)
    transfer = max(large - steps * latency, 1e-9)
    return {"latency_s": latency, "bandwidth": _wire(kind, _LARGE * 4, world) / transfer}


def _group_sizes(world: int) -> list[int]:
    """Power-of-two group sizes below ``world`` that tile it (2, 4, ...)."""
    sizes, g = [], 2
    while g < world:
        if world % g == 0:
            sizes.append(g)
        g *= 2
    return sizes


def _steps(kind: str, world: int) -> int:
    if kind == "p2p":
        return 1
    return (2 if kind == "all_reduce" else 1) * (world - 1)


def _wire(kind: str, nbytes: float, world: int) -> float:
    if kind == "p2p":
        return nbytes
    factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
    return nbytes * factor


_MLP = {"dim": 384, "hidden": 1024, "layers": 3, "tokens": 384}
"""The reference training step of :func:`_mlp_step_rate`: SwiGLU-free MLP blocks of a
small decoder's width (what a model sized to a CPU runs). Sized unlike the models that
``benchmarks/bench_suggest.py`` measures against the cost model (width 256 / FFN 768
and width 128, 128 to 1,024 tokens per rank), so that what is calibrated is not the
benchmark's own step."""


def _mlp_step(dim: int, hidden: int, layers: int, tokens: int) -> tuple[Any, int, int]:
    """A training step of an MLP stack: ``(step, matmul FLOPs, operators it runs)``."""
    from hyper_parallel.analysis.suggest import count_operators

    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, dim)]
    model = torch.nn.Sequential(*blocks)
    x = torch.randn(tokens, dim)
    params = sum(p.numel() for p in model.parameters())

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    with count_operators() as ops:
        step()
    return step, 6 * params * tokens, ops.count


def _op_overhead(repeats: int) -> float:
    """Seconds per operator of a training step whose tensors are tiny (8 x 8 weights, 4
    tokens): its time over the operators it runs (counted as the cost model counts a
    model's), so the FLOPs are negligible and what is left is the fixed cost per
    operator (dispatch, autograd, the kernel's start)."""
    step, _, ops = _mlp_step(8, 8, _MLP["layers"], 4)
    return _timed(step, 10 * repeats) / ops


def _mlp_step_rate(repeats: int, overhead: float, bandwidth: float) -> float:
    """FLOP/s of forward + backward of a small MLP stack in fp32 (matmuls ``6 x params x
    tokens``): small matmuls and autograd, as a training step has them; the fixed cost
    per operator (``overhead`` x the operators) and the memory traffic of the operators
    without a FLOP formula (their elements x 4 bytes over ``bandwidth``) taken out, as
    the cost model adds both back per counted operator and element."""
    from hyper_parallel.analysis.suggest import count_operators

    step, flops, ops = _mlp_step(*(_MLP[k] for k in ("dim", "hidden", "layers", "tokens")))
    with count_operators() as counted:
        step()
    seconds = _timed(step, repeats)
    rest = overhead * ops + 4 * counted.elements / bandwidth
    return flops / max(seconds - rest, 0.25 * seconds)


def _dtensor_op_overhead(world: int, repeats: int, overhead: float) -> float:
    """Extra seconds per operator on a DTensor: AdamW steps (the trainer's optimizer)
    of tiny parameters sharded over all ranks, against the same step on plain tensors,
    over the operators the plain step runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel.analysis.suggest import count_operators

    mesh = init_device_mesh("cpu", (world,))
    tensors = 16

    def optimizer(dtensor: bool) -> tuple[Any, int]:
        params = []
        for _ in range(tensors):
            t = torch.zeros(8 * world, 8)
            if dtensor:
                t = distribute_tensor(t, mesh, [Shard(0)])
            params.append(torch.nn.Parameter(t))
        opt = torch.optim.AdamW(params)

        def step() -> None:
            for q in params:
                q.grad = torch.zeros_like(q)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # AdamW's states are created on the first step
        with count_operators() as ops:
            step()
        return step, ops.count

    plain, ops = optimizer(False)
    sharded, _ = optimizer(True)
    extra = _timed(sharded, repeats) - _timed(plain, repeats)
    return max(extra / ops, 0.0)


def _comm_overlap(world: int, repeats: int) -> float:
    """Share of an all-gather's time hidden by matmuls running while it is in flight:
    ``(compute + collective - both) / min(compute, collective)``, clipped to [0, 1].

    The three are timed in turn within each repetition (medians over ``3 x repeats``),
    so a change of the machine's load touches them alike."""
    shard = torch.ones(_LARGE // world)
    out = torch.empty(_LARGE)
    a = torch.randn(256, 256)

    def gather() -> None:
        all_gather_single(out, shard)

    alone = _timed(gather, repeats)
    count = torch.tensor(
        [max(1, round(alone / max(_timed(lambda: torch.mm(a, a), repeats), 1e-9)))]
    )
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the same compute on every rank
    inner = int(count.item())

    def compute() -> None:
        for _ in range(inner):
            torch.mm(a, a)

    def both() -> None:
        work = all_gather_single(out, shard, async_op=True)
        compute()
        work.wait()

    times: dict[str, list[float]] = {"c": [], "g": [], "b": []}
    for _ in range(3 * repeats):
        for key, fn in (("c", compute), ("g", gather), ("b", both)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    c, g, b = (statistics.median(times[k]) for k in ("c", "g", "b"))
    return min(1.0, max(0.0, (c + g - b) / max(min(c, g), 1e-9)))


def _worker(rank: int, world: int, init: str, threads: int, quick: bool, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    repeats = 3 if quick else 7
    result: dict[str, Any] = {"flops": {}, "collectives": {}}
    try:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            # Several matmuls per timing, so the ranks compute at the same time (as in a
            # training step) and share the cores as they will then.
            n, inner = 512, 8
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)

            def matmuls(a: torch.Tensor = a, b: torch.Tensor = b, inner: int = inner) -> None:
                for _ in range(inner):
                    torch.mm(a, b)

            seconds = _timed(matmuls, repeats)
            result["flops"][name] = 2 * n**3 * inner / seconds
        src = torch.ones(1 << 23)  # 32 MiB
        dst = torch.empty_like(src)
        seconds = _timed(lambda: dst.copy_(src), repeats)
        result["memory_bandwidth"] = 2 * src.numel() * 4 / seconds  # read + write
        result["op_overhead_s"] = _op_overhead(repeats)
        result["step_flops"] = _mlp_step_rate(
            repeats, result["op_overhead_s"], result["memory_bandwidth"]
        )
        result["dtensor_op_overhead_s"] = _dtensor_op_overhead(
            world, repeats, result["op_overhead_s"]
        )
        result["comm_overlap"] = _comm_overlap(world, repeats)
        for kind in _KINDS:
            try:
                small = _after_compute(_collective(kind, _SMALL, world, rank), repeats)
                large = _after_compute(_collective(kind, _LARGE, world, rank), repeats)
            except (RuntimeError, ValueError) as e:  # a collective gloo does not have
                result["collectives"][kind] = {"error": str(e).splitlines()[0]}
                continue
            result["collectives"][kind] = _fit(kind, small, large, world)
        result["by_group"] = {}
        for size in _group_sizes(world):
            # Every rank creates every group (new_group's contract), uses its own.
            groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
            group = groups[rank // size]
            into = result["by_group"].setdefault(size, {})
            for kind in _KINDS[:-1]:  # point-to-point: one pair, measured above
                try:
                    small = _after_compute(_collective(kind, _SMALL, size, rank, group), repeats)
                    large = _after_compute(_collective(kind, _LARGE, size, rank, group), repeats)
                except (RuntimeError, ValueError):
                    continue
                into[kind] = _fit(kind, small, large, size)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(yaml.safe_dump(gathered), encoding="utf-8")
        dist.barrier()  # no rank tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def calibrate(path: str | Path, *, ranks: int = 4, threads: int = 1, quick: bool = False) -> str:
    """Measure this machine on ``ranks`` local gloo ranks; write the hardware file ``path``.

    Returns:
        A one-paragraph summary of what was measured.

    Raises:
        RuntimeError: When the ranks fail (their error is shown).
    """
    if ranks < 2:
        raise ValueError("calibrate: ranks must be >= 2 (collectives need two ranks).")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        raw_path = os.path.join(tmp, "raw.yaml")
        mp.spawn(_worker, args=(ranks, init, threads, quick, raw_path), nprocs=ranks, join=True)
        per_rank = yaml.safe_load(Path(raw_path).read_text(encoding="utf-8"))
    flops = {d: statistics.median(r["flops"][d] for r in per_rank) for d in ("fp32", "bf16")}
    memory_bw = statistics.median(r["memory_bandwidth"] for r in per_rank)
    step_rate = statistics.median(r["step_flops"] for r in per_rank)
    op_overhead = statistics.median(r["op_overhead_s"] for r in per_rank)
    dtensor_overhead = statistics.median(r["dtensor_op_overhead_s"] for r in per_rank)
    overlap = statistics.median(r["comm_overlap"] for r in per_rank)
    links: dict[str, Any] = {}
    for kind in _KINDS:
        rows = [r["collectives"][kind] for r in per_rank if "error" not in r["collectives"][kind]]
        if not rows:
            continue
        links[kind] = {
            "latency_s": {
                "value": max(row["latency_s"] for row in rows),
                "source": f"measured: {kind} of {_SMALL * 4} B on {ranks} gloo ranks, "
                "issued after compute, less the compute",
            },
            "bandwidth": {
                "value": min(row["bandwidth"] for row in rows),
                "source": f"measured: {kind} of {_LARGE * 4} B on {ranks} gloo ranks, "
                "after compute (wire bytes per rank over the time left after latency)",
            },
            "efficiency": 1.0,
        }
    by_group: dict[int, Any] = {}
    for size in _group_sizes(ranks):
        for kind in _KINDS[:-1]:
            rows = [r["by_group"][size][kind] for r in per_rank if kind in r["by_group"][size]]
            if not rows:
                continue
            by_group.setdefault(size, {})[kind] = {
                "latency_s": {
                    "value": max(row["latency_s"] for row in rows),
                    "source": f"measured: {kind} of {_SMALL * 4} B in every group of "
                    f"{size} of {ranks} gloo ranks at once, after compute",
                },
                "bandwidth": {
                    "value": min(row["bandwidth"] for row in rows),
                    "source": f"measured: {kind} of {_LARGE * 4} B in every group of "
                    f"{size} of {ranks} gloo ranks at once, after compute",
                },
                "efficiency": 1.0,
            }
    slowest = min(links.values(), key=lambda v: v["bandwidth"]["value"])
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = _cpu_name()
    hardware = {
        "name": "calibrated-" + (os.uname().nodename or "host"),
        "description": f"{cpu}: {ranks} gloo ranks x {threads} thread(s), measured by "
        f"hyper-parallel calibrate on {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "memory_bytes": {
            "value": float(total_ram // ranks),
            "source": "measured: physical RAM / ranks",
        },
        "peak_flops": {
            d: {
                "value": flops[d],
                "source": f"measured: 8 x 512x512 {d} matmuls, median rank, all ranks at once",
            }
            for d in ("bf16", "fp32")
        },
        "compute_efficiency": {
            d: {
                "value": round(min(1.0, step_rate / flops["fp32"]), 4),
                "source": "measured: forward + backward of an MLP stack (dim "
                f"{_MLP['dim']}, hidden {_MLP['hidden']}, {_MLP['layers']} layers, "
                f"{_MLP['tokens']} tokens, fp32) over the fp32 matmul rate",
            }
            for d in ("bf16", "fp32")
        },
        "op_overhead_s": {
            "value": op_overhead,
            "source": f"measured: a training step of {_MLP['layers']} tiny MLP blocks (8 x 8, "
            "4 tokens) over the operators it runs, median rank, all ranks at once",
        },
        "dtensor_op_overhead_s": {
            "value": dtensor_overhead,
            "source": "measured: AdamW steps of 16 tiny DTensor parameters (Shard(0) over "
            "the ranks) less the same on plain tensors, over the operators of the plain "
            "step, median rank, all ranks at once",
        },
        "comm_overlap": {
            "value": round(overlap, 4),
            "source": f"measured: share of an all_gather of {_LARGE * 4} B hidden by "
            "matmuls issued while it is in flight (compute + collective - both, over the "
            "shorter), median rank",
        },
        "hbm_bandwidth": {"value": memory_bw, "source": "measured: 32 MiB copy (read + write)"},
        "optimizer_temporary": {
            "value": 0.0,
            "source": "torch.optim.AdamW on a CPU loops over the parameters (its multi-tensor "
            "path is for CUDA): one parameter's temporary at a time, not counted",
        },
        "gpus_per_node": {"value": ranks, "source": "the local ranks measured"},
        "intra_node": {
            "bandwidth": dict(links.get("all_reduce", slowest)["bandwidth"]),
            "latency_s": dict(links.get("all_reduce", slowest)["latency_s"]),
            "efficiency": 1.0,
        },
        "inter_node": {
            "bandwidth": {
                "value": slowest["bandwidth"]["value"],
                "source": "not measured (one machine): the slowest local collective",
            },
            "latency_s": {
                "value": slowest["latency_s"]["value"],
                "source": "not measured (one machine): the slowest local collective",
            },
            "efficiency": 1.0,
        },
        "collectives": {
            k: {f: dict(v) if isinstance(v, dict) else v for f, v in link.items()}
            for k, link in links.items()
        },
        "collectives_by_group": by_group,
    }
    Path(path).write_text(
        "# Written by 'hyper-parallel calibrate'; every value says how it was measured.\n"
        + yaml.safe_dump(hardware, sort_keys=False),
        encoding="utf-8",
    )
    parts = [
        f"{k} {v['bandwidth']['value'] / 1e9:.2f} GB/s, {v['latency_s']['value'] * 1e6:.0f} us/step"
        for k, v in links.items()
    ]
    return (
        f"wrote {path}: matmul fp32 {flops['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
        f"{flops['bf16'] / 1e9:.1f} GFLOP/s per rank; memory {memory_bw / 1e9:.1f} GB/s; "
        f"per operator {op_overhead * 1e6:.1f} us (+{dtensor_overhead * 1e6:.1f} us on "
        f"DTensor); collectives hidden behind compute {overlap:.0%}; " + "; ".join(parts)
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"
