"""Job files: ``--config job.toml`` (the run options as its schema), flags over it, and the
record a run leaves in its run directory (resolved config, version, commit)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from hyper_parallel import __version__
from hyper_parallel.train import TrainConfig
from hyper_parallel.train.arguments import add_train_arguments, config_from_args
from hyper_parallel.train.run import main as run


def _config(path, *flags):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(path), *flags]))


def test_a_job_file_holds_the_run_options_and_flags_override_it(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        'mesh = "dp_shard=2,tp=2"\n'
        "steps = 7\n"
        "batch_size = 4          # underscores work too\n"
        "seq-len = 16\n"
        "model-overrides = { num_layers = 1 }\n"
        'lr-schedule = "wsd"\n'
        "min-lr = 1e-5\n"
        "sp = true\n"
        "no-progress = true\n"
    )
    cfg = _config(job, "--steps", "9")
    assert cfg.mesh == {"dp_shard": 2, "tp": 2} and cfg.steps == 9  # the flag wins
    assert (cfg.batch_size, cfg.seq_len, cfg.lr_schedule) == (4, 16, "wsd")
    assert cfg.model_overrides == {"num_layers": 1} and cfg.min_lr == 1e-5
    assert cfg.sp is True and cfg.progress is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stpes = 3\n", r"unknown option\(s\) 'stpes' \(did you mean 'steps'\?\)"),
        ("lr_shedule = 'wsd'\n", r"'lr_shedule' \(did you mean 'lr[-_]schedule'\?\)"),
        ('mesh = "dp=x"\n', r"mesh = 'dp=x': "),
        ('steps = "3"\n', r"steps = '3': expected a number \(int\)"),
        ('lr-schedule = "cosin"\n', r"lr-schedule = 'cosin': choose one of cosine, linear"),
        ("sp = 1\n", r"sp = 1: expected true or false"),
        ("steps = \n", r"not valid TOML"),
        # Names and paths are strings (these raised a TypeError from deep in the trainer).
        ("checkpoint-dir = 5\n", r"checkpoint-dir = 5: expected a string"),
        ('model = ["llama3-8b"]\n', r"model = \['llama3-8b'\]: expected a string"),
        # torchtitan-style sections: said to be sections, the file flat.
        ('[model]\nname = "llama3"\n', r"model = \{'name': 'llama3'\}: expected a string.* flat"),
        ("steps = 1\n[training]\nlr = 0.1\n", r"'training'.*\[training\] is a section.*lr = "),
    ],
)
def test_bad_job_files_name_the_key_and_the_fix(tmp_path, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    with pytest.raises(ValueError, match=message):
        _config(job)


@pytest.mark.parametrize("key", ["metrics-out", "metrics_out", "grads-out"])
def test_a_command_line_output_in_a_job_file_says_to_pass_it_as_a_flag(tmp_path, capsys, key):
    """--metrics-out / --grads-out are train flags, not TrainConfig fields: a job file
    setting one used to be told only 'unknown option(s)'."""
    job = tmp_path / "job.toml"
    job.write_text(f'steps = 1\n{key} = "out file.json"\n')
    flag = "--" + key.replace("_", "-")
    assert run(["--config", str(job), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} is an output of the train command line, not a run option" in err
    assert f"remove the key '{key}' and pass it as a flag next to --config" in err
    assert f"(--config {job} {flag} 'out file.json')" in err and "unknown option" not in err
    job.write_text(f'stpes = 1\n{key} = "m.json"\n')  # with a mistyped key: both said
    with pytest.raises(ValueError, match=rf"'stpes' \(did you mean 'steps'\?\).* Also {flag} is"):
        _config(job)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("num_steps", "steps"),
        ("global_batch_size", "batch_size"),
        ("num_microbatches", "microbatches"),
        ("sequence_parallel", "sp"),
    ],
)
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_former_field_names_are_refused_with_the_flag_name(tmp_path, old, new, suffix):
    # TrainConfig's fields carry the flags' names; the old names are unknown keys.
    job = tmp_path / f"job{suffix}"
    job.write_text(json.dumps({old: 2}) if suffix == ".json" else f"{old} = 2\n")
    with pytest.raises(
        ValueError, match=rf"unknown option\(s\) '{old}' \(did you mean '{new}'\?\)"
    ):
        _config(job)
    with pytest.raises(TypeError, match=old):
        TrainConfig(**{old: 2})


def test_the_run_directory_keeps_the_resolved_config_version_and_commit(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    argv += ["--model-overrides", '{"num_layers": 1}', "--lr-schedule", "linear"]
    assert run([*argv, "--run-dir", str(run_dir)]) == 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["hyper_parallel"] == __version__
    assert record["git_commit"] is None or len(record["git_commit"].split("-")[0]) == 40
    resolved = TrainConfig.from_dict(record["config"])
    # config.toml is a job file that gives the same run back
    again = _config(run_dir / "config.toml")
    assert again.to_dict() == resolved.to_dict()
    assert again.lr_schedule == "linear" and again.model_overrides == {"num_layers": 1}
    assert "train.log" in {p.name for p in run_dir.iterdir()}


def test_the_run_record_keeps_a_field_no_flag_sets(tmp_path, capsys):
    """compile_backend, a TrainConfig field job files take but no flag sets, was left out
    of config.toml: the record of a run at compile_backend = "aot_eager" ran again under
    inductor."""
    job = tmp_path / "job.toml"
    job.write_text('compile_backend = "aot_eager"\n')
    run_dir = tmp_path / "run"
    argv = ["--config", str(job), "--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    assert run([*argv, "--no-progress", "--run-dir", str(run_dir)]) == 0
    resolved = TrainConfig.from_dict(json.loads((run_dir / "run.json").read_text())["config"])
    assert resolved.compile_backend == "aot_eager"
    again = _config(run_dir / "config.toml")
    assert again.to_dict() == resolved.to_dict()
    # At its default it is not written (a record of the flags' options only, as before).
    assert run(["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress",
                "--run-dir", str(tmp_path / "plain")]) == 0  # fmt: skip
    assert "compile_backend" not in (tmp_path / "plain" / "config.toml").read_text()


def _header_command(config) -> list[str]:
    """The command the header of ``config`` gives, as words (``cd DIR && ...``)."""
    import shlex

    (line,) = [ln for ln in config.read_text().splitlines() if ln.startswith("#   cd ")]
    return shlex.split(line.removeprefix("#"))


def test_a_run_record_keeps_no_one_off_action_and_its_header_runs_it_again(
    tmp_path, capsys, monkeypatch
):
    from hyper_parallel.train.checkpoint import checkpoint_steps

    # Reading a record back with --config repeated its --overwrite (no flag turns a
    # boolean off) and deleted the run's checkpoints; its header said "--config
    # config.toml" for a record in ck/, which, followed, trained into ck/ck/.
    monkeypatch.chdir(tmp_path)
    argv = ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--log-every", "0"]
    argv += ["--model-overrides", '{"num_layers": 1}', "--checkpoint-dir", "ck"]
    assert run([*argv, "--steps", "1", "--overwrite"]) == 0
    config = tmp_path / "ck" / "config.toml"
    text = config.read_text()
    keys = {ln.split(" = ")[0] for ln in text.splitlines() if " = " in ln and ln[0] != "#"}
    assert "overwrite" not in keys and "resume" not in keys
    assert "# Given to this run, one-off actions not kept here: --overwrite" in text
    assert run(["--config", "ck/config.toml", "--steps", "1"]) == 2
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    assert [s for s, _ in checkpoint_steps("ck")] == [1]
    # The header's command, followed literally from elsewhere, continues this run.
    words = _header_command(config)
    assert words[:3] == ["cd", str(tmp_path), "&&"]
    assert words[3:] == [
        *("python", "-m", "hyper_parallel.train.run", "--config", "ck/config.toml", "--resume")
    ]
    monkeypatch.chdir(tmp_path / "ck")
    monkeypatch.chdir(words[1])
    assert run([*words[6:], "--steps", "2"]) == 0
    assert [s for s, _ in checkpoint_steps("ck")] == [1, 2]
    assert not (tmp_path / "ck" / "ck").exists()
    assert "--resume" in config.read_text() and "resume = " not in config.read_text()


def test_the_header_of_a_multi_rank_record_is_its_torchrun_line(tmp_path, monkeypatch):
    from hyper_parallel.train.arguments import RUN_OPTIONS
    from hyper_parallel.train.job import rerun_command, write_run_record

    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(mesh={"dp_shard": 2}, run_dir="out/run")
    write_run_record("out/run", cfg, RUN_OPTIONS, world_size=2, ranks_per_node=2)
    words = _header_command(tmp_path / "out" / "run" / "config.toml")
    assert words[3:] == [
        *("torchrun", "--standalone", "--nproc-per-node", "2"),
        *("-m", "hyper_parallel.train.run", "--config", "out/run/config.toml", "--overwrite"),
    ]
    two_nodes = rerun_command("c.toml", world_size=16, ranks_per_node=8)
    assert two_nodes.startswith("torchrun --nnodes 2 --nproc-per-node 8 ")
    assert rerun_command("my dir/c.toml") == (
        "python -m hyper_parallel.train.run --config 'my dir/c.toml'"
    )


def test_a_json_file_of_trainconfig_fields_still_reads(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(TrainConfig(steps=5, seed=3).to_dict()))
    cfg = _config(path, "--seed", "4")
    assert (cfg.steps, cfg.seed) == (5, 4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", "3", "TrainConfig.steps must be an integer, got str: '3'."),
        ("steps", True, "TrainConfig.steps must be an integer, got bool: True."),
        ("lr", "1e-3", "TrainConfig.lr must be a number, got str: '1e-3'."),
        ("sp", 1, "TrainConfig.sp must be True or False, got int: 1."),
        ("microbatches", 2.0, "TrainConfig.microbatches must be an integer or None, got float"),
        ("model_overrides", "x", "TrainConfig.model_overrides must be a dict"),
        ("text", 5, "TrainConfig.text must be a string, got int: 5."),
    ],
)
def test_train_config_fields_of_the_wrong_type_name_the_field(field, value, message):
    """From Python a field of the wrong type is named (``steps="3"`` was a TypeError from
    a comparison inside the constructor: "'<' not supported between 'str' and 'int'")."""
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**{field: value})


def test_train_config_takes_integers_for_floats_numpy_integers_and_paths(tmp_path):
    import numpy as np

    cfg = TrainConfig(lr=1, steps=np.int64(3), checkpoint_dir=tmp_path, eval_split=0.1)
    assert (cfg.lr, cfg.steps, cfg.checkpoint_dir) == (1, 3, tmp_path)
