"""The cost model against published GPU training runs: fit on the `fit` rows, report all.

Reads ``hyper_parallel/analysis/published/runs.yaml`` (each run's layout, GPUs, what
differs from our eager trainer, the published tokens/s/GPU or model TFLOP/s per GPU,
memory where given, the source) and predicts each run with the planner's cost model
(:class:`hyper_parallel.analysis.suggest.LayoutScorer`, the model behind ``suggest`` and
``plan --gpu``).

Free parameters, fitted on the ``fit`` rows only (the split is the file's, assigned by
its stated rule before any fitting and checked on load): the bf16 compute efficiency
(one value for every H100/H200 file), the links' collective efficiency (every link of
those files), and the stated factors of what differs from our trainer: the published
runs' attention efficiency (their kernels' score matmuls, which dominate at long
sequences; the trainer's own kernels are measured, in the hardware files), the compute
time under ``torch.compile``, under float8 linears (tensorwise, rowwise), on
Megatron-Core with Transformer Engine (``runtime: megatron-te``) and the share of tp
collectives async TP leaves exposed. "Before" is the datasheet constants
with no factor modeled (:data:`BEFORE`: what the planner predicted until the fit was
written). Held-out rows never enter the fit; their errors are reported apart.

The fit is what the planner uses: the GPU's values are written in the hardware files
the fit rows ran on (:data:`FITTED_KINDS`, each value's ``source`` naming this script),
the run factors in :data:`hyper_parallel.analysis.suggest.STATED_FACTORS`. Every run
reports whether they hold exactly this fit; ``--check`` fits on the fit rows alone and
exits 1 when they do not.

Error: ``predicted / published - 1`` of tokens/s/GPU (or model TFLOP/s per GPU, the
planner's FLOPs of a step over its predicted time); memory: predicted peak per GPU
against the published figure (GiB). Rows the cost model cannot express are listed with
the reason (e.g. gradient accumulation at pp=1).

Run::

    .venv/bin/python benchmarks/bench_published.py [--json out.json]
    .venv/bin/python benchmarks/bench_published.py --check   # the files hold the fit?
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Any

from hyper_parallel.analysis.cost_model import (
    MEMORY_HEADROOM_FRACTION,
    Hardware,
    Link,
    load_hardware,
)
from hyper_parallel.analysis.published import load_runs
from hyper_parallel.analysis.suggest import (
    AC_MODES,
    STATED_FACTORS,
    Candidate,
    LayoutScorer,
    RunFactors,
)
from hyper_parallel.distributed.pipeline import MULTI_STAGE_SCHEDULES
from hyper_parallel.dmodule import keep_gathered

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")

FITTED_KINDS = ("h100-80gb", "h100-96gb", "h200-141gb")
"""The hardware files the fit rows ran on: the fitted GPU values are written in each."""

BEFORE = {
    "efficiency": 0.55,  # the datasheet files' assumed bf16 compute efficiency
    "attention": None,  # None: the published runs' attention at the matmuls' efficiency
    "link_efficiency": 0.8,  # the datasheet files' assumed nccl-tests bus bandwidth share
    "compile": 1.0,
    "float8_tensorwise": 1.0,
    "float8_rowwise": 1.0,
    "async_tp_exposed": 1.0,
    "megatron_te": 1.0,
    "allocator_share": 0.0,  # a reserved figure compared with the live peak as is
}
GRIDS = {
    "efficiency": [round(0.30 + 0.01 * i, 2) for i in range(61)],
    "attention": [round(0.10 + 0.02 * i, 2) for i in range(36)],
    "link_efficiency": [round(0.16 + 0.04 * i, 2) for i in range(21)],
    "compile": [round(0.60 + 0.02 * i, 2) for i in range(21)],
    "float8_tensorwise": [round(0.50 + 0.02 * i, 2) for i in range(31)],
    "float8_rowwise": [round(0.50 + 0.02 * i, 2) for i in range(31)],
    "async_tp_exposed": [round(0.1 * i, 1) for i in range(11)],
    "megatron_te": [round(0.20 + 0.02 * i, 2) for i in range(51)],
}
MEMORY_GRIDS = {"allocator_share": [round(0.01 * i, 2) for i in range(31)]}
"""Fitted on the memory of the fit rows alone (the step time does not read it)."""


@dataclasses.dataclass
class Row:
    run: dict[str, Any]
    scorer: LayoutScorer | None
    candidates: list[Candidate]
    skipped: str = ""


def _candidates(run: dict[str, Any]) -> list[Candidate]:
    mesh = {a: int(run["mesh"].get(a, 1)) for a in AXES}
    dp = mesh["dp_replicate"] * mesh["dp_shard"]
    local = run["global_batch"] // dp
    if mesh["pp"] > 1:
        microbatches = run.get("microbatches") or local
        schedule = run.get("schedule") or "1F1B"
    else:
        microbatches = run.get("grad_accum") or 1
        schedule = None
    modes = [run["ac"]] if run["ac"] else list(AC_MODES)
    # Stages per rank of a looped schedule the source does not state: each that suggest
    # searches (2, and 4 and 8 where the layers allow; the scorer refuses the rest).
    per_ranks: list[int | None] = [run.get("stages_per_rank")]
    looped = schedule in MULTI_STAGE_SCHEDULES and schedule != "ZBVZeroBubble"
    if per_ranks == [None] and looped:
        per_ranks = [2, 4, 8]
    # Accumulation under FSDP2: reduced at the last micro-batch or at each (sources do
    # not say; torchtitan and NeMo AutoModel reduce each): both are candidates.
    fsdp = mesh["dp_replicate"] * mesh["dp_shard"] * mesh["cp"] > 1
    each = (False, True) if mesh["pp"] == 1 and microbatches > 1 and fsdp else (False,)
    return [
        Candidate(
            **mesh,
            microbatches=microbatches,
            schedule=schedule,
            ac=ac,
            sp=mesh["tp"] > 1,
            stages_per_rank=per_rank,
            reduce_each=e,
        )
        for ac in modes
        for e in each
        for per_rank in per_ranks
    ]


def _as_run(run: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Traced as the run kept its activations: a compiled run's blocks keep their
    gathered inputs (``keep_gathered``, as our trainer compiled does; the scorer's traces
    are per run's key, so they hold it). Not the scorer's ``compile``: its run-plan gate
    would refuse what our trainer cannot compile (e.g. cp next to dp_shard) while the
    published run ran it."""
    return keep_gathered(bool(run["compile"]))


