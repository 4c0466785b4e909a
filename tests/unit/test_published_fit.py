"""The planner ships the published-runs fit: the H100/H200 hardware files and
``STATED_FACTORS`` hold exactly what ``benchmarks/bench_published.py`` fits on the ``fit``
rows, and with them the cost model gives the errors the docs publish (section u)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from hyper_parallel.analysis.cost_model import load_hardware
from hyper_parallel.analysis.published import load_runs
from hyper_parallel.analysis.suggest import STATED_FACTORS, RunFactors

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    name = "bench_published"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def test_run_factors_state_compile_float8_and_async_tp():
    f = RunFactors.stated(compile=True, float8="tensorwise", async_tp=True)
    assert f.compute == STATED_FACTORS["compile"]  # float8 speeds the matmuls alone
    assert f.matmul == STATED_FACTORS["float8_tensorwise"]
    assert f.tp_exposed == STATED_FACTORS["async_tp_exposed"]
    assert RunFactors.stated() == RunFactors()  # the eager bf16 trainer: no factor
    mine = {**STATED_FACTORS, "compile": 0.5}
    assert RunFactors.stated(compile=True, values=mine).compute == 0.5
    with pytest.raises(ValueError, match="float8='mxfp8'; use one of none, tensorwise"):
        RunFactors.stated(float8="mxfp8")
    # another stack: Megatron-Core with Transformer Engine, on top of float8
    te = RunFactors.stated(float8="tensorwise", runtime="megatron-te")
    assert te.compute == STATED_FACTORS["megatron_te"]
    assert te.matmul == STATED_FACTORS["float8_tensorwise"]
    with pytest.raises(ValueError, match="runtime='jax'; use one of pytorch, megatron-te"):
        RunFactors.stated(runtime="jax")


def test_a_run_states_its_stack_or_is_pytorch(monkeypatch):
    """``runtime`` defaults to ``pytorch``; an unknown one is refused with the run's id."""
    import hyper_parallel.analysis.published as published

    runs = load_runs()
    assert {r["runtime"] for r in runs} == {"pytorch", "megatron-te"}
    assert all(r["runtime"] == "megatron-te" for r in runs if r["source_key"] == "mb2511")
    raw = published._raw()
    raw["runs"][0] = {**raw["runs"][0], "runtime": "jax"}
    monkeypatch.setattr(published, "_raw", lambda: raw)
    with pytest.raises(ValueError, match=r"tt2412-t1-a.*runtime 'jax'; use one of pytorch"):
        load_runs()


def test_a_published_memory_figure_says_what_it_measures(monkeypatch, bench):
    """A run with ``memory_gib`` needs a source stating ``memory: reserved|allocated``;
    a reserved figure is the live peak over ``1 - allocator_share``, an allocated one the
    live peak itself."""
    import hyper_parallel.analysis.published as published

    runs = load_runs()
    with_memory = [r for r in runs if "memory_gib" in r["measured"]]
    assert with_memory and {r["memory_metric"] for r in with_memory} == {"reserved"}
    live = 100 * 2**30
    p = {"allocator_share": 0.2}
    assert bench._memory_gib(with_memory[0], live, p) == pytest.approx(125.0, rel=1e-12)
    assert bench._memory_gib({"memory_metric": "allocated"}, live, p) == 100.0
    raw = published._raw()
    raw["sources"]["tt2412"] = {k: v for k, v in raw["sources"]["tt2412"].items() if k != "memory"}
    monkeypatch.setattr(published, "_raw", lambda: raw)
    with pytest.raises(ValueError, match=r"tt2412-t1-a.*memory_gib given.*reserved, allocated"):
        load_runs()


def test_the_fitted_files_agree_name_the_fit_and_are_what_the_bench_predicts_with(bench):
    ships = bench.shipped()  # raises when the files disagree
    assert set(ships) == set(bench.BEFORE)
    for kind in bench.FITTED_KINDS:
        hw = load_hardware(kind)
        for field in ("compute_efficiency.bf16", "intra_node.efficiency", "inter_node.efficiency"):
            assert "bench_published.py" in hw.sources[field], (kind, field)
            assert "fit rows" in hw.sources[field], (kind, field)
        # The trainer's attention kernels are measured, not fitted on published runs
        # (theirs is the stated factor "attention").
        for field in ("attention_efficiency", "chunked_attention_efficiency"):
            assert hw.sources[field].startswith("measured: benchmarks/bench_gpu.py"), (kind, field)
        assert hw.chunked_attention_efficiency < hw.attention_efficiency
        # The bench's "after" hardware is the shipped file itself.
        assert bench._hardware(hw, ships) == hw


def test_the_models_stated_error_lies_between_its_held_out_median_and_worst():
    """suggest's ``MODEL_ERROR`` (its band for telling step times apart) is what section u
    measures on the held-out rows: no narrower than the median |error|, no wider than the
    worst."""
    from hyper_parallel.analysis.suggest._search import MODEL_ERROR

    latest = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    held = latest["sections"]["u"]["data"]["summary"]["after_heldout"]
    assert held["n"] >= 10
    assert held["median"] <= MODEL_ERROR <= held["worst"]


