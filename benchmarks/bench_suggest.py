"""The cost model against reality: predicted vs measured step time and peak memory on gloo.

For a Llama sized to this CPU (``llama3-debug`` with ``--overrides``) on 4 local gloo
ranks, each of 8 layouts (dp_shard=4, dp_replicate=2 x dp_shard=2, tp=4,
dp_shard=2 x tp=2, cp=2 x tp=2, pp=2 x dp_shard=2, pp=2 x tp=2, pp=4) is

- **predicted** by :func:`hyper_parallel.analysis.suggest.predict` with the hardware
  file ``hyper-parallel calibrate`` wrote for this machine (``--hardware``; when not
  given, calibrated right before each layout is measured, so both see the machine
  under the same load; each row keeps the values it was predicted with);
- **measured**: the trainer's optimizer step (``Trainer.train_step``), median over
  ``--reps`` of the slowest rank, after ``--warmup`` steps, one torch thread per rank;
  peak memory per rank is the peak of **live tensor storage** during one more step
  (what ``torch.cuda.max_memory_allocated`` measures on a GPU, and what the cost
  model predicts): the bytes of every distinct tensor storage alive when the step
  starts (found through the garbage collector: parameters, optimizer states, anything
  the trainer keeps), plus the running maximum of the step's allocations minus its
  frees, recorded by ``torch.profiler`` (``profile_memory=True``: every allocation and
  free of torch's CPU allocator, in order). The largest rank's. That step is not
  timed (the profiler slows it).
- for transparency, the rise of the process's resident set over the timed steps
  (``VmHWM``, reset through ``/proc/self/clear_refs`` after the build, over its size
  after the build, plus the parameter shards the build allocated): it also holds
  malloc's arenas and slack, gloo's buffers and Python objects, so it is reported
  (``rss MiB``) but not compared.

Printed: per layout predicted and measured step time and memory, then Spearman's rank
correlation of the step times, the median relative error of the step time and of the
memory. Each layout runs in its own process group (its own spawn), one after the other.

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_suggest.py --reps 5 --json suggest.json
    .venv/bin/python benchmarks/bench_suggest.py --hardware mine.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _common import gloo_ranks

LAYOUTS = (
    "dp_shard=4",
    "dp_replicate=2,dp_shard=2",
    "tp=4",
    "dp_shard=2,tp=2",
    "cp=2,tp=2",
    "pp=2,dp_shard=2",
    "pp=2,tp=2",
    "pp=4",
)
OVERRIDES = {"num_layers": 8, "dim": 256, "ffn_dim": 768, "num_heads": 8, "num_kv_heads": 4}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _live_storage_bytes() -> int:
    """Bytes of the distinct CPU tensor storages reachable from Python now (a DTensor's
    local tensor included; wrapper subclasses without storage of their own skipped)."""
    import gc
    import warnings

    import torch

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        for t in (obj, getattr(obj, "_local_tensor", None)):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                s = t.untyped_storage()
                if s.device.type == "cpu":
                    storages[s.data_ptr()] = s.nbytes()
            except (RuntimeError, NotImplementedError):  # no storage of its own
                continue
    return sum(storages.values())


def _peak_tensor_bytes(step: Any) -> int:
    """Peak live tensor bytes while ``step()`` runs: what is alive before it plus the
    running maximum of its allocations less its frees (``torch.profiler``'s memory
    records of the CPU allocator, in time order)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    before = _live_storage_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = 0
    for _, delta in records:
        running += delta
        peak = max(peak, running)
    return before + peak


def _candidate(mesh: str, batch: int) -> Any:
    from hyper_parallel.analysis.suggest import Candidate
    from hyper_parallel.distributed.layout import MeshLayout

    layout = MeshLayout.parse(mesh)
    local = batch // (layout.dp_replicate * layout.dp_shard)
    m = local if layout.pp > 1 else 1
    return Candidate(
        pp=layout.pp,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        cp=layout.cp,
        tp=layout.tp,
        ep=1,
        microbatches=m,
        schedule="1F1B" if layout.pp > 1 else None,
        ac="none",
        sp=layout.tp > 1,
    )