def _accumulates(scorer: LayoutScorer, c: Candidate) -> bool:
    """Whether the cost model runs ``microbatches`` passes at pp=1 (gradient
    accumulation): the compute of ``k`` micro-batches of ``b/k`` against one of ``b``."""
    one = scorer.predict(dataclasses.replace(c, microbatches=1))
    many = scorer.predict(c)
    return many.time["pipeline_or_compute"] > 0.7 * one.time["pipeline_or_compute"]


def prepare(runs: list[dict[str, Any]]) -> list[Row]:
    """Each run's scorer and candidates (runs of one model, cluster, sequence and batch
    share a scorer: its traces and FLOP counts do not depend on the rest)."""
    rows = []
    scorers: dict[tuple, LayoutScorer] = {}
    for run in runs:
        try:
            key = (
                run["model"],
                run["gpus"],
                run["hardware"],
                run["seq"],
                run["global_batch"],
                bool(run["compile"]),
                run["precision"],
            )
            if key not in scorers:
                scorers[key] = LayoutScorer(
                    run["model"],
                    gpus=run["gpus"],
                    gpu=run["hardware"],
                    seq_len=run["seq"],
                    global_batch_tokens=run["global_batch"] * run["seq"],
                    dtype=run["precision"],
                )
            scorer = scorers[key]
            candidates = _candidates(run)
            ok = []
            reasons = []
            for c in candidates:
                try:
                    with _as_run(run):
                        scorer.predict(c)
                    ok.append(c)
                except ValueError as e:
                    reasons.append(str(e))
            if not ok:
                rows.append(Row(run, None, [], skipped=reasons[0][:160]))
                continue
            if ok[0].pp == 1 and ok[0].microbatches > 1:
                with _as_run(run):
                    accumulates = _accumulates(scorer, ok[0])
            else:
                accumulates = True
            if not accumulates:
                rows.append(
                    Row(run, None, [], "gradient accumulation at pp=1: not in the cost model")
                )
                continue
            rows.append(Row(run, scorer, ok))
        except ValueError as e:
            rows.append(Row(run, None, [], skipped=str(e)[:160]))
    return rows


def _hardware(base: Hardware, p: dict[str, Any]) -> Hardware:
    """``base`` with the GPU's parameters of ``p`` (the published runs' attention is a
    run factor: :func:`_factors`)."""

    def link(x: Link) -> Link:
        return dataclasses.replace(x, efficiency=p["link_efficiency"])

    return dataclasses.replace(
        base,
        compute_efficiency={**base.compute_efficiency, "bf16": p["efficiency"]},
        intra_node=link(base.intra_node),
        inter_node=link(base.inter_node),
        collectives={k: link(v) for k, v in base.collectives.items()},
    )


