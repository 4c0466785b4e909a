"""The cost model against reality: predicted vs measured step time and peak memory on gloo.

For models sized to this CPU on 4 local gloo ranks (``llama3-debug`` with
:data:`OVERRIDES`; ``qwen3-moe-debug`` with :data:`MOE_OVERRIDES` for expert
parallelism), each layout of :data:`LAYOUTS` (FSDP, HSDP, TP, CP, PP under 1F1B, GPipe,
Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble, EP, and gradient
accumulation at ``pp=1``) is

- **predicted** by :func:`hyper_parallel.analysis.suggest.predict` with the hardware
  file ``hyper-parallel calibrate`` wrote for this machine (``--hardware``; when not
  given, this machine is calibrated once, before the first layout). ``calibrate``
  measures its own workloads (square 512 x 512 matmuls, an MLP stack of width 384 /
  1,024 over 384 tokens, tiny operators, collectives of 4 KiB and 8 MiB), sized unlike
  the models measured here, so the calibration is not the benchmark run again;
- **measured**: the trainer's optimizer step (``Trainer.train_step``), median over
  ``--reps`` of the slowest rank, after ``--warmup`` steps, one torch thread per rank;
  peak memory per rank in two ways, the largest rank's:

  - **live tensor bytes** (what ``torch.cuda.max_memory_allocated`` measures on a GPU,
    and what the cost model predicts): the bytes of every distinct tensor storage alive
    when one more step starts (found through the garbage collector), plus the running
    maximum of that step's allocations minus its frees, recorded by ``torch.profiler``
    (``profile_memory=True``). That step is not timed (the profiler slows it);
  - **resident set** (``VmHWM``): its peak over the timed steps (reset through
    ``/proc/self/clear_refs`` after the build) less the resident set after the build,
    plus the parameter shards the build allocated: malloc's arenas and slack, gloo's
    buffers and Python objects included.

**Tuning and held-out layouts.** Every layout is tagged ``tune`` or ``held_out`` in
:data:`LAYOUTS`, fixed here before anything was fitted. One number is fitted: a scale
on the predicted step time (:func:`fit_time_scale`, the geometric mean of measured /
predicted), on the ``tune`` rows only; held-out measurements are only reported. The
report gives, per split (and over all rows): Spearman's rank correlation of the step
times overall, within the ``tp > 1`` layouts and within the ``tp = 1`` layouts (the
scale does not change ranks); the median and worst relative error of the step time,
as predicted and after the fitted scale; the median and worst relative error of the
peak memory against the live tensor bytes and against the resident set.

Each layout runs in its own process group (its own spawn), one after the other,
tuning and held-out layouts alternately (:func:`run_order`: a change of the machine's
load during the run falls on both splits alike); a layout that fails is reported as
failed and left out of the statistics (after a second attempt: :data:`ATTEMPTS`; a row
measured on the second says so).

Nothing here is a test: times depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/bench_suggest.py --json suggest.json
    .venv/bin/python benchmarks/bench_suggest.py --hardware mine.yaml --reps 5
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _common import gloo_ranks

OVERRIDES = {"num_layers": 8, "dim": 256, "ffn_dim": 768, "num_heads": 8, "num_kv_heads": 4}
"""``llama3-debug`` sized to this CPU (the dense layouts)."""
MOE_OVERRIDES = {
    "num_layers": 4,
    "dim": 128,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 16,
    "moe_hidden_dim": 256,
}
"""``qwen3-moe-debug`` sized to this CPU (8 experts, top-2; the expert-parallel layouts)."""

BATCH, SEQ = 8, 128
"""Global batch (sequences) and sequence length of every layout (``--batch``, ``--seq``)."""

TUNE, HELD_OUT = "tune", "held_out"
SPLITS = (TUNE, HELD_OUT)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One measured layout and the split it belongs to (fixed before any fitting)."""

    mesh: str
    split: str
    model: str = "llama3-debug"
    schedule: str | None = None
    """Pipeline schedule (``pp > 1`` only)."""
    microbatches: int | None = None
    """Micro-batches per step; ``None``: one per sequence of the local batch under
    ``pp``, 1 without (``> 1`` at ``pp = 1`` is gradient accumulation)."""

    @property
    def name(self) -> str:
        parts = [self.mesh]
        if self.model != "llama3-debug":
            parts.insert(0, self.model)
        if self.schedule:
            parts.append(self.schedule)
        if self.microbatches and "pp=" not in self.mesh:
            parts.append(f"x{self.microbatches} accum")
        return " ".join(parts)

    def axes(self) -> dict[str, int]:
        from hyper_parallel.distributed.layout import MeshLayout

        layout = MeshLayout.parse(self.mesh)
        return {a: getattr(layout, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}

    def kinds(self) -> set[str]:
        """What the layout exercises: ``fsdp``, ``hsdp``, ``tp``, ``cp``, ``ep``,
        ``accumulation``, ``pp:<schedule>``."""
        a = self.axes()
        kinds = set()
        if a["dp_shard"] > 1:
            kinds.add("hsdp" if a["dp_replicate"] > 1 else "fsdp")
        for axis in ("tp", "cp", "ep"):
            if a[axis] > 1:
                kinds.add(axis)
        if a["pp"] > 1:
            kinds.add(f"pp:{self.schedule}")
        elif (self.microbatches or 1) > 1:
            kinds.add("accumulation")
        return kinds


LAYOUTS: tuple[Layout, ...] = (
    # Tuning layouts: the fitted time scale sees only these.
    Layout("dp_shard=4", TUNE),
    Layout("tp=4", TUNE),
    Layout("dp_replicate=2,dp_shard=2", TUNE),
    Layout("cp=2,tp=2", TUNE),
    Layout("dp_replicate=2,tp=2", TUNE),
    Layout("pp=2,dp_shard=2", TUNE, schedule="1F1B"),
    Layout("pp=4", TUNE, schedule="GPipe"),
    Layout("pp=2,dp_shard=2", TUNE, schedule="Interleaved1F1B"),
    Layout("pp=4", TUNE, schedule="InterleavedZeroBubble"),
    Layout("dp_shard=4", TUNE, microbatches=2),
    Layout("dp_shard=4", TUNE, model="qwen3-moe-debug"),
    Layout("dp_shard=4,ep=4", TUNE, model="qwen3-moe-debug"),
    # Held-out layouts: measured and reported, never fitted to.
    Layout("dp_shard=2,tp=2", HELD_OUT),
    Layout("cp=2,dp_shard=2", HELD_OUT),
    Layout("cp=4", HELD_OUT),
    Layout("dp_replicate=2,dp_shard=2", HELD_OUT, microbatches=2),
    Layout("pp=2,tp=2", HELD_OUT, schedule="1F1B"),
    Layout("pp=4", HELD_OUT, schedule="1F1B"),
    Layout("pp=2,dp_shard=2", HELD_OUT, schedule="GPipe"),
    Layout("pp=4", HELD_OUT, schedule="Interleaved1F1B"),
    Layout("pp=2,dp_shard=2", HELD_OUT, schedule="ZBVZeroBubble"),
    Layout("dp_shard=4,ep=2", HELD_OUT, model="qwen3-moe-debug"),
    Layout("dp_shard=2,tp=2,ep=2", HELD_OUT, model="qwen3-moe-debug"),
)
"""The measured layouts, each tagged with its split (declared before any tuning)."""

REQUIRED_KINDS = (
    "cp",
    "ep",
    "hsdp",
    "accumulation",
    "pp:1F1B",
    "pp:GPipe",
    "pp:Interleaved1F1B",
    "pp:zero-bubble",
)
"""What each split must exercise (``pp:zero-bubble``: InterleavedZeroBubble or
ZBVZeroBubble)."""


def covered_kinds(layouts: Sequence[Layout]) -> set[str]:
    """The kinds ``layouts`` exercise, zero-bubble schedules also as ``pp:zero-bubble``."""
    kinds: set[str] = set()
    for layout in layouts:
        kinds |= layout.kinds()
        if layout.schedule and "ZeroBubble" in layout.schedule:
            kinds.add("pp:zero-bubble")
    return kinds


def run_order(layouts: Sequence[Layout]) -> list[Layout]:
    """Tuning and held-out layouts alternately, each split in its declared order: the
    machine's load drifts over a run, and both splits should see the drift alike."""
    tune = [lay for lay in layouts if lay.split == TUNE]
    held = [lay for lay in layouts if lay.split != TUNE]
    order: list[Layout] = []
    for i in range(max(len(tune), len(held))):
        order += tune[i : i + 1] + held[i : i + 1]
    return order


def _overrides(model: str, args: argparse.Namespace) -> dict[str, Any]:
    return args.moe_overrides if "moe" in model else args.overrides


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


def _candidate(layout: Layout, batch: int) -> Any:
    from hyper_parallel.analysis.suggest import Candidate

    a = layout.axes()
    local = batch // (a["dp_replicate"] * a["dp_shard"])
    m = layout.microbatches or (local if a["pp"] > 1 else 1)
    return Candidate(
        **a,
        microbatches=m,
        schedule=layout.schedule if a["pp"] > 1 else None,
        ac="none",
        sp=a["tp"] > 1,
    )


def _rank(
    rank: int,
    fields: dict[str, Any],
    batch: int,
    seq: int,
    reps: int,
    warmup: int,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    from hyper_parallel.train import TrainConfig, Trainer

    layout = Layout(**fields)
    c = _candidate(layout, batch)
    cfg = TrainConfig(
        model=layout.model,
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
        microbatches=c.microbatches,
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
        "step_s_all": slowest,
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


def fit_time_scale(rows: Sequence[dict[str, Any]]) -> float:
    """The one tuned number: a scale on the predicted step time, the geometric mean of
    measured / predicted over ``rows`` (:func:`summarize` passes the tuning rows only)."""
    if not rows:
        raise ValueError("fit_time_scale: no rows to fit on")
    logs = [math.log(r["measured_step_s"] / r["predicted_step_s"]) for r in rows]
    return math.exp(statistics.mean(logs))


def _errors(predicted: list[float], measured: list[float]) -> dict[str, float | None]:
    rel = [abs(p / m - 1) for p, m in zip(predicted, measured) if m > 0]
    if not rel:
        return {"median": None, "worst": None}
    return {"median": statistics.median(rel), "worst": max(rel)}


def _spearman_or_none(rows: Sequence[dict[str, Any]]) -> float | None:
    if len(rows) < 3:  # a rank correlation of two points says nothing
        return None
    return spearman([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows])


def split_summary(rows: Sequence[dict[str, Any]], scale: float) -> dict[str, Any]:
    """The statistics of ``rows`` (one split): rank correlations (all, ``tp > 1``,
    ``tp = 1``), relative errors of the step time (as predicted and scaled by
    ``scale``), of the memory against live tensor bytes and against the resident set."""
    tp = [r for r in rows if r["mesh"].get("tp", 1) > 1]
    no_tp = [r for r in rows if r["mesh"].get("tp", 1) == 1]
    pred = [r["predicted_step_s"] for r in rows]
    meas = [r["measured_step_s"] for r in rows]
    mem = [r["predicted_bytes"] for r in rows]
    return {
        "layouts": len(rows),
        "layouts_tp": len(tp),
        "layouts_no_tp": len(no_tp),
        "spearman": _spearman_or_none(rows),
        "spearman_tp": _spearman_or_none(tp),
        "spearman_no_tp": _spearman_or_none(no_tp),
        "step_error": _errors(pred, meas),
        "step_error_scaled": _errors([scale * p for p in pred], meas),
        "memory_error_live": _errors(mem, [r["measured_bytes"] for r in rows]),
        "memory_error_rss": _errors(mem, [r["rss_bytes"] for r in rows]),
    }


def summarize(
    rows: Sequence[dict[str, Any]], fit: Callable[[Sequence[dict[str, Any]]], float] | None = None
) -> dict[str, Any]:
    """The fit (on the ``tune`` rows only) and the statistics per split and over all rows.

    Every row gets ``scaled_step_s`` and ``scaled_step_error`` (the fitted scale applied
    to its prediction); no held-out measurement reaches ``fit``."""
    fit = fit or fit_time_scale
    tune = [r for r in rows if r["split"] == TUNE]
    scale = fit(tune) if tune else 1.0  # no tuning row measured: nothing fitted
    for r in rows:
        r["scaled_step_s"] = scale * r["predicted_step_s"]
        r["scaled_step_error"] = r["scaled_step_s"] / r["measured_step_s"] - 1
    out: dict[str, Any] = {
        "fit": {
            "time_scale": scale,
            "fitted": bool(tune),
            "what": "measured / predicted step time, geometric mean over the tune rows"
            if tune
            else "not fitted (no tune row measured): 1",
            "fitted_on": [r["layout"] for r in tune],
        }
    }
    for split in SPLITS:
        out[split] = split_summary([r for r in rows if r["split"] == split], scale)
    out["all"] = split_summary(rows, scale)
    return out


def _calibration(hardware: str) -> dict[str, Any]:
    """The measured values the predictions used (a JSON copy of the hardware file)."""
    from hyper_parallel.analysis.cost_model import load_hardware

    hw = load_hardware(hardware).to_dict()
    hw.pop("sources", None)
    return hw


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.0%}" if signed else f"{x:.0%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"{'layout':<44} {'split':<8} {'pred ms':>8} {'meas ms':>8} {'err':>6} {'scaled':>6}  "
        f"{'pred MiB':>8} {'live MiB':>8} {'err':>6} {'RSS MiB':>8} {'err':>6}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['layout']:<44} {r['split']:<8} {1e3 * r['predicted_step_s']:>8.1f} "
            f"{1e3 * r['measured_step_s']:>8.1f} {_pct(r['step_error'], True):>6} "
            f"{_pct(r['scaled_step_error'], True):>6}  "
            f"{r['predicted_bytes'] / 2**20:>8.1f} {r['measured_bytes'] / 2**20:>8.1f} "
            f"{_pct(r['memory_error'], True):>6} {r['rss_bytes'] / 2**20:>8.1f} "
            f"{_pct(r['rss_error'], True):>6}"
        )
    for f in result.get("failed", []):
        lines.append(f"{f['layout']:<44} {f['split']:<8} FAILED: {f['error']}")
    s = result["summary"]
    lines += [
        "",
        f"fitted time scale (on the tune rows only): {s['fit']['time_scale']:.3f}",
        f"{'split':<9} {'n':>3} {'rho':>5} {'rho tp':>6} {'rho no-tp':>9} "
        f"{'step med':>8} {'worst':>6} {'scaled med':>10} {'worst':>6} "
        f"{'live med':>8} {'worst':>6} {'RSS med':>7} {'worst':>6}",
    ]
    for split in (*SPLITS, "all"):
        t = s[split]
        lines.append(
            f"{split:<9} {t['layouts']:>3} {_num(t['spearman']):>5} {_num(t['spearman_tp']):>6} "
            f"{_num(t['spearman_no_tp']):>9} {_pct(t['step_error']['median']):>8} "
            f"{_pct(t['step_error']['worst']):>6} {_pct(t['step_error_scaled']['median']):>10} "
            f"{_pct(t['step_error_scaled']['worst']):>6} "
            f"{_pct(t['memory_error_live']['median']):>8} "
            f"{_pct(t['memory_error_live']['worst']):>6} "
            f"{_pct(t['memory_error_rss']['median']):>7} {_pct(t['memory_error_rss']['worst']):>6}"
        )
    lines.append(
        f"load average at start {s['load_average'][0]:.1f}, end {s['load_average_end'][0]:.1f}; "
        f"hardware: {s['hardware']}"
    )
    return "\n".join(lines)


def measure_layout(layout: Layout, hardware: str, args: argparse.Namespace) -> dict[str, Any]:
    """Predict and measure one layout: its row."""
    from hyper_parallel.analysis.suggest import ModelSource, predict

    overrides = _overrides(layout.model, args)
    source = ModelSource(layout.model, tuple(sorted(overrides.items())))
    c = _candidate(layout, args.batch)
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
    started = time.perf_counter()
    measured = gloo_ranks(
        _rank,
        4,
        dataclasses.asdict(layout),
        args.batch,
        args.seq,
        args.reps,
        args.warmup,
        overrides,
    )
    return {
        "layout": layout.name,
        "split": layout.split,
        "model": layout.model,
        "mesh": layout.axes(),
        "schedule": c.schedule,
        "microbatches": c.microbatches,
        "kinds": sorted(layout.kinds()),
        "predicted_step_s": p.step_s,
        "measured_step_s": measured["step_s"],
        "measured_step_s_reps": measured["step_s_all"],
        "step_error": p.step_s / measured["step_s"] - 1,
        "predicted_bytes": p.memory_bytes_per_gpu,
        "predicted_memory": p.memory,
        "measured_bytes": measured["peak_bytes"],
        "rss_bytes": measured["rss_bytes"],
        "memory_error": p.memory_bytes_per_gpu / max(measured["peak_bytes"], 1) - 1,
        "rss_error": p.memory_bytes_per_gpu / max(measured["rss_bytes"], 1) - 1,
        "predicted_time": p.time,
        "wall_s": time.perf_counter() - started,
        "load_average": os.getloadavg()[0],
    }


ATTEMPTS = 2
"""Tries per layout: a rank that crashes (seen: SIGABRT in a pipeline layout that runs
clean on its own) gets the layout one more spawn; the row says so (``retried_after``)."""


def _measure_with_retry(
    layout: Layout, hardware: str, args: argparse.Namespace
) -> tuple[dict[str, Any] | None, list[str]]:
    """``(row or None, the first line of each failed attempt's error)``."""
    errors: list[str] = []
    for _ in range(ATTEMPTS):
        try:
            return measure_layout(layout, hardware, args), errors
        except Exception as e:
            traceback.print_exc()
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return None, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", help="hardware file (default: calibrate this machine once)")
    parser.add_argument(
        "--only", nargs="+", default=None, help="measure only the layouts of these names"
    )
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--overrides", type=json.loads, default=OVERRIDES)
    parser.add_argument("--moe-overrides", type=json.loads, default=MOE_OVERRIDES)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    layouts = run_order([lay for lay in LAYOUTS if args.only is None or lay.name in args.only])
    load = os.getloadavg()
    hardware = args.hardware
    calibration_s = 0.0
    if hardware is None:
        # Once, before the first layout: the fitted scale and every prediction refer to
        # one hardware file. The full calibration (7 repeats per value).
        from hyper_parallel.analysis.calibrate import calibrate

        hardware = os.path.join(tempfile.mkdtemp(), "calibrated.yaml")
        started = time.perf_counter()
        print(calibrate(hardware, ranks=4, threads=1, quick=False), flush=True)
        calibration_s = time.perf_counter() - started
    rows, failed = [], []
    for layout in layouts:
        row, errors = _measure_with_retry(layout, hardware, args)
        if row is None:  # reported, not hidden: the layout is listed as failed
            failed.append({"layout": layout.name, "split": layout.split, "error": errors[-1]})
            print(f"  {layout.name}: FAILED ({errors[-1]})", flush=True)
            continue
        if errors:
            row["retried_after"] = errors[0]
        rows.append(row)
        print(
            f"  {layout.name} [{layout.split}]: predicted {1e3 * row['predicted_step_s']:.1f} ms, "
            f"measured {1e3 * row['measured_step_s']:.1f} ms ({row['wall_s']:.0f} s)"
            + (f", after a failed attempt ({errors[0]})" if errors else ""),
            flush=True,
        )
    summary = summarize(rows)
    summary.update(
        load_average=load,
        load_average_end=os.getloadavg(),
        hardware=args.hardware or "calibrated once before the first layout",
        calibration=_calibration(hardware),
        calibration_s=calibration_s,
    )
    result = {
        "layouts": [{**dataclasses.asdict(lay), "name": lay.name} for lay in layouts],
        "rows": rows,
        "failed": failed,
        "summary": summary,
    }
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
