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
f. context parallelism, cp = 1/2/4 at growing sequences on gloo, and the dry run of 8B at
   32K and 128K (``bench_cp.py``).
g. gradient accumulation: a fixed global batch as 1/2/4/8 micro-batches at dp_shard=2 on
   gloo: step time, tokens/s, peak live tensor bytes, activations (``bench_accumulation.py``).
k. checkpoint cost: step time with no checkpoint, in-place saves and asynchronous saves
   (``--async-checkpoint``) every N steps, side by side at dp_shard=2 on gloo
   (``bench_checkpoint.py``).
m. mixture of experts: the MoE layer at ep=2/4 vs a hand-written dispatch, and tokens/s of
   the debug MoE training step (``bench_moe.py``).
p. pipeline parallelism: step time per schedule vs pp=1, measured vs predicted bubble
   (``bench_pp.py``).
h. Hugging Face checkpoint loading at dp_shard=2 x tp=2: time, bytes read and peak memory
   per rank, ours vs DCP's ``HuggingFaceStorageReader``; the data path's tokens/s
   (``bench_hf_load.py``).
s. the planner's cost model against reality: 23 layouts on 4 gloo ranks (tuning and
   held-out layouts apart), predicted (with this machine calibrated) vs measured step time
   and peak memory (``bench_suggest.py``).
o. operation counts per forward: Python calls and dispatcher ops of the fast path vs
   hand-written code (``bench_op_counts.py``; noise-free, held by a test).
r. the dry run at scale: CPU time, wall time and peak RSS of ``hyper-parallel plan`` for
   llama3-70b (1,024 ranks), llama3-405b (16,384) and qwen3-235b-a22b (``bench_dry_run.py``).
t. the planner at scale: the same for ``hyper-parallel suggest`` on llama3-70b (1,024 GPUs),
   llama3-405b (16,384) and qwen3-30b-a3b (64), with candidates searched and traced
   (``bench_suggest_speed.py``).
u. the planner against published GPU runs (torchtitan, the Llama 3 paper, NeMo AutoModel,
   Megatron-Bridge):
   the cost model's free parameters fitted on the file's ``fit`` rows only, the error on
   the held-out rows apart, before and after (``bench_published.py``; no GPU needed).
v. the planner on the published settings: for each model, GPU count and kind, sequence
   and batch a published run used without float8, the published layout's predicted step
   time against the fastest layout ``suggest`` finds and against its top plan, and
   whether that plan is one a practitioner would run (``bench_settings.py``).

Every section in ``latest.json`` is stamped with the commit it measured, whether the
tree had uncommitted changes (``dirty``), its arguments and the number of pooled runs.
``--only`` re-runs some sections and keeps the others' earlier results (and stamps);
``latest.md`` is always rendered from the whole ``latest.json`` (the same data), and
so is the performance table of ``docs/benchmarks.md`` (``--write-docs`` rewrites it
between its markers; ``tests/unit/test_bench_results.py`` checks it matches
``latest.json``), and so is every measured figure the README and the ``docs/`` pages
quote: each sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``, in
whichever page tells its story, and is rendered by ``figures``; a figure whose section
``latest.json`` does not hold reads "not measured yet".
``--repeat N`` runs each section N times and pools them: repetition lists (times)
are concatenated, single figures are the median over the runs.

Each comparison interleaves its contenders in one run and reports medians, min-max
and ratios. Nothing here is a test: numbers depend on the machine and its load.

Run::

    .venv/bin/python benchmarks/run_all.py            # everything (~15-20 minutes)
    .venv/bin/python benchmarks/run_all.py --quick    # fewer repetitions
    .venv/bin/python benchmarks/run_all.py --only a d
    .venv/bin/python benchmarks/run_all.py --only m --repeat 3   # three runs pooled
    .venv/bin/python benchmarks/run_all.py --render-only --write-docs  # no measuring
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
ROOT = HERE.parent
BENCH_PAGE = ROOT / "docs" / "benchmarks.md"
"""The page that holds the performance table (between ``SUMMARY_BEGIN`` and ``SUMMARY_END``)."""
SUMMARY_BEGIN = "<!-- bench-summary: generated by benchmarks/run_all.py from latest.json -->"
SUMMARY_END = "<!-- /bench-summary -->"
SECTIONS = "abcdefgkmphsortuvw"
FIGURE_BEGIN, FIGURE_END = "<!-- bench:{} -->", "<!-- /bench:{} -->"
# Keys whose number lists are repetitions (pooled by concatenation under --repeat).
_REPETITIONS = ("times_us", "times_ms", "step_ms", "times")
X = "\u00d7"  # the multiplication sign of the published figures
DASH = "\u2013"  # the en dash of the published ranges
CHARTS = True  # --no-charts: render markdown without drawing the PNGs
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


def stamp(args: list[str], repeats: int) -> dict[str, Any]:
    """The commit measured, whether the tree differed from it, when, and how."""

    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(
                ["git", *cmd], cwd=HERE.parent, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "--short=12", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "generated": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "args": args,
        "repeats": repeats,
    }


def pool_runs(runs: list[Any], key: str = "", under: bool = False) -> Any:
    """Pool several runs of one benchmark: repetition lists concatenated, figures the median.

    A list of numbers under a repetition key (``times_us``, ``step_ms``, any
    ``*_us`` / ``*_ms``, at any depth below it) is concatenated; any other number is
    the median over the runs (identical values — sizes, counts — stay as they are);
    strings, booleans and other lists are kept from the first run.
    """
    under = under or key in _REPETITIONS or key.endswith(("_us", "_ms"))
    first = runs[0]
    if isinstance(first, dict):
        return {k: pool_runs([r[k] for r in runs], k, under) for k in first}
    if isinstance(first, list):
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in first)
        if numbers and under:
            return [x for r in runs for x in r]
        same_length = all(len(r) == len(first) for r in runs)
        if first and same_length and all(isinstance(x, dict) for x in first):
            return [pool_runs([r[i] for r in runs], key, under) for i in range(len(first))]
        return first
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(runs)
    return first