def _factors(run: dict[str, Any], p: dict[str, Any], hw: Hardware) -> RunFactors:
    """The run's stated factors; its attention rate by its ``attention``: ``fitted``, the
    published runs' fitted rate (torch's SDPA as those runs ran it); ``measured``, the
    hardware file's measured one-sequence kernel (cuDNN), at every cp degree (the run's
    kernel is that one, or its cp calls it once per query chunk).

    Raises:
        ValueError: The run's attention is ``measured`` and its hardware file measures no
            attention kernel.
    """
    stated = RunFactors.stated(
        compile=bool(run["compile"]),
        float8=run["float8"],
        async_tp=bool(run["async_tp"]),
        runtime=run.get("runtime", "pytorch"),
        compiled_loss=bool(run.get("compile_loss")),
        values=p,
    )
    if p["attention"] is None:  # before: attention at the matmuls' rate, every run
        attention = p["efficiency"]
    elif run["attention"] == "measured":
        if hw.attention_efficiency is None:
            raise ValueError(
                f"published run {run['id']!r}: attention: measured, but hardware "
                f"{run['hardware']!r} has no attention_efficiency; measure it "
                "(benchmarks/bench_gpu.py) or state attention: fitted."
            )
        attention = hw.attention_efficiency
    else:
        attention = p["attention"]
    return dataclasses.replace(stated, attention_efficiency=attention)


def shipped() -> dict[str, Any]:
    """The parameters the planner ships: the GPU's from the :data:`FITTED_KINDS` files,
    the rest from :data:`STATED_FACTORS`.

    Raises:
        ValueError: The files disagree on a value (one fit writes one value in each).
    """
    seen: dict[str, dict[str, Any]] = {}
    for kind in FITTED_KINDS:
        hw = load_hardware(kind)
        links = {hw.intra_node.efficiency, hw.inter_node.efficiency}
        links |= {x.efficiency for x in hw.collectives.values()}
        if len(links) != 1:
            raise ValueError(f"hardware {kind}: link efficiencies differ ({sorted(links)}).")
        seen[kind] = {
            "efficiency": hw.compute_efficiency["bf16"],
            "link_efficiency": links.pop(),
        }
    if any(seen[k] != seen[FITTED_KINDS[0]] for k in FITTED_KINDS):
        raise ValueError(f"hardware files disagree on the fitted values: {seen}.")
    return {
        **seen[FITTED_KINDS[0]],
        **STATED_FACTORS,
        "allocator_share": MEMORY_HEADROOM_FRACTION,
    }


def compare(fitted: dict[str, Any], ships: dict[str, Any]) -> list[str]:
    """The parameters whose shipped value is not the fitted one, as lines for people."""
    return [
        f"{name}: fitted {fitted[name]}, shipped {ships.get(name)}"
        for name in fitted
        if ships.get(name) is None
        or fitted[name] is None
        or not math.isclose(fitted[name], ships[name], rel_tol=1e-9)
    ]


def evaluate(row: Row, p: dict[str, Any], cache: dict[str, Hardware]) -> dict[str, Any]:
    """The prediction of one run under parameters ``p``: the fastest of its candidates
    that fits (the AC modes and stages per rank the source does not state; one
    candidate when it states them)."""
    assert row.scorer is not None
    run = row.run
    key = run["hardware"]
    if key not in cache:
        cache[key] = load_hardware(key)
    hw = _hardware(cache[key], p)
    best = None
    for c in row.candidates:
        with _as_run(run):
            pred = row.scorer.predict(c, hardware=hw, factors=_factors(run, p, hw))
        fits = pred.memory_bytes_per_gpu <= row.scorer.memory_limit
        rank = (not fits, pred.step_s)
        if best is None or rank < best[0]:
            best = (rank, c, pred)
    assert best is not None
    _, c, pred = best
    measured = run["measured"]
    if "tokens_per_s_per_gpu" in measured:
        published, predicted, unit = (
            measured["tokens_per_s_per_gpu"],
            pred.tokens_per_s_per_gpu,
            "tok/s/GPU",
        )
    else:
        peak = hw.peak_flops["bf16"]
        published, predicted, unit = measured["tflops_per_gpu"], pred.mfu * peak / 1e12, "TFLOP/s"
    out = {
        "published": published,
        "predicted": predicted,
        "unit": unit,
        "error": predicted / published - 1,
        "ac": c.ac,
        "memory_gib": _memory_gib(run, pred.memory_bytes_per_gpu, p),
        "memory_error": None,
    }
    if "memory_gib" in measured:
        out["memory_error"] = out["memory_gib"] / measured["memory_gib"] - 1
    return out


