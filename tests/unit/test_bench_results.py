"""The published benchmark numbers come from ``latest.json``, stamped, by the script.

The README's performance block is exactly what ``run_all.py`` renders from
``benchmarks/results/latest.json``; ``latest.md`` holds the same summary and every
section's stamp; ``--only`` keeps the other sections' results; ``--repeat`` pools.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def run_all() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


def test_readme_figures_are_the_ones_latest_json_gives(run_all):
    results = run_all.load_results()
    assert run_all.readme_block() == run_all.summary(results).strip()
    # Every row the README's table had before it was generated is still produced.
    block = run_all.readme_block()
    for row in ("fake PG, tp=8", "real gloo tp=2", "training step", "collectives per step"):
        assert row in block, row


def test_latest_md_is_rendered_from_latest_json_with_every_stamp(run_all):
    results = run_all.load_results()
    md = (BENCHMARKS / "results" / "latest.md").read_text()
    assert run_all.summary(results) in md
    for key, section in results.items():
        st = section["stamp"]
        assert {"commit", "dirty", "generated", "args", "repeats"} <= set(st), key
        assert f"*Commit {st['commit']}" in md, key


def test_only_keeps_the_other_sections_and_stamps_the_new_one(run_all, tmp_path, monkeypatch):
    shutil.copy(BENCHMARKS / "results" / "latest.json", tmp_path / "latest.json")
    before = run_all.load_results(tmp_path / "latest.json")
    counts = {"tp": 2, "cases": {"mlp tp": {"ours (fast)": {"python_calls": 1, "dispatch_ops": 2}}}}
    calls = []

    def fake_run(script, args, out, timeout):
        calls.append(script)
        return counts

    monkeypatch.setattr(run_all, "_run", fake_run)
    monkeypatch.setattr(run_all, "RESULTS", run_all.RESULTS)  # restored after the test
    monkeypatch.setattr(run_all, "CHARTS", run_all.CHARTS)
    assert (
        run_all.main(
            ["--only", "o", "--repeat", "2", "--results-dir", str(tmp_path), "--no-charts"]
        )
        == 0
    )
    after = run_all.load_results(tmp_path / "latest.json")
    assert calls == ["bench_op_counts.py", "bench_op_counts.py"]
    assert {k: v for k, v in after.items() if k != "o"} == {
        k: v for k, v in before.items() if k != "o"
    }
    stamp = after["o"]["stamp"]
    assert stamp["repeats"] == 2 and stamp["commit"] != "unknown"
    assert isinstance(stamp["dirty"], bool)
    md = (tmp_path / "latest.md").read_text()
    assert "## o. Operations per forward" in md and run_all.summary(after) in md
    assert json.loads((tmp_path / "latest.json").read_text())["format"] == 2


def test_repeats_pool_times_and_take_the_median_of_figures(run_all):
    runs = [
        {"ep": 2, "times_us": {"ours": [1.0, 2.0]}, "tokens_per_s": 10.0, "label": "x"},
        {"ep": 2, "times_us": {"ours": [3.0]}, "tokens_per_s": 30.0, "label": "x"},
        {"ep": 2, "times_us": {"ours": [4.0]}, "tokens_per_s": 20.0, "label": "x"},
    ]
    pooled = run_all.pool_runs(runs)
    assert pooled == {
        "ep": 2,
        "times_us": {"ours": [1.0, 2.0, 3.0, 4.0]},
        "tokens_per_s": 20.0,
        "label": "x",
    }
    nested = run_all.pool_runs([{"layer": [{"step_ms": [1.0]}]}, {"layer": [{"step_ms": [2.0]}]}])
    assert nested == {"layer": [{"step_ms": [1.0, 2.0]}]}
