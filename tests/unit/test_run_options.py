"""One run-option table for every command: the same flags, defaults and help in ``plan``,
``validate``, ``suggest``, ``train.run`` and ``demo``; ``--hf-config`` and
``--model-overrides`` in all of them; ``--dtype bf16`` one meaning (fp32 states)."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
import torch

from hyper_parallel.cli import _parser, main
from hyper_parallel.train.arguments import (
    COMMAND_OPTIONS,
    MODEL_FIELDS,
    command_defaults,
    config_from_args,
    option_fields,
    option_flag,
    option_kwargs,
)
from hyper_parallel.train.run import build_parser

TABLE_FLAGS = {option_flag(dest): dest for dest in option_fields()}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: sub.choices[name] for name in ("plan", "validate", "suggest", "demo")}
    out["train"] = build_parser()
    return out


PARSERS = _parsers()


def test_every_command_is_walked() -> None:
    assert set(PARSERS) == set(COMMAND_OPTIONS)


@pytest.mark.parametrize("command", sorted(COMMAND_OPTIONS))
def test_command_options_are_the_tables(command: str) -> None:
    parser = PARSERS[command]
    spec = COMMAND_OPTIONS[command]
    fields = list(option_fields() if spec.fields is None else spec.fields)
    defaults = command_defaults(command)
    actions = {a.dest: a for a in parser._actions}
    for dest in fields:
        action = actions.get(dest)
        assert action is not None, f"{command} lacks {option_flag(dest)}"
        want = option_kwargs(dest, defaults)
        assert action.option_strings == [option_flag(dest)], (command, dest)
        assert action.help == want["help"], (command, dest)
        # A command with --config parses its own defaults unset (applied beneath the file).
        default = None if spec.config_file and dest in spec.defaults else want["default"]
        assert action.default == parser.get_default(dest) == default, (command, dest)
        assert action.choices == want.get("choices"), (command, dest)
        assert action.metavar == want.get("metavar"), (command, dest)
        assert action.required == (dest in spec.required), (command, dest)
    # No command defines a flag of the table on its own (another meaning, another help).
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in TABLE_FLAGS:
                assert TABLE_FLAGS[flag] in fields and action.dest == TABLE_FLAGS[flag], flag


def test_every_command_takes_the_model_options() -> None:
    for command, parser in PARSERS.items():
        flags = {f for a in parser._actions for f in a.option_strings}
        for dest in (*MODEL_FIELDS, "dtype"):  # DESIGN §9: --dtype in every command
            assert option_flag(dest) in flags, (command, dest)
    assert {option_flag(d) for d in MODEL_FIELDS} == {"--model", "--model-overrides", "--hf-config"}


def test_dtype_help_says_mixed_precision_everywhere() -> None:
    helps = {
        PARSERS[c]._option_string_actions["--dtype"].help.split(" (default")[0]
        for c in ("plan", "validate", "suggest", "train", "demo")
    }
    assert len(helps) == 1
    (text,) = helps
    assert "fp32 master weights, gradients and AdamW state" in text


# ---------------------------------------------------------------------- behaviour


def _tiny_llama31(tmp_path) -> str:
    """A tiny config.json with Llama 3.1's rope scaling, as transformers writes one."""
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "num_hidden_layers": 3,
                "vocab_size": 300,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "max_position_embeddings": 512,
                "tie_word_embeddings": False,
            }
        )
    )
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_hf_config_and_overrides_mean_one_model_in_every_command(tmp_path, capsys) -> None:
    from hyper_parallel.dmodule.model_spec import get_spec

    config = _tiny_llama31(tmp_path)
    overrides = '{"num_layers": 2}'
    # train.run and the demo: the TrainConfig their options build, resolved where the
    # run is built (TrainConfig itself reads no file).
    from hyper_parallel.train.run_hooks import resolve_model

    for command in ("train", "demo"):
        args = PARSERS[command].parse_args(
            ["--hf-config", config, "--model-overrides", overrides, "--mesh", "dp=2"]
        )
        cfg, hf = resolve_model(config_from_args(args))
        assert hf.spec == "llama3-hf"
        assert cfg.model == "llama3-hf" and cfg.model_overrides["num_layers"] == 2
        assert cfg.model_overrides["rope_scaling"]["factor"] == 8.0
    spec = get_spec(cfg.model)
    expected = spec.family.num_params(spec.config(**cfg.model_overrides))
    # plan: the same model, counted by the dry run.
    code, out, err = _run(
        capsys, "plan", "--hf-config", config, "--model-overrides", overrides,
        "--mesh", "dp=2,tp=2", "--seq", "128", "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["num_params"] == expected and report["model"] == "llama3-hf"
    # validate: the same model, checked.
    code, out, err = _run(
        capsys, "validate", "--hf-config", config, "--model-overrides", overrides,
        "--mesh", "tp=2", "--format", "json",
    )  # fmt: skip
    assert code == 0, (out, err)
    # suggest: its commands name the same model, and plan takes them.
    code, out, err = _run(
        capsys, "suggest", "--hf-config", config, "--model-overrides", overrides,
        "--gpus", "2", "--gpu", "h100-80gb", "--seq", "128",
        "--global-batch-tokens", "1024", "--top", "1", "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    command = shlex.split(json.loads(out)["plans"][0]["command"])
    given = json.loads(command[command.index("--model-overrides") + 1])
    assert given == {k: v for k, v in cfg.model_overrides.items()}
    code, out, err = _run(
        capsys, "plan", "--model", command[command.index("--model") + 1],
        "--model-overrides", json.dumps(given), "--mesh", "dp=2", "--seq", "128",
        "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["num_params"] == expected


def test_plan_predicts_the_model_it_traces(tmp_path, capsys) -> None:
    # plan --gpu once scored the registered model without --model-overrides /
    # --hf-config (llama3-8b cut to 8 layers was predicted at 32 layers: 203 GiB beside
    # the dry run's 63) and eagerly under --compile.
    config = _tiny_llama31(tmp_path)
    predicted = {}
    for layers in (2, 3):
        code, out, err = _run(
            capsys, "plan", "--hf-config", config, "--model-overrides",
            json.dumps({"num_layers": layers}), "--mesh", "dp=2", "--seq", "128",
            "--gpu", "h100-80gb", "--format", "json",
        )  # fmt: skip
        assert code == 0, err
        report = json.loads(out)
        # The states the cost model counts are the traced model's, byte for byte.
        assert report["predicted"]["memory"]["params"] == report["per_rank_bytes"]["params"]
        predicted[layers] = report["predicted"]
    assert predicted[3]["memory"]["params"] > predicted[2]["memory"]["params"]
    assert predicted[3]["step_s"] > predicted[2]["step_s"]
    # Compiled: the same memory, the compute at the stated compile factor (below 1) —
    # at a size where compute is most of the step.
    for extra in ((), ("--compile",)):
        code, out, err = _run(
            capsys, "plan", "--model", "llama3-8b", "--model-overrides", '{"num_layers": 2}',
            "--mesh", "dp=1", "--dtype", "bf16", "--seq", "1024", "--gpu", "h100-80gb",
            "--format", "json", *extra,
        )  # fmt: skip
        assert code == 0, err
        predicted[extra] = json.loads(out)["predicted"]
    eager, compiled = predicted[()], predicted[("--compile",)]
    assert compiled["memory"]["params"] == eager["memory"]["params"]
    assert compiled["step_s"] < 0.95 * eager["step_s"], (compiled, eager)


def test_a_file_sized_model_without_its_file_is_refused(capsys) -> None:
    # Once it planned the 131K-parameter debug preset in its place.
    for command in ("plan", "validate"):
        code, out, err = _run(capsys, command, "--model", "llama3-hf", "--mesh", "dp=2")
        assert code == 1
        assert "llama3-hf takes its sizes from a Hugging Face config.json" in out + err
        assert "--hf-config PATH" in out + err
    code, _, err = _run(
        capsys, "suggest", "--model", "qwen3-hf", "--gpus", "8", "--gpu", "h100-80gb",
        "--seq", "1024", "--global-batch-tokens", "65536",
    )  # fmt: skip
    assert code == 2 and "--hf-config PATH" in err
    from hyper_parallel.train.trainer import TrainConfig, check_config

    problems = check_config(TrainConfig(model="llama3-hf"), 1)
    assert any("--hf-config PATH" in str(p) for p in problems)


def test_a_file_sized_model_without_its_file_names_only_the_commands_options(capsys) -> None:
    # plan and validate were told "pass --hf-config PATH (or --hf-checkpoint DIR to load its
    # weights too)" — neither has --hf-checkpoint — and a second, generic "Fix: name a
    # registered model and its fields." followed.
    for command in ("plan", "validate", "suggest", "train", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        takes = {flag for flag in ("--hf-config", "--hf-checkpoint") if flag in out}
        if command in ("plan", "validate"):
            argv = ["--model", "llama3-hf", "--mesh", "tp=2"]
        elif command == "suggest":
            argv = ["--model", "llama3-hf", "--gpus", "8", "--gpu", "h100-80gb", "--seq",
                    "1024", "--global-batch-tokens", "65536"]  # fmt: skip
        elif command == "demo":
            argv = ["--model", "llama3-hf", "--mesh", "tp=2", "--steps", "1"]
        else:  # train: one process
            argv = ["--model", "llama3-hf", "--steps", "1"]
        code, out, err = _run(capsys, command, *argv)
        said = out + err
        assert code != 0 and "takes its sizes from a Hugging Face config.json" in said, said
        offered = {flag for flag in ("--hf-config", "--hf-checkpoint") if flag in said}
        assert offered == takes, (command, offered, takes, said)
        assert said.lower().count("fix:") == 1, said
    # The trainer's gate (TrainConfig has hf_checkpoint) offers the weights too.
    from hyper_parallel.train.trainer import TrainConfig, check_config

    (problem,) = check_config(TrainConfig(model="llama3-hf"), 1)
    assert "--hf-checkpoint DIR" in problem.fix and "--hf-config PATH" in problem.fix
    assert str(problem).count("Fix:") == 1


def test_no_model_or_two_models_are_usage_errors(tmp_path, capsys) -> None:
    code, _, err = _run(capsys, "plan", "--mesh", "dp=2")
    assert code == 2 and "give --model NAME" in err
    config = _tiny_llama31(tmp_path)
    code, _, err = _run(capsys, "plan", "--model", "llama3-8b", "--hf-config", config,
                        "--mesh", "dp=2")  # fmt: skip
    assert code == 2 and "give one of them" in err
    code, _, err = _run(capsys, "validate", "--hf-model", "llama", "--model-overrides", "{}",
                        "--mesh", "tp=2", "--model", "llama3-8b")  # fmt: skip
    assert code == 2 and "--hf-model" in err


def test_plan_dtype_bf16_keeps_fp32_states(capsys) -> None:
    # --dtype bf16 is the trainer's: fp32 master weights, gradients and AdamW moments
    # (once: 2-byte parameters and gradients, half of what a bf16 run holds).
    reports = {}
    for dtype in ("fp32", "bf16"):
        code, out, err = _run(
            capsys, "plan", "--model", "llama3-debug", "--mesh", "dp=2,tp=2", "--seq", "64",
            "--dtype", dtype, "--format", "json",
        )  # fmt: skip
        assert code == 0, err
        reports[dtype] = json.loads(out)["per_rank_bytes"]
    fp32, bf16 = reports["fp32"], reports["bf16"]
    for state in ("params", "grads", "optimizer"):
        assert bf16[state] == fp32[state] > 0, state
    assert fp32["params"] == fp32["grads"] and fp32["optimizer"] == 2 * fp32["params"]
    assert 0 < bf16["activations"] < fp32["activations"]


def test_the_dry_run_refuses_low_precision_masters_under_bf16() -> None:
    from hyper_parallel.analysis import dry_run
    from hyper_parallel.dmodule.model_spec import get_spec

    config = get_spec("llama3-debug").config()
    with pytest.raises(ValueError, match="fp32 master weights"):
        dry_run(config, {"dp": 2}, seq_len=16, param_dtype=torch.bfloat16, dtype="bf16")


def test_plan_gpu_refuses_what_it_does_not_model_and_says_when_a_layout_does_not_fit(
    tmp_path, capsys
) -> None:
    """--no-fsdp and --plan FILE were predicted as the default run (llama3-8b dp=8
    --no-fsdp: 24.9 GiB beside the dry run's 123.7); a layout over the device's usable
    memory was printed as a plain figure, where suggest refuses it."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("output:\n  state_shardings: {weight: {tp: Shard(0)}}\n")
    base = ["plan", "--model", "llama3-debug", "--seq", "64", "--gpu", "h100-80gb"]
    for extra in (["--mesh", "dp=2", "--no-fsdp"], ["--mesh", "tp=2", "--plan", str(plan)]):
        code, out, err = _run(capsys, *base, *extra)
        assert code == 2 and out == "", err
        assert "predict the trainer's run of --model" in err and extra[-1] in err, err
    code, out, err = _run(capsys, *base, "--mesh", "dp=2", "--format", "json")
    assert code == 0, err
    predicted = json.loads(out)["predicted"]
    assert predicted["fits"] and predicted["memory_limit_bytes"] < 80 * 10**9
    # qwen3-30b-a3b at dp=8 x ep=8, 4K, ac=full: 71.1 GiB against the 62.1 it may use.
    code, out, err = _run(
        capsys, "plan", "--model", "qwen3-30b-a3b", "--mesh", "dp=8,ep=8", "--dtype", "bf16",
        "--ac", "full", "--seq", "4096", "--gpu", "h100-80gb",
    )  # fmt: skip
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("Predicted on"))
    assert "DOES NOT FIT" in line and "suggest refuses this layout" in line, line


def test_plan_json_under_pp_counts_the_pipelines_micro_batches(capsys) -> None:
    code, out, err = _run(
        capsys, "plan", "--model", "llama3-debug", "--mesh", "pp=2,dp=2,tp=2", "--sp",
        "--seq", "64", "--schedule", "Interleaved1F1B", "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["num_microbatches"] == report["pipeline"]["num_microbatches"] == 4
