"""How long ``hyper-parallel suggest`` takes on this machine, and how much memory.

Each case runs ``suggest ... --format json`` in a fresh subprocess, exactly as a user
would: wall time (launch to exit, imports included), CPU time (user + system: less
sensitive to other load) and peak resident set, with the candidates searched and the
local structures traced (one dry run each) from its JSON. The goals of the planner's
issue: Llama-3-70B on 1,024 GPUs in < 60 s, Llama-3-405B on 16,384 GPUs in < 120 s,
< 4 GB of memory. ``run_all.py`` runs it as section t.

Run::

    .venv/bin/python benchmarks/bench_suggest_speed.py [--json suggest_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from _common import cli_run

# model, GPUs, sequence, tokens per step, goal in seconds (None: no goal stated)
CASES: tuple[tuple[str, int, int, int, float | None], ...] = (
    ("llama3-70b", 1024, 8192, 4 * 2**20, 60.0),
    ("llama3-405b", 16384, 8192, 16 * 2**20, 120.0),
    ("qwen3-30b-a3b", 64, 4096, 2**20, None),
)


def measure(model: str, gpus: int, seq: int, tokens: int, goal: float | None) -> dict[str, Any]:
    """One ``suggest`` run on H100s in a subprocess."""
    run = cli_run(
        "suggest",
        "--model",
        model,
        "--gpus",
        str(gpus),
        "--gpu",
        "h100-80gb",
        "--seq",
        str(seq),
        "--global-batch-tokens",
        str(tokens),
        "--top",
        "5",
        "--format",
        "json",
    )
    report = json.loads(run.pop("stdout"))
    best = report["plans"][0]
    return {
        "model": model,
        "gpus": gpus,
        "seq": seq,
        "tokens": tokens,
        "goal_s": goal,
        **run,
        "searched": report["searched"],
        "traced": report["traced"],
        "best": ",".join(f"{k}={v}" for k, v in best["mesh"].items() if v > 1) or "1 GPU",
    }


def format_result(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"hyper-parallel suggest on {os.cpu_count()} CPU(s):",
        f"  {'model':<14} {'GPUs':>6} {'searched':>9} {'traced':>6} {'wall s':>7} "
        f"{'CPU s':>6} {'goal s':>6} {'peak RSS MB':>12}",
    ]
    for r in rows:
        goal = f"{r['goal_s']:.0f}" if r["goal_s"] else "-"
        lines.append(
            f"  {r['model']:<14} {r['gpus']:>6,} {r['searched']:>9,} {r['traced']:>6} "
            f"{r['wall_s']:>7.1f} {r['cpu_s']:>6.1f} {goal:>6} {r['peak_rss_bytes'] / 1e6:>12,.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    rows = [measure(*case) for case in CASES]
    print(format_result(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
