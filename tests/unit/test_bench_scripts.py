"""The scripts behind the docs' dry-run and init-memory numbers run and report sane values."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hyper_parallel.dmodule import get_spec

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_bench_measures_the_cli_plan_command(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its _common
    bench = _load("bench_dry_run")
    row = bench.measure("llama3-debug", "dp=2,tp=2", "--seq", "64")
    assert row["world_size"] == 4 and row["num_params"] > 0
    assert row["cpu_s"] > 0 and row["wall_s"] > 0
    assert 50e6 < row["peak_rss_bytes"] < 4e9  # torch alone is tens of MB
    assert "llama3-debug" in bench.format_result([row])


def test_suggest_speed_bench_measures_the_cli_suggest_command(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = _load("bench_suggest_speed")
    row = bench.measure("llama3-debug", 2, 128, 2 * 128, None)
    assert row["searched"] > 0 and row["traced"] > 0 and row["best"]
    assert row["cpu_s"] > 0 and row["wall_s"] > 0 and 50e6 < row["peak_rss_bytes"] < 4e9
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


def test_pp_bench_times_stage_actions_and_renders_rows(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its _common
    bench = _load("bench_pp")

    class Stage:
        def forward_one_chunk(self):
            time.sleep(0.01)

    class Schedule:
        def __init__(self):
            self._stage = Stage()

        def step(self):
            self._stage.forward_one_chunk()
            time.sleep(0.01)

    schedule = Schedule()
    meter = bench._Busy(schedule)
    schedule.step()
    assert 0.0 < meter.busy < meter.window  # the step's idle part is outside the action
    rows = [
        {"pp": 2, "contender": "pp=1", "step_ms": {"median": 10.0, "min": 9.0, "max": 11.0}},
        {
            "pp": 2,
            "contender": "1F1B",
            "step_ms": {"median": 15.0, "min": 14.0, "max": 16.0},
            "measured_bubble": 0.2,
            "predicted_bubble": 0.111,
        },
    ]
    table = bench.format_result(rows)
    assert "1.50x" in table and "0.200" in table and "0.111" in table


def test_hf_load_bench_sizes_its_checkpoint_and_section_h_renders(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = _load("bench_hf_load")
    from hyper_parallel.models.llama.config import llama3_config, num_params

    for size_mb in (64, 1024):
        dims = bench._dims(size_mb)
        assert abs(4 * num_params(llama3_config(**dims)) / 1e6 - size_mb) < 0.15 * size_mb
    run_all = _load("run_all")
    contender = {
        "seconds": [0.2, 0.3],
        "bytes": [100e6],
        "mapped_bytes": [150e6],
        "rchar_bytes": [0],
        "peak_bytes": [5e6, 6e6],
    }
    rank = {"rank": 0, "state_bytes": 100e6, "same_values": True}
    result = {
        "checkpoint": {"bytes": 1e9, "files": 4},
        "mesh": {"dp_shard": 2, "tp": 2},
        "ranks": [{**rank, "ours": contender, "dcp": contender}],
        "data": {"data_tokens_per_s_per_rank": 1e6, "train_tokens_per_s": 1e3},
    }
    text = run_all.section_hf_load(result, [])
    row = "| 0 | 100.0 | 0.250 [0.200-0.300] | 0.250 [0.200-0.300] | **1.00** | 100.0 | 100.0 "
    assert row + "| **1.00** | 150.0 | 150.0 | 5.5 | 5.5 | True |" in text, text
    assert "**1,000x**" in text
    assert "requested 100.0 MB, mapped 150.0 MB" in bench.report(result)


def test_settings_bench_sets_the_published_layout_beside_the_fastest_that_fits():
    bench = _load("bench_settings")
    from hyper_parallel.analysis.published import load_runs

    chosen = bench.settings(load_runs())
    assert all(e["run"]["float8"] == "none" for e in chosen)
    ids = [e["ids"] for e in chosen]
    assert ["tt2506-70b-bf16-async", "tt2506-70b-bf16-vanilla"] in ids  # one setting, two rows
    assert not any("mb2511-h100-llama3-8b" in i for i in ids)  # float8 rows are not settings
    run = {
        "id": "tiny",
        "model": "llama3-debug",
        "gpus": 4,
        "hardware": "h100-80gb",
        "seq": 128,
        "global_batch": 8,
        "mesh": {"dp_shard": 2, "tp": 2},
        "compile": False,
        "float8": "none",
        "ac": "none",
        "precision": "bf16",
    }
    row = bench.measure({"ids": ["tiny"], "run": run})
    published, top = row["published"], row["top"]
    assert published["mesh"] == "dp_shard=2,tp=2"
    # The fastest is the minimum over every layout that fits: the published one and the
    # top plan are among them.
    assert row["fastest_s"] <= published["step_s"] and row["fastest_s"] <= top["step_s"]
    assert row["top_tp_in_node"] and set(row["needs"]) == {"pp", "cp"}
    # A tiny model fits without pp and cp: the top plan uses neither where none is needed.
    assert row["needs"] == {"pp": False, "cp": False}
    own = row["published_own_ac"]  # the run's own checkpointing, unless ours chose it
    assert own is None if published["ac"] == "none" else own["ac"] == "none"
    if own is not None and own["fits"]:
        assert own["step_s"] >= row["fastest_s"]
    text = bench.format_result([row])
    assert "llama3-debug" in text and "dp_shard=2,tp=2" in text


def test_settings_bench_sets_the_records_other_structures_beside_a_setting():
    """The record's rows of the same model, GPU kind, sequence and compile switch in
    another structure: float8 rows, other GPU kinds or precisions and the setting's own structure
    (any dp) are left out; per structure the fastest row without async TP; each
    predicted on its own GPUs and batch."""
    bench = _load("bench_settings")
    from hyper_parallel.analysis.published import load_runs

    runs = load_runs()
    (tp8,) = [e for e in bench.settings(runs) if "tt2506-8b-bf16-vanilla" in e["ids"]]
    alts = bench.alternatives(tp8, runs)
    # torchtitan's FSDP-only rows of Llama 3 8B, compiled, bf16, on the same H100s: the
    # faster of 8 GPUs (6,667) and 128 GPUs (6,514) tokens/s/GPU.
    assert [a["id"] for a in alts] == ["tt2412-t1-b"]
    assert bench._published_tps(tp8, runs) == 4378.0  # the vanilla row, not async TP's
    (fsdp,) = [e for e in bench.settings(runs) if "tt2412-t1-b" in e["ids"]]
    # The other way round: the tp=8 rows; of async TP and vanilla, the vanilla one.
    assert [a["id"] for a in bench.alternatives(fsdp, runs)] == ["tt2506-8b-bf16-vanilla"]

    def row(id_, mesh, gpus, tps, **kw):
        return {
            "id": id_, "model": "llama3-debug", "gpus": gpus, "hardware": "h100-80gb",
            "seq": 128, "global_batch": 8, "mesh": mesh, "compile": False, "float8": "none",
            "ac": "none", "precision": "bf16", "measured": {"tokens_per_s_per_gpu": tps}, **kw,
        }  # fmt: skip

    runs = [
        row("mine", {"dp_shard": 2, "tp": 2}, 4, 100.0),
        row("same-structure", {"dp_shard": 4, "tp": 2}, 8, 500.0),
        row("fsdp", {"dp_shard": 2}, 2, 150.0),
        row("fsdp-f8", {"dp_shard": 2}, 2, 900.0, float8="tensorwise"),
        row("fsdp-a100", {"dp_shard": 2}, 2, 900.0, hardware="a100-80gb"),
        row("fsdp-bf16-true", {"dp_shard": 2}, 2, 900.0, precision="bf16-true"),
    ]
    setting = {"ids": ["mine"], "run": runs[0]}
    assert [a["id"] for a in bench.alternatives(setting, runs)] == ["fsdp"]
    measured = bench.measure(setting, runs)
    (alt,) = measured["record"]
    assert alt["published_ratio"] == 1.5 and alt["gpus"] == 2 and alt["why"] is None
    # Ours: the fsdp row's best plan on its 2 GPUs and 8 sequences against the
    # setting's best plan of dp_shard=2,tp=2 on 4, as tokens/s/GPU.
    fsdp = bench.suggest(
        "llama3-debug", mesh={"dp_shard": 2}, gpus=2, gpu="h100-80gb", seq_len=128,
        global_batch_tokens=8 * 128, compile=False, top=5,
    )  # fmt: skip
    step = min(s for s, _, fit in fsdp.points if fit)
    ours = 8 * 128 / measured["published"]["step_s"] / 4
    assert alt["predicted_ratio"] == pytest.approx(8 * 128 / step / 2 / ours, rel=1e-12)
    assert "the record: dp_shard=2 on 2 (fsdp) ran 1.50x" in bench.format_result([measured])


def test_comms_bench_minimum_with_shards_kept_is_the_tests_analytical_count(monkeypatch):
    """Section d's two minima: the one ours runs (shards kept, gathered again in
    backward) is the count ``test_llama_tp`` holds every step to; the other is torch's."""
    from tests.distributed.llama_checks import expected_collectives

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = _load("bench_comms")
    layers = 4
    for layout, sp in (("tp", False), ("tp_sp", True)):
        rows = bench.minimum(layers, 2, 64, 256, sp, keep_shards=True)
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["kind"]] = counts.get(r["kind"], 0) + r["count"]
        want: dict[str, int] = {}
        for phase in expected_collectives(layout, layers).values():
            for kind, n in phase.items():
                want[kind] = want.get(kind, 0) + n
        assert counts == want, layout
    kept = bench.minimum(layers, 2, 64, 256, True, keep_shards=True)
    plain = bench.minimum(layers, 2, 64, 256, True)
    # 2L + 1 more all-gathers of the activations, nothing else.
    extra = sum(r["bytes"] for r in kept) - sum(r["bytes"] for r in plain)
    assert extra == (2 * layers + 1) * 2 * 64 * 256 * bench.DTYPE_BYTES
