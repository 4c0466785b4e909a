"""The scripts behind the README's dry-run and init-memory numbers run and report sane values."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from hyper_parallel.dmodule import get_spec

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_bench_measures_the_cli_plan_command():
    bench = _load("bench_dry_run")
    row = bench.measure("llama3-debug", "dp=2,tp=2", "--seq", "64")
    assert row["world_size"] == 4 and row["num_params"] > 0
    assert row["cpu_s"] > 0 and row["wall_s"] > 0
    assert 50e6 < row["peak_rss_bytes"] < 4e9  # torch alone is tens of MB
    assert "llama3-debug" in bench.format_result([row])


def test_init_memory_bench_names_the_largest_module():
    bench = _load("bench_init_memory")
    with torch.device("meta"):
        model = get_spec("llama3-debug").config().build()
    name, size = bench.largest_module(model)
    sizes = {
        n: sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for n, m in model.named_modules()
    }
    assert size == max(sizes.values()) and sizes[name] == size
    assert name in ("tok_embeddings", "output")
