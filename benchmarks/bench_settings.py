"""The planner on published settings: the layout practitioners ran against its best.

For each *setting* of ``hyper_parallel/analysis/published/runs.yaml`` — a model, a
number and kind of GPU, a sequence length and a global batch — that a row ran without
float8 (``suggest`` does not search float8; a float8 row's layout was chosen for it),
``suggest`` is run twice with the row's switches (``--compile`` where the row compiled):

- free: every layout; the *fastest* is the lowest predicted step time of any layout
  that fits, the *top* is the plan ``suggest`` prints first (the simplest of those it
  cannot tell apart from the fastest: within 1.5x);
- fixed: ``--mesh`` of the published layout; its best schedule, micro-batches,
  checkpointing and sp for our trainer.

Printed per setting: the published layout's predicted step time against the fastest
and against the top plan (the goal of issue #30: within 10 % of the predicted best),
and whether the top plan is one a practitioner would run: tp within a node, cp only
where no layout without it fits, pp only where no layout without it fits. Rows of one
setting (e.g. torchtitan's vanilla and async-TP rows) share it; Megatron-Bridge rows
all use float8 and are not settings here.

Nothing here is fitted or tuned: it reads the shipped hardware files and factors.

Run::

    .venv/bin/python benchmarks/bench_settings.py [--only ID ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hyper_parallel.analysis.published import load_runs
from hyper_parallel.analysis.suggest import DoesNotFit, suggest

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def settings(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per distinct published setting run without float8 (first row's id)."""
    seen: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        if run.get("float8", "none") != "none":
            continue
        key = (
            run["model"],
            run["gpus"],
            run["hardware"],
            run["seq"],
            run["global_batch"],
            tuple(sorted(run["mesh"].items())),
            bool(run.get("compile")),
        )
        entry = seen.setdefault(key, {"ids": [], "run": run})
        entry["ids"].append(run["id"])
    return list(seen.values())


def _mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={mesh[a]}" for a in AXES if mesh.get(a, 1) > 1) or "1 GPU"


def _plan(plan: dict[str, Any]) -> dict[str, Any]:
    p = plan["predicted"]
    return {
        "mesh": _mesh_text(plan["mesh"]),
        "sizes": plan["mesh"],
        "schedule": plan["schedule"],
        "microbatches": plan["microbatches"],
        "ac": plan["ac"],
        "sp": plan["sp"],
        "step_s": p["step_s"],
        "memory_gib": p["memory_bytes_per_gpu"] / 2**30,
        "mfu": p["mfu"],
    }


def measure(entry: dict[str, Any]) -> dict[str, Any]:
    """``suggest`` free and at the published mesh for one setting."""
    run = entry["run"]
    common = {
        "gpus": run["gpus"],
        "gpu": run["hardware"],
        "seq_len": run["seq"],
        "global_batch_tokens": run["global_batch"] * run["seq"],
        "compile": bool(run.get("compile")),
        "top": 5,
    }
    started = time.perf_counter()
    try:
        free = suggest(run["model"], **common)
    except DoesNotFit as e:  # no layout at all: nothing to compare the published one with
        raise SystemExit(f"setting of {', '.join(entry['ids'])}: {e}") from e
    out: dict[str, Any] = {
        "ids": entry["ids"],
        "model": run["model"],
        "gpus": run["gpus"],
        "hardware": run["hardware"],
        "seq": run["seq"],
        "global_batch": run["global_batch"],
        "compile": common["compile"],
        "published_mesh": _mesh_text(run["mesh"]),
        "published_ac": run.get("ac"),
    }
    report = free.to_dict()
    fits = [step for step, _, fit in free.points if fit]
    out["fastest_s"] = min(fits)
    out["top"] = _plan(report["plans"][0])
    out["top_why"] = report["plans"][0]["why"]
    out["candidates_fit"] = len(fits)
    # What the top plan asks of its user, as issue #30 words a practitioner's layout.
    out["top_tp_in_node"] = out["top"]["sizes"].get("tp", 1) <= free.gpus_per_node
    out["needs"] = _needs(report)
    try:
        fixed = suggest(run["model"], mesh=run["mesh"], **common).to_dict()
        out["published"] = _plan(fixed["plans"][0])
    except DoesNotFit as e:
        out["published"] = None
        out["published_error"] = str(e)
    out["published_own_ac"] = _own_ac(run, common, out["published"])
    out["elapsed_s"] = time.perf_counter() - started
    return out


