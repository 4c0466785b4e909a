"""The fast path's cost per forward, counted: no count may grow past its budget.

Counts (``benchmarks/bench_op_counts.py``) are Python function calls and torch
dispatcher ops per forward call, on the fake process group at tp=2, after warm-up.
They do not depend on the machine's load, so a regression of the per-call overhead
that a wall-clock ratio would hide fails here. Raise a budget only with the reason
in the commit message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Measured on torch 2.13.0 (CPU), Python 3.11, with
# `.venv/bin/python benchmarks/bench_op_counts.py --tp 2` (identical at --tp 4 and
# run to run; torch's hash-collision equality checks left out, see the benchmark):
# (python_calls, dispatch_ops) of "ours (fast)" per case. Raised 2026-12-04 for the
# models' RMSNorm and SwiGLU as autograd Functions that keep less for backward (+10
# calls per feed-forward, +2 ops per block) and sequence parallelism's shard kept for
# backward (+4 calls per gathered input under SP).
BUDGETS = {
    "mlp tp": (73, 11),
    "llama feed-forward TP": (228, 16),
    "llama block TP": (1450, 83),
    "llama feed-forward TP+SP": (350, 25),
    "llama block TP+SP": (1708, 101),
}


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    # A fresh interpreter: what earlier tests of the session imported or patched (dynamo,
    # dispatch modes, caches) must not change the counts.
    out = tmp_path_factory.mktemp("op_counts") / "counts.json"
    subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_op_counts.py"), "--tp", "2", "--json", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)},
    )
    return json.loads(out.read_text())["cases"]


@pytest.mark.parametrize("case", sorted(BUDGETS))
def test_fast_path_counts_stay_within_budget(counts, case):
    calls, ops = BUDGETS[case]
    ours = counts[case]["ours (fast)"]
    assert ours["python_calls"] <= calls, (case, ours["python_calls"], calls)
    assert ours["dispatch_ops"] <= ops, (case, ours["dispatch_ops"], ops, ours["ops"])


def test_the_counters_see_the_difference_between_paths(counts):
    # The guard is sensitive: the DTensor path costs several times the fast path's calls,
    # and the fast path's dispatcher ops are the hand-written code's (plus none per linear).
    mlp = counts["mlp tp"]
    assert mlp["ours (DTensor)"]["python_calls"] > 3 * mlp["ours (fast)"]["python_calls"]
    assert mlp["ours (fast)"]["dispatch_ops"] == mlp["hand-written"]["dispatch_ops"]
    assert counts["mlp tp"]["ours (fast)"]["ops"].get("c10d.allreduce_", 0) == 1
