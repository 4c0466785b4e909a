"""``validate`` with a pp axis: the trainer's pipeline checks, before anything is traced."""

from __future__ import annotations

import json

import pytest
import torch

from hyper_parallel.analysis import validate
from hyper_parallel.cli import main
from hyper_parallel.dmodule import get_spec
from hyper_parallel.models.llama import PIPELINE
from hyper_parallel.train.trainer import TrainConfig, check_config


@pytest.fixture(scope="module")
def config():
    return get_spec("llama3-debug").config()


def _errors(report):
    return [(f.path, f.field) for f in report.errors]


def test_a_good_pipeline_plan_validates_and_traces_one_pipeline_group(config):
    report = validate(config, {"pp": 2, "dp_shard": 2}, schedule="GPipe", num_microbatches=4)
    assert report.ok, report.to_table()
    assert report.traced
    assert report.mesh == {"pp": 2, "dp_shard": 2}
    # The trace runs one pipeline's group (the mesh without pp), micro-batch inputs.
    assert "fake process group of 2 ranks" in " ".join(report.notes)
    by_flops = validate(config, {"pp": 2}, pipeline_split={"balance": "flops"}, seq_len=32)
    assert by_flops.ok, by_flops.to_table()
    bad = validate(config, {"pp": 2}, pipeline_split={"balance": "time"})
    assert _errors(bad) == [("pipeline", "split.balance")]


def test_too_few_microbatches_for_the_schedule(config):
    report = validate(config, {"pp": 2}, schedule="1F1B", num_microbatches=1)
    assert _errors(report) == [("pipeline", "num_microbatches")]
    (error,) = report.errors
    assert "refuses 1 micro-batches" in error.message and "at least 2" in error.fix
    # Refused before anything runs: no forward pass was traced.
    assert not report.traced
    assert any("pipeline plan has errors" in n for n in report.notes)


def test_a_layer_count_the_split_cannot_place(config):
    report = validate(config, {"pp": 2}, pipeline_split={"units_per_stage": 1})
    assert _errors(report) == [("pipeline", "split")]
    assert "cannot place this layer count" in report.errors[0].message
    more = validate(config, {"pp": 4}, schedule="Interleaved1F1B")  # 8 stages, 4 units
    assert _errors(more) == [("pipeline", "split")]
    assert "num_layers" in more.errors[0].fix


def test_a_stage_with_nothing_in_it(config):
    split = {"stages": [["tok_embeddings", "layers.0", "layers.1", "norm", "output"], []]}
    report = validate(config, {"pp": 2}, pipeline_split=split)
    assert ("pipeline", "split.stages[1]") in _errors(report)
    assert "is empty" in next(f.message for f in report.errors if f.field == "split.stages[1]")


def test_weights_tied_across_stages(config):
    with torch.device("meta"):
        model = config.build()
    model.output.weight = model.tok_embeddings.weight
    report = validate(model, {"pp": 2}, num_microbatches=2)
    (error,) = report.errors
    assert error.field == "split" and "tied" in error.message
    assert "tok_embeddings.weight (stage 0)" in error.message
    assert "output.weight (stage 1)" in error.message
    assert "same stage" in error.fix
    assert not report.traced
    with torch.device("meta"):
        untied = config.build()
    assert validate(untied, {"pp": 2}, num_microbatches=2).ok


def test_a_batch_that_does_not_split_into_microbatches(config):
    report = validate(config, {"pp": 2}, num_microbatches=2, batch_size=3)
    assert _errors(report) == [("pipeline", "num_microbatches")]
    assert "3 sequences" in report.errors[0].message
    assert validate(config, {"pp": 2}, num_microbatches=2, batch_size=4).ok


def test_pp_with_cp_runs_on_every_mesh(config):
    # Each stage holds its cp rank's positions; FSDP2 shards over dp_shard x cp and
    # averages the cp-partial gradients, with or without other axes.
    for mesh, world in (({"pp": 2, "cp": 2}, 4), ({"pp": 2, "cp": 2, "dp_shard": 2, "tp": 2}, 16)):
        cfg = TrainConfig(mesh=mesh, microbatches=2, batch_size=4)
        assert not [f for f in check_config(cfg, world) if f.field == "pp"], mesh


def test_validate_and_the_trainer_share_the_pipeline_findings(config):
    cfg = TrainConfig(mesh={"pp": 2}, microbatches=3, batch_size=4)
    trainer = {f.message for f in check_config(cfg, world_size=2)}
    report = validate(config, {"pp": 2}, num_microbatches=3, batch_size=4)
    assert trainer and trainer == {f.message for f in report.errors}