def _own_ac(
    run: dict[str, Any], common: dict[str, Any], best: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The published layout with the checkpointing its run used, where that is one of
    ours and not the one our best plan of the layout took: its fastest step time and its
    memory, and whether that fits (the limit is the report's)."""
    ac = run.get("ac")
    if ac is None or (best is not None and best["ac"] == ac):
        return None
    try:
        report = suggest(run["model"], mesh=run["mesh"], ac=ac, **common)
    except DoesNotFit as e:
        report = e.report
    fits = [(step, mem) for step, mem, fit in report.points if fit]
    step, mem = min(fits) if fits else min((step, mem) for step, mem, _ in report.points)
    if not fits and report.best_unfit is not None:
        mem = report.best_unfit[1]  # the least memory any setting of it needs
    return {
        "ac": ac,
        "fits": bool(fits),
        "step_s": step,
        "memory_gib": mem / 2**30,
        "limit_gib": report.memory_limit / 2**30,
    }


def _needs(report: dict[str, Any]) -> dict[str, bool]:
    """Whether the top plan uses pp or cp where a layout without it fits (the report's
    ``needs``: whether every layout that fits uses the axis)."""
    sizes = report["plans"][0]["mesh"]
    return {axis: sizes.get(axis, 1) > 1 and not report["needs"][axis] for axis in ("pp", "cp")}


def _own_text(own: dict[str, Any], fastest_s: float) -> str:
    """The published layout at its own checkpointing, in words."""
    if own["fits"]:
        return (
            f"with its own ac={own['ac']}: {own['step_s']:.2f}s "
            f"({100 * (own['step_s'] / fastest_s - 1):+.1f}% vs fastest), "
            f"{own['memory_gib']:.1f} GiB"
        )
    return (
        f"with its own ac={own['ac']}: does not fit on our trainer, needs at least "
        f"{own['memory_gib']:.1f} GiB of {own['limit_gib']:.1f} (it would take "
        f"{own['step_s']:.2f}s, {100 * (own['step_s'] / fastest_s - 1):+.1f}% vs fastest)"
    )


def format_result(rows: list[dict[str, Any]]) -> str:
    """The table ``main`` prints."""
    lines = [
        "published settings (no float8): the published layout's predicted step time "
        "against the planner's fastest and its top plan",
        f"  {'setting':<44} {'published layout (ours)':<44} {'vs fastest':>10} "
        f"{'vs top':>7}  top plan",
    ]
    for r in rows:
        setting = f"{r['model']} {r['gpus']}x{r['hardware']} {r['seq']}x{r['global_batch']}" + (
            " compile" if r["compile"] else ""
        )
        p = r["published"]
        if p is None:
            pub, vf, vt = f"{r['published_mesh']}: does not fit", "-", "-"
        else:
            pub = f"{p['mesh']} ac={p['ac']} mb={p['microbatches']} {p['step_s']:.2f}s"
            vf = f"{100 * (p['step_s'] / r['fastest_s'] - 1):+.1f}%"
            vt = f"{100 * (p['step_s'] / r['top']['step_s'] - 1):+.1f}%"
        t = r["top"]
        flags = []
        if not r["top_tp_in_node"]:
            flags.append("tp across nodes")
        flags += [f"{a} not needed" for a, needless in r["needs"].items() if needless]
        top = f"{t['mesh']} ac={t['ac']} {t['step_s']:.2f}s" + (
            f" ({'; '.join(flags)})" if flags else " (practical)"
        )
        lines.append(f"  {setting:<44} {pub:<44} {vf:>10} {vt:>7}  {top}")
        own = r.get("published_own_ac")
        if own is not None:
            lines.append(f"  {'':<44} {_own_text(own, r['fastest_s'])}")
    within = [
        r for r in rows if r["published"] and r["published"]["step_s"] <= 1.1 * r["fastest_s"]
    ]
    within_top = [
        r for r in rows if r["published"] and r["published"]["step_s"] <= 1.1 * r["top"]["step_s"]
    ]
    practical = [r for r in rows if r["top_tp_in_node"] and not any(r["needs"].values())]
    lines.append(
        f"  published within 10% of the fastest: {len(within)} of {len(rows)}; of the top "
        f"plan: {len(within_top)} of {len(rows)}; top plan practical: {len(practical)} of "
        f"{len(rows)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="settings whose row ids include these")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    chosen = settings(load_runs())
    if args.only:
        chosen = [e for e in chosen if set(e["ids"]) & set(args.only)]
    rows = []
    for entry in chosen:
        rows.append(measure(entry))
        r = rows[-1]
        print(f"  {', '.join(r['ids'])}: {r['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    print(format_result(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
