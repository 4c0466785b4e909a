"""Run every benchmark; write ``benchmarks/results/latest.md`` and PNG charts next to it.

``make bench`` runs this. Each benchmark runs as its own subprocess (its own process
group: fake, or spawned gloo ranks) and hands back JSON; this script renders the
tables and charts. Sections:

a. framework overhead per call, fake process group, tp=8 (``bench_boundary.py``);
b. the same MLP on real gloo ranks, tp=2 and tp=4, small and medium activations, and
   compiled with inductor at tp=2;
c. a training step of the debug Llama at dp=2 x tp=2 (``bench_train_step.py``), eager
   and with every block compiled (inductor);
d. collectives and bytes per step, TP and TP+SP, vs the minimum (``bench_comms.py``);
e. peak memory to initialize a model larger than a rank's share (``bench_init_memory.py``);
f. context parallelism, cp = 1/2/4 at one global sequence on gloo (``bench_cp.py``).
m. mixture of experts: the MoE layer at ep=2/4 vs a hand-written dispatch, and tokens/s of
   the debug MoE training step (``bench_moe.py``).
p. pipeline parallelism: step time per schedule vs pp=1, measured vs predicted bubble
   (``bench_pp.py``).
s. the planner's cost model against reality: 8 layouts on 4 gloo ranks, predicted (with
   this machine calibrated) vs measured step time and peak memory (``bench_suggest.py``).

Each comparison interleaves its contenders in one run and reports medians, min-max
and ratios. Nothing here is a test: numbers depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/run_all.py            # everything (~15-20 minutes)
    .venv/bin/python benchmarks/run_all.py --quick    # fewer repetitions
    .venv/bin/python benchmarks/run_all.py --only a d
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OURS, OURS_DT, TORCH, HAND = "ours (fast)", "ours (DTensor)", "torch styles", "hand-written"
_PHASE = {"forward": "fwd", "backward": "bwd"}


# --------------------------------------------------------------------------- running


def _run(script: str, args: list[str], out: Path, timeout: float) -> Any:
    """Run ``benchmarks/<script>`` with ``--json out``; its parsed JSON, or raise with stderr."""
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[1:])} failed ({proc.returncode}) after {took:.0f}s:\n"
            + proc.stderr[-3000:]
        )
    print(f"  {script} {' '.join(args)}: {took:.0f}s", flush=True)
    return json.loads(out.read_text())


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _fmt(values: list[float], digits: int = 0) -> str:
    med, lo, hi = _stats(values)
    return f"{med:,.{digits}f} ({lo:,.{digits}f}-{hi:,.{digits}f})"


# --------------------------------------------------------------------------- sections


def section_overhead(rows: list[dict[str, Any]], charts: list[str]) -> str:
    """(a) fake process group."""
    lines = [
        "## a. Framework overhead per call — fake process group, tp=8",
        "",
        "Column→row MLP (`Linear(d, 4d)` column-wise, `Linear(4d, d)` row-wise, output "
        "replicated). Collectives on a fake process group cost nothing, so this is the "
        "framework's own work per call. µs per call: median (min-max over repetitions).",
        "",
    ]
    lines += _boundary_table(rows)
    lines += ["", f"![overhead]({_chart_overhead(rows, charts)})", ""]
    return "\n".join(lines)


def _boundary_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| case | ours (fast) | ours (DTensor) | torch styles | hand-written | "
        "ours/torch | ours/hand |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["times_us"]
        ours, torch_ = (statistics.median(t[k]) for k in (OURS, TORCH))
        # Compiled cases have no hand-written contender (see bench_boundary.py).
        hand, vs_hand = (
            (_fmt(t[HAND]), f"{ours / statistics.median(t[HAND]):.2f}") if HAND in t else ("—", "—")
        )
        out.append(
            f"| {r['label']} | {_fmt(t[OURS])} | {_fmt(t[OURS_DT])} | {_fmt(t[TORCH])} | "
            f"{hand} | **{ours / torch_:.2f}** | {vs_hand} |"
        )
    return out


def section_gloo(rows: list[dict[str, Any]], charts: list[str]) -> str:
    """(b) gloo."""
    lines = [
        "## b. The same MLP on real gloo ranks — tp=2 and tp=4, small and medium activations",
        "",
        "Spawned gloo processes on this machine's CPUs; a repetition counts as its "
        "slowest rank. Small: x = (2, 16, 256); medium: x = (4, 64, 512). µs per call. "
        "*compiled*: each contender is the same module under "
        "`torch.compile(fullgraph=True, dynamic=False)` with inductor (the MLP is the "
        "block; no hand-written contender there).",
        "",
    ]
    lines += _boundary_table(rows)
    lines += ["", f"![gloo]({_chart_gloo(rows, charts)})", ""]
    return "\n".join(lines)


def section_train(results: list[dict[str, Any]], charts: list[str]) -> str:
    """(c) training step."""
    lines = [
        "## c. Training step of the debug Llama — dp=2 x tp=2 (4 gloo ranks), FSDP2 on dp",
        "",
        "`llama3-debug`, global batch 8 x 64 tokens; a step is zero_grad, forward, "
        "vocab-parallel cross entropy, backward, clipping, AdamW. Ours: the model's own "
        "TP / TP+SP configs (`build_parallel_model`); torch: torchtitan's plan with "
        "torch's styles + `fully_shard`. *compiled*: every contender compiles each block "
        "(`torch.compile(fullgraph=True)`, inductor, after the TP plan and before "
        "`fully_shard`, as torchtitan does); compilation is in the untimed first step. "
        "ms per step; the first-step loss shows the contenders compute the same step.",
        "",
        "| layout | ours (fast) | ours (DTensor) | torch styles | ours/torch | "
        "first-step loss (ours / torch) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        t = r["times_ms"]
        ratio = statistics.median(t[OURS]) / statistics.median(t[TORCH])
        loss = r["first_step_loss"]
        lines.append(
            f"| {_train_label(r)} | {_fmt(t[OURS], 1)} | {_fmt(t[OURS_DT], 1)} | "
            f"{_fmt(t[TORCH], 1)} | **{ratio:.2f}** | {loss[OURS]:.6f} / {loss[TORCH]:.6f} |"
        )
    lines += ["", f"![train step]({_chart_train(results, charts)})", ""]
    return "\n".join(lines)


def _train_label(result: dict[str, Any]) -> str:
    backend = result.get("compile", "none")
    return result["layout"] if backend == "none" else f"{result['layout']} compiled ({backend})"


def section_comms(result: dict[str, Any], charts: list[str]) -> str:
    """(d) collectives."""
    lines = [
        f"## d. Collectives per training step — llama3-debug, tp={result['tp']}",
        "",
        f"One forward + backward (loss included), batch {result['batch']} x "
        f"{result['seq']} tokens, recorded with `CollectiveRecorder` on a fake process "
        "group. *Minimum*: Megatron's analytical count (see `bench_comms.py`). Bytes are "
        "per-rank buffers.",
        "",
        "| layout | contender | collectives | KiB | bytes / minimum | breakdown |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for layout, by_contender in result["layouts"].items():
        min_bytes = sum(r["bytes"] for r in by_contender["minimum"])
        for name, rows in by_contender.items():
            count = sum(r["count"] for r in rows)
            num_bytes = sum(r["bytes"] for r in rows)
            detail = ", ".join(
                f"{_PHASE[r['phase']]} {r['kind']} x{r['count']}" for r in rows if r["count"]
            )
            lines.append(
                f"| {layout} | {name} | {count} | {num_bytes / 1024:,.1f} | "
                f"{num_bytes / min_bytes:.2f} | {detail} |"
            )
    lines += ["", f"![collectives]({_chart_comms(result, charts)})", ""]
    return "\n".join(lines)


def section_memory(result: dict[str, Any], charts: list[str]) -> str:
    """(e) init memory."""
    mib = 1024 * 1024
    model = result["model"]
    total = result["rows"][0]["model_param_bytes"]
    lines = [
        f"## e. Peak memory to initialize a model larger than one rank's share — tp={result['tp']}",
        "",
        f"Llama with dim {model['dim']}, {model['num_layers']} layers, vocabulary "
        f"{model['vocab_size']}: {total / 4 / 1e6:.0f}M parameters, {total / mib:.0f} MiB "
        "fp32. Peak resident memory of rank 0 above its level before building, each mode "
        "in a fresh process. The meta path keeps only its shards, but while one module is "
        "initialized that module's full parameters exist on every rank (so every mesh "
        "starts from the same values), plus the initializer's temporaries: the peak is "
        "the shards plus a few times the largest module "
        f"({result['rows'][0]['largest_module']}, "
        f"{result['rows'][0]['largest_module_bytes'] / mib:.0f} MiB here; "
        f"{result['at_scale']['largest_module_bytes'] / 1e9:.1f} GB for "
        f"{result['at_scale']['model']}'s {result['at_scale']['largest_module']}).",
        "",
        "| mode | peak MiB | parameters held MiB | peak / whole |",
        "| --- | ---: | ---: | ---: |",
    ]
    whole = result["rows"][0]["peak_bytes"]
    for row in result["rows"]:
        lines.append(
            f"| {row['mode']} | {row['peak_bytes'] / mib:,.0f} | "
            f"{row['rank_param_bytes'] / mib:,.0f} | {row['peak_bytes'] / whole:.2f} |"
        )
    lines += ["", f"![init memory]({_chart_memory(result, charts)})", ""]
    return "\n".join(lines)


def section_cp(result: dict[str, Any], charts: list[str]) -> str:
    """(f) context parallelism."""
    rows = result["results"]
    base = rows[0]["activation_bytes"]
    lines = [
        f"## f. Context parallelism — llama3-debug, cp = "
        f"{'/'.join(str(r['cp']) for r in rows)}, global sequence {result['seq']}",
        "",
        f"Batch {result['batch']} x {result['seq']} tokens, fp32, spawned gloo ranks "
        "(`bench_cp.py`); cp = 1 is the model in one process. *Step*: forward + loss + "
        f"backward, median (min-max) of {result['reps']}, slowest rank. *Activations*: "
        "bytes the forward saves for backward on one rank (saved-tensor hooks, each "
        "storage once). *Minimum*: all-gather context parallelism gathers each layer's "
        "keys and values once in forward and reduce-scatters their gradients once in "
        "backward; *total* adds the one gather of the positions (for the causal mask).",
        "",
        "| cp | step ms | activations KiB / rank | vs cp=1 | bytes on cp KiB | "
        "k/v / minimum | total / minimum |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["step_ms"]
        on_cp = sum(c["bytes"] for c in r["comms"] if c["axis"] == "cp")
        minimum = sum(r["minimum"].values()) if r["cp"] > 1 else 0
        kv = on_cp - r["positions_bytes"] if on_cp else 0
        lines.append(
            f"| {r['cp']} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | "
            f"{r['activation_bytes'] / 1024:,.1f} | {r['activation_bytes'] / base:.2f} | "
            f"{on_cp / 1024:,.1f} | {f'{kv / minimum:.2f}' if minimum else '-'} | "
            f"{f'{on_cp / minimum:.3f}' if minimum else '-'} |"
        )
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- charts


def section_moe(result: dict[str, Any], charts: list[str]) -> str:
    """(m) mixture of experts."""
    shape = result["shape"]
    lines = [
        "## m. Mixture of experts — expert-parallel dispatch on gloo (`bench_moe.py`)",
        "",
        f"One MoE layer ({shape['num_experts']} experts, top-{shape['top_k']}, dim "
        f"{shape['dim']}, expert hidden {shape['hidden_dim']}; {shape['batch']} x "
        f"{shape['seq']} tokens per rank), forward + backward, on ep gloo ranks. Ours: the "
        "Qwen3-MoE `MoE` with its experts parallelized by `expert_parallel(...)`; "
        "hand-written: plain tensors, `torch.distributed.all_to_all_single` for counts, "
        "dispatch and combine, the same router and expert maths. us per call (slowest "
        "rank); the outputs and expert gradients of both are compared once.",
        "",
        "| ep | ours | hand-written | ours/hand | max abs diff (out / w1 grad) |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["layer"]:
        t = r["times_us"]
        ratio = statistics.median(t["ours"]) / statistics.median(t["hand-written"])
        lines.append(
            f"| {r['ep']} | {_fmt(t['ours'])} | {_fmt(t['hand-written'])} | **{ratio:.2f}** | "
            f"{r['max_out_diff']:.1e} / {r['w1_grad_diff']:.1e} |"
        )
    lines += [
        "",
        "Training step of `qwen3-moe-debug` through the trainer's build (experts on ep, "
        "FSDP2 on fsdp / efsdp, AdamW):",
        "",
        "| mesh | ms per step (median, min-max) | tokens/s |",
        "| --- | ---: | ---: |",
    ]
    for s in result["step"]:
        lines.append(
            f"| {s['mesh']} (batch {s['global_batch']} x {s['seq']}) | "
            f"{_fmt(s['step_ms'], 1)} | {s['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def section_pp(rows: list[dict[str, Any]], charts: list[str]) -> str:
    """(p) pipeline parallelism."""
    lines = [
        "## p. Pipeline parallelism — each schedule vs pp=1 on the same gloo ranks",
        "",
        "`llama3-debug` with 8 blocks of width 256, global batch 16 x 128 tokens, 8 "
        "micro-batches; a step is the trainer's (`Trainer.train_step`); pp=1 is FSDP2 "
        "over the same ranks (dp_shard = pp). Bubble: measured = per rank, the share of "
        "the schedule's step spent outside torch's stage actions (waiting, "
        "communication included), averaged over ranks; predicted = `bubble_fraction` "
        "from the schedule's action list (backward = 2 x forward, free communication).",
        "",
        "| pp | contender | step ms | vs pp=1 | bubble measured | bubble predicted |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    base = {r["pp"]: r["step_ms"]["median"] for r in rows if r["contender"] == "pp=1"}
    for r in rows:
        s = r["step_ms"]
        step = f"{s['median']:,.1f} ({s['min']:,.1f}-{s['max']:,.1f})"
        measured = f"{r['measured_bubble']:.3f}" if "measured_bubble" in r else "-"
        predicted = f"{r['predicted_bubble']:.3f}" if "predicted_bubble" in r else "-"
        lines.append(
            f"| {r['pp']} | {r['contender']} | {step} | "
            f"{s['median'] / base[r['pp']]:.2f} | {measured} | {predicted} |"
        )
    return "\n".join([*lines, ""])


def section_suggest(result: dict[str, Any], charts: list[str]) -> str:
    """(s) the planner's cost model vs measured steps."""
    s = result["summary"]
    lines = [
        "## s. The planner's cost model vs measured steps — 8 layouts on 4 gloo ranks",
        "",
        "`hyper-parallel calibrate` measures this machine (matmul FLOP/s, gloo collectives); "
        "`suggest`'s cost model predicts each layout's step time and peak memory per rank; "
        "the trainer's step is measured (median of the slowest rank) and peak memory is the "
        "rise of the peak resident set over the size before the build (largest rank). "
        f"Spearman rank correlation {s['spearman']:.2f} (goal >= 0.8); median relative "
        f"error: step time {s['median_step_error']:.0%} (goal <= 25%), memory "
        f"{s['median_memory_error']:.0%} (goal within 15%); load average "
        f"{s['load_average'][0]:.1f} at start, {s['load_average_end'][0]:.1f} at end.",
        "",
        "| layout | predicted ms | measured ms | error | predicted MiB | measured MiB | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['layout']} | {1e3 * r['predicted_step_s']:.1f} | "
            f"{1e3 * r['measured_step_s']:.1f} | {r['step_error']:+.0%} | "
            f"{r['predicted_bytes'] / 2**20:.1f} | {r['measured_bytes'] / 2**20:.1f} | "
            f"{r['memory_error']:+.0%} |"
        )
    return "\n".join([*lines, ""])


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(
    name: str,
    groups: list[str],
    series: dict[str, list[tuple[float, float, float]]],
    ylabel: str,
    title: str,
    charts: list[str],
    log: bool = False,
) -> str:
    """Grouped bars: median height, min-max whiskers; saved as results/<name>.png."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        meds = [v[0] for v in values]
        err = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
        ax.bar(xs, meds, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    charts.append(path.name)
    return path.name


def _boundary_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    return {c: [_stats(r["times_us"][c]) for r in rows] for c in (OURS, OURS_DT, TORCH, HAND)}


def _short(label: str) -> str:
    return label.replace(" hidden=", "\nh=").replace(" fwd", "\nfwd").replace("gloo ", "")


def _chart_overhead(rows: list[dict[str, Any]], charts: list[str]) -> str:
    return _bars(
        "overhead_fake_tp8",
        [_short(r["label"]) for r in rows],
        _boundary_series(rows),
        "µs per call (median, min-max)",
        "Column→row MLP, fake process group tp=8: framework overhead",
        charts,
    )


def _chart_gloo(rows: list[dict[str, Any]], charts: list[str]) -> str:
    rows = [r for r in rows if not r["case"].get("compiled")]  # every contender ran
    return _bars(
        "mlp_gloo",
        [_short(r["label"]) for r in rows],
        _boundary_series(rows),
        "µs per call (median, min-max)",
        "Column→row MLP on gloo ranks",
        charts,
        log=True,
    )


def _chart_train(results: list[dict[str, Any]], charts: list[str]) -> str:
    series = {c: [_stats(r["times_ms"][c]) for r in results] for c in (OURS, OURS_DT, TORCH)}
    return _bars(
        "train_step_dp2_tp2",
        [_train_label(r).replace(" compiled", "\ncompiled") for r in results],
        series,
        "ms per step (median, min-max)",
        "llama3-debug training step, dp=2 x tp=2",
        charts,
    )


def _chart_comms(result: dict[str, Any], charts: list[str]) -> str:
    layouts = list(result["layouts"])
    names = list(next(iter(result["layouts"].values())))
    series = {}
    for name in names:
        values = []
        for layout in layouts:
            kib = sum(r["bytes"] for r in result["layouts"][layout][name]) / 1024
            values.append((kib, kib, kib))
        series[name] = values
    return _bars(
        "collectives_per_step",
        layouts,
        series,
        "KiB per rank per step",
        f"Collective bytes per step, llama3-debug tp={result['tp']}",
        charts,
    )


def _chart_memory(result: dict[str, Any], charts: list[str]) -> str:
    mib = 1024 * 1024
    series = {
        "peak": [(r["peak_bytes"] / mib,) * 3 for r in result["rows"]],
        "parameters held": [(r["rank_param_bytes"] / mib,) * 3 for r in result["rows"]],
    }
    return _bars(
        "init_memory",
        [r["mode"] for r in result["rows"]],
        series,
        "MiB (rank 0)",
        f"Initializing a {result['rows'][0]['model_param_bytes'] / mib:.0f} MiB model, "
        f"tp={result['tp']}",
        charts,
    )


# --------------------------------------------------------------------------- report


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"{cpu}, {os.cpu_count()} CPUs visible, load average {load} at start; "
        f"Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} "
        f"{platform.release()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--only", nargs="+", choices=list("abcdefmps"), default=list("abcdefmps"), help="sections"
    )
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    reps = "8" if args.quick else "30"
    gloo_reps = "5" if args.quick else "15"
    started = time.perf_counter()
    header = machine()
    sections: list[str] = []
    charts: list[str] = []
    failures: list[str] = []
    raw: dict[str, Any] = {}
    plan: dict[str, tuple[str, list[str], float, Callable[..., str]]] = {
        "a": (
            "bench_boundary.py",
            ["--backend", "fake", "--tp", "8", "--reps", reps],
            300,
            section_overhead,
        ),
        "b": (
            "bench_boundary.py",
            [
                *("--backend", "gloo", "--tp", "2", "4", "--size", "small", "medium"),
                *("--reps", gloo_reps, "--inner", "10", "--compile-tp", "2"),
            ],
            900,
            section_gloo,
        ),
        "c": (
            "bench_train_step.py",
            ["--reps", "3" if args.quick else "8", "--compile", "none", "inductor"],
            1200,
            section_train,
        ),
        "d": ("bench_comms.py", ["--tp", "4"], 240, section_comms),
        "e": ("bench_init_memory.py", ["--tp", "8"], 300, section_memory),
        "f": (
            "bench_cp.py",
            ["--seq", "512", "--reps", "3" if args.quick else "8"],
            420,
            section_cp,
        ),
        "m": (
            "bench_moe.py",
            ["--reps", gloo_reps, "--step-reps", "3" if args.quick else "6"],
            600,
            section_moe,
        ),
        "p": (
            "bench_pp.py",
            ["--pp", "2", "--reps", "4" if args.quick else "10"],
            600,
            section_pp,
        ),
        "s": (
            "bench_suggest.py",
            ["--reps", "3" if args.quick else "5"],
            1200,
            section_suggest,
        ),
    }
    print(f"benchmarks on {header}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hp_bench_") as tmp:
        for key in args.only:
            script, script_args, timeout, render = plan[key]
            try:
                data = _run(script, script_args, Path(tmp) / f"{key}.json", timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failures.append(f"({key}) {e}")
                sections.append(f"## {key}. {script} failed\n\n```\n{e}\n```\n")
                continue
            raw[key] = data
            sections.append(render(data, charts))
    took = time.perf_counter() - started
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    report = "\n".join(
        [
            "# Benchmarks",
            "",
            f"Generated {now} by `make bench` (`benchmarks/run_all.py"
            f"{' --quick' if args.quick else ''}`) in {took / 60:.1f} minutes.",
            "",
            f"Machine: {header}.",
            "",
            "Every comparison runs its contenders interleaved in one process group "
            "(round-robin, order rotated each repetition) and reports the median and "
            "min-max over repetitions; ratios are of medians. *ours (fast)* is the "
            "default path; *ours (DTensor)* is the same plan with "
            "`hyper_parallel.dmodule.fast_path(False)`. Shared, busy machines make the "
            "absolute numbers noisy; the ratios are the result.",
            "",
            *sections,
        ]
    )
    (RESULTS / "latest.md").write_text(report)
    (RESULTS / "latest.json").write_text(json.dumps(raw, indent=1))
    print(f"wrote {RESULTS / 'latest.md'} and {len(charts)} charts in {took / 60:.1f} min")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
