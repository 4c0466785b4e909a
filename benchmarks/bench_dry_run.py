"""Wall time and peak memory of ``hyper-parallel plan`` (the dry run) at scale.

Each case runs the CLI's ``plan`` command in a fresh subprocess, exactly as a user
would, and reports the subprocess's wall time (launch to exit, Python start-up and
imports included), its CPU time (user + system: what the wall time is on an idle
machine, and much less sensitive to other load) and its peak resident set size (its
own ``ru_maxrss`` at exit).
``run_all.py`` runs it as section r and writes the docs' dry-run figures from it.

Run::

    .venv/bin/python benchmarks/bench_dry_run.py [--json dry_run.json]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from _common import cli_run

CASES = (
    ("llama3-70b", "dp=128,tp=8"),
    ("llama3-405b", "dp=2048,tp=8"),
    # The docs' MoE plan command (ep borrows its ranks from dp_shard x tp: 4,096 ranks).
    ("qwen3-235b-a22b", "dp_shard=512,tp=8,ep=64"),
)


def measure(model: str, mesh: str, *extra: str) -> dict[str, Any]:
    """One ``plan --model MODEL --mesh MESH --format json [EXTRA...]`` run in a subprocess."""
    run = cli_run("plan", "--model", model, "--mesh", mesh, "--format", "json", *extra)
    report = json.loads(run.pop("stdout"))
    return {
        "model": model,
        "mesh": mesh,
        "world_size": report["world_size"],
        **run,
        "num_params": report.get("num_params"),
    }


def format_result(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"hyper-parallel plan (dry run, fake process group), {os.cpu_count()} CPU(s):",
        f"  {'model':<16} {'mesh':<24} {'ranks':>7} {'wall s':>7} {'CPU s':>6} {'peak RSS MB':>12}",
    ]
    for r in rows:
        lines.append(
            f"  {r['model']:<16} {r['mesh']:<24} {r['world_size']:>7,} {r['wall_s']:>7.1f} "
            f"{r['cpu_s']:>6.1f} {r['peak_rss_bytes'] / 1e6:>12.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    rows = [measure(model, mesh) for model, mesh in CASES]
    print(format_result(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
