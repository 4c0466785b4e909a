"""The mistakes a user makes with the CLI and the trainer: a clear error, no traceback.

Exit status: 1 for a model/plan/mesh that cannot work together, 2 for a usage error.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hyper_parallel.cli import main
from hyper_parallel.dmodule import get_spec

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _usage_exit(capsys, argv, run=main) -> str:
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return err


def test_unknown_model_is_a_usage_error(capsys):
    code, _, err = _run(capsys, ["validate", "--model", "llama3-7b", "--mesh", "tp=2"])
    assert code == 2 and "no model named 'llama3-7b'" in err and "llama3-8b" in err


@pytest.mark.parametrize("mesh", ["tp=0", "tp", "tp=2,,dp=2", "tp=2,tp=2", "tp=x", "tp:2"])
def test_malformed_mesh_is_a_usage_error(capsys, mesh):
    err = _usage_exit(capsys, ["plan", "--model", "llama3-debug", "--mesh", mesh])
    assert "argument --mesh" in err
    assert "axis=size" in err or ">= 1" in err or "more than once" in err


def test_an_empty_mesh_is_one_device_as_in_training(capsys):
    # --mesh is the run options' one flag: "" is one device in train.run and here alike.
    code, out, _ = _run(capsys, ["plan", "--model", "llama3-debug", "--mesh", "", "--seq", "64"])
    assert code == 0 and "on one device" in out.splitlines()[0]


def test_bad_format_and_batch_are_usage_errors(capsys):
    assert "invalid choice: 'xml'" in _usage_exit(
        capsys, ["plan", "--model", "llama3-debug", "--mesh", "tp=2", "--format", "xml"]
    )
    assert ">= 1" in _usage_exit(
        capsys, ["plan", "--model", "llama3-debug", "--mesh", "tp=2", "--batch", "0"]
    )


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_heads_not_divisible_by_tp(capsys, command):
    code, out, err = _run(capsys, [command, "--model", "llama3-70b", "--mesh", "dp=3,tp=16"])
    assert code == 1
    assert "8 key/value heads cannot be split over tp_size=16" in out + err


def test_validate_json_reports_a_refused_mesh(capsys):
    import json

    code, out, _ = _run(
        capsys, ["validate", "--model", "llama3-70b", "--mesh", "tp=3", "--format", "json"]
    )
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["num_errors"] == 1
    assert "64 query heads" in report["findings"][0]["message"]


# Every bad mesh, in every command that takes one: one usage error naming the problem,
# before any model is built or process group exists.
BAD_MESHES = [
    ("dp=2,tpp=2", "'tpp' is not a mesh axis. Did you mean 'tp'?"),
    ("dp_shard=2,tp=3,ep=4", "ep=4 does not divide dp_shard x cp x tp = 2 x 1 x 3 = 6"),
    ("tp=0", "axis 'tp' has size 0; sizes are integers >= 1"),
    ("tp=2,dp=2,tp=2", "'tp' is given more than once"),
    ("dp=2,dp_shard=2", "'dp' and 'dp_shard' both name the dp_shard axis"),
]
COMMANDS = {
    "plan": ["plan", "--model", "llama3-debug"],
    "validate": ["validate", "--model", "llama3-debug"],
    "demo": ["demo"],
    "train": [],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("mesh", "message"), BAD_MESHES)
def test_every_bad_mesh_is_one_clear_usage_error(capsys, command, mesh, message):
    import torch.distributed as dist

    run = _train if command == "train" else main
    err = _usage_exit(capsys, [*COMMANDS[command], "--mesh", mesh], run=run)
    assert "argument --mesh" in err and message in err and "Fix:" in err
    assert not dist.is_initialized()


def test_mesh_product_must_match_the_ranks_torchrun_starts(capsys, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _train(["--mesh", "tp=2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs pp x dp_replicate x dp_shard x cp x tp = 2 ranks, but the world has 4" in err
    assert "--nproc-per-node 2" in err
    assert not dist.is_initialized()  # refused before any process group exists


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("dp=2,ep=2", "model 'llama3-debug' does not support ep"),
        ("pp=8", "the split cannot place a unit on every stage"),
        ("cp=2", "cannot be split head-tail over cp=2"),  # --seq-len 30: not 2 x cp chunks
    ],
)
def test_axes_the_trainer_cannot_run_are_refused_by_name(capsys, monkeypatch, mesh, message):
    from hyper_parallel.distributed import MeshLayout

    monkeypatch.setenv("WORLD_SIZE", str(MeshLayout.parse(mesh).world_size))
    assert _train(["--mesh", mesh, "--steps", "1", "--seq-len", "30"]) == 2
    err = capsys.readouterr().err
    assert message in err
    if mesh == "cp=2":  # the flag to change, and to what
        assert "--seq-len on train.run" in err and "multiple of 4 (e.g. 28 or 32)" in err
    if mesh != "cp=2":  # the demo's sequence (64) splits over cp=2
        code, _, err = _run(capsys, ["demo", "--mesh", mesh, "--steps", "1"])
        assert code == 2 and message in err


@pytest.mark.parametrize(
    ("command", "mesh", "message"),
    [
        (command, mesh, message)
        for command in ("plan", "validate")
        for mesh, message in [
            ("dp=2,ep=2", "model 'llama3-debug' does not support ep"),
            ("cp=2,tp=2", "cannot be split head-tail over cp=2"),
        ]
    ],
)
def test_plan_and_validate_refuse_axes_the_model_cannot_use(capsys, command, mesh, message):
    argv = [command, "--model", "llama3-debug", "--mesh", mesh, "--seq", "30"]
    code, out, err = _run(capsys, argv)
    assert code == 1 and message in out + err
    if mesh.startswith("cp"):
        assert "(--seq;" in out + err and "multiple of 4" in out + err


@needs_transformers
@pytest.mark.parametrize("command", ["plan", "validate"])
def test_a_plan_without_cp_is_refused_on_a_cp_mesh(capsys, command):
    plan = str(Path(__file__).resolve().parents[2] / "examples" / "plans" / "hf_llama_tp.yaml")
    argv = [command, "--hf-model", "llama", "--plan", plan, "--mesh", "cp=2,tp=2"]
    code, out, err = _run(capsys, argv)
    assert code == 1 and "declares no 'cp' placement" in out + err


def test_plan_with_pp_reports_stages_and_the_bubble(capsys):
    from hyper_parallel.analysis.pipeline_cost import bubble_fraction

    code, out, _ = _run(
        capsys,
        [
            "plan",
            "--model",
            "llama3-debug",
            "--mesh",
            "pp=2,tp=2",
            "--seq",
            "64",
            "--format",
            "json",
        ],
    )
    assert code == 0
    report = json.loads(out)
    assert report["world_size"] == 4 and report["mesh"]["pp"] == 2
    assert [s["units"] for s in report["stages"]] == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "norm+output"],
    ]
    assert report["bubble_fraction"] == bubble_fraction("1F1B", 2, 2)
    assert report["per_rank_bytes"]["total"] == max(s["total"] for s in report["stages"])
    for stage in report["stages"]:  # each stage's own tp collectives, per micro-batch x 2
        mb = {(c["kind"], c["phase"]): c["count"] for c in stage["collectives_per_microbatch"]}
        step = {(c["kind"], c["phase"]): c["count"] for c in stage["collectives"]}
        assert mb[("all_reduce", "forward")] >= 2  # the stage's block: attention and MLP
        assert step == {k: 2 * v for k, v in mb.items()}
    from hyper_parallel.cli import _pipeline_table

    table = _pipeline_table(report)
    moved = sum(c["bytes"] for c in report["stages"][0]["collectives"])
    assert "collective bytes/step" in table and f"{moved:,}" in table.splitlines()[2]
    code, _, err = _run(
        capsys,
        ["plan", "--model", "llama3-debug", "--mesh", "pp=8", "--format", "json"],
    )
    assert code == 1 and "cannot place" in err


def test_plan_with_pp_counts_fp32_master_states_and_prints_the_heaviest_rank(capsys):
    """Under bf16 the trainer keeps fp32 parameters, gradients and AdamW moments (FSDP2
    gathers bf16 copies for compute): a stage's states are those of fp32 whatever
    --dtype says (only its activations change), AdamW's two moments twice the
    parameters. The table's memory is the heaviest pp rank's, as the JSON's
    per_rank_bytes, and says what the whole-model tables above it are."""
    from hyper_parallel.analysis._format import human_bytes

    argv = ["plan", "--model", "llama3-debug", "--mesh", "pp=2,dp_shard=2,tp=2", "--seq", "64"]
    argv += ["--schedule", "Interleaved1F1B", "--microbatches", "4"]
    reports = {}
    for dtype in ("fp32", "bf16"):
        code, out, _ = _run(capsys, [*argv, "--dtype", dtype, "--format", "json"])
        assert code == 0
        reports[dtype] = json.loads(out)
    for fp32, bf16 in zip(reports["fp32"]["stages"], reports["bf16"]["stages"], strict=True):
        assert bf16["params"] == fp32["params"] == bf16["grads"] > 0
        assert bf16["optimizer"] == 2 * bf16["params"]
        assert bf16["activations"] <= fp32["activations"]  # bf16 compute: 2-byte tensors
    assert sum(s["activations"] for s in reports["bf16"]["stages"]) < sum(
        s["activations"] for s in reports["fp32"]["stages"]
    )  # (the embedding's stage saves only its int64 token ids either way)
    report = reports["bf16"]
    totals: dict[int, int] = {}
    for stage in report["stages"]:
        totals[stage["rank"]] = totals.get(stage["rank"], 0) + stage["total"]
    assert report["per_rank_bytes"]["total"] == max(totals.values())
    code, out, _ = _run(capsys, [*argv, "--dtype", "bf16"])
    assert code == 0
    lines = out.splitlines()
    # The header names the whole mesh (it said the pipeline group's alone, "on one
    # device (1 ranks)" at pp=2).
    assert lines[0].startswith(
        "plan: llama3-debug on pp=2 x dp_shard=2 x tp=2 (fsdp=2, batch=2, loss=2) (8 ranks; "
        "one pipeline's group: dp_shard=2 x tp=2, 4 ranks); "
    )
    assert lines[1].startswith("pp=2 (8 ranks): parameters and collectives below are the whole")
    heaviest = max(totals, key=lambda r: (totals[r], -r))
    assert f"Memory per rank (pp rank {heaviest}, the heaviest" in out
    assert "Collectives per training step (per rank, the whole model on one pipeline's" in out
    total = [line for line in lines if line.startswith("total ")]
    assert total == [f"total {human_bytes(max(totals.values())):>{len(total[0]) - 6}}"]
    summary = (
        lines[-1]
        if lines[-1].startswith("Summary")
        else next(line for line in lines if line.startswith("Summary:"))
    )
    assert (
        summary.startswith("Summary: ")
        and " on 8 ranks (pp=2 x 4): the heaviest pp rank " in summary
    )
    assert f"holds {human_bytes(max(totals.values()))} with activations" in summary


def test_unknown_mesh_axis_is_named_with_the_nearest(capsys):
    err = _usage_exit(capsys, ["validate", "--model", "llama3-debug", "--mesh", "dp=2,dp_shrad=2"])
    assert "'dp_shrad' is not a mesh axis. Did you mean 'dp_shard'?" in err


def test_missing_plan_file(capsys, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    code, _, err = _run(
        capsys, ["validate", "--model", "llama3-debug", "--mesh", "tp=2", "--plan", missing]
    )
    assert code == 2 and "does not exist" in err
    code, _, err = _run(
        capsys, ["plan", "--model", "llama3-debug", "--mesh", "tp=2", "--plan", str(tmp_path)]
    )
    assert code == 2 and "is a directory" in err


def test_plan_file_with_a_typod_placement(capsys, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("layers.*.attention.wq:\n  state_shardings:\n    weight: {tp: Shrd(0)}\n")
    argv = ["--model", "llama3-debug", "--mesh", "tp=2", "--plan", str(plan)]
    code, out, _ = _run(capsys, ["validate", *argv])
    assert code == 1 and "invalid placement 'Shrd(0)'" in out
    code, _, err = _run(capsys, ["plan", *argv])
    assert code == 1 and "invalid placement 'Shrd(0)'" in err


def test_plan_refuses_a_pattern_that_matches_nothing(capsys, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("layers.*.atention.wq:\n  state_shardings:\n    weight: {tp: Shard(0)}\n")
    argv = ["--model", "llama3-debug", "--mesh", "tp=2", "--plan", str(plan), "--seq", "8"]
    code, _, err = _run(capsys, ["plan", *argv])
    assert code == 1 and "matches no module" in err
    code, out, _ = _run(capsys, ["validate", *argv])
    assert code == 1 and "matches no module" in out


@needs_transformers
def test_hf_family_errors(capsys):
    code, _, err = _run(capsys, ["validate", "--hf-model", "bert", "--mesh", "tp=2"])
    assert code == 2 and "unknown Hugging Face model family 'bert'" in err
    code, out, _ = _run(capsys, ["validate", "--hf-model", "gpt2", "--mesh", "tp=2"])
    assert code == 1  # no default plan for GPT-2's fused c_attn: say why
    code, out, _ = _run(capsys, ["validate", "--hf-model", "llama", "--mesh", "tp=8"])
    assert code == 1 and "num_key_value_heads=4, not divisible" in out


# ---------------------------------------------------------------------- trainer


def _train(argv):
    from hyper_parallel.train.run import main as train_main

    return train_main(argv)


def test_trainer_usage_errors(capsys, tmp_path):
    assert ">= 1" in _usage_exit(capsys, ["--mesh", "tp=0"], run=_train)
    assert "quote the keys" in _usage_exit(
        capsys, ["--model-overrides", "{num_layers: 4}"], run=_train
    )
    assert _train(["--config", str(tmp_path / "missing.json")]) == 2
    _, err = capsys.readouterr()
    assert "cannot read it" in err and "Traceback" not in err
    assert _train(["--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert _train(["--resume", "--steps", "1"]) == 2
    assert "needs a checkpoint_dir" in capsys.readouterr().err


def test_resume_without_a_checkpoint_says_so(capsys, tmp_path):
    ckpt = Path(tmp_path) / "ckpt"
    argv = ["--resume", "--checkpoint-dir", str(ckpt), "--steps", "1", "--no-progress"]
    argv += ["--model-overrides", '{"num_layers": 1}', "--seq-len", "8", "--batch-size", "2"]
    assert _train(argv) == 0
    assert "no checkpoint in" in capsys.readouterr().out


def test_plan_estimates_a_context_parallel_pipeline(capsys):
    # Each stage traced with its cp rank's part of the sequence and its positions: the
    # cp collectives of its blocks are among its own, and each rank sends its 1/cp of
    # the residual stream to the next stage.
    argv = ["plan", "--model", "llama3-debug", "--mesh", "pp=2,cp=2", "--seq", "32"]
    code, out, _ = _run(capsys, [*argv, "--format", "json"])
    assert code == 0
    report = json.loads(out)
    assert report["world_size"] == 4 and report["mesh"]["pp"] == 2
    for stage in report["stages"]:
        axes = {(c["kind"], c["axis"]) for c in stage["collectives_per_microbatch"]}
        assert {("all_gather", "cp"), ("reduce_scatter", "cp")} <= axes
        assert stage["activations"] > 0
    dim = get_spec("llama3-debug").config().norm.dim
    assert report["p2p_bytes"]["per_microbatch"] == 32 // 2 * dim * 4


@pytest.mark.parametrize("ranks", ["1", "0", "x"])
def test_calibrate_refuses_fewer_than_two_ranks_before_making_its_folder(capsys, tmp_path, ranks):
    out = tmp_path / "cal" / "one.yaml"
    err = _usage_exit(capsys, ["calibrate", "--out", str(out), "--ranks", ranks, "--quick"])
    assert f"argument --ranks: '{ranks}' is not an integer >= 2" in err and "--ranks 2 or" in err
    assert not (tmp_path / "cal").exists()


def test_verify_hf_mesh_examples_are_meshes_it_accepts():
    import argparse
    import re

    from hyper_parallel.distributed.mesh_arguments import mesh_argument
    from hyper_parallel.hf_commands.verify import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = next(a.help for a in parser._actions if "--mesh" in a.option_strings)
    examples = re.findall(r"[a-z_]+=\d+(?:,[a-z_]+=\d+)*", text.split("e.g.")[1])
    assert "dp_shard=2,ep=2" in examples
    for example in examples:
        mesh_argument(example)  # raises argparse.ArgumentTypeError on a mesh it refuses


def test_generate_says_a_prompt_too_long_for_the_model_is_too_long():
    from hyper_parallel.hf_commands.generate import generate

    model = get_spec("llama3-debug").config(num_layers=1, max_seq_len=8).build()
    model.init_states()
    with pytest.raises(ValueError, match=r"prompt is too long: 9 tokens.*max_seq_len=8") as info:
        generate(model, list(range(1, 10)), 4)
    assert "shorten the prompt to at most 7 tokens" in str(info.value)
    assert "fewer tokens" not in str(info.value)
    with pytest.raises(ValueError, match="prompt is too long: 8 tokens"):
        generate(model, list(range(1, 9)), 1)  # no room left for a new token
    with pytest.raises(ValueError, match=r"6 prompt tokens \+ 4 new .* at most 2 new tokens"):
        generate(model, list(range(1, 7)), 4)
    assert len(generate(model, list(range(1, 7)), 2)) == 2


def test_export_hf_states_its_default_dtype_as_save_hf_picks_it(capsys):
    # save_hf's default: the source checkpoint's dtype when it says bf16/fp16, else fp32
    # (export-hf loads the parameters in fp32); not "as trained".
    from hyper_parallel.hf_commands.export import export_hf

    with pytest.raises(SystemExit):
        main(["export-hf", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {fp32,bf16,fp16} dtype of the tensors written (default:" in help_text
    doc = " ".join(export_hf.__doc__.split())
    for text in (help_text, doc):
        assert "Hugging Face checkpoint the run started from" in text
        assert "says bf16 or fp16, else fp32" in text
    assert "as trained" not in doc


def test_bytes_for_a_vocabulary_too_small_are_refused_before_any_rank_starts(capsys, monkeypatch):
    # A model (a Hugging Face checkpoint's, or vocab_size overridden) whose vocabulary cannot
    # hold the shipped text's bytes: each rank refused it once launched, so the demo ended
    # in torchrun's traceback, exit 1 and "parity: ... nan ... FAIL".
    overrides = ["--model-overrides", '{"vocab_size": 128}']
    code, _, err = _run(capsys, ["demo", "--mesh", "cp=2", "--steps", "1", *overrides])
    assert code == 2, err
    assert "has a vocabulary of 128 but the data is bytes (vocabulary 256)" in err
    assert "override vocab_size >= 256 (--model-overrides), or train on --data" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _train(["--mesh", "cp=2", "--steps", "1", *overrides]) == 2
    assert "has a vocabulary of 128" in capsys.readouterr().err
