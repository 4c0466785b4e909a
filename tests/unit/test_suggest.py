"""``hyper-parallel suggest``: answers that make sense, the cost model's formulas, files.

Small models and clusters so each search takes a few seconds (one dry run per local
structure, shared by every candidate with it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import yaml

from hyper_parallel.analysis.cost_model import (
    HARDWARE_KINDS,
    OPTIMIZER_BYTES_PER_ELEMENT,
    axis_span,
    collective_seconds,
    exposed_seconds,
    list_hardware,
    load_hardware,
    optimizer_seconds,
    usable_memory,
)
from hyper_parallel.analysis.suggest import (
    DoesNotFit,
    ModelSource,
    count_flops,
    count_operators,
    model_from_hf_config,
    suggest,
)
from hyper_parallel.cli import main
from hyper_parallel.distributed.layout import MeshLayout

# A ~0.3B Llama: fits one GPU for training, big enough that compute matters.
SMALL_LLAMA = ModelSource(
    "llama3-8b",
    (
        ("dim", 1024),
        ("ffn_dim", 4096),
        ("num_heads", 16),
        ("num_kv_heads", 8),
        ("num_layers", 8),
        ("vocab_size", 32000),
    ),
    label="llama-0.3b",
)


def _hardware(**changes: object) -> object:
    return dataclasses.replace(load_hardware("h100-80gb"), **changes)


# ----------------------------------------------------------------------------- data


def test_every_shipped_kind_loads_with_sources() -> None:
    assert set(HARDWARE_KINDS) <= set(list_hardware())
    for kind in HARDWARE_KINDS:
        hw = load_hardware(kind)
        assert hw.memory_bytes > 30e9 and hw.peak_flops["bf16"] > 1e14
        assert hw.intra_node.bandwidth > hw.inter_node.bandwidth
        # every number the file gives carries its source
        for field in (
            "memory_bytes",
            "peak_flops.bf16",
            "hbm_bandwidth",
            "intra_node.bandwidth",
            "inter_node.bandwidth",
        ):
            assert hw.sources.get(field), (kind, field)


def test_user_hardware_file_plain_numbers(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "mine",
                "memory_bytes": 16e9,
                "peak_flops": {"bf16": 1e14, "fp32": 5e13},
                "compute_efficiency": 0.5,
                "hbm_bandwidth": 1e12,
                "gpus_per_node": 4,
                "intra_node": {"bandwidth": 1e11, "latency_s": 5e-6},
                "inter_node": {"bandwidth": 1e10, "latency_s": 2e-5, "efficiency": 0.7},
            }
        )
    )
    hw = load_hardware(path)
    assert hw.gpus_per_node == 4 and hw.compute_efficiency == {"bf16": 0.5, "fp32": 0.5}
    assert hw.inter_node.efficiency == 0.7 and hw.intra_node.efficiency == 1.0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "memory_bytes": 1e9}))
    with pytest.raises(ValueError, match="missing field 'peak_flops'"):
        load_hardware(bad)
    with pytest.raises(ValueError, match=r"unknown GPU kind 'h100'.*h100-80gb"):
        load_hardware("h100")
    # The kinds a short or misspelt name stands for are named first.
    with pytest.raises(ValueError, match=r"'h200' \(did you mean 'h200-141gb'\?\)"):
        load_hardware("h200")
    with pytest.raises(ValueError, match=r"'h100' \(did you mean 'h100-80gb' or 'h100-96gb'\?\)"):
        load_hardware("h100")
    with pytest.raises(ValueError, match=r"'a100-80' \(did you mean 'a100-80gb'\?\)"):
        load_hardware("a100-80")


def test_overhead_and_overlap_fields(tmp_path) -> None:
    base = {
        "memory_bytes": 16e9,
        "peak_flops": 1e14,
        "compute_efficiency": 0.5,
        "hbm_bandwidth": 1e12,
        "gpus_per_node": 4,
        "intra_node": {"bandwidth": 1e11, "latency_s": 5e-6},
        "inter_node": {"bandwidth": 1e10, "latency_s": 2e-5},
    }
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(base))
    hw = load_hardware(path)  # absent: the GPU defaults
    assert (hw.op_overhead_s, hw.dtensor_op_overhead_s, hw.comm_overlap) == (0.0, 0.0, 1.0)
    path.write_text(
        yaml.safe_dump(
            base | {"op_overhead_s": 5e-6, "dtensor_op_overhead_s": 6e-5, "comm_overlap": 0}
        )
    )
    hw = load_hardware(path)
    assert (hw.op_overhead_s, hw.dtensor_op_overhead_s, hw.comm_overlap) == (5e-6, 6e-5, 0.0)
    for bad, match in ((1.5, "<= 1.0"), (-0.1, ">= 0.0")):
        path.write_text(yaml.safe_dump(base | {"comm_overlap": bad}))
        with pytest.raises(ValueError, match=f"field 'comm_overlap' is {bad}; it must be {match}"):
            load_hardware(path)
    # exposure: comm_overlap of the shorter of the two hides
    assert exposed_seconds(hw, 3.0, 2.0) == 3.0  # nothing hides at 0
    assert exposed_seconds(dataclasses.replace(hw, comm_overlap=0.5), 3.0, 2.0) == 2.0
    assert exposed_seconds(dataclasses.replace(hw, comm_overlap=1.0), 1.0, 2.0) == 0.0
    # optimizer: AdamW's bytes + operators per tensor (DTensor ones dearer)
    plain = optimizer_seconds(hw, 1e6, 10, 10, sharded=False)
    assert math.isclose(plain, OPTIMIZER_BYTES_PER_ELEMENT * 1e6 / 1e12 + 100 * 5e-6)
    assert math.isclose(optimizer_seconds(hw, 1e6, 10, 10, sharded=True) - plain, 100 * 6e-5)
    for kind in HARDWARE_KINDS:  # the shipped kinds state these, with a source
        gpu = load_hardware(kind)
        assert (gpu.op_overhead_s, gpu.dtensor_op_overhead_s, gpu.comm_overlap) == (0, 0, 1)
        assert gpu.sources.get("comm_overlap") and gpu.sources.get("op_overhead_s")
        assert gpu.optimizer_temporary == 1 and gpu.sources.get("optimizer_temporary")
    assert hw.optimizer_temporary == 1  # absent: the GPU default


def test_hardware_file_not_yaml_or_efficiency_out_of_range_is_refused(tmp_path, capsys) -> None:
    """A malformed YAML file was a yaml.parser.ParserError traceback; an efficiency above
    1 (compute_efficiency: {bf16: 5}) was taken as 5x the peak."""
    path = tmp_path / "hw.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match=r"hardware file '.*hw\.yaml': not valid YAML \(.*line 2"):
        load_hardware(path)
    argv = ["suggest", "--model", "llama3-debug", "--gpus", "2", "--hardware", str(path),
            "--seq", "64", "--global-batch-tokens", "128"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: hardware file" in err and "not valid YAML" in err and "Traceback" not in err
    base = {
        "memory_bytes": 16e9,
        "peak_flops": 1e14,
        "compute_efficiency": {"bf16": 0.5, "fp32": 0.5},
        "hbm_bandwidth": 1e12,
        "gpus_per_node": 4,
        "intra_node": {"bandwidth": 1e11, "latency_s": 5e-6},
        "inter_node": {"bandwidth": 1e10, "latency_s": 2e-5},
    }
    link = {"bandwidth": 1e11, "latency_s": 5e-6}
    for field, change in (
        ("compute_efficiency.bf16", {"compute_efficiency": {"bf16": 5, "fp32": 0.5}}),
        ("compute_efficiency", {"compute_efficiency": 1.5}),
        ("intra_node.efficiency", {"intra_node": link | {"efficiency": 2}}),
        ("inter_node.efficiency", {"inter_node": link | {"efficiency": {"value": 1.2}}}),
        ("collectives.all_gather.efficiency",
         {"collectives": {"all_gather": link | {"efficiency": 3}}}),
        ("attention_efficiency", {"attention_efficiency": 1.1}),
        ("attention_efficiency", {"attention_efficiency": 0}),
        ("chunked_attention_efficiency", {"chunked_attention_efficiency": 7}),
    ):  # fmt: skip
        path.write_text(yaml.safe_dump(base | change))
        with pytest.raises(
            ValueError, match=rf"field '{re.escape(field)}' is .*must be in \(0, 1\]"
        ):
            load_hardware(path)
    path.write_text(yaml.safe_dump(base | {"attention_efficiency": 1, "intra_node": link}))
    assert load_hardware(path).attention_efficiency == 1.0


def test_calibrated_links_per_group_size(tmp_path) -> None:
    from hyper_parallel.analysis.calibrate import _fit, _group_sizes

    assert _group_sizes(4) == [2] and _group_sizes(8) == [2, 4] and _group_sizes(2) == []
    # the latency-bandwidth model solved back: 3 ring steps of 1 ms, 6 MiB on the wire at 1 GB/s
    fit = _fit("all_gather", 3e-3, 3e-3 + 6 * 2**20 / 1e9, 4)
    assert math.isclose(fit["latency_s"], 1e-3) and math.isclose(fit["bandwidth"], 1e9)
    slow = {"bandwidth": 1e9, "latency_s": 1e-3}  # all_gather over 2 ranks, measured
    raw = {
        "memory_bytes": 8e9,
        "peak_flops": 1e12,
        "compute_efficiency": 0.5,
        "hbm_bandwidth": 1e10,
        "gpus_per_node": 4,
        "intra_node": {"bandwidth": 1e10, "latency_s": 1e-5},
        "inter_node": {"bandwidth": 1e9, "latency_s": 1e-4},
        "collectives_by_group": {2: {"all_gather": slow}},
    }
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    hw = load_hardware(path)
    assert hw.link("all_gather", False, 2).bandwidth == 1e9  # measured for 2 ranks
    assert hw.link("all_gather", False, 4).bandwidth == 1e10  # not measured: intra_node
    assert hw.link("reduce_scatter", False, 2).bandwidth == 1e10
    got = collective_seconds(hw, "all_gather", 2e6, count=1, group_size=2, crosses_nodes=False)
    assert math.isclose(got, 1e-3 + 1e6 / 1e9)


def test_calibrate_writes_a_file_the_planner_reads(tmp_path) -> None:
    """``calibrate`` (quick, 2 gloo ranks, ~9 s) writes a hardware file ``load_hardware``
    reads, each measured value with its source; AdamW on a CPU holds no temporary of
    every parameter (``optimizer_temporary`` 0), so the planner's optimizer step there is
    the states alone."""
    from hyper_parallel.analysis.calibrate import calibrate

    path = tmp_path / "this-machine.yaml"
    calibrate(path, ranks=2, quick=True)
    hw = load_hardware(path)
    assert hw.optimizer_temporary == 0.0 and "CPU" in hw.sources["optimizer_temporary"]
    assert hw.peak_flops["fp32"] > 0 and hw.op_overhead_s > 0 and 0 <= hw.comm_overlap <= 1
    for key in ("memory_bytes", "hbm_bandwidth", "comm_overlap", "op_overhead_s"):
        assert hw.sources.get(key), key


def test_operator_counts_and_memory_traffic() -> None:
    import torch

    a, b = torch.ones(4, 8, device="meta"), torch.ones(8, 2, device="meta")
    with count_operators() as ops:
        a * 2  # elementwise: reads 32, writes 32
        a.view(32)  # a view: no traffic
        a @ b  # a matmul: in the FLOPs, not the traffic
    assert ops.count == 3 and ops.elements == 64
    f = count_flops(
        ModelSource("llama3-debug", (("num_layers", 2), ("dim", 64), ("num_heads", 4))), 32
    )
    # one block: norms, SwiGLU, rotary, residuals move at least a few times its
    # activations (32 tokens x 64 dims); 9 parameter tensors (2 norms, 7 linears)
    assert f.block_fwd_elements > 10 * 32 * 64 and f.block_bwd_elements > f.block_fwd_elements / 2
    assert f.block_tensors == 9 and f.rest_tensors == 3
    assert f.optimizer_ops_per_tensor >= 5  # AdamW's single-tensor step on a CPU


def test_axis_span_follows_mesh_order() -> None:
    layout = MeshLayout(pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=4)
    assert axis_span(layout, "tp", 8) == (4, False)
    assert axis_span(layout, "cp", 8) == (2, False)  # stride 4: ranks 0 and 4 of a node
    assert axis_span(layout, "dp_shard", 8) == (4, True)  # stride 8
    assert axis_span(layout, "fsdp", 8) == (8, True)  # dp_shard x cp = 8 at stride 4
    assert axis_span(layout, "fsdp", 32) == (8, False)
    assert axis_span(MeshLayout(dp_shard=8, ep=4), "ep", 8) == (4, False)
    assert axis_span(MeshLayout(dp_shard=8, ep=4), "efsdp", 8) == (2, False)


def test_collective_formula() -> None:
    hw = load_hardware("h100-80gb")
    link = hw.intra_node
    assert 0 < link.efficiency <= 1
    n, p = 1 << 30, 8
    got = collective_seconds(hw, "all_gather", n, count=1, group_size=p, crosses_nodes=False)
    want = (p - 1) * link.latency_s + n * (p - 1) / p / (link.bandwidth * link.efficiency)
    assert math.isclose(got, want)
    # all-reduce: twice the bytes; tree latency (2 log2 p steps) when it beats the ring
    ar = collective_seconds(hw, "all_reduce", n, count=1, group_size=p, crosses_nodes=False)
    want_ar = 6 * link.latency_s + 2 * n * (p - 1) / p / (link.bandwidth * link.efficiency)
    assert math.isclose(ar, want_ar)
    inter = collective_seconds(hw, "all_gather", n, count=1, group_size=p, crosses_nodes=True)
    assert inter > 5 * got
    assert usable_memory(hw) < hw.memory_bytes - 2 * 1024**3


def test_hf_config(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "num_hidden_layers": 16,
                "vocab_size": 128256,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": False,
            }
        )
    )
    source = model_from_hf_config(path)
    assert source.spec_name == "llama3-hf"
    config = source.config()
    assert len(config.layers) == 16 and config.norm.dim == 2048
    path.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="architectures"):
        model_from_hf_config(path)
    with pytest.raises(ValueError, match="cannot read it"):
        model_from_hf_config(tmp_path / "missing" / "config.json")


def test_hf_config_qwen3_dense_from_transformers(tmp_path) -> None:
    """A Qwen3 dense config.json as transformers writes it: suggested through the
    package's converter, and its command names the converter's spec and overrides."""
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    source = model_from_hf_config(tmp_path / "config.json")
    assert source.spec_name == "qwen3-hf"
    overrides = dict(source.overrides)
    assert (overrides["dim"], overrides["head_dim"], overrides["num_layers"]) == (512, 64, 4)
    report = suggest(
        source, gpus=2, gpu="h100-80gb", seq_len=1024, global_batch_tokens=2 * 1024, top=1
    )
    command = report.plans[0][2]
    assert "--model qwen3-hf --model-overrides " in command
    assert '"head_dim":64' in command
    # a field the converter does not implement is refused, named
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["use_sliding_window"] = True
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="use_sliding_window"):
        model_from_hf_config(tmp_path)


# ----------------------------------------------------------------------------- answers


def test_model_that_fits_one_gpu_gets_plain_data_parallel() -> None:
    report = suggest(
        SMALL_LLAMA, gpus=4, gpu="h100-80gb", seq_len=1024, global_batch_tokens=4 * 8 * 1024, top=3
    )
    best = report.plans[0][0]
    assert (best.pp, best.cp, best.tp, best.ep) == (1, 1, 1, 1), best
    assert best.dp == 4
    assert report.searched > 50 and 0 < report.traced <= 6
    plan = report.to_dict()["plans"][0]
    assert set(plan) == {
        "mesh",
        "microbatches",
        "schedule",
        "stages_per_rank",
        "reduce_each_microbatch",
        "ac",
        "sp",
        "predicted",
        "command",
        "slurm",
        "why",
        "equivalent",
    }
    assert set(plan["predicted"]) >= {
        "step_s",
        "tokens_per_s_per_gpu",
        "mfu",
        "memory_bytes_per_gpu",
    }
    assert 0 < plan["predicted"]["mfu"] < 0.6
    assert plan["predicted"]["memory_bytes_per_gpu"] < usable_memory(report.hardware)
    assert plan["command"].startswith(
        "torchrun --standalone --nproc-per-node 4 -m "
        "hyper_parallel.train.run --model llama3-8b "
        "--model-overrides "
    )
    assert f"--mesh {best.mesh_text()} " in plan["command"]
    assert "--batch-size 32 " in plan["command"] and "--seq-len 1024 " in plan["command"]
    assert set(report.to_dict()) >= {"plans", "rejected", "hardware", "searched", "traced"}


def test_tp_never_spans_nodes_unless_allowed() -> None:
    hw = _hardware(memory_bytes=8e9)  # forces model parallelism for the 0.3B model
    report = suggest(
        SMALL_LLAMA,
        gpus=4,
        gpu=hw,
        gpus_per_node=2,
        seq_len=1024,
        global_batch_tokens=4 * 1024,
        top=100,
    )
    assert report.plans and all(c.tp <= 2 for c, _, _ in report.plans)
    assert report.rejected["tp would span nodes (allow with --allow-cross-node-tp)"] == 1


def test_sequence_that_does_not_fit_gets_cp() -> None:
    # Two 16k-token sequences on four GPUs, tp ruled out (one GPU per node): one
    # sequence per data-parallel rank at most, so the sequence itself must be split.
    report = suggest(
        SMALL_LLAMA,
        gpus=4,
        gpu="h100-80gb",
        gpus_per_node=1,
        seq_len=16384,
        global_batch_tokens=2 * 16384,
        top=20,
    )
    best = report.plans[0][0]
    assert best.cp > 1 and best.tp == 1, best
    # and with memory just above what the best needs, it still fits and keeps cp
    need = report.plans[0][1].memory_bytes_per_gpu
    tight = _hardware(memory_bytes=(need + 2 * 1024**3) / 0.92 + 1e6)
    again = suggest(
        SMALL_LLAMA,
        gpus=4,
        gpu=tight,
        gpus_per_node=1,
        seq_len=16384,
        global_batch_tokens=2 * 16384,
        top=3,
    )
    assert again.plans[0][0].cp > 1
    assert again.plans[0][1].memory_bytes_per_gpu <= again.memory_limit


def test_moe_gets_ep() -> None:
    moe = ModelSource(
        "qwen3-moe-debug",
        (
            ("dim", 512),
            ("moe_hidden_dim", 1024),
            ("num_experts", 32),
            ("top_k", 2),
            ("num_heads", 8),
            ("num_kv_heads", 4),
            ("head_dim", 64),
            ("num_layers", 4),
            ("vocab_size", 32000),
        ),
    )
    report = suggest(
        moe, gpus=2, gpu="h100-80gb", seq_len=1024, global_batch_tokens=2 * 1024, top=3
    )
    assert report.plans[0][0].ep == 2, report.plans[0][0]


def test_cluster_too_small_does_not_fit(capsys) -> None:
    # Two searches (the 405B's structures are the costly part): the CLI's exit code and
    # the DoesNotFit message it prints.
    argv405 = [
        "suggest",
        "--model",
        "llama3-405b",
        "--gpus",
        "8",
        "--gpu",
        "h100-80gb",
        "--seq",
        "8192",
        "--global-batch-tokens",
        str(8 * 8192),
    ]
    code = main(argv405)
    assert code == 1
    err = capsys.readouterr().err
    # 405B's states alone exceed 8 GPUs whatever the layout: said as such, with their size
    # (16 bytes a parameter, counted here on the meta device), not as one layout's need.
    import torch

    from hyper_parallel.analysis._format import human_bytes
    from hyper_parallel.dmodule import get_spec

    with torch.device("meta"):
        params = sum(p.numel() for p in get_spec("llama3-405b").build().parameters())
    assert re.search(
        r"does not fit: needs >= [\d.]+ GB per GPU at best \(the training states ", err
    )
    assert f"spread over all 8 GPUs: {human_bytes(16 * params / 8)} per rank" in err, err
    assert "a shorter sequence does not help" in err
    assert "or --dtype bf16-true (half the states)" in err
    # bf16 states: 8 bytes a parameter, and no bf16-true to suggest any more.
    assert main([*argv405[:1], "--dtype", "bf16-true", *argv405[1:]]) == 1
    err = capsys.readouterr().err
    assert "(bf16 weights, gradients and AdamW moments, 8 bytes a parameter)" in err, err
    assert f"spread over all 8 GPUs: {human_bytes(8 * params / 8)} per rank" in err, err
    assert "--dtype bf16-true" not in err
    # Where the states fit and a traced layout does not, that layout is named (8B's states
    # take 60 GiB a rank on 2 GPUs, AdamW's step 15 more: 75 of the 62 usable).
    argv = ["suggest", "--model", "llama3-8b", "--gpus", "2", "--gpu", "h100-80gb"]
    assert main([*argv, "--seq", "8192", "--global-batch-tokens", str(2 * 8192)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"does not fit: needs >= [\d.]+ GB per GPU at best \(layout [a-z]+=2 ", err), (
        err
    )
    assert "headroom at its optimizer step (the states and AdamW's sqrt(exp_avg_sq)" in err, err
    assert issubclass(DoesNotFit, ValueError)


def test_charts_are_written(tmp_path) -> None:
    from hyper_parallel.analysis.charts import suggest_chart

    report = suggest(
        SMALL_LLAMA, gpus=2, gpu="h100-80gb", seq_len=1024, global_batch_tokens=2 * 1024, top=2
    )
    suggest_chart(report, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 10_000
    code = main(
        [
            "plan",
            "--model",
            "llama3-debug",
            "--mesh",
            "pp=2",
            "--seq",
            "64",
            "--microbatches",
            "2",
            "--chart",
            str(tmp_path / "p.png"),
        ]
    )
    assert code == 0 and (tmp_path / "p.png").stat().st_size > 10_000
    # Into a folder that is not there yet: it is made.
    assert main(["plan", "--model", "llama3-debug", "--mesh", "dp=2", "--seq", "64",
                 "--chart", str(tmp_path / "new" / "dir" / "p.png")]) == 0  # fmt: skip
    assert (tmp_path / "new" / "dir" / "p.png").stat().st_size > 10_000


def test_a_chart_matplotlib_cannot_write_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch
) -> None:
    """An unknown extension, or no matplotlib: argparse's error, exit 2, nothing written
    (both were a traceback after the dry run or the search)."""
    base = ["--model", "llama3-debug", "--seq", "64"]
    for argv in (
        ["plan", *base, "--mesh", "dp=2", "--chart", str(tmp_path / "p.txt")],
        ["suggest", *base, "--gpus", "2", "--gpu", "h100-80gb", "--global-batch-tokens", "128",
         "--chart", str(tmp_path / "s.doc")],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --chart:" in err and "matplotlib does not write ." in err, err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.backend_bases", None)
    with pytest.raises(SystemExit) as e:
        main(["plan", *base, "--mesh", "dp=2", "--chart", str(tmp_path / "p.png")])
    assert e.value.code == 2 and "charts need matplotlib" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_chart_is_never_written_over_a_file_unasked_nor_beside_its_name(tmp_path, capsys) -> None:
    """--chart onto a file that is there replaced it silently; a folder, or a name without
    a suffix (matplotlib wrote NAME.png and NAME was printed), was accepted. Now: a file
    that is there is refused before any work unless --overwrite, an input always, a
    folder or a bare name at parsing; the path printed is the file written."""
    plan = ["plan", "--model", "llama3-debug", "--mesh", "dp=2", "--seq", "64", "--chart"]
    suggest_ = ["suggest", "--model", "llama3-debug", "--gpus", "2", "--seq", "64",
                "--global-batch-tokens", "128", "--chart"]  # fmt: skip
    for argv, message in (
        ([*plan, str(tmp_path)], "is a folder; give a file path in it"),
        ([*plan, str(tmp_path / "noext")], "has no suffix; the suffix names the format: use "),
        ([*suggest_, str(tmp_path / "noext"), "--gpu", "h100-80gb"], "has no suffix"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --chart:" in err and message in err, err
    assert "png" in err and list(tmp_path.iterdir()) == []
    chart = tmp_path / "p.png"
    chart.write_bytes(b"mine")
    assert main([*plan, str(chart)]) == 2
    err = capsys.readouterr().err
    assert "--chart" in err and "a file is there already" in err and "--overwrite" in err, err
    assert main([*suggest_, str(chart), "--gpu", "h100-80gb"]) == 2
    assert "a file is there already" in capsys.readouterr().err
    assert chart.read_bytes() == b"mine"
    assert main([*plan, str(chart), "--overwrite"]) == 0
    assert f"chart: {chart}" in capsys.readouterr().err and chart.stat().st_size > 10_000
    # A file the command reads: never, even with --overwrite.
    hardware = tmp_path / "hw.svg"
    hardware.write_text("name: mine\n")  # refused before it is read
    assert main([*suggest_, str(hardware), "--hardware", str(hardware), "--overwrite"]) == 2
    assert "it is the input" in capsys.readouterr().err


def test_suggest_on_a_fixed_mesh_says_the_pipeline_switches_it_does_not_use(capsys) -> None:
    """--mesh without pp and --schedule / --stages-per-rank: ignored without a word (validate
    warned); the run plan's warnings now, on stderr and in the JSON."""
    argv = ["suggest", "--model", "llama3-debug", "--gpus", "2", "--gpu", "h100-80gb",
            "--seq", "64", "--global-batch-tokens", "128", "--mesh", "dp=2", "--top", "1",
            "--format", "json"]  # fmt: skip
    assert main([*argv, "--schedule", "GPipe", "--stages-per-rank", "2"]) == 0
    out, err = capsys.readouterr()
    fields = [w["field"] for w in json.loads(out)["warnings"]]
    assert fields == ["schedule", "stages_per_rank"]
    assert (
        "hyper-parallel suggest: warning: schedule='GPipe' shapes a pipeline, but the mesh " in err
    )
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["warnings"] == [] and "warning:" not in err


