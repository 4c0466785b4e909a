"""The published benchmark numbers come from ``latest.json``, stamped, by the script.

The performance block of ``docs/benchmarks.md`` is exactly what ``run_all.py`` renders
from ``benchmarks/results/latest.json``, and so is every measured figure the README and
the ``docs/`` pages quote (``<!-- bench:NAME -->`` markers, each in one page; "not
measured yet" where the section has no data);
``latest.md`` holds the same summary and every
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

X = "\u00d7"  # the multiplication sign the figures print
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def run_all() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_one_latest_json_gives(run_all):
    results = run_all.load_results()
    assert run_all.docs_block() == run_all.summary(results).strip()
    # Every row the table had before it was generated is still produced.
    block = run_all.docs_block()
    for row in ("fake PG, tp=8", "real gloo tp=2", "training step", "collectives per step"):
        assert row in block, row


def test_every_measured_figure_in_the_readme_and_docs_is_latest_jsons(run_all):
    results = run_all.load_results()
    expected = run_all.figures(results)
    quoted = run_all.docs_figures()
    # Every figure the script makes is quoted once (README or docs/), and no other is.
    assert set(quoted) == set(expected)
    for name, text in expected.items():
        assert quoted[name] == text, name
        section = run_all.FIGURES[name][0]
        if section not in results:  # no stale hand number: exactly the placeholder
            assert text == run_all.not_measured(section), name


def test_figures_render_from_data_and_say_not_measured_without_it(run_all, tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(
        f"{run_all.SUMMARY_BEGIN}\nold\n{run_all.SUMMARY_END}\n"
        "peak: <!-- bench:init-memory -->253 MiB<!-- /bench:init-memory -->; "
        "plan: <!-- bench:dry-run -->8.5 s<!-- /bench:dry-run -->\n"
    )
    # The other figures sit in another page (as they do in the README and docs/).
    other = tmp_path / "other.md"
    other.write_text(
        "moe: <!-- bench:dry-run-moe -->~30 s<!-- /bench:dry-run-moe -->; "
        "hf: <!-- bench:hf-load -->1.24 s<!-- /bench:hf-load -->; "
        "suggest: <!-- bench:suggest-speed -->60 s<!-- /bench:suggest-speed -->; "
        "s: <!-- bench:suggest-fidelity -->0.83<!-- /bench:suggest-fidelity -->; "
        "v: <!-- bench:published-settings -->5 of 11<!-- /bench:published-settings -->\n"
    )
    pages = [page, other]
    rows = [
        {"model": m, "mesh": mesh, "world_size": n, "wall_s": w, "cpu_s": c, "peak_rss_bytes": b}
        for m, mesh, n, w, c, b in (
            ("llama3-70b", "dp=128,tp=8", 1024, 9.04, 8.46, 341e6),
            ("qwen3-235b-a22b", "dp_shard=512,tp=8,ep=64", 4096, 31.0, 29.94, 352e6),
        )
    ]
    sections = {"r": {"stamp": {}, "data": rows}}
    run_all.write_docs("table", page, run_all.figures(sections), pages)
    got = run_all.docs_figures(pages)
    assert got["dry-run"] == (
        f"llama3-70b at dp=128{X}tp=8 (1,024 ranks) in 8.5 CPU-seconds (9.0 s wall) and 341 MB peak"
    )
    assert got["dry-run-moe"].startswith(f"qwen3-235b-a22b at dp_shard=512{X}tp=8{X}ep=64 (4,096")
    assert got["init-memory"] == run_all.not_measured("e")
    assert got["hf-load"] == run_all.not_measured("h")
    assert got["suggest-speed"] == run_all.not_measured("t")
    assert got["suggest-fidelity"] == run_all.not_measured("s")
    assert got["published-settings"] == run_all.not_measured("v")
    assert "old" not in page.read_text() and "table" in page.read_text()
    assert "~30 s" not in other.read_text() and "253 MiB" not in page.read_text()
    # Section r without the MoE case: that figure is not measured, the other is.
    figs = run_all.figures({"r": {"stamp": {}, "data": rows[:1]}})
    assert figs["dry-run-moe"] == run_all.not_measured("r")


def test_a_figure_must_be_quoted_by_exactly_one_page(run_all, tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"{run_all.SUMMARY_BEGIN}\n{run_all.SUMMARY_END}\n")
    twice = "<!-- bench:dry-run -->x<!-- /bench:dry-run -->"
    (tmp_path / "a.md").write_text(twice)
    (tmp_path / "b.md").write_text(twice)
    pages = [page, tmp_path / "a.md", tmp_path / "b.md"]
    figs = {"dry-run": "y"}
    with pytest.raises(SystemExit, match="exactly one"):
        run_all.write_docs("table", page, figs, pages)
    with pytest.raises(ValueError, match="repeated"):
        run_all.docs_figures(pages)
    with pytest.raises(SystemExit, match="no page"):
        run_all.write_docs("table", page, {"hf-load": "z"}, pages[:1])


def test_hf_load_figure_is_the_medians_of_section_h(run_all):
    def rank(i, ours_s, dcp_s):
        timing = {"bytes": [255.9e6], "mapped_bytes": [390e6], "peak_bytes": [131e6, 140e6, 150e6]}
        return {
            "rank": i,
            "state_bytes": 255.9e6,
            "ours": {"seconds": [ours_s, 9.0, 0.1], **timing},
            "dcp": {"seconds": [dcp_s, 9.0, 0.1], **timing},
        }

    h = {
        "checkpoint": {"bytes": 1.07e9, "files": 4},
        "mesh": {"dp_shard": 2, "tp": 2},
        "ranks": [rank(0, 0.5, 1.0), rank(1, 0.8, 1.0)],
        "data": {"data_tokens_per_s_per_rank": 5.2e6, "train_tokens_per_s": 1e4},
    }
    fig = run_all.figures({"h": {"stamp": {}, "data": h}})["hf-load"]
    assert fig.startswith(f"1,070 MB in 4 files at dp_shard=2 {X} tp=2")
    # medians 0.5 and 0.8 over 1.0 (the outliers 9.0 / 0.1 do not count)
    assert f"load time ours / DCP 0.50\u20130.80{X}" in fig
    assert "ours requests 255.9 MB" in fig and "+140 MB (ours)" in fig
    assert "file pages mapped: 390.0 MB and 390.0 MB" in fig
    assert "5.2 M tokens/s" in fig and f"520{X} what" in fig


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


def test_settings_figure_counts_published_layouts_near_the_fastest(run_all):
    def row(name, published, fastest, top):
        plan = {"step_s": published} if published else None
        return {"ids": [name], "published": plan, "fastest_s": fastest, "top": {"step_s": top}}

    data = {
        "rows": [
            row("a", 10.5, 10.0, 10.5),  # +5 %: near the fastest and the top plan
            row("b", 13.0, 10.0, 12.5),  # +30 % of the fastest, +4 % of the top plan
            row("c", None, 10.0, 10.0),  # does not fit: counted among the settings only
        ]
    }
    figs = run_all.figures({"v": {"stamp": {}, "data": data}})
    assert figs["published-settings"] == (
        "in 1 of 3 published settings the published layout is predicted within 10 % of the "
        "fastest layout that fits, in 2 within 10 % of the top plan; the widest gap +30 % (b)"
    )
    # The record's own faster structure, where a setting has one (the fastest is named).
    alt = {"mesh": "dp_shard=8", "gpus": 8, "id": "r1", "why": None}
    data["rows"][1]["record"] = [
        {**alt, "published_ratio": 1.5, "predicted_ratio": 1.4},
        {**alt, "id": "r2", "published_ratio": 0.9, "predicted_ratio": 0.8},
    ]
    data["rows"][0]["record"] = [{**alt, "id": "r3", "published_ratio": 1.2, "why": "refused"}]
    figs = run_all.figures({"v": {"stamp": {}, "data": data}})
    assert figs["published-settings"].endswith(
        "(b); in 2 the record itself ran another structure faster per GPU (b: dp_shard=8 on 8 "
        "GPUs, r1, ran 1.50x its tokens/s/GPU; predicted 1.40x)"
    )
