"""Runs beyond one machine: ``hyper-parallel launch`` and ``suggest`` print the per-node
``torchrun`` command and a SLURM batch script (content checked, the script run by bash
against stand-ins for ``scontrol`` and ``srun``); ``suggest --hf-config DIR`` commands
start from DIR's weights; ``suggest --write-config`` writes a job file that ``train
--config`` and ``validate --config`` read."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from hyper_parallel.cli import _parser, main
from hyper_parallel.train.arguments import add_train_arguments, config_from_args

TRAIN_ARGS = [
    "--mesh", "dp=2,tp=2",
    "--steps", "3",
    "--model-overrides", '{"num_layers": 2}',
    "--checkpoint-dir", "/shared/ckpt dir",  # a space: quoted in the command and the script
    "--checkpoint-every", "2",
    "--sp",
    "--no-progress",
]  # fmt: skip


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _launcher_and_train(command: str) -> tuple[list[str], list[str]]:
    words = shlex.split(command)
    at = words.index("-m")
    assert words[at + 1] == "hyper_parallel.train.run", command
    return words[:at], words[at + 2 :]


def _option(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def _run_slurm_script(script: str, tmp_path, nodelist_hosts: list[str]) -> list[str]:
    """Run the script under bash with ``scontrol`` and ``srun`` stand-ins; returns the
    arguments ``srun`` received (the torchrun line every node would run), with the
    variables the script set expanded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        '[ "$1 $2" = "show hostnames" ] || exit 3\n'
        + "".join(f"echo {h}\n" for h in nodelist_hosts)
    )
    record = tmp_path / "srun.args"
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n')
    for tool in ("scontrol", "srun"):
        os.chmod(bin_dir / tool, 0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[07-08]",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(len(nodelist_hosts)),
    }
    subprocess.run(["bash", str(path)], env=env, check=True, timeout=30)
    return record.read_text().splitlines()


# ---------------------------------------------------------------------- launch


def test_help_lists_launch(capsys) -> None:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "launch" in sub.choices
    with pytest.raises(SystemExit):
        main(["--help"])
    assert " launch " in " ".join(capsys.readouterr().out.split())


def test_launch_prints_each_nodes_command_and_a_slurm_script(capsys, tmp_path) -> None:
    assert shutil.which("bash") is not None
    script_path = tmp_path / "run.sbatch"
    code, out, err = _run(
        capsys, "launch", "--nodes", "2", "--gpus-per-node", "2", "--slurm",
        str(script_path), *TRAIN_ARGS,
    )  # fmt: skip
    assert code == 0, err
    (command,) = [line for line in out.splitlines() if line.startswith("torchrun ")]
    launcher, train = _launcher_and_train(command)
    assert train == TRAIN_ARGS  # every option carried, unchanged
    assert _option(launcher, "--nnodes") == "2" and _option(launcher, "--nproc-per-node") == "2"
    assert _option(launcher, "--node-rank") == "$NODE_RANK"
    assert _option(launcher, "--rdzv-backend") == "c10d"
    assert _option(launcher, "--rdzv-endpoint") == "$MASTER_ADDR:$MASTER_PORT"
    assert "--standalone" not in launcher
    # The script: valid bash, SLURM's directives, and the line srun starts on each node.
    script = script_path.read_text()
    subprocess.run(["bash", "-n", str(script_path)], check=True, timeout=30)
    assert script.startswith("#!/bin/bash\n") and os.access(script_path, os.X_OK)
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2"):
        assert f"#SBATCH {directive}\n" in script
    srun = _run_slurm_script(script, tmp_path, ["node07", "node08"])
    at = srun.index("torchrun")
    assert srun[:at] == ["--nodes=2", "--ntasks-per-node=1"]
    launcher, train = srun[at : srun.index("-m")], srun[srun.index("-m") + 2 :]
    assert train == TRAIN_ARGS
    assert _option(launcher, "--nnodes") == "2" and _option(launcher, "--nproc-per-node") == "2"
    assert _option(launcher, "--rdzv-backend") == "c10d"
    assert _option(launcher, "--rdzv-id") == "4242"  # $SLURM_JOB_ID
    assert _option(launcher, "--rdzv-endpoint") == "node07:29500"  # the first host
    # A script that is there (often edited by hand) is not replaced; nothing is printed.
    script_path.write_text("#!/bin/bash\n# mine\n")
    code, out, err = _run(
        capsys, "launch", "--nodes", "2", "--gpus-per-node", "2", "--slurm",
        str(script_path), *TRAIN_ARGS,
    )  # fmt: skip
    assert code == 2 and out == "" and "a file is there already" in err
    assert script_path.read_text() == "#!/bin/bash\n# mine\n"
    # A folder that is not there is made.
    code, _, err = _run(
        capsys, "launch", "--nodes", "2", "--gpus-per-node", "2", "--slurm",
        str(tmp_path / "jobs" / "run.sbatch"), *TRAIN_ARGS,
    )  # fmt: skip
    assert code == 0 and (tmp_path / "jobs" / "run.sbatch").read_text().startswith("#!/bin/bash")