# ------------------------------------------------------------------- states are exact

SMALL_MOE = ModelSource(
    "qwen3-moe-debug",
    (
        ("dim", 256),
        ("moe_hidden_dim", 512),
        ("num_experts", 8),
        ("top_k", 2),
        ("num_heads", 4),
        ("num_kv_heads", 2),
        ("head_dim", 64),
        ("num_layers", 3),
        ("vocab_size", 1024),
    ),
)


@pytest.mark.parametrize(
    ("source", "mesh"),
    [
        (SMALL_MOE, {"dp_shard": 4, "ep": 2}),
        (SMALL_MOE, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}),
        (SMALL_MOE, {"dp_shard": 2, "tp": 2, "ep": 4}),
        (SMALL_MOE, {"dp_shard": 2, "cp": 2, "ep": 2}),
        (ModelSource("llama3-debug"), {"dp_replicate": 2, "dp_shard": 2}),
        (ModelSource("llama3-debug"), {"tp": 4}),
    ],
    ids=["moe-fsdp-ep", "moe-hsdp-ep", "moe-tp-ep4", "moe-cp-ep", "hsdp", "tp"],
)
def test_predicted_states_equal_the_dry_run_of_the_layout(source, mesh) -> None:
    # "Memory exact": the states one rank holds (fp32 parameters, gradients, AdamW
    # moments) are the dry run's of that very layout — routed experts split over ep x
    # efsdp included (a model whose experts went uncounted was predicted 89 % low) — and
    # so are the activations under every checkpointing mode (composed per block from
    # one trace per structure: they were summed where the dry run takes the larger).
    from hyper_parallel.analysis.dry_run import dry_run
    from hyper_parallel.analysis.suggest import Candidate, predict
    from hyper_parallel.distributed.axes import apply_model_axes

    sizes = dict.fromkeys(("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"), 1) | mesh
    sp = sizes["tp"] > 1
    layout = Candidate(**sizes, microbatches=1, schedule=None, ac="none", sp=sp).layout
    gpus = layout.world_size
    config = apply_model_axes(source.spec, source.config(), layout, sequence_parallel=sp)
    for ac in ("none", "selective", "full"):
        c = Candidate(**sizes, microbatches=1, schedule=None, ac=ac, sp=sp)
        p = predict(
            source, c, gpus=gpus, gpu="h100-80gb", seq_len=256, global_batch_tokens=gpus * 256
        )
        report = dry_run(
            config, c.layout, seq_len=256, loss_fn=source.spec.family.loss_fn, ac=ac, dtype="bf16"
        )
        sequences = gpus // c.dp  # the data-parallel rank's batch, one forward
        expected = {
            "params": report.per_rank.params,
            "grads": report.per_rank.grads,  # fp32 under bf16 too: mixed precision's
            "optimizer": report.per_rank.optimizer,
            "activations": report.per_rank.activations * sequences,
        }
        assert {k: p.memory[k] for k in expected} == expected, ac


