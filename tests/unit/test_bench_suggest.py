"""bench_suggest's honesty rules, without a process group: the tune / held-out split is
declared up front and covers every kind of layout, the fit sees only tuning rows, and
calibrate's workload is sized unlike the models the bench measures."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its _common
    spec = importlib.util.spec_from_file_location("bench_suggest", BENCHMARKS / "bench_suggest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_suggest", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_layouts_are_split_up_front_and_each_split_covers_every_kind(bench):
    layouts = bench.LAYOUTS
    assert len(layouts) >= 16
    names = [lay.name for lay in layouts]
    assert len(set(names)) == len(names)
    assert {lay.split for lay in layouts} == set(bench.SPLITS)
    tune = {lay.name for lay in layouts if lay.split == bench.TUNE}
    held = {lay.name for lay in layouts if lay.split == bench.HELD_OUT}
    assert tune and held and not tune & held and tune | held == set(names)
    for split in bench.SPLITS:
        mine = [lay for lay in layouts if lay.split == split]
        missing = set(bench.REQUIRED_KINDS) - bench.covered_kinds(mine)
        assert not missing, (split, missing)
        # Enough layouts with and without tp for a rank correlation within each.
        assert sum(lay.axes()["tp"] > 1 for lay in mine) >= 3, split
        assert sum(lay.axes()["tp"] == 1 for lay in mine) >= 3, split


def test_kinds_name_what_a_layout_exercises(bench):
    Layout = bench.Layout
    assert Layout("dp_replicate=2,dp_shard=2", bench.TUNE).kinds() == {"hsdp"}
    assert Layout("dp_shard=4", bench.TUNE, microbatches=2).kinds() == {"fsdp", "accumulation"}
    assert Layout("pp=2,dp_shard=2", bench.TUNE, schedule="GPipe", microbatches=4).kinds() == {
        "fsdp",
        "pp:GPipe",
    }
    assert "pp:zero-bubble" in bench.covered_kinds(
        [Layout("pp=4", bench.TUNE, schedule="InterleavedZeroBubble")]
    )
    assert "pp:zero-bubble" not in bench.covered_kinds(
        [Layout("pp=4", bench.TUNE, schedule="Interleaved1F1B")]
    )


def _row(bench, layout, predicted: float, measured: float) -> dict:
    nbytes = 100 * 2**20
    return {
        "layout": layout.name,
        "split": layout.split,
        "mesh": layout.axes(),
        "predicted_step_s": predicted,
        "measured_step_s": measured,
        "step_error": predicted / measured - 1,
        "predicted_bytes": nbytes,
        "measured_bytes": nbytes // 2,
        "rss_bytes": nbytes * 2,
        "memory_error": 1.0,
        "rss_error": -0.5,
        "wall_s": 0.0,
    }


def _run_main(bench, monkeypatch, tmp_path, held_out_factor: float) -> tuple[dict, list]:
    """``main`` with the measurement replaced: tuning layouts measure 2x their
    prediction, held-out ones ``held_out_factor`` x; what reached the fit."""
    order = {lay.name: i for i, lay in enumerate(bench.LAYOUTS)}

    def measure(layout, hardware, args):
        predicted = 0.1 * (1 + order[layout.name])
        factor = 2.0 if layout.split == bench.TUNE else held_out_factor
        return _row(bench, layout, predicted, factor * predicted)

    seen: list = []
    real_fit = bench.fit_time_scale

    def spy(rows):
        seen.append([(r["layout"], r["split"]) for r in rows])
        return real_fit(rows)

    monkeypatch.setattr(bench, "measure_layout", measure)
    monkeypatch.setattr(bench, "fit_time_scale", spy)
    monkeypatch.setattr(bench, "_calibration", lambda hardware: {})
    out = tmp_path / f"s{held_out_factor}.json"
    assert bench.main(["--hardware", "unused.yaml", "--json", str(out)]) == 0
    return json.loads(out.read_text()), seen


def test_the_time_scale_is_fitted_on_tuning_rows_only(bench, monkeypatch, tmp_path):
    result, seen = _run_main(bench, monkeypatch, tmp_path, held_out_factor=10.0)
    tune = [(lay.name, lay.split) for lay in bench.LAYOUTS if lay.split == bench.TUNE]
    assert seen == [tune]  # called once, with exactly the tuning rows
    s = result["summary"]
    assert s["fit"]["time_scale"] == pytest.approx(2.0)
    assert s["fit"]["fitted_on"] == [name for name, _ in tune]
    # Held-out rows measured 10x their prediction keep their error after the fit.
    assert s["held_out"]["step_error_scaled"]["median"] == pytest.approx(0.8)
    assert s["tune"]["step_error_scaled"]["worst"] == pytest.approx(0.0, abs=1e-12)
    assert s["tune"]["step_error"]["median"] == pytest.approx(0.5)
    # Other held-out measurements: the same fit.
    again, _ = _run_main(bench, monkeypatch, tmp_path, held_out_factor=0.3)
    assert again["summary"]["fit"]["time_scale"] == pytest.approx(2.0)
    # Memory errors against both measures, per split.
    assert s["held_out"]["memory_error_live"]["median"] == pytest.approx(1.0)
    assert s["held_out"]["memory_error_rss"]["median"] == pytest.approx(0.5)
    # Predictions in measured order everywhere: every rank correlation is 1.
    for split in bench.SPLITS:  # (not "all": the two splits measure at other ratios)
        for key in ("spearman", "spearman_tp", "spearman_no_tp"):
            assert s[split][key] == pytest.approx(1.0), (split, key)


def test_fit_refuses_no_rows_and_spearman_is_rank_based(bench):
    with pytest.raises(ValueError):
        bench.fit_time_scale([])
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_calibrate_workload_is_sized_unlike_the_bench_models(bench):
    from hyper_parallel.analysis.calibrate import _MLP

    models = (bench.OVERRIDES, bench.MOE_OVERRIDES)
    widths = {m["dim"] for m in models}
    hidden = {bench.OVERRIDES["ffn_dim"], bench.MOE_OVERRIDES["moe_hidden_dim"]}
    assert _MLP["dim"] not in widths | hidden
    assert _MLP["hidden"] not in widths | hidden
    # Tokens per rank per micro-batch of every layout at the bench's batch and sequence.
    tokens = set()
    for layout in bench.LAYOUTS:
        c = bench._candidate(layout, bench.BATCH)
        tokens.add(bench.BATCH * bench.SEQ // (c.dp * c.cp * c.microbatches))
    assert _MLP["tokens"] not in tokens | {bench.SEQ}


def test_run_order_alternates_the_splits_and_keeps_every_layout(bench):
    order = bench.run_order(bench.LAYOUTS)
    assert sorted(lay.name for lay in order) == sorted(lay.name for lay in bench.LAYOUTS)
    splits = [lay.split for lay in order]
    n = min(splits.count(bench.TUNE), splits.count(bench.HELD_OUT))
    assert all(splits[i] != splits[i + 1] for i in range(2 * n - 1))


def test_a_crashed_layout_is_retried_once_then_reported_failed(bench, monkeypatch, tmp_path):
    calls: dict[str, int] = {}
    first, second = bench.LAYOUTS[0], bench.LAYOUTS[1]

    def measure(layout, hardware, args):
        calls[layout.name] = calls.get(layout.name, 0) + 1
        if layout.name == second.name or calls[layout.name] == 1:
            raise RuntimeError(f"process 0 terminated ({layout.name})")
        return _row(bench, layout, 1.0, 2.0)

    monkeypatch.setattr(bench, "measure_layout", measure)
    monkeypatch.setattr(bench, "_calibration", lambda hardware: {})
    monkeypatch.setattr(bench, "LAYOUTS", tuple(bench.LAYOUTS[:4]))
    out = tmp_path / "s.json"
    assert bench.main(["--hardware", "unused.yaml", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert calls[first.name] == 2 and calls[second.name] == bench.ATTEMPTS
    row = next(r for r in result["rows"] if r["layout"] == first.name)
    assert row["retried_after"] == f"process 0 terminated ({first.name})"
    assert [f["layout"] for f in result["failed"]] == [second.name]
    assert second.name not in [r["layout"] for r in result["rows"]]


def test_without_tuning_rows_nothing_is_fitted(bench):
    held = [lay for lay in bench.LAYOUTS if lay.split == bench.HELD_OUT][:3]
    rows = [_row(bench, lay, 1.0, 4.0) for lay in held]
    out = bench.summarize(rows, fit=lambda rows: pytest.fail("fit called without tune rows"))
    assert out["fit"]["time_scale"] == 1.0 and not out["fit"]["fitted"]
    assert out["held_out"]["step_error_scaled"]["median"] == pytest.approx(0.75)