def _memory_gib(run: dict[str, Any], live: float, p: dict[str, Any]) -> float:
    """The planner's peak of live bytes as the run's source measures memory: a
    ``reserved`` figure holds the allocator's share besides (``allocator_share`` of the
    reserved bytes: the cost model's ``MEMORY_HEADROOM_FRACTION``)."""
    if run.get("memory_metric") == "reserved":
        live = live / (1 - p["allocator_share"])
    return live / 2**30


def _memory_loss(rows: list[Row], p: dict[str, Any], cache: dict[str, Hardware]) -> float:
    """Mean absolute log error of the published memory of the fit rows."""
    errors = []
    for r in rows:
        if "memory_gib" in r.run["measured"]:
            e = evaluate(r, p, cache)["memory_error"]
            errors.append(abs(math.log1p(e)))
    return statistics.fmean(errors) if errors else 0.0


def _loss(rows: list[Row], p: dict[str, Any], cache: dict[str, Hardware]) -> float:
    """Mean absolute log error of the fit rows (robust to the few the model misses by
    far: a squared error would let them set every parameter)."""
    errs = [abs(math.log1p(evaluate(r, p, cache)["error"])) for r in rows]
    return sum(errs) / len(errs)


def fit(rows: list[Row], start: dict[str, Any], cache: dict[str, Hardware]) -> dict[str, Any]:
    """Coordinate descent over each parameter's grid, on the fit rows only."""
    assert all(r.run["split"] == "fit" for r in rows)
    p = dict(start)
    if p["attention"] is None:
        p["attention"] = p["efficiency"]
    best = _loss(rows, p, cache)
    for _ in range(4):
        improved = False
        for name, grid in GRIDS.items():
            # A parameter no fit row exercises stays where it is.
            if not any(_uses(r.run, name) for r in rows):
                continue
            for v in grid:
                trial = {**p, name: v}
                loss = _loss(rows, trial, cache)
                if loss < best - 1e-12:
                    best, p, improved = loss, trial, True
        if not improved:
            break
    for name, grid in MEMORY_GRIDS.items():
        p[name] = min(grid, key=lambda v: (_memory_loss(rows, {**p, name: v}, cache), v))
    return p


def _uses(run: dict[str, Any], name: str) -> bool:
    return {
        "compile": bool(run["compile"]),
        "float8_tensorwise": run["float8"] == "tensorwise",
        "float8_rowwise": run["float8"] == "rowwise",
        "async_tp_exposed": bool(run["async_tp"]) and run["mesh"].get("tp", 1) > 1,
        "megatron_te": run.get("runtime") == "megatron-te",
        "attention": run["attention"] == "fitted",
    }.get(name, True)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "worst": None, "n": 0}
    a = [abs(v) for v in values]
    return {"median": statistics.median(a), "worst": max(a), "n": len(a)}