# ---------------------------------------------------------------------- pipeline search


def test_the_pipeline_search_covers_stages_per_rank_and_short_local_batches():
    from hyper_parallel.analysis.suggest._search import _pipelines

    # Llama 3 405B at 8K on 16,384 GPUs: pp=16, 16 sequences per data-parallel rank; 126
    # layers take 4 stages per rank at pp=16, not 8.
    found = _pipelines(16, 16, num_layers=126)
    per_rank = {}
    for schedule, _m, spr in found:
        per_rank.setdefault(schedule, set()).add(spr)
    assert per_rank["Interleaved1F1B"] == {None, 4}
    assert per_rank["InterleavedZeroBubble"] == {None, 4}
    assert per_rank["ZBVZeroBubble"] == per_rank["1F1B"] == per_rank["GPipe"] == {None}
    # One sequence per micro-batch is searched under every schedule, though the default
    # count (one per stage: 32 for 2 stages per rank) is more than the batch holds.
    for schedule in ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"):
        assert (schedule, 16, None) in found, schedule
    # Fixed by the caller: only that.
    fixed = _pipelines(2, 8, fixed=4, stages_per_rank=3, num_layers=8)
    assert {(s, m, spr) for s, m, spr in fixed if s == "Interleaved1F1B"} == {
        ("Interleaved1F1B", 4, 3)
    }
    assert _pipelines(1, 8) == [(None, m, None) for m in (1, 2, 4, 8)]