def _rank(
    rank: int, mesh: str, batch: int, seq: int, reps: int, warmup: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    from hyper_parallel.train import TrainConfig, Trainer

    c = _candidate(mesh, batch)
    cfg = TrainConfig(
        model="llama3-debug",
        model_overrides=overrides,
        mesh=c.layout.active(),
        batch_size=batch,
        seq_len=seq,
        steps=warmup + reps + 1,
        log_every=0,
        progress=False,
        max_grad_norm=0.0,
        sp=c.sp,
        schedule=c.schedule or "1F1B",
        microbatches=c.microbatches if c.pp > 1 else None,
    )
    import torch

    torch.set_num_threads(1)  # as calibrate measured: one thread per rank
    trainer = Trainer(cfg, device="cpu")
    # States the build allocated (the local shards of the parameters); gradients and
    # AdamW moments are allocated by the first step, activations by every step.
    from hyper_parallel.core.dtensor.dtensor import DTensor

    held = 0
    for module in trainer.model_parts:
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            held += local.numel() * local.element_size()
    _reset_peak()
    baseline = _status("VmRSS") - held
    times = []
    for step in range(warmup + reps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        took = time.perf_counter() - start
        if step >= warmup:
            times.append(took)
    rss = _status("VmHWM") - baseline
    dist.barrier()
    tensors = _peak_tensor_bytes(trainer.train_step)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"times": times, "rss": rss, "tensors": tensors})
    slowest = [max(g["times"][i] for g in gathered) for i in range(len(times))]
    return {
        "step_s": statistics.median(slowest),
        "peak_bytes": max(g["tensors"] for g in gathered),
        "rss_bytes": max(g["rss"] for g in gathered),
    }


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # average ranks of ties
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks; ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def _calibration(hardware: str) -> dict[str, Any]:
    """The measured values the predictions used (a JSON copy of the hardware file)."""
    from hyper_parallel.analysis.cost_model import load_hardware

    hw = load_hardware(hardware).to_dict()
    hw.pop("sources", None)
    return hw


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"{'layout':<28} {'pred step ms':>12} {'meas step ms':>12} {'err':>7}  "
        f"{'pred MiB':>9} {'meas MiB':>9} {'err':>7} {'rss MiB':>8}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['layout']:<28} {1e3 * r['predicted_step_s']:>12.1f} "
            f"{1e3 * r['measured_step_s']:>12.1f} {r['step_error']:>+7.0%}  "
            f"{r['predicted_bytes'] / 2**20:>9.1f} {r['measured_bytes'] / 2**20:>9.1f} "
            f"{r['memory_error']:>+7.0%} {r.get('rss_bytes', 0) / 2**20:>8.1f}"
        )
    s = result["summary"]
    lines.append(
        f"Spearman rank correlation of step times: {s['spearman']:.2f} (goal >= 0.8); median "
        f"relative error: step time {s['median_step_error']:.0%} (goal <= 25%), peak memory "
        f"{s['median_memory_error']:.0%} (goal within 15%); load average at start "
        f"{s['load_average'][0]:.1f}, end {s['load_average_end'][0]:.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", help="hardware file (default: calibrate this machine now)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--overrides", type=json.loads, default=OVERRIDES)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    from hyper_parallel.analysis.suggest import ModelSource, predict

    load = os.getloadavg()
    source = ModelSource("llama3-debug", tuple(sorted(args.overrides.items())))
    rows = []
    for mesh in args.layouts:
        hardware = args.hardware
        if hardware is None:
            # Calibrated right before each layout is measured: on a shared machine the
            # load moves, and prediction and measurement must see the same machine.
            # The full calibration (7 repeats per value): the quick one's
            # small-collective latencies are too noisy under load.
            from hyper_parallel.analysis.calibrate import calibrate

            hardware = os.path.join(tempfile.mkdtemp(), "calibrated.yaml")
            print(calibrate(hardware, ranks=4, threads=1, quick=False), flush=True)
        c = _candidate(mesh, args.batch)
        p = predict(
            source,
            c,
            gpus=4,
            gpu=hardware,
            gpus_per_node=4,
            seq_len=args.seq,
            global_batch_tokens=args.batch * args.seq,
            dtype="fp32",
        )
        measured = gloo_ranks(
            _rank, 4, mesh, args.batch, args.seq, args.reps, args.warmup, args.overrides
        )
        row = {
            "layout": mesh,
            "predicted_step_s": p.step_s,
            "measured_step_s": measured["step_s"],
            "step_error": p.step_s / measured["step_s"] - 1,
            "predicted_bytes": p.memory_bytes_per_gpu,
            "predicted_memory": p.memory,
            "measured_bytes": measured["peak_bytes"],
            "rss_bytes": measured["rss_bytes"],
            "memory_error": p.memory_bytes_per_gpu / max(measured["peak_bytes"], 1) - 1,
            "predicted_time": p.time,
            "calibration": _calibration(hardware),
            "load_average": os.getloadavg()[0],
        }
        rows.append(row)
        print(
            f"  {mesh}: predicted {1e3 * p.step_s:.1f} ms, measured "
            f"{1e3 * measured['step_s']:.1f} ms",
            flush=True,
        )
    result = {
        "rows": rows,
        "summary": {
            "spearman": spearman(
                [r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows]
            ),
            "median_step_error": statistics.median(abs(r["step_error"]) for r in rows),
            "median_memory_error": statistics.median(abs(r["memory_error"]) for r in rows),
            "load_average": load,
            "load_average_end": os.getloadavg(),
            "hardware": args.hardware or "calibrated before each layout",
        },
    }
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
