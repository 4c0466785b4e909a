"""The committed GPU comparison (``benchmarks/results/gpu_h200.md``) is what
``benchmarks/bench_gpu.py`` renders today from the committed measurement
(``gpu_h200.json``) and the shipped hardware file: a change to the cost model that moves
a prediction beside the measured H200 runs shows here, and the page is re-rendered with
``bench_gpu.py --write benchmarks/results/gpu_h200.md`` (no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_the_committed_gpu_page_is_what_the_bench_renders_today():
    from hyper_parallel.analysis.cost_model import load_hardware

    bench = _bench()
    result = json.loads((RESULTS / "gpu_h200.json").read_text())
    predicted = bench.predictions(result, "h200-141gb")
    text = bench.format_report(result, predicted, load_hardware("h200-141gb"))
    assert text == (RESULTS / "gpu_h200.md").read_text()
    # Every trainer run measured is one the planner predicts (none failed, none skipped).
    assert len(predicted) == len(result["trainer"]) == 8
    assert all("error" not in run for run in result["trainer"])


def test_a_measurement_older_than_a_trainer_change_is_marked_not_a_memory_check():
    from hyper_parallel.analysis.cost_model import load_hardware

    bench = _bench()
    result = json.loads((RESULTS / "gpu_h200.json").read_text())
    predicted = bench.predictions(result, "h200-141gb")
    hw = load_hardware("h200-141gb")
    assert "Measured before a change to the trainer" in bench.format_report(result, predicted, hw)
    newer = dict(result, when={k: "2099-01-01 00:00 UTC" for k in result["when"]})
    assert "Measured before" not in bench.format_report(newer, predicted, hw)