def test_suggested_commands_carry_the_stages_per_rank():
    from hyper_parallel.analysis.suggest import Candidate, ModelSource
    from hyper_parallel.analysis.suggest._search import _train_args

    c = Candidate(2, 1, 2, 1, 1, 1, 8, "Interleaved1F1B", "none", False, 4)
    args = _train_args(ModelSource("llama3-debug"), c, 16, 8, "bf16")
    at = args.index("--stages-per-rank")
    assert args[at + 1] == "4" and args[args.index("--microbatches") + 1] == "8"
    default = dataclasses.replace(c, stages_per_rank=None)
    assert "--stages-per-rank" not in _train_args(
        ModelSource("llama3-debug"), default, 16, 8, "bf16"
    )


# ---------------------------------------------------------------------- fixed settings


def test_a_fixed_mesh_is_scored_whatever_its_cp_and_the_search_counts_what_it_skips():
    kw = dict(gpus=4, gpu="h100-80gb", seq_len=256, global_batch_tokens=1024, ac="none")
    # 128 tokens per cp rank: below what the free search tries, still the user's layout.
    report = suggest("llama3-debug", mesh={"dp": 2, "cp": 2}, **kw)
    assert report.plans and {c.mesh_text() for c, _, _ in report.plans} == {"dp_shard=2,cp=2"}
    assert not any("sp off" in reason for reason in report.rejected)  # other meshes' reasons
    from hyper_parallel.analysis.suggest._search import CP_PRUNED

    free = suggest("llama3-debug", **kw)
    assert free.rejected[CP_PRUNED] > 0
    assert all(c.cp == 1 for c, _, _ in free.plans)