def load_results(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """``{section: {"stamp": ..., "data": ...}}`` from ``latest.json`` (empty if absent)."""
    path = path if path is not None else RESULTS / "latest.json"
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    if "sections" in raw:
        return raw["sections"]
    # Written before sections were stamped: the commit is not known.
    unknown = {"commit": "unknown (before stamps)", "dirty": None, "generated": None}
    return {
        k: {"stamp": {**unknown, "args": None, "repeats": 1}, "data": v} for k, v in raw.items()
    }


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
        "group. *Minimum*: Megatron's analytical count (see `bench_comms.py`); *minimum, "
        "shards kept*: the same where each gathered input is kept as its shard for "
        "backward and gathered again there (Megatron-LM's sequence parallelism, and ours "
        "since it keeps shards: less activation memory for more all-gathers; torch's "
        "styles keep the gathered input). Bytes are per-rank buffers; *bytes / minimum* "
        "is against the first.",
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
    """(f) context parallelism: gloo at growing sequences, and the dry run of 8B."""
    parts = result["by_seq"]
    cps = "/".join(str(r["cp"]) for r in parts[0]["results"])
    seqs = ", ".join(str(p["seq"]) for p in parts)
    lines = [
        f"## f. Context parallelism — llama3-debug, cp = {cps}, global sequence {seqs}",
        "",
        f"Batch {result['batch']}, fp32, spawned gloo ranks (`bench_cp.py`); cp = 1 is the "
        "model in one process. *Step*: forward + loss + backward, median (min-max) of "
        f"{result['reps']}, slowest rank. *Activations*: bytes the forward saves for backward "
        "on one rank (saved-tensor hooks, each storage once); *x cp*: that over cp=1's, times "
        "cp (1.00 is an exact 1/cp; above it, each layer's gathered keys and values). "
        "*Minimum*: all-gather context parallelism gathers each layer's keys and values once "
        "in forward and reduce-scatters their gradients once in backward.",
        "",
        "| seq | cp | step ms | activations KiB / rank | vs cp=1 | x cp | bytes on cp KiB | "
        "on cp / minimum |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for part in parts:
        base = part["results"][0]["activation_bytes"]
        for r in part["results"]:
            t = r["step_ms"]
            on_cp = sum(c["bytes"] for c in r["comms"] if c["axis"] == "cp")
            minimum = sum(r["minimum"].values()) if r["cp"] > 1 else 0
            act = r["activation_bytes"]
            lines.append(
                f"| {part['seq']} | {r['cp']} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) "
                f"| {act / 1024:,.1f} | {act / base:.3f} | {act / base * r['cp']:.3f} | "
                f"{on_cp / 1024:,.1f} | {f'{on_cp / minimum:.3f}' if minimum else '-'} |"
            )
    if result.get("dry_run"):
        lines += [
            "",
            "The dry run of llama3-8b (max_seq_len raised to the sequence), bf16 compute, one "
            "sequence per data-parallel rank, GiB per rank:",
            "",
            "| seq | mesh | activations | full AC | total | activations vs dp_shard=8 |",
            "| ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        dp = {d["seq"]: d for d in result["dry_run"] if d["mesh"] == "dp_shard=8"}
        for d in result["dry_run"]:
            ref = dp.get(d["seq"])
            vs = f"{d['activations'] / ref['activations']:.3f}" if ref else "-"
            lines.append(
                f"| {d['seq']:,} | {d['mesh']} | {d['activations'] / 2**30:,.2f} | "
                f"{d['activations_by_ac']['full'] / 2**30:,.2f} | {d['total'] / 2**30:,.2f} "
                f"| {vs} |"
            )
    lines.append("")
    return "\n".join(lines)


def section_accumulation(result: dict[str, Any], charts: list[str]) -> str:
    """(g) gradient accumulation."""
    rows = result["results"]
    base = rows[0]
    mesh = ",".join(f"{a}={n}" for a, n in result["mesh"].items())
    lines = [
        f"## g. Gradient accumulation — llama3-debug on {mesh}, micro-batches "
        f"{'/'.join(str(r['microbatches']) for r in rows)}",
        "",
        f"Global batch {result['batch']} x {result['seq']} tokens fixed, fp32, spawned gloo "
        "ranks (`bench_accumulation.py`). *Step*: the trainer's optimizer step, median "
        f"(min-max) of {result['reps']}, slowest rank. *Peak*: live tensor storage during a "
        "step (alive before it plus the running maximum of the CPU allocator's allocations "
        "less frees, `torch.profiler`), largest rank. *Activations*: bytes one micro-batch's "
        "forward saves for backward.",
        "",
        "| micro-batches | step ms | tokens/s | vs 1 | peak KiB / rank | vs 1 | "
        "activations KiB | vs 1 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["step_s"]
        lines.append(
            f"| {r['microbatches']} | {t['median'] * 1e3:.0f} ({t['min'] * 1e3:.0f}-"
            f"{t['max'] * 1e3:.0f}) | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['peak_bytes'] / 1024:,.0f} | "
            f"{r['peak_bytes'] / base['peak_bytes']:.2f} | "
            f"{r['activation_bytes'] / 1024:,.0f} | "
            f"{r['activation_bytes'] / base['activation_bytes']:.2f} |"
        )
    lines.append("")
    return "\n".join(lines)


def section_checkpoint(result: dict[str, Any], charts: list[str]) -> str:
    """(k) checkpoint cost: none, in-place, asynchronous."""
    rows = {r["mode"]: r for r in result["results"]}
    base = rows["none"]["step_s"]["median"]
    mesh = ",".join(f"{a}={n}" for a, n in result["mesh"].items())
    lines = [
        f"## k. Checkpoint cost — a save every {result['every']} steps, in place vs "
        f"asynchronous, on {mesh}",
        "",
        f"llama3-debug with {json.dumps(result['model_overrides'])} "
        f"({result['params'] / 1e6:.1f} M parameters; a checkpoint of "
        f"{result['checkpoint_bytes'] / 2**20:.1f} MiB with AdamW's moments), batch "
        f"{result['batch']} x {result['seq']}, fp32, spawned gloo ranks "
        "(`bench_checkpoint.py`). Three trainers of the same run, round-robin. *Per step*: "
        f"each round of {result['every']} steps plus its save, divided by "
        f"{result['every']}, median (min-max) of {result['reps']}, slowest rank. *Held*: "
        "how long the save call held the loop (async: the copy to CPU memory, and waiting "
        "for the previous save).",
        "",
        "| checkpoints | ms per step | vs none | held ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode, label in (("none", "none"), ("sync", "in place"), ("async", "asynchronous")):
        t, h = rows[mode]["step_s"], rows[mode]["held_s"]
        lines.append(
            f"| {label} | {t['median'] * 1e3:.1f} ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}) "
            f"| {t['median'] / base:.2f} | {h['median'] * 1e3:.1f} |"
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


def section_hf_load(result: dict[str, Any], charts: list[str]) -> str:
    """(h) Hugging Face checkpoint loading and the data path."""
    ckpt, mib = result["checkpoint"], 1e6
    mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items())
    lines = [
        f"## h. Loading a Hugging Face checkpoint — {mesh}, {ckpt['bytes'] / mib:,.0f} MB "
        f"in {ckpt['files']} files",
        "",
        "Each rank loads the Llama checkpoint into its FSDP2 x TP shards. *Ours*: "
        "`load_hf` (names and rotary layout mapped, each shard copied from the file's "
        "slice). *DCP*: `dcp.load` with `HuggingFaceStorageReader` into the same DTensors "
        "keyed by Hugging Face names (no layout mapping). Time: median [min-max] over "
        "repetitions, contenders alternated, after one untimed load of each. Bytes, counted "
        "in that untimed load with `safetensors.safe_open` wrapped for both: *requested* = "
        "the slices asked of the files; *mapped* = the files' pages resident in the rank's "
        "memory maps when it closes each file (`/proc/self/smaps`; 4 KiB pages, so a slice "
        "of half of each row maps every page). Both read through `mmap` (`rchar` ~0). "
        "Peak: resident memory above the states during the load (mapped pages included).",
        "",
        "| rank | shards MB | ours s | DCP s | ours/DCP time | ours MB requested "
        "| DCP MB requested | ours/DCP bytes | ours MB mapped | DCP MB mapped "
        "| ours peak MB | DCP peak MB | same values |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| :--- |",
    ]

    def span(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

    for r in result["ranks"]:
        o, d = r["ours"], r["dcp"]
        med = {k: statistics.median(v) for k, v in o.items() if v}
        dmed = {k: statistics.median(v) for k, v in d.items() if v}
        lines.append(
            f"| {r['rank']} | {r['state_bytes'] / mib:,.1f} | {span(o['seconds'])} | "
            f"{span(d['seconds'])} | **{med['seconds'] / dmed['seconds']:.2f}** | "
            f"{med['bytes'] / mib:,.1f} | {dmed['bytes'] / mib:,.1f} | "
            f"**{med['bytes'] / max(dmed['bytes'], 1):.2f}** | "
            f"{med.get('mapped_bytes', 0) / mib:,.1f} | {dmed.get('mapped_bytes', 0) / mib:,.1f} | "
            f"{med['peak_bytes'] / mib:,.1f} | {dmed['peak_bytes'] / mib:,.1f} | "
            f"{r.get('same_values', '-')} |"
        )
    data = result["data"]
    lines += [
        "",
        f"Data path: `TokenBatches` over a memory-mapped `.bin` gives "
        f"{data['data_tokens_per_s_per_rank']:,.0f} tokens/s to one dp=2 rank; a training "
        f"step of `llama3-debug` (one process) consumes {data['train_tokens_per_s']:,.0f} "
        f"tokens/s: **{data['data_tokens_per_s_per_rank'] / data['train_tokens_per_s']:,.0f}x**.",
        "",
    ]
    return "\n".join(lines)


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


# --------------------------------------------------------------------------- summary


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _boundary_row(rows: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["label"] == label), None)


def summary(sections: dict[str, dict[str, Any]]) -> str:
    """The performance table of ``docs/benchmarks.md``, from ``latest.json``'s data only
    (the sections it holds)."""
    data = {k: v["data"] for k, v in sections.items()}
    head = ["| comparison | ours | torch's styles | ours / torch |", "| --- | ---: | ---: | ---: |"]
    rows: list[str] = []
    if "a" in data:
        for mode, text in (
            ("fwd", "forward, framework overhead"),
            ("fwd+bwd", "forward + backward"),
        ):
            r = _boundary_row(data["a"], f"fake tp=8 x=(2,16,256) hidden=1024 {mode}")
            if r:
                ours, torch_ = _med(r["times_us"][OURS]), _med(r["times_us"][TORCH])
                rows.append(
                    f"| col→row MLP {text} (fake PG, tp=8) | {ours:,.0f} µs | {torch_:,.0f} µs "
                    f"| **{ours / torch_:.2f}** |"
                )
    if "b" in data:
        for label, text in (
            (
                "gloo tp=2 x=(2,16,256) hidden=1024 fwd+bwd",
                "real gloo tp=2, small activations, fwd + bwd",
            ),
            (
                "gloo tp=4 x=(4,64,512) hidden=2048 fwd+bwd",
                "real gloo tp=4, medium activations, fwd + bwd",
            ),
            (
                "gloo tp=2 x=(2,16,256) hidden=1024 fwd+bwd compiled",
                "gloo tp=2, small, fwd + bwd, both compiled (inductor)",
            ),
            (
                "gloo tp=2 x=(4,64,512) hidden=2048 fwd+bwd compiled",
                "gloo tp=2, medium, fwd + bwd, both compiled (inductor)",
            ),
        ):
            r = _boundary_row(data["b"], label)
            if r:
                ours, torch_ = _med(r["times_us"][OURS]) / 1e3, _med(r["times_us"][TORCH]) / 1e3
                rows.append(
                    f"| same MLP, {text} | {ours:,.1f} ms | {torch_:,.1f} ms | **{ours / torch_:.2f}** |"
                )
    for r in data.get("c", []):
        compiled = r.get("compile", "none") != "none"
        text = (
            f"same step, every block compiled ({r['compile']}), {r['layout']}"
            if compiled
            else f"llama3-debug training step, dp=2 {X} tp=2, FSDP2, {r['layout']}"
        )
        ours, torch_ = _med(r["times_ms"][OURS]), _med(r["times_ms"][TORCH])
        rows.append(f"| {text} | {ours:,.1f} ms | {torch_:,.1f} ms | **{ours / torch_:.2f}** |")
    if "d" in data:
        for layout, by in data["d"]["layouts"].items():
            minimum = sum(x["bytes"] for x in by["minimum"])

            def cell(name: str, by: dict = by, minimum: int = minimum) -> str:
                count = sum(x["count"] for x in by[name])
                return f"{count} / {sum(x['bytes'] for x in by[name]) / minimum:.2f}{X}"

            kept = "minimum, shards kept"
            why = ""
            if kept in by and sum(x["bytes"] for x in by[kept]) != minimum:
                why = (
                    f" (ours keeps each gathered input as its shard and gathers it again in "
                    f"backward, as Megatron-LM does: its minimum is {cell(kept)})"
                )
            rows.append(
                f"| collectives per step, {layout} (tp={data['d']['tp']}): count / bytes vs "
                f"analytical minimum{why} | {cell(OURS)} | {cell(TORCH)} | |"
            )
    if "e" in data:
        whole, meta = data["e"]["rows"][0], data["e"]["rows"][1]
        params = whole["model_param_bytes"] / 4 / 1e6
        rows.append(
            f"| peak memory to initialize a {params:.0f}M model at tp={data['e']['tp']} (vs "
            f"building it whole) | {meta['peak_bytes'] / whole['peak_bytes']:.2f}{X} | | |"
        )
    other = ["", "| other figure | value |", "| --- | ---: |"]
    if "a" in data:
        for mode in ("fwd", "fwd+bwd"):
            r = _boundary_row(data["a"], f"fake tp=8 x=(2,16,256) hidden=1024 {mode}")
            if r and HAND in r["times_us"]:
                ratio = _med(r["times_us"][OURS]) / _med(r["times_us"][HAND])
                other.append(f"| ours / hand-written, MLP {mode}, fake PG tp=8 | {ratio:.2f}{X} |")
    if "f" in data and "by_seq" in data["f"]:
        part = data["f"]["by_seq"][-1]
        res = part["results"]
        acts = " / ".join(f"{r['activation_bytes'] / res[0]['activation_bytes']:.2f}" for r in res)
        cps = "/".join(str(r["cp"]) for r in res)
        other.append(
            f"| activations per rank at cp = {cps}, vs cp=1 (seq {part['seq']}) | {acts} |"
        )
    if "m" in data:
        for r in data["m"]["layer"]:
            t = r["times_us"]
            other.append(
                f"| MoE layer ours / hand-written dispatch at ep={r['ep']} | "
                f"{_med(t['ours']) / _med(t['hand-written']):.2f}{X} |"
            )
    if "o" in data:
        for case, by in data["o"]["cases"].items():
            ours = by["ours (fast)"]
            other.append(
                f"| {case}, fast path: Python calls / dispatcher ops per forward | "
                f"{ours['python_calls']} / {ours['dispatch_ops']} |"
            )
    stamps = sorted(
        {
            f"{v['stamp']['commit']}{' (dirty)' if v['stamp'].get('dirty') else ''}"
            for v in sections.values()
        }
    )
    lines = [*head, *rows]
    if len(other) > 3:
        lines += other
    lines += ["", f"Measured at commit(s) {', '.join(stamps)} (per section in latest.json)."]
    return "\n".join(lines)


def not_measured(key: str) -> str:
    """What the docs show for a figure whose section ``latest.json`` does not hold."""
    return f"not measured yet — run `make bench` (section {key})"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


def _span(values: list[float], fmt: str) -> str:
    """``lo-hi`` (en dash) of ``values``; one value when they agree as printed."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}{DASH}{hi}"


def _figure_init_memory(e: dict[str, Any]) -> str:
    meta = next(r for r in e["rows"] if r["mode"].startswith("meta"))
    scale = e["at_scale"]
    return (
        f"at tp={e['tp']} on a {meta['model_param_bytes'] / 4 / 1e6:.0f}M Llama, "
        f"{_mib(meta['peak_bytes'])} peak for {_mib(meta['rank_param_bytes'])} of shards, "
        f"largest module {_mib(meta['largest_module_bytes'])}; {scale['model']}'s "
        f"`{scale['largest_module']}` is {scale['largest_module_bytes'] / 1e9:.1f} GB in full"
    )


def _dry_run_case(r: dict[str, Any]) -> str:
    mesh = r["mesh"].replace(",", X)
    return (
        f"{r['model']} at {mesh} ({r['world_size']:,} ranks) in {r['cpu_s']:.1f} CPU-seconds "
        f"({r['wall_s']:.1f} s wall) and {r['peak_rss_bytes'] / 1e6:.0f} MB peak"
    )


DRY_RUN_MOE = "qwen3-235b-a22b"  # the docs' MoE plan command; the other cases are dense


def _figure_dry_run(rows: list[dict[str, Any]], moe: bool) -> str | None:
    picked = [r for r in rows if (r["model"] == DRY_RUN_MOE) == moe]
    return "; ".join(_dry_run_case(r) for r in picked) if picked else None


def _figure_suggest_speed(rows: list[dict[str, Any]]) -> str | None:
    return "; ".join(
        f"{r['model']} on {r['gpus']:,} GPUs: {r['cpu_s']:.0f} s CPU ({r['wall_s']:.0f} s wall), "
        f"{r['searched']:,} candidates searched, {r['traced']} traced, "
        f"{r['peak_rss_bytes'] / 1e9:.1f} GB peak"
        for r in rows
    )


def _figure_hf_load(h: dict[str, Any]) -> str:
    ranks, ckpt = h["ranks"], h["checkpoint"]
    mesh = f" {X} ".join(f"{k}={v}" for k, v in h["mesh"].items())
    med = {
        name: [{k: statistics.median(v) for k, v in r[name].items()} for r in ranks]
        for name in ("ours", "dcp")
    }
    ratio = [o["seconds"] / d["seconds"] for o, d in zip(med["ours"], med["dcp"], strict=True)]
    data = h["data"]
    return (
        f"{ckpt['bytes'] / 1e6:,.0f} MB in {ckpt['files']} files at {mesh}, medians per rank: "
        f"each rank's shards are {_span([r['state_bytes'] / 1e6 for r in ranks], ',.1f')} MB, "
        f"ours requests {_span([o['bytes'] / 1e6 for o in med['ours']], ',.1f')} MB and DCP "
        f"{_span([d['bytes'] / 1e6 for d in med['dcp']], ',.1f')} MB (file pages mapped: "
        f"{_span([o.get('mapped_bytes', 0) / 1e6 for o in med['ours']], ',.1f')} MB and "
        f"{_span([d.get('mapped_bytes', 0) / 1e6 for d in med['dcp']], ',.1f')} MB); "
        f"load time ours / DCP "
        f"{_span(ratio, '.2f')}{X}; peak resident memory above the states "
        f"+{_span([o['peak_bytes'] / 1e6 for o in med['ours']], ',.0f')} MB (ours) vs "
        f"+{_span([d['peak_bytes'] / 1e6 for d in med['dcp']], ',.0f')} MB (DCP). The data "
        f"path: `TokenBatches` serves {data['data_tokens_per_s_per_rank'] / 1e6:,.1f} M "
        "tokens/s to a rank from a memory-mapped `.bin`, "
        f"{data['data_tokens_per_s_per_rank'] / data['train_tokens_per_s']:,.0f}{X} what a "
        "`llama3-debug` training step consumes here"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _rho(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _figure_suggest(s: dict[str, Any]) -> str:
    """Section s in one sentence: the held-out layouts' rank correlations and errors."""
    summary = s["summary"]
    h, t = summary["held_out"], summary["tune"]
    return (
        f"over {h['layouts']} held-out layouts on 4 gloo ranks (none used to fit anything), "
        f"Spearman rank correlation {_rho(h['spearman'])} ({_rho(h['spearman_tp'])} among "
        f"tp > 1, {_rho(h['spearman_no_tp'])} among tp = 1); step-time error median "
        f"{_pct(h['step_error']['median'])}, worst {_pct(h['step_error']['worst'])} as "
        f"predicted, median {_pct(h['step_error_scaled']['median'])}, worst "
        f"{_pct(h['step_error_scaled']['worst'])} after a time scale "
        f"({summary['fit']['time_scale']:.2f}) fitted on the {t['layouts']} tuning layouts; "
        f"peak memory median error {_pct(h['memory_error_live']['median'])} (worst "
        f"{_pct(h['memory_error_live']['worst'])}) against live tensor bytes, "
        f"{_pct(h['memory_error_rss']['median'])} (worst "
        f"{_pct(h['memory_error_rss']['worst'])}) against the resident set"
    )


def _figure_settings(data: dict[str, Any]) -> str | None:
    rows = [r for r in data.get("rows", []) if r["published"]]
    if not rows:
        return None
    gap = {r["ids"][0]: r["published"]["step_s"] / r["fastest_s"] - 1 for r in rows}
    near = sum(g <= 0.1 for g in gap.values())
    near_top = sum(r["published"]["step_s"] <= 1.1 * r["top"]["step_s"] for r in rows)
    worst = max(gap, key=lambda k: gap[k])
    text = (
        f"in {near} of {len(data['rows'])} published settings the published layout is "
        f"predicted within 10 % of the fastest layout that fits, in {near_top} within 10 % "
        f"of the top plan; the widest gap {100 * gap[worst]:+.0f} % ({worst})"
    )
    # Where the record itself holds a structure that ran faster per GPU than the
    # published layout: the fastest such row, published and predicted ratio.
    faster = [
        (a["published_ratio"], r["ids"][0], a)
        for r in data["rows"]
        for a in r.get("record", [])
        if a["published_ratio"] > 1
    ]
    for ratio, name, a in sorted(faster, key=lambda f: (-f[0], f[1]))[:1]:
        ours = f"{a['predicted_ratio']:.2f}x" if a.get("why") is None else a["why"]
        text += (
            f"; in {len({f[1] for f in faster})} the record itself ran another structure "
            f"faster per GPU ({name}: {a['mesh']} on {a['gpus']} GPUs, {a['id']}, ran "
            f"{ratio:.2f}x its tokens/s/GPU; predicted {ours})"
        )
    return text


FIGURES: dict[str, tuple[str, Callable[[Any], str | None]]] = {
    "init-memory": ("e", _figure_init_memory),
    "dry-run": ("r", lambda rows: _figure_dry_run(rows, moe=False)),
    "dry-run-moe": ("r", lambda rows: _figure_dry_run(rows, moe=True)),
    "hf-load": ("h", _figure_hf_load),
    "suggest-fidelity": ("s", _figure_suggest),
    "suggest-speed": ("t", _figure_suggest_speed),
    "published-settings": ("v", _figure_settings),
}
"""The published measured figures: marker name -> (section, how it is written from the data)."""


def figures(sections: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Every measured figure the README and docs quote, by marker name, from ``latest.json``.

    A figure whose section is absent (or holds no such case) is ``not_measured``.
    """
    data = {k: v["data"] for k, v in sections.items()}
    out = {}
    for name, (key, make) in FIGURES.items():
        text = make(data[key]) if key in data else None
        out[name] = text if text is not None else not_measured(key)
    return out


def _replace_between(text: str, begin: str, end: str, body: str, where: Path) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{where}: needs exactly one {begin!r} ... {end!r} block to rewrite")
    start = text.index(begin) + len(begin)
    return text[:start] + body + text[text.index(end) :]


def figure_pages() -> list[Path]:
    """The pages that may quote a figure: the README and every page under ``docs/``."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def write_docs(
    table: str,
    page: Path | None = None,
    figs: dict[str, str] | None = None,
    pages: list[Path] | None = None,
) -> None:
    """Put ``table`` between the summary markers of ``page`` (``docs/benchmarks.md``) and
    each figure of ``figs`` between its markers, in the one page of ``pages`` (default
    :func:`figure_pages`) that holds them.

    Raises:
        SystemExit: ``page`` lacks the table markers, or a figure's markers are in no
            page or in more than one.
    """
    page = BENCH_PAGE if page is None else page
    pages = figure_pages() if pages is None else pages
    texts = {p: p.read_text() for p in {*pages, page}}
    texts[page] = _replace_between(texts[page], SUMMARY_BEGIN, SUMMARY_END, f"\n{table}\n", page)
    for name, body in (figs or {}).items():
        begin, end = FIGURE_BEGIN.format(name), FIGURE_END.format(name)
        holders = [p for p in pages if begin in texts[p]]
        if len(holders) != 1:
            where = ", ".join(str(p) for p in holders) or "no page"
            raise SystemExit(
                f"figure {name!r}: its {begin!r} markers must be in exactly one of the "
                f"README and docs/ pages, found in {where}"
            )
        texts[holders[0]] = _replace_between(texts[holders[0]], begin, end, body, holders[0])
    for p, text in texts.items():
        if text != p.read_text():
            p.write_text(text)


def docs_figures(pages: list[Path] | None = None) -> dict[str, str]:
    """Every ``<!-- bench:NAME -->...<!-- /bench:NAME -->`` figure of ``pages`` (default
    the README and ``docs/``), by name.

    Raises:
        ValueError: A figure's markers appear more than once.
    """
    import re

    names: list[str] = []
    out: dict[str, str] = {}
    for p in figure_pages() if pages is None else pages:
        for name, body in re.findall(
            r"<!-- bench:([\w-]+) -->(.*?)<!-- /bench:\1 -->", p.read_text(), re.S
        ):
            names.append(name)
            out[name] = body
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"figure markers repeated across the README and docs/: {sorted(dup)}")
    return out


def docs_block(page: Path | None = None) -> str:
    """The generated performance block of ``page`` (``docs/benchmarks.md``), stripped."""
    text = (BENCH_PAGE if page is None else page).read_text()
    start = text.index(SUMMARY_BEGIN) + len(SUMMARY_BEGIN)
    return text[start : text.index(SUMMARY_END)].strip()


def section_ops(result: dict[str, Any], charts: list[str]) -> str:
    """(o) operation counts."""
    lines = [
        f"## o. Operations per forward — fake process group, tp={result['tp']} (`bench_op_counts.py`)",
        "",
        "Python function calls (`sys.setprofile`) and dispatcher ops (`TorchDispatchMode`) "
        "of one forward after warm-up, no grad. Deterministic: "
        "`tests/unit/test_op_counts.py` holds the fast path's counts at their budgets.",
        "",
        "| case | contender | Python calls | dispatcher ops |",
        "| --- | --- | ---: | ---: |",
    ]
    for case, by in result["cases"].items():
        for name, c in by.items():
            lines.append(f"| {case} | {name} | {c['python_calls']} | {c['dispatch_ops']} |")
    lines.append("")
    return "\n".join(lines)


def section_suggest(result: dict[str, Any], charts: list[str]) -> str:
    """(s) the planner's cost model vs measured steps, tuning and held-out layouts apart."""
    s = result["summary"]
    rows = result["rows"]
    lines = [
        f"## s. The planner's cost model vs measured steps — {len(rows)} layouts on 4 gloo ranks",
        "",
        "`hyper-parallel calibrate` measures this machine once, on workloads sized unlike "
        "the models below (matmul FLOP/s, per-operator and DTensor dispatch cost, memory "
        "bandwidth, gloo collectives per group size, how much of a collective hides behind "
        "compute); `suggest`'s cost model predicts each layout's step time and peak memory "
        "per rank; the trainer's step is measured (median of the slowest rank). Peak "
        "memory is measured two ways, largest rank: live tensor storage during a step "
        "(what is alive before it plus the running maximum of the CPU allocator's "
        "allocations less frees, from `torch.profiler`; the GPU analogue is "
        "`torch.cuda.max_memory_allocated`), and the resident set (`VmHWM` over the steps "
        "less the resident set after the build, plus the parameters: malloc's arenas, "
        "gloo's buffers and Python objects too). Each layout is tagged *tune* or "
        "*held_out* in `bench_suggest.py` before anything is fitted; one number is fitted, "
        f"a scale on the predicted step time ({s['fit']['time_scale']:.3f}: measured over "
        "predicted, geometric mean over the tuning rows); the held-out rows are only "
        f"reported. Load average {s['load_average'][0]:.1f} at start, "
        f"{s['load_average_end'][0]:.1f} at end.",
        "",
        "| split | layouts | Spearman (all / tp > 1 / tp = 1) | step error median, worst "
        "| after fitted scale | memory vs live bytes | memory vs RSS |",
        "| --- | ---: | --- | --- | --- | --- | --- |",
    ]
    for split in ("tune", "held_out", "all"):
        t = s[split]
        lines.append(
            f"| {split} | {t['layouts']} | {_rho(t['spearman'])} / {_rho(t['spearman_tp'])} / "
            f"{_rho(t['spearman_no_tp'])} | {_pct(t['step_error']['median'])}, "
            f"{_pct(t['step_error']['worst'])} | {_pct(t['step_error_scaled']['median'])}, "
            f"{_pct(t['step_error_scaled']['worst'])} | "
            f"{_pct(t['memory_error_live']['median'])}, "
            f"{_pct(t['memory_error_live']['worst'])} | {_pct(t['memory_error_rss']['median'])}, "
            f"{_pct(t['memory_error_rss']['worst'])} |"
        )
    lines += [
        "",
        "| layout | split | predicted ms | measured ms | error | scaled error | predicted MiB "
        "| live MiB | error | RSS MiB | error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['split']} | {1e3 * r['predicted_step_s']:.1f} | "
            f"{1e3 * r['measured_step_s']:.1f} | {r['step_error']:+.0%} | "
            f"{r['scaled_step_error']:+.0%} | {r['predicted_bytes'] / 2**20:.1f} | "
            f"{r['measured_bytes'] / 2**20:.1f} | {r['memory_error']:+.0%} | "
            f"{r['rss_bytes'] / 2**20:.1f} | {r['rss_error']:+.0%} |"
            + (
                f" (measured on a second attempt: {r['retried_after']})"
                if r.get("retried_after")
                else ""
            )
        )
    for f in result.get("failed", []):
        lines.append(f"| {f['layout']} | {f['split']} | failed: {f['error']} | | | | | | | | |")
    return "\n".join([*lines, ""])


def section_dry_run(rows: list[dict[str, Any]], charts: list[str]) -> str:
    """(r) the dry run at scale."""
    lines = [
        "## r. The dry run at scale — `hyper-parallel plan` (`bench_dry_run.py`)",
        "",
        "Each case runs `plan --model M --mesh AXES --format json` in a fresh process, as a "
        "user would, on PyTorch's fake process group with fake tensors: wall time (launch "
        "to exit, imports included), CPU time (user + system: the wall time on an idle "
        "machine, less sensitive to other load) and the process's peak resident set.",
        "",
        "| model | mesh | ranks | CPU s | wall s | peak RSS MB |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['world_size']:,} | {r['cpu_s']:.1f} | "
            f"{r['wall_s']:.1f} | {r['peak_rss_bytes'] / 1e6:,.0f} |"
        )
    return "\n".join([*lines, ""])


def section_suggest_speed(rows: list[dict[str, Any]], charts: list[str]) -> str:
    """(t) the planner at scale."""
    lines = [
        "## t. The planner at scale — `hyper-parallel suggest` (`bench_suggest_speed.py`)",
        "",
        "Each case runs `suggest --model M --gpus N --gpu h100-80gb --seq S "
        "--global-batch-tokens T --format json` in a fresh process, as a user would: wall "
        "time (launch to exit, imports included), CPU time (user + system) and peak resident "
        "set; candidates searched and local structures traced (one dry run each) from its "
        "output. Goals: 70B on 1,024 GPUs < 60 s, 405B on 16,384 GPUs < 120 s, < 4 GB.",
        "",
        "| model | GPUs | seq | searched | traced | CPU s | wall s | goal s | peak RSS MB | best |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        goal = f"{r['goal_s']:.0f}" if r.get("goal_s") else "-"
        lines.append(
            f"| {r['model']} | {r['gpus']:,} | {r['seq']:,} | {r['searched']:,} | "
            f"{r['traced']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {goal} | "
            f"{r['peak_rss_bytes'] / 1e6:,.0f} | {r['best']} |"
        )
    return "\n".join([*lines, ""])


def section_checkpointing(data: dict[str, Any], charts: list[str]) -> str:
    """(w) activation checkpointing modes on one CPU process, measured and predicted."""
    o = data["overrides"]
    lines = [
        "## w. Activation checkpointing — none, selective, op, full on one CPU thread "
        "(`bench_checkpointing.py`)",
        "",
        f"llama3-debug widened to dim {o['dim']}, {o['num_layers']} layers, "
        f"{o['num_heads']} heads; batch {data['batch']} x {data['seq']} tokens, fp32, the "
        "trainer's one-device build of each mode, one thread. *Step*: forward, loss and "
        f"backward, median (min-max) of {data['reps']}, the modes alternating; *pred*: the "
        "planner's step time on one rank of this CPU (`predict` with a quick `calibrate` of "
        "it). *Held*: bytes the CPU allocator holds after forward and loss (what the forward "
        "keeps for backward), and the dry run's end-of-forward bytes (fake tensors). *Peak*: "
        "live bytes above the parameters during a step (gradients included). *Recompute*: "
        "the FLOPs backward repeats as the planner counts them, share of `full`'s; *time vs "
        "none*: the step's increase over `none` as a share of `full`'s, measured and "
        "predicted.",
        "",
        "| ac | step ms | pred ms | held KiB | pred | peak KiB | recompute | time vs none | pred |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["results"]:
        t = r["step_s"]
        lines.append(
            f"| {r['ac']} | {t['median'] * 1e3:,.0f} ({t['min'] * 1e3:,.0f}-"
            f"{t['max'] * 1e3:,.0f}) | {r['step_predicted_s'] * 1e3:,.0f} | "
            f"{r['held_bytes'] / 1024:,.0f} | {r['held_predicted'] / 1024:,.0f} | "
            f"{r['peak_bytes'] / 1024:,.0f} | {r.get('flop_share', float('nan')):.2f} | "
            f"{r.get('time_share', float('nan')):.2f} | "
            f"{r.get('time_share_predicted', float('nan')):.2f} |"
        )
    lines.append("")
    return "\n".join(lines)


def section_published(data: dict[str, Any], charts: list[str]) -> str:
    """(g) the cost model against published GPU runs."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.0f}%"

    def stats(x: dict[str, Any]) -> str:
        if not x.get("n"):
            return "-"
        return f"median {100 * x['median']:.0f}%, worst {100 * x['worst']:.0f}% (n={x['n']})"

    lines = [
        "## u. The planner against published GPU runs (`bench_published.py`)",
        "",
        "Each row of `hyper_parallel/analysis/published/runs.yaml` predicted by the cost "
        "model behind `suggest` and `plan --gpu` (its own hardware file, its layout, what "
        "differs from our trainer as stated factors). *Before*: the datasheet constants "
        "(compute efficiency 0.55, attention at the matmuls' rate, links at 80 %), no "
        "factor modeled. *After*: compute, attention-kernel and link efficiencies and the "
        "compile / float8 / async-TP factors fitted on the `fit` rows only (split fixed in "
        "the file before fitting); held-out rows never tune anything. The fit is what the "
        "planner ships: the H100/H200 hardware files and `STATED_FACTORS` hold it "
        "(`bench_published.py --check`). Error: predicted / published - 1 (tokens/s/GPU, "
        "or model TFLOP/s per GPU for the Llama 3 paper).",
        "",
        "| run | split | layout | published | before | error | after | error | "
        "memory GiB pub / pred |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in data["rows"]:
        if e.get("skipped"):
            lines.append(
                f"| {e['id']} | {e['split']} | left out: {e['skipped']} |  |  |  |  |  |  |"
            )
            continue
        b, a = e["before"], e["after"]
        mem = "-"
        if a.get("memory_error") is not None:
            mem = f"{a['memory_gib'] / (1 + a['memory_error']):.1f} / {a['memory_gib']:.1f}"
        lines.append(
            f"| {e['id']} | {e['split']} | {e['layout']} | {b['published']:,.1f} | "
            f"{b['predicted']:,.1f} | {pct(b['error'])} | {a['predicted']:,.1f} | "
            f"{pct(a['error'])} | {mem} |"
        )
    s = data["summary"]
    lines += [
        "",
        f"Fitted (fit rows): `{json.dumps(data['params_after'])}`; shipped: "
        + (
            "this fit."
            if not data.get("shipped_mismatch")
            else "**not this fit** (" + "; ".join(data["shipped_mismatch"]) + ")."
        ),
        "",
        f"- Held-out tokens/s error before: {stats(s['before_heldout'])}; after: "
        f"{stats(s['after_heldout'])}.",
        f"- Fit rows before: {stats(s['before_fit'])}; after: {stats(s['after_fit'])}.",
        f"- Memory, held-out rows with a published figure: {stats(s['after_heldout_memory'])}.",
        "",
    ]
    return "\n".join(lines)


def section_settings(data: dict[str, Any], charts: list[str]) -> str:
    """Section v: the published layout on its own setting against the planner's best."""
    del charts
    lines = [
        "## v. The planner on the published settings (`bench_settings.py`)",
        "",
        "Each setting a published run used without float8 (model, GPUs, sequence, batch, "
        "and `--compile` where the run compiled): `suggest` free and at the published "
        "`--mesh` (its best schedule, micro-batches, checkpointing and sp on our trainer). "
        "*vs fastest*: the published layout's predicted step time against the fastest "
        "layout that fits; *vs top*: against the plan `suggest` prints first (the simplest "
        "of those within 1.5x of the fastest). *At the run's own ac*: the published layout "
        "with the checkpointing the run used, where ours took another (predicted time, and "
        "the least memory our trainer needs for it against the limit). Top plan: tp within a "
        "node, pp and cp only where no layout without them fits. *The record*: the other "
        "rows of the same model, GPU kind, sequence and compile switch without float8 in "
        "another structure (axes other than dp), the fastest of each: their published "
        "tokens/s/GPU over the setting's (rows without async TP, which our trainer does not "
        "do), and the same ratio predicted (each row's layout on its own GPUs and batch).",
        "",
        "| rows | setting | published layout on our trainer | step s | vs fastest | vs top "
        "| at the run's own ac | top plan | step s | practical | the record: published / ours |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- | --- |",
    ]
    for r in data["rows"]:
        setting = f"{r['model']}, {r['gpus']} x {r['hardware']}, {r['seq']:,} x {r['global_batch']}"
        setting += ", compiled" if r["compile"] else ""
        p, t = r["published"], r["top"]
        if p is None:
            pub, step, vf, vt = f"{r['published_mesh']}: does not fit", "-", "-", "-"
        else:
            pub = f"{p['mesh']} ({p['schedule'] or 'no pp'}, {p['microbatches']} mb, ac={p['ac']})"
            step = f"{p['step_s']:.2f}"
            vf = f"{100 * (p['step_s'] / r['fastest_s'] - 1):+.0f}%"
            vt = f"{100 * (p['step_s'] / t['step_s'] - 1):+.0f}%"
        flags = [] if r["top_tp_in_node"] else ["tp across nodes"]
        flags += [f"{a} not needed" for a, needless in r["needs"].items() if needless]
        own = r.get("published_own_ac")
        if own is None:
            own_text = "(the same)"
        else:
            own_text = (
                f"ac={own['ac']}: {own['step_s']:.2f} s "
                f"({100 * (own['step_s'] / r['fastest_s'] - 1):+.0f}% vs fastest), "
                + (
                    f"{own['memory_gib']:.1f} GiB"
                    if own["fits"]
                    else f"does not fit: needs {own['memory_gib']:.0f} of {own['limit_gib']:.0f} GiB"
                )
            )
        record = "; ".join(
            f"{a['mesh']} on {a['gpus']} ({a['id']}): {a['published_ratio']:.2f}x / "
            + (f"{a['predicted_ratio']:.2f}x" if a["why"] is None else a["why"])
            for a in r.get("record", [])
        )
        lines.append(
            f"| {', '.join(r['ids'])} | {setting} | {pub} | {step} | {vf} | {vt} | {own_text} | "
            f"{t['mesh']} (ac={t['ac']}) | {t['step_s']:.2f} | {'; '.join(flags) or 'yes'} | "
            f"{record or '-'} |"
        )
    rows = [r for r in data["rows"] if r["published"]]
    near = sum(r["published"]["step_s"] <= 1.1 * r["fastest_s"] for r in rows)
    near_top = sum(r["published"]["step_s"] <= 1.1 * r["top"]["step_s"] for r in rows)
    outrun = [r for r in data["rows"] if any(a["published_ratio"] > 1 for a in r.get("record", []))]
    lines += [
        "",
        f"Published layout within 10 % of the fastest: {near} of {len(data['rows'])} "
        f"settings; of the top plan: {near_top}. The record itself holds a structure that "
        f"ran faster per GPU than the published layout in {len(outrun)} "
        f"({', '.join(r['ids'][0] for r in outrun) or 'none'}).",
        "",
    ]
    return "\n".join(lines)


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
    if not CHARTS:  # --no-charts: the name only (the markdown still links it)
        charts.append(f"{name}.png")
        return f"{name}.png"
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
        "--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="sections"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run each section N times and pool them"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: re-render latest.md (and the docs) from latest.json",
    )
    parser.add_argument(
        "--write-docs",
        "--write-readme",
        dest="write_docs",
        action="store_true",
        help="rewrite docs/benchmarks.md's performance table and every figure the README and "
        "docs/ quote (--write-readme is the former name)",
    )
    parser.add_argument("--results-dir", help="where latest.* and charts go (default results/)")
    parser.add_argument("--no-charts", action="store_true", help="do not redraw the PNG charts")
    args = parser.parse_args(argv)
    if args.results_dir:
        globals()["RESULTS"] = Path(args.results_dir)
    if args.no_charts:
        globals()["CHARTS"] = False
    RESULTS.mkdir(parents=True, exist_ok=True)
    reps = "8" if args.quick else "30"
    gloo_reps = "5" if args.quick else "15"
    started = time.perf_counter()
    header = machine()
    failures: list[str] = []
    plan: dict[str, tuple[str, list[str], float]] = {
        "a": ("bench_boundary.py", ["--backend", "fake", "--tp", "8", "--reps", reps], 300),
        "b": (
            "bench_boundary.py",
            [
                *("--backend", "gloo", "--tp", "2", "4", "--size", "small", "medium"),
                *("--reps", gloo_reps, "--inner", "10", "--compile-tp", "2"),
            ],
            900,
        ),
        "c": (
            "bench_train_step.py",
            ["--reps", "3" if args.quick else "8", "--compile", "none", "inductor"],
            1200,
        ),
        "d": ("bench_comms.py", ["--tp", "4"], 240),
        "e": ("bench_init_memory.py", ["--tp", "8"], 300),
        "f": (
            "bench_cp.py",
            ["--seq", "256", "512", "1024", "--reps", "3" if args.quick else "8"],
            1200,
        ),
        "g": ("bench_accumulation.py", ["--reps", "3" if args.quick else "8"], 600),
        "k": ("bench_checkpoint.py", ["--reps", "3" if args.quick else "6"], 900),
        "m": (
            "bench_moe.py",
            ["--reps", gloo_reps, "--step-reps", "3" if args.quick else "6"],
            600,
        ),
        "p": ("bench_pp.py", ["--pp", "2", "--reps", "4" if args.quick else "10"], 600),
        "o": ("bench_op_counts.py", ["--tp", "2"], 300),
        "r": ("bench_dry_run.py", [], 900),
        "h": ("bench_hf_load.py", ["--size-mb", "256", "--reps", "3" if args.quick else "5"], 900),
        "s": ("bench_suggest.py", ["--reps", "2" if args.quick else "4"], 1800),
        "t": ("bench_suggest_speed.py", [], 1200),
        "u": ("bench_published.py", [], 1800),
        "v": ("bench_settings.py", [], 2400),
        "w": ("bench_checkpointing.py", ["--reps", "3" if args.quick else "6"], 900),
    }
    results = load_results()
    if not args.render_only:
        print(f"benchmarks on {header}", flush=True)
        with tempfile.TemporaryDirectory(prefix="hp_bench_") as tmp:
            for key in args.only:
                script, script_args, timeout = plan[key]
                runs = []
                try:
                    for i in range(args.repeat):
                        runs.append(
                            _run(script, script_args, Path(tmp) / f"{key}{i}.json", timeout)
                        )
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    failures.append(f"({key}) {e}")
                    continue
                run_stamp = stamp([script, *script_args], args.repeat)
                run_stamp["machine"] = header
                results[key] = {"stamp": run_stamp, "data": pool_runs(runs)}
    took = time.perf_counter() - started
    report = render(results, took if not args.render_only else None, failures)
    (RESULTS / "latest.md").write_text(report)
    (RESULTS / "latest.json").write_text(json.dumps({"format": 2, "sections": results}, indent=1))
    if args.write_docs:
        write_docs(summary(results), figs=figures(results))
    print(f"wrote {RESULTS / 'latest.md'} in {took / 60:.1f} min")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


RENDER: dict[str, Callable[..., str]] = {
    "a": section_overhead,
    "b": section_gloo,
    "c": section_train,
    "d": section_comms,
    "e": section_memory,
    "f": section_cp,
    "g": section_accumulation,
    "k": section_checkpoint,
    "m": section_moe,
    "p": section_pp,
    "h": section_hf_load,
    "s": section_suggest,
    "o": section_ops,
    "r": section_dry_run,
    "t": section_suggest_speed,
    "u": section_published,
    "v": section_settings,
    "w": section_checkpointing,
}


def render(
    results: dict[str, dict[str, Any]], took: float | None = None, failures: list[str] | None = None
) -> str:
    """``latest.md`` from the stamped sections (charts are written beside it)."""
    charts: list[str] = []
    sections = []
    for key in SECTIONS:
        if key not in results:
            continue
        st = results[key]["stamp"]
        dirty = " (uncommitted changes)" if st.get("dirty") else ""
        pooled = f", {st['repeats']} runs pooled" if st.get("repeats", 1) > 1 else ""
        body = RENDER[key](results[key]["data"], charts)
        title, _, rest = body.partition("\n")
        note = f"*Commit {st['commit']}{dirty}, {st.get('generated') or 'date unknown'}{pooled}.*"
        sections.append(f"{title}\n\n{note}\n{rest}")
    for failure in failures or []:
        sections.append(f"## failed\n\n```\n{failure}\n```\n")
    when = f" (this run: {took / 60:.1f} minutes)" if took is not None else ""
    return "\n".join(
        [
            "# Benchmarks",
            "",
            f"Rendered from `latest.json` by `benchmarks/run_all.py`{when}; each section says "
            "the commit it measured and when. `make bench` re-runs every section.",
            "",
            "Every comparison runs its contenders interleaved in one process group "
            "(round-robin, order rotated each repetition) and reports the median and "
            "min-max over repetitions; ratios are of medians. *ours (fast)* is the "
            "default path; *ours (DTensor)* is the same plan with "
            "`hyper_parallel.dmodule.fast_path(False)`. Shared, busy machines make the "
            "absolute numbers noisy; the ratios are the result.",
            "",
            "## Summary (the table of docs/benchmarks.md)",
            "",
            summary(results),
            "",
            *sections,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