def test_compare_names_each_value_that_is_not_the_fit(bench):
    ships = bench.shipped()
    assert bench.compare(dict(ships), ships) == []
    off = {**ships, "efficiency": ships["efficiency"] + 0.01, "attention": None}
    lines = bench.compare(off, ships)
    assert [line.split(":")[0] for line in lines] == ["efficiency", "attention"]


def test_the_shipped_values_give_the_published_held_out_errors(bench):
    """Three held-out rows predicted with what ships give the errors that
    ``benchmarks/results/latest.json`` (the docs' section u) reports after the fit."""
    latest = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    data = latest["sections"]["u"]["data"]
    ships = bench.shipped()
    assert data["shipped_mismatch"] == []
    for name, value in data["params_after"].items():
        assert value == ships[name] or math.isclose(value, ships[name], rel_tol=1e-9), name
    published = {e["id"]: e for e in data["rows"]}
    ids = ("tt2412-t1-a", "tt2412-t3-b", "trainy2506-4n")
    rows = bench.prepare([r for r in load_runs() if r["id"] in ids])
    assert sorted(r.run["id"] for r in rows if r.scorer is not None) == sorted(ids)
    for row in rows:
        assert row.run["split"] == "heldout"
        got = bench.evaluate(row, ships, {})
        want = published[row.run["id"]]["after"]
        assert got["error"] == pytest.approx(want["error"], rel=1e-9, abs=1e-12), row.run["id"]
        assert got["memory_gib"] == pytest.approx(want["memory_gib"], rel=1e-9)


@pytest.mark.slow
def test_the_shipped_values_are_the_fit_of_the_fit_rows(bench):
    """``bench_published.py --check`` as a test: the fit reads the fit rows only."""
    fitted = bench.fit_published()
    assert bench.compare(fitted, bench.shipped()) == []


def test_what_a_source_leaves_unstated_is_searched_and_what_it_states_is_kept(bench):
    """A looped schedule without ``stages_per_rank`` tries 2, 4 and 8 (what ``suggest``
    searches), with ``ac: null`` every mode; a stated value is the one candidate."""
    paper = {r["id"]: r for r in load_runs()}["llama3paper-c-128k"]
    assert paper["ac"] is None and "stages_per_rank" not in paper
    got = bench._candidates(paper)
    assert sorted({c.stages_per_rank for c in got}) == [2, 4, 8]
    assert {c.ac for c in got} == {"none", "selective", "full", "op"}
    stated = {**paper, "stages_per_rank": 2, "ac": "full"}
    assert [(c.stages_per_rank, c.ac) for c in bench._candidates(stated)] == [(2, "full")]
    titan = {r["id"]: r for r in load_runs()}["tt2412-t5-b"]  # torchtitan states 2
    assert [c.stages_per_rank for c in bench._candidates(titan)] == [2]


def test_a_run_says_where_its_attention_rate_comes_from(monkeypatch, bench):
    """``attention: fitted`` (the default) takes the published fit's rate and tunes it;
    ``measured`` (a row's, else its source's) takes the hardware file's one-sequence
    kernel at every cp degree and tunes nothing; "before" models no attention rate; an
    unknown value, or ``measured`` on hardware that measured none, is refused."""
    import dataclasses

    import hyper_parallel.analysis.published as published

    runs = {r["id"]: r for r in load_runs()}
    titan, paper = runs["tt2412-t2-c"], runs["llama3paper-c-128k"]
    assert titan["attention"] == "fitted" and titan["mesh"]["cp"] == 4
    assert paper["attention"] == "measured" and paper["mesh"]["cp"] == 16  # its source's
    assert runs["automodel-llama3-70b"]["attention"] == "fitted"  # torch's SDPA
    assert runs["automodel-qwen3-moe-30b"]["attention"] == "measured"  # the row's: TE
    ships = bench.shipped()
    h80, h96 = load_hardware("h100-80gb"), load_hardware("h100-96gb")
    assert h80.attention_efficiency != ships["attention"]
    assert bench._factors(paper, ships, h80).attention_efficiency == h80.attention_efficiency
    assert bench._factors(titan, ships, h96).attention_efficiency == ships["attention"]
    assert bench._factors(paper, bench.BEFORE, h80).attention_efficiency == 0.55
    assert bench._uses(titan, "attention") and not bench._uses(paper, "attention")
    with pytest.raises(ValueError, match=r"llama3paper-c-128k.*attention: measured.*h100-80gb"):
        bench._factors(paper, ships, dataclasses.replace(h80, attention_efficiency=None))
    raw = published._raw()
    raw["runs"][0] = {**raw["runs"][0], "attention": "flash3"}
    monkeypatch.setattr(published, "_raw", lambda: raw)
    with pytest.raises(ValueError, match=r"tt2412-t1-a.*attention 'flash3'; use one of fitted"):
        load_runs()