def test_a_model_without_pipeline_stages_is_refused():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    report = validate(model, {"pp": 2}, plan={}, inputs=[torch.zeros(1, 4)])
    assert ("mesh", "pp") in _errors(report)
    assert "pipeline=PipelineLayout" in report.errors[0].fix
    assert PIPELINE.units_of_model(get_spec("llama3-debug").build())  # the description fits


def test_cli_validate_with_pp(capsys):
    assert main(["validate", "--model", "llama3-debug", "--mesh", "pp=2,tp=2"]) == 0
    capsys.readouterr()
    code = main(
        [
            "validate",
            "--model",
            "llama3-debug",
            "--mesh",
            "pp=2,tp=2",
            "--microbatches",
            "2",
            "--batch",
            "3",
            "--format",
            "json",
        ]
    )
    assert code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"]["pp"] == 2 and out["num_errors"] == 1
    assert out["findings"][0]["field"] == "num_microbatches"


def test_a_split_that_is_not_a_dict_is_refused_naming_the_field(config, tmp_path, capsys):
    # A job file's array (the natural TOML for stage lists) reached the split as a list:
    # AttributeError "'list' object has no attribute 'balance'" in validate and train.
    stages = [["tok_embeddings", "layers.0"], ["layers.1", "norm+output"]]
    for split in (stages, "units_per_stage=2", 2):
        cfg = TrainConfig(mesh={"pp": 2}, batch_size=4, seq_len=32, pipeline_split=split)
        (error,) = [f for f in check_config(cfg, 2) if f.severity == "error"]
        assert (error.path, error.field) == ("pipeline", "pipeline_split")
        assert f"is {type(split).__name__}" in error.message and "units_per_stage" in error.fix
        report = validate(config, {"pp": 2}, pipeline_split=split)
        assert ("pipeline", "pipeline_split") in _errors(report)
    job = tmp_path / "job.toml"
    job.write_text(f'mesh = "pp=2"\nbatch_size = 4\npipeline_split = {json.dumps(stages)}\n')
    assert main(["validate", "--model", "llama3-debug", "--config", str(job)]) == 1
    assert "pipeline_split" in capsys.readouterr().out
    # The inline table the fix names is a split.
    job.write_text(
        f'mesh = "pp=2"\nbatch_size = 4\npipeline_split = {{stages = {json.dumps(stages)}}}\n'
    )
    assert main(["validate", "--model", "llama3-debug", "--config", str(job)]) == 0


def test_the_tied_weights_fix_names_an_override_that_unties_them():
    # The fix said "e.g. tie_word_embeddings=False"; qwen3's field is tie_embeddings, and
    # --model-overrides '{"tie_word_embeddings": false}' is refused ("unexpected keyword").
    tied = TrainConfig(
        mesh={"pp": 2}, model="qwen3-debug", model_overrides={"tie_embeddings": True}
    )
    (error,) = [f for f in check_config(tied, 2) if f.severity == "error"]
    assert "tied tensor" in error.message
    fix = error.fix.split("--model-overrides '", 1)[1].split("'", 1)[0]
    untied = tied.replace(model_overrides={**tied.model_overrides, **json.loads(fix)})
    assert [f for f in check_config(untied, 2) if f.severity == "error"] == []


def test_a_flops_balance_without_a_sequence_names_the_flag(capsys):
    # validate without --seq counted FLOPs at 2,048 tokens, past llama3-debug's 512
    # positions, and said only "use a sequence length the model takes" (no flag; the
    # user gave none): the same split ran in demo at its 64 tokens.
    argv = ["validate", "--model", "llama3-debug", "--mesh", "pp=2"]
    argv += ["--pipeline-split", '{"balance": "flops"}']
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "(no sequence length given: 2,048 assumed)" in out and "--seq N" in out
    assert main([*argv, "--seq", "64"]) == 0


def test_pp_on_a_transformers_model_points_at_hf_config(tmp_path, capsys):
    # validate --hf-model with pp said "register the model's PipelineLayout, or pass
    # validate(..., pipeline=PipelineLayout(...))", nothing a command-line user can do for
    # transformers' model, and plan printed no fix at all; --hf-config of the same config
    # builds this library's model, which is cut into stages (and validates at pp=2).
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
                "rms_norm_eps": 1e-5,
            }
        )
    )
    argv = ["validate", "--mesh", "pp=2", "--format", "json"]
    assert main([*argv, "--hf-model", str(tmp_path)]) == 1
    (error,) = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["field"] == "pp"]
    assert f"--hf-config {tmp_path} instead of --hf-model" in error["fix"]
    assert main([*argv, "--hf-config", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["plan", "--hf-model", "llama", "--mesh", "pp=2"]) == 1
    assert "Fix: leave pp out of the mesh, or check" in capsys.readouterr().err