def fit_published(runs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The fit on the ``fit`` rows of ``runs`` (default: the published file's), reading
    no held-out row."""
    fit_runs = [r for r in (load_runs() if runs is None else runs) if r["split"] == "fit"]
    rows = [r for r in prepare(fit_runs) if r.scorer is not None]
    return fit(rows, BEFORE, {})


def check() -> int:
    """Fit on the fit rows and compare with what the planner ships: 0 when the
    hardware files and :data:`STATED_FACTORS` hold exactly this fit, else 1."""
    fitted = fit_published()
    mismatch = compare(fitted, shipped())
    print(f"fitted on the fit rows: {json.dumps(fitted)}")
    if mismatch:
        print(
            "the shipped values are not this fit (write them into "
            f"hyper_parallel/analysis/hardware/{{{','.join(FITTED_KINDS)}}}.yaml and "
            "hyper_parallel/analysis/suggest/_cost.py STATED_FACTORS):"
        )
        print("\n".join(f"  {line}" for line in mismatch))
        return 1
    print(f"the hardware files ({', '.join(FITTED_KINDS)}) and STATED_FACTORS hold this fit.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--check",
        action="store_true",
        help="fit on the fit rows only; exit 1 unless the shipped files hold that fit",
    )
    args = parser.parse_args(argv)
    if args.check:
        return check()
    started = time.perf_counter()
    runs = load_runs()
    rows = prepare(runs)
    usable = [r for r in rows if r.scorer is not None]
    fit_rows = [r for r in usable if r.run["split"] == "fit"]
    cache: dict[str, Hardware] = {}
    after = fit(fit_rows, BEFORE, cache)
    ships = shipped()
    table = []
    for r in rows:
        entry = {
            "id": r.run["id"],
            "model": r.run["model"],
            "gpus": r.run["gpus"],
            "hardware": r.run["hardware"],
            "layout": _layout(r.run),
            "split": r.run["split"],
            "source": f"{r.run['source_url']} ({r.run['where']})",
            "skipped": r.skipped,
        }
        if r.scorer is not None:
            entry["before"] = evaluate(r, BEFORE, cache)
            entry["after"] = evaluate(r, after, cache)
        table.append(entry)
    summary = {}
    for when in ("before", "after"):
        for split in ("fit", "heldout"):
            done = [e for e in table if e["split"] == split and when in e]
            summary[f"{when}_{split}"] = _stats([e[when]["error"] for e in done])
            summary[f"{when}_{split}_memory"] = _stats(
                [e[when]["memory_error"] for e in done if e[when]["memory_error"] is not None]
            )
    result = {
        "rows": table,
        "params_before": BEFORE,
        "params_after": after,
        "params_shipped": ships,
        "shipped_mismatch": compare(after, ships),
        "summary": summary,
        "elapsed_s": time.perf_counter() - started,
    }
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _layout(run: dict[str, Any]) -> str:
    mesh = ",".join(f"{a}={run['mesh'][a]}" for a in AXES if run["mesh"].get(a, 1) > 1)
    extra = [f"seq {run['seq']:,}", f"gbs {run['global_batch']}"]
    if run["mesh"].get("pp", 1) > 1:
        extra.append(f"{run.get('schedule') or '1F1B'} x{run.get('microbatches') or 'local'}")
    if run.get("grad_accum"):
        extra.append(f"GA {run['grad_accum']}")
    extra.append(f"ac={run['ac'] or '?'}")
    flags = [
        f
        for f, on in (
            ("compile", run["compile"]),
            (f"fp8-{run['float8']}", run["float8"] != "none"),
            ("asyncTP", run["async_tp"]),
            ("Megatron-TE", run.get("runtime") == "megatron-te"),
        )
        if on
    ]
    return f"{mesh} ({', '.join(extra + flags)})"


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"{'id':<26} {'split':<7} {'published':>10} {'before':>9} {'err':>7} "
        f"{'after':>9} {'err':>7} {'mem GiB pub/pred':>17}  layout"
    ]
    for e in result["rows"]:
        if e["skipped"]:
            lines.append(f"{e['id']:<26} {e['split']:<7} left out: {e['skipped']}")
            continue
        b, a = e["before"], e["after"]
        pub_mem = ""
        if a["memory_error"] is not None:
            pub_mem = f"{a['memory_gib'] / (1 + a['memory_error']):.1f}/{a['memory_gib']:.1f}"
        lines.append(
            f"{e['id']:<26} {e['split']:<7} {b['published']:>10,.1f} {b['predicted']:>9,.1f} "
            f"{100 * b['error']:>+6.0f}% {a['predicted']:>9,.1f} {100 * a['error']:>+6.0f}% "
            f"{pub_mem:>17}  {e['layout']}"
        )
    s = result["summary"]

    def fmt(x: dict[str, Any]) -> str:
        if not x["n"]:
            return "-"
        return f"median {100 * x['median']:.0f}%, worst {100 * x['worst']:.0f}% (n={x['n']})"

    lines += [
        "",
        f"fitted on the fit rows: {json.dumps(result['params_after'])}",
        "shipped (hardware files, STATED_FACTORS): "
        + (
            "this fit"
            if not result["shipped_mismatch"]
            else "NOT this fit: " + "; ".join(result["shipped_mismatch"])
        ),
        f"before: fit {fmt(s['before_fit'])}; held-out {fmt(s['before_heldout'])}",
        f"after:  fit {fmt(s['after_fit'])}; held-out {fmt(s['after_heldout'])}",
        f"memory (|pred/pub - 1|), held-out: {fmt(s['after_heldout_memory'])}; "
        f"fit: {fmt(s['after_fit_memory'])}",
        f"({result['elapsed_s']:.0f} s)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