def test_launch_one_node_is_standalone_and_prints_the_script(capsys) -> None:
    code, out, err = _run(
        capsys, "launch", "--nodes", "1", "--gpus-per-node", "4", "--slurm", "-", *TRAIN_ARGS
    )
    assert code == 0, err
    lines = out.splitlines()
    launcher, train = _launcher_and_train(lines[0])
    assert launcher == ["torchrun", "--standalone", "--nproc-per-node", "4"]
    assert train == TRAIN_ARGS
    assert "#SBATCH --nodes=1" in out and "srun --nodes=1" in out


def test_launch_warns_when_tensor_parallel_groups_span_nodes(capsys) -> None:
    """tp=4 on 2 nodes x 2 GPUs was printed without a word: every tp group's per-layer
    collectives would cross nodes. tp is the innermost axis (runs of tp consecutive ranks),
    so a group stays in a node exactly when tp divides the GPUs per node."""
    model = ["--model", "llama3-debug", "--batch-size", "12"]
    for nodes, gpus, mesh, spans in [
        (2, 2, "tp=4", True),  # each group: 2 ranks on each of 2 nodes
        (2, 6, "dp=3,tp=4", True),  # ranks 4..7: 2 on node 0, 2 on node 1
        (2, 8, "dp=4,tp=4", False),
        (2, 4, "dp=2,tp=4", False),
    ]:
        argv = ["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--mesh", mesh, *model]
        code, out, err = _run(capsys, "launch", *argv)
        assert code == 0 and "torchrun --nnodes" in out, err
        warned = "groups span nodes" in err
        assert warned is spans, (mesh, gpus, err)
    # One node: the world is the node, nothing spans nodes.
    code, _, err = _run(
        capsys, "launch", "--nodes", "1", "--gpus-per-node", "4", "--mesh", "tp=4", *model
    )
    assert code == 0 and "span" not in err, err


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1", "http"])
def test_launch_refuses_a_port_outside_1_to_65535(capsys, port) -> None:
    """--port 99999 used to be written into the script as MASTER_PORT=99999."""
    with pytest.raises(SystemExit) as e:
        main(["launch", "--nodes", "2", "--gpus-per-node", "1", "--slurm", "-", f"--port={port}"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "MASTER_PORT" not in out
    assert f"argument --port: '{port}' is not a TCP port; give one in 1..65535" in err


def test_launch_takes_the_highest_port_and_the_script_api_checks_it_too(capsys) -> None:
    from hyper_parallel.train.launch import slurm_script

    code, out, err = _run(
        capsys, "launch", "--nodes", "2", "--gpus-per-node", "1", "--slurm", "-", "--port", "65535"
    )
    assert code == 0, err
    assert "MASTER_PORT=${MASTER_PORT:-65535}" in out
    with pytest.raises(ValueError, match=r"port 99999 is not a TCP port; give one in 1\.\.65535"):
        slurm_script([], nodes=2, gpus_per_node=1, port=99999)


def test_launch_carries_a_job_file_and_checks_it(capsys, tmp_path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('mesh = "dp=2,tp=4"\nsteps = 5\nmodel-overrides = { num_layers = 2 }\n')
    code, out, err = _run(
        capsys, "launch", "--nodes", "2", "--gpus-per-node", "4", "--config", str(job)
    )
    assert code == 0, err
    (command,) = [line for line in out.splitlines() if line.startswith("torchrun ")]
    assert _launcher_and_train(command)[1] == ["--config", str(job)]
    # The mesh is checked against nodes x GPUs per node before anything is printed.
    code, out, err = _run(
        capsys, "launch", "--nodes", "2", "--gpus-per-node", "2", "--config", str(job)
    )
    assert code == 2 and out == ""
    assert "dp_shard=2,tp=4" in err and "8 ranks" in err and "the world has 4" in err
    # The fix is in nodes (not a one-node 'torchrun --nproc-per-node 8').
    assert "launch 8 ranks: --nodes 4 --gpus-per-node 2." in err and "nproc" not in err
    # A misspelt train option: the trainer's error, once.
    code, out, err = _run(capsys, "launch", "--nodes", "2", "--gpus-per-node", "2", "--stepz", "3")
    assert code == 2 and out == ""
    assert err.count("error") == 1 and "--stepz" in err


# ---------------------------------------------------------------------- suggest


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    """A tiny Llama checkpoint as transformers writes it (config + safetensors)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    assert any(name.endswith(".safetensors") for name in os.listdir(folder))
    return str(folder)


def _suggest(capsys, source: list[str], *extra: str) -> tuple[int, dict, str]:
    code, out, err = _run(
        capsys, "suggest", *source, "--gpu", "h100-80gb", "--seq", "128",
        "--global-batch-tokens", "2048", "--format", "json", *extra,
    )  # fmt: skip
    return code, (json.loads(out) if out else {}), err


def test_suggest_prints_each_nodes_command_and_a_slurm_script(capsys, tiny_hf, tmp_path) -> None:
    code, report, err = _suggest(
        capsys, ["--hf-config", tiny_hf], "--gpus", "4", "--gpus-per-node", "2", "--top", "2"
    )
    assert code == 0, err
    assert report["nodes"] == 2
    for plan in report["plans"]:
        launcher, train = _launcher_and_train(plan["command"])
        assert _option(launcher, "--nnodes") == "2"
        assert _option(launcher, "--nproc-per-node") == "2"
        assert _option(launcher, "--node-rank") == "$NODE_RANK"
        assert _option(launcher, "--rdzv-backend") == "c10d"
        assert _option(train, "--mesh") == ",".join(
            f"{a}={s}" for a, s in plan["mesh"].items() if s > 1
        )
    script = report["slurm"]
    srun = _run_slurm_script(script, tmp_path, ["gpu-a", "gpu-b"])
    top_train = _launcher_and_train(report["plans"][0]["command"])[1]
    assert srun[srun.index("-m") + 2 :] == top_train  # the top plan's options, each one
    assert _option(srun, "--rdzv-endpoint") == "gpu-a:29500"
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=2" in script
    # Each suggestion carries its own script (DESIGN §9), running its own options.
    assert len(report["plans"]) == 2 and report["plans"][0]["slurm"] == script
    for i, plan in enumerate(report["plans"]):
        (tmp_path / f"plan{i}").mkdir()
        srun = _run_slurm_script(plan["slurm"], tmp_path / f"plan{i}", ["gpu-a", "gpu-b"])
        assert srun[srun.index("-m") + 2 :] == _launcher_and_train(plan["command"])[1]
    # The table shows both.
    code, out, err = _run(
        capsys, "suggest", "--hf-config", tiny_hf, "--gpu", "h100-80gb", "--seq", "128",
        "--global-batch-tokens", "2048", "--gpus", "4", "--gpus-per-node", "2", "--top", "1",
    )  # fmt: skip
    assert code == 0, err
    assert "run on each of the 2 nodes" in out and "SLURM batch script of plan 1" in out
    # One node: the standalone line and no script.
    code, report, err = _suggest(capsys, ["--hf-config", tiny_hf], "--gpus", "2", "--top", "1")
    assert code == 0, err
    launcher, _ = _launcher_and_train(report["plans"][0]["command"])
    assert launcher == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    assert report["nodes"] == 1 and report["slurm"] is None
    assert report["plans"][0]["slurm"] is None


def test_suggest_hf_config_commands_start_from_the_weights(capsys, tiny_hf, tmp_path) -> None:
    from hyper_parallel.analysis.suggest import model_from_hf_config

    code, report, err = _suggest(capsys, ["--hf-config", tiny_hf], "--gpus", "2", "--top", "1")
    assert code == 0, err
    train = _launcher_and_train(report["plans"][0]["command"])[1]
    assert _option(train, "--hf-checkpoint") == tiny_hf
    # The config.json's path names the same folder; a sharded checkpoint, by its index.
    assert model_from_hf_config(os.path.join(tiny_hf, "config.json")).weights == tiny_hf
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(tiny_hf, "config.json"), sharded)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert model_from_hf_config(sharded).weights == str(sharded)
    # A config without weights: nothing to start from, the model only.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(tiny_hf, "config.json"), bare)
    code, report, err = _suggest(capsys, ["--hf-config", str(bare)], "--gpus", "2", "--top", "1")
    assert code == 0, err
    assert "--hf-checkpoint" not in report["plans"][0]["command"]


def _train_config(job) -> object:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(job)]))


def test_suggest_write_config_writes_the_picked_plans_job_file(capsys, tiny_hf, tmp_path) -> None:
    for pick in (1, 2):
        job = tmp_path / f"job{pick}.toml"
        code, report, err = _suggest(
            capsys, ["--hf-config", tiny_hf], "--gpus", "4", "--gpus-per-node", "2",
            "--mesh", "pp=2,dp=2", "--top", "2", "--write-config", str(job),
            "--pick", str(pick),
        )  # fmt: skip
        assert code == 0, err
        plan = report["plans"][pick - 1]
        cfg = _train_config(job)  # train --config reads it
        assert cfg.mesh == {a: s for a, s in plan["mesh"].items() if s > 1}
        assert cfg.schedule == plan["schedule"]
        assert cfg.microbatches == plan["microbatches"]
        assert (cfg.ac, bool(cfg.sp)) == (plan["ac"], plan["sp"])
        assert (cfg.seq_len, cfg.batch_size) == (128, 2048 // 128)
        assert cfg.hf_checkpoint == tiny_hf
        # Its options are the printed command's, each one.
        train = _launcher_and_train(plan["command"])[1]
        again = _train_config(job)
        parser = argparse.ArgumentParser()
        add_train_arguments(parser)
        assert again == config_from_args(parser.parse_args(train))
        # validate --config accepts it.
        code, out, err = _run(capsys, "validate", "--config", str(job))
        assert code == 0, (out, err)
        assert "OK:" in out
    # The two picks differ (GPipe and 1F1B here), so --pick chose.
    assert (tmp_path / "job1.toml").read_text() != (tmp_path / "job2.toml").read_text()
    code, _, err = _suggest(
        capsys, ["--hf-config", tiny_hf], "--gpus", "2", "--top", "1",
        "--write-config", str(tmp_path / "x.toml"), "--pick", "3",
    )  # fmt: skip
    assert code == 2 and "--pick 3: there are 1 plan(s)" in err
    assert not (tmp_path / "x.toml").exists()
    # A file that is there is not replaced unasked (refused before the search); with
    # --overwrite it is. A folder that is not there is made.
    job = tmp_path / "job1.toml"
    job.write_text("# mine\n")
    base = ["--gpus", "2", "--top", "1", "--write-config"]
    code, report, err = _suggest(capsys, ["--hf-config", tiny_hf], *base, str(job))
    assert code == 2 and report == {} and "a file is there already" in err and "--overwrite" in err
    assert job.read_text() == "# mine\n"
    code, _, err = _suggest(capsys, ["--hf-config", tiny_hf], *base, str(job), "--overwrite")
    assert code == 0 and _train_config(job).hf_checkpoint == tiny_hf
    code, _, err = _suggest(capsys, ["--hf-config", tiny_hf], *base, str(tmp_path / "a/b.toml"))
    assert code == 0 and _train_config(tmp_path / "a" / "b.toml").hf_checkpoint == tiny_hf


def test_suggest_write_config_never_replaces_a_file_it_reads(capsys, tiny_hf, tmp_path) -> None:
    """--write-config X --overwrite onto its own --hardware or --hf-config file replaced
    it; now refused before the search, even with --overwrite (as tokenize --out)."""
    hardware = tmp_path / "mine.yaml"
    hardware.write_text("name: mine\n")  # refused before it is read
    kept = hardware.read_text()
    args = ["--seq", "128", "--global-batch-tokens", "2048", "--gpus", "2", "--overwrite"]
    config = os.path.join(tiny_hf, "config.json")
    before = Path(config).read_text()
    for source, target in (
        (["--model", "llama3-debug", "--hardware", str(hardware)], str(hardware)),
        (["--hf-config", tiny_hf, "--gpu", "h100-80gb"], config),  # the folder's config.json
        (["--hf-config", config, "--gpu", "h100-80gb"], config),
    ):
        code, out, err = _run(capsys, "suggest", *source, *args, "--write-config", target)
        assert code == 2 and out == "", err
        assert f"--write-config {target}: it is the input" in err and "even with --overwrite" in err
        assert "Traceback" not in err
    assert hardware.read_text() == kept and Path(config).read_text() == before


def test_suggest_pick_without_write_config_is_refused(capsys) -> None:
    """--pick N without --write-config was accepted and did nothing."""
    code, out, err = _run(
        capsys, "suggest", "--model", "llama3-debug", "--gpu", "h100-80gb", "--gpus", "2",
        "--seq", "64", "--global-batch-tokens", "128", "--pick", "3",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert "error: argument --pick: --pick 3 needs --write-config FILE" in err, err


def test_validate_config_takes_the_job_files_mesh_and_flags_override_it(capsys, tmp_path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('model = "llama3-debug"\nmesh = "tp=2"\nsteps = 4\n')
    code, out, err = _run(capsys, "validate", "--config", str(job), "--format", "json")
    assert code == 0, (out, err)
    mesh = json.loads(out)["mesh"]
    assert (mesh["tp"], mesh["dp_shard"]) == (2, 1)
    code, out, err = _run(
        capsys, "validate", "--config", str(job), "--mesh", "dp=2", "--format", "json"
    )
    assert code == 0, (out, err)
    mesh = json.loads(out)["mesh"]
    assert (mesh["tp"], mesh["dp_shard"]) == (1, 2)
    # plan --config: the same mesh, and the job's seq-len as its sequence.
    job.write_text('model = "llama3-debug"\nmesh = "dp=2,tp=2"\nseq-len = 48\n')
    code, out, err = _run(capsys, "plan", "--config", str(job), "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["mesh"]["dp_shard"], report["mesh"]["tp"], report["seq_len"]) == (2, 2, 48)
    job.write_text('model = "llama3-debug"\nmesh = "tp=2"\nstepz = 4\n')
    code, out, err = _run(capsys, "validate", "--config", str(job))
    assert code == 2 and "'stepz' (did you mean 'steps'?)" in err


def test_plan_config_traces_the_jobs_batch_as_the_trainer_splits_it(capsys, tmp_path) -> None:
    """plan --config traced one sequence a rank whatever the job's batch-size (global): now
    the trainer's micro-batch (batch-size / (dp_replicate x dp_shard) / microbatches),
    unless --batch is given; a batch that does not divide is refused, naming both."""
    from hyper_parallel.train.arguments import RUN_OPTIONS
    from hyper_parallel.train.config import TrainConfig, run_plan
    from hyper_parallel.train.job import load_job_file

    job = tmp_path / "job.toml"
    job.write_text(
        'model = "llama3-debug"\nmesh = "dp_replicate=2,dp_shard=2"\nbatch-size = 16\n'
        "microbatches = 2\nseq-len = 32\n"
    )
    values = {k: v for k, v in load_job_file(str(job), RUN_OPTIONS).items() if v is not None}
    trainer = run_plan(TrainConfig(**values), world_size=4)
    code, out, err = _run(capsys, "plan", "--config", str(job), "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    # The trainer's run plan: the rank's batch, and its micro-batches.
    assert (trainer.batch_size, trainer.num_microbatches) == (4, 2)
    assert (report["batch_size"], report["num_microbatches"]) == (2, 2)
    code, out, err = _run(capsys, "plan", "--config", str(job), "--batch", "1", "--format", "json")
    assert code == 0 and json.loads(out)["batch_size"] == 1, err
    code, out, err = _run(capsys, "validate", "--config", str(job), "--format", "json")
    assert code == 0, err  # validate: the rank's 4 sequences, in two micro-batches of 2
    assert "inputs [(2, 32)]" in " ".join(json.loads(out)["notes"]), out
    code, out, err = _run(capsys, "plan", "--config", str(job), "--microbatches", "3")
    assert code == 2 and "batch-size 16 gives 4 sequences per data-parallel rank" in err, err
    code, out, err = _run(capsys, "plan", "--config", str(job), "--mesh", "dp_shard=3")
    assert code == 2 and "does not divide over the 3 data-parallel ranks" in err, err


def test_plan_config_takes_the_trainers_defaults_for_what_the_job_leaves_out(
    capsys, tiny_hf, tmp_path
) -> None:
    """A job file without model, seq-len or batch-size runs the trainer's defaults (and an
    hf-checkpoint's model); plan and validate refused it ("no model") or traced their own
    defaults (plan: seq 2,048, which llama3-debug refuses)."""
    from hyper_parallel.train.arguments import RUN_OPTIONS
    from hyper_parallel.train.config import TrainConfig, run_plan
    from hyper_parallel.train.job import load_job_file

    job = tmp_path / "job.toml"
    job.write_text('mesh = "dp_shard=2"\nsteps = 3\n')
    values = {k: v for k, v in load_job_file(str(job), RUN_OPTIONS).items() if v is not None}
    trainer = run_plan(TrainConfig(**values), world_size=2)
    code, out, err = _run(capsys, "plan", "--config", str(job), "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    assert report["model"] == trainer.name == "llama3-debug", report["model"]
    assert (report["seq_len"], report["batch_size"]) == (TrainConfig().seq_len, trainer.batch_size)
    code, out, err = _run(capsys, "validate", "--config", str(job), "--format", "json")
    assert code == 0, err
    assert f"inputs [({trainer.batch_size}, {TrainConfig().seq_len})]" in " ".join(
        json.loads(out)["notes"]
    )
    # The command line still names the model; a default batch that does not divide says so.
    code, out, err = _run(capsys, "plan", "--config", str(job), "--model", "qwen3-debug")
    assert code == 0 and "plan: qwen3-debug on" in out, err
    code, out, err = _run(capsys, "plan", "--config", str(job), "--mesh", "dp_shard=3")
    assert code == 2 and "the trainer's default batch-size 8 does not divide" in err, err
    # An hf-checkpoint job: the checkpoint's model (its config.json), as the trainer runs.
    job.write_text(f'hf-checkpoint = "{tiny_hf}"\nmesh = "tp=2"\nseq-len = 32\n')
    code, out, err = _run(capsys, "plan", "--config", str(job), "--format", "json")
    assert code == 0, err
    assert json.loads(out)["model"] != "llama3-debug", out