def test_a_fixed_mesh_whose_batch_does_not_split_names_suggests_own_options():
    """8 sequences (1024 tokens of 128) over dp_shard=3: the fix named --batch-size, an
    option suggest does not have; it names --global-batch-tokens and --seq."""
    kw = dict(gpus=3, gpu="h100-80gb", seq_len=128, global_batch_tokens=1024)
    with pytest.raises(ValueError, match=r"batch_size=8 \(the global batch\)") as info:
        suggest("llama3-debug", mesh={"dp_shard": 3}, **kw)
    assert "--global-batch-tokens a multiple of 3 x --seq 128 = 384" in str(info.value)
    assert "--batch-size" not in str(info.value)
    # The fix it gives is one that runs: 3 x 384 tokens.
    fixed = suggest("llama3-debug", mesh={"dp_shard": 3}, **{**kw, "global_batch_tokens": 1152})
    assert fixed.plans


def test_reduce_each_microbatch_fixes_that_part_of_the_search(capsys):
    kw = dict(
        mesh={"dp": 2},
        gpus=2,
        gpu="h100-80gb",
        seq_len=256,
        global_batch_tokens=2048,
        microbatches=2,
        ac="full",
    )
    searched = suggest("llama3-debug", **kw)
    assert {c.reduce_each for c, _, _ in searched.plans} == {False, True}
    for fixed in (True, False):
        report = suggest("llama3-debug", reduce_each_microbatch=fixed, **kw)
        assert [c.reduce_each for c, _, _ in report.plans] == [fixed]
        assert ("--reduce-each-microbatch" in report.plans[0][2]) is fixed
    argv = [
        "suggest",
        "--model",
        "llama3-debug",
        "--mesh",
        "dp=2",
        "--seq",
        "256",
        "--gpu",
        "h100-80gb",
        "--gpus",
        "2",
        "--global-batch-tokens",
        "2048",
        "--microbatches",
        "2",
        "--ac",
        "full",
        "--format",
        "json",
    ]
    assert main([*argv, "--reduce-each-microbatch"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert [p["reduce_each_microbatch"] for p in plans] == [True]
    # Not given: searched, and the table tells the two rows apart.
    assert main(argv[:-2]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "dp_shard=2" in line]
    assert sorted(r[2:4] for r in rows[:2]) == [["2", "-"], ["2", "each"]]


def test_rows_tell_stages_per_rank_apart():
    report = suggest(
        ModelSource("llama3-debug", (("num_layers", 14),)),
        mesh={"pp": 2},
        gpus=2,
        gpu="h100-80gb",
        seq_len=256,
        global_batch_tokens=4096,
        schedule="Interleaved1F1B",
        ac="none",
        microbatches=8,
    )
    plans = report.to_dict()["plans"]
    assert sorted(p["stages_per_rank"] for p in plans) == [2, 4]
    assert all(p["reduce_each_microbatch"] is False for p in plans)
    table = report.to_table()
    assert "Interleaved1F1B x2" in table and "Interleaved1F1B x4" in table
