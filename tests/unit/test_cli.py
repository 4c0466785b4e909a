"""The ``hyper-parallel`` command line: subcommands, exit codes, JSON keys, tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.cli import main

PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"
PLAN_KEYS = {
    "model",
    "world_size",
    "mesh",
    "num_params",
    "per_rank_bytes",
    "collectives",
    "modules",
}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_models_lists_the_registry(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    for name in ("llama3-debug", "llama3-8b", "llama3-70b", "llama3-405b"):
        assert name in out
    code, out, _ = run_cli(capsys, "models", "--format", "json")
    assert {
        "name": "llama3-70b",
        "description": "Llama 3 70B shapes",
        "shardings": ["tp", "tp_sp", "cp"],
    } in json.loads(out)
    moe = next(m for m in json.loads(out) if m["name"] == "qwen3-moe-debug")
    assert moe["shardings"] == ["tp", "tp_sp", "cp", "ep"]


def test_plan_json_keys_and_values(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "llama3-debug", "--mesh", "dp=2,tp=2", "--seq", "32",
        "--format", "json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert set(d) >= PLAN_KEYS
    assert d["model"] == "llama3-debug" and d["world_size"] == 4
    assert d["mesh"] == {
        "pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1,
        "fsdp": 2, "efsdp": 4, "batch": 2, "loss": 2, "world_size": 4,
    }  # fmt: skip
    assert d["fsdp_axes"] == ["fsdp"] and d["plan_axes"] == ["tp"]
    assert set(d["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    rb = d["per_rank_bytes"]
    assert rb["activations"] > 0
    assert rb["total"] == rb["params"] + rb["grads"] + rb["optimizer"] + rb["activations"]
    kinds = {(c["kind"], c["axis"], c["phase"]) for c in d["collectives"]}
    assert ("all_gather", "fsdp", "forward") in kinds and ("all_reduce", "tp", "forward") in kinds
    assert all({"kind", "axis", "phase", "count", "bytes"} <= set(c) for c in d["collectives"])
    assert d["modules"][0]["path"] == "tok_embeddings"
    assert d["seq_len"] == 32 and d["fsdp"] is True and d["param_dtype"] == "float32"


def test_plan_and_validate_context_parallel(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "llama3-debug", "--mesh", "dp_shard=2,cp=2,tp=2",
        "--seq", "32", "--format", "json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert d["plan_axes"] == ["cp", "tp"] and d["placement_axes"] == ["fsdp", "tp"]
    assert d["fsdp_axes"] == ["fsdp"]  # FSDP2 shards the states over dp_shard x cp
    assert d["mesh"]["fsdp"] == 4 and d["mesh"]["loss"] == 4 and d["world_size"] == 8
    wq = next(p for m in d["modules"] if m["path"].endswith("attention.wq") for p in m["params"])
    assert wq["placements"] == {"fsdp": "Shard(0)", "tp": "Shard(0)"}
    kinds = {(c["kind"], c["axis"], c["phase"]) for c in d["collectives"]}
    assert ("all_gather", "cp", "forward") in kinds and (
        "reduce_scatter",
        "cp",
        "backward",
    ) in kinds
    code, out, _ = run_cli(capsys, "validate", "--model", "llama3-debug", "--mesh", "cp=2,tp=2")
    assert code == 0 and out.splitlines()[-1].startswith("OK: 0 error(s)")
    assert "plan on cp x tp" in out.splitlines()[0]


def test_plan_table_sp_no_fsdp_bf16(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "llama3-debug", "--mesh", "dp=2,tp=2", "--seq", "32",
        "--sp", "--no-fsdp", "--dtype", "bf16",
    )  # fmt: skip
    assert code == 0
    assert out.splitlines()[-1].startswith("Summary: 131,392 parameters on 4 ranks")
    # --dtype bf16 is the trainer's mixed precision: fp32 states, bf16 compute.
    head = out.splitlines()[0]
    assert "no FSDP" in head and "float32 parameters, gradients and AdamW state" in head
    assert "bfloat16 compute" in head
    rows = [line.split() for line in out.splitlines()]
    assert ["forward", "reduce_scatter", "tp"] in [r[:3] for r in rows]
    assert ["backward", "all_reduce", "(computed)", "dp_shard"] in [r[:4] for r in rows]


def test_plan_hugging_face_with_plan_file(capsys):
    pytest.importorskip("transformers")
    code, out, _ = run_cli(
        capsys, "plan", "--hf-model", "llama", "--plan", str(PLANS / "hf_llama_tp.yaml"),
        "--mesh", "dp=2,tp=2", "--format", "json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert d["model"] == "hf:llama" and d["world_size"] == 4 and d["seq_len"] == 64


def test_validate_ok_and_errors_exit_codes(capsys):
    code, out, _ = run_cli(capsys, "validate", "--model", "llama3-debug", "--mesh", "dp=2,tp=2")
    assert code == 0
    assert out.splitlines()[-1].startswith("OK: 0 error(s)")
    # 4 key/value heads cannot be split over tp=8: the traced forward fails.
    code, out, _ = run_cli(
        capsys, "validate", "--model", "llama3-debug", "--mesh", "tp=8", "--format", "json"
    )
    assert code == 1
    d = json.loads(out)
    assert d["ok"] is False and d["num_errors"] >= 1 and d["mesh"]["tp"] == 8
    assert {"severity", "path", "field", "message", "fix"} <= set(d["findings"][0])


def test_validate_hugging_face_plan_files(capsys, tmp_path):
    pytest.importorskip("transformers")
    good = str(PLANS / "hf_llama_tp.yaml")
    code, _, _ = run_cli(
        capsys, "validate", "--hf-model", "llama", "--plan", good, "--mesh", "tp=2"
    )
    assert code == 0
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "model.layers.*.self_attn.q_proj:\n"
        "  state_shardings: {wieght: {tp: Shard(0)}}\n"
        "model.layers.*.mlp.gate:\n"
        "  state_shardings: {weight: {tp: Shard(0)}}\n"
    )
    code, out, _ = run_cli(
        capsys, "validate", "--hf-model", "llama", "--plan", str(broken), "--mesh", "tp=2"
    )
    assert code == 1
    assert "ERROR model.layers.*.self_attn.q_proj (x2) state_shardings['wieght']" in out
    assert "ERROR model.layers.*.mlp.gate plan" in out


def test_plan_refuses_an_invalid_plan_with_exit_1(capsys, tmp_path):
    pytest.importorskip("transformers")
    broken = tmp_path / "broken.yaml"
    broken.write_text("lm_head:\n  state_shardings: {weight: {TP: Shard(0)}}\n")
    code, _, err = run_cli(
        capsys, "plan", "--hf-model", "llama", "--plan", str(broken), "--mesh", "tp=2"
    )
    assert code == 1
    assert "hyper-parallel validate" in err and "not in mesh" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "nope", "--mesh", "tp=2"], "no model named 'nope'"),
        (["validate", "--model", "llama3-debug", "--mesh", "tp=2", "--plan", "x.txt"], "suffix"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_sequence_parallel_without_tp_is_the_run_plans_finding(capsys, command):
    # The finding the trainer raises, word for word: one gate for every entry point.
    from hyper_parallel.train import TrainConfig, Trainer

    cfg = TrainConfig(mesh={"dp_shard": 2}, sp=True, seq_len=16)  # data: it refuses nothing
    with pytest.raises(ValueError) as e:
        Trainer(cfg, device="cpu")
    finding = str(e.value).splitlines()[-1].strip()
    argv = [command, "--model", "llama3-debug", "--mesh", "dp=2", "--sp", "--seq", "16"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    assert "sp (sequence parallelism) needs tp > 1" in finding
    text = " ".join((out + err).split())
    assert finding.split(": ", 2)[-1].split(" Fix:")[0] in text


def test_plan_says_the_pipeline_switches_it_does_not_use(capsys):
    """--schedule, --stages-per-rank and --pipeline-split at pp=1 were dropped without a
    word by plan (validate warned): the run plan's warnings, on stderr and in the JSON."""
    argv = ["plan", "--model", "llama3-debug", "--mesh", "dp=2", "--seq", "32"]
    code, out, err = run_cli(
        capsys, *argv, "--schedule", "GPipe", "--stages-per-rank", "2",
        "--pipeline-split", '{"units_per_stage": 1}', "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    assert [w["field"] for w in warnings] == ["schedule", "stages_per_rank", "pipeline_split"]
    assert all("the mesh has no pp axis (pp=1)" in w["message"] for w in warnings)
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(lines) == 3 and lines[0].startswith(
        "hyper-parallel plan: warning: schedule='GPipe' shapes a pipeline, but the mesh has no "
        "pp axis (pp=1)"
    ), err
    assert "Fix: drop --schedule" in lines[0]
    code, out, err = run_cli(capsys, *argv, "--format", "json")
    assert code == 0 and json.loads(out)["warnings"] == [] and "warning:" not in err
    code, out, err = run_cli(capsys, *argv, "--schedule", "GPipe")  # the table too
    assert code == 0 and "hyper-parallel plan: warning: schedule='GPipe'" in err


def test_each_json_option_gives_its_own_example(capsys):
    """--pipeline-split's errors showed --model-overrides' example ({"num_layers": 4})."""
    for argv, message in (
        (["--mesh", "pp=2", "--pipeline-split", "[1]"],
         """argument --pipeline-split: expected a JSON object, e.g. '{"units_per_stage": 2}'"""),
        (["--mesh", "tp=2", "--model-overrides", "{x: 1}"],
         """argument --model-overrides: not valid JSON (Expecting property name enclosed in """
         """double quotes); quote the keys, e.g. '{"num_layers": 4}'"""),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["plan", "--model", "llama3-debug", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_malformed_mesh_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama3-debug", "--mesh", "dp:2"])
    assert e.value.code == 2
    assert "not 'axis=size'" in capsys.readouterr().err


def test_demo_delegates_to_the_trainer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    assert "--steps" in capsys.readouterr().out


def test_console_entry_point_exit_code():
    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.cli", "validate", "--model", "llama3-debug",
         "--mesh", "tp=8", "--format", "json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["ok"] is False


def test_hf_model_overrides_take_the_aliases_transformers_maps(capsys):
    """Qwen3-MoE's ``num_experts`` (its name in the Hub's config.json files) is an alias
    transformers maps to ``num_local_experts``; it was refused as no field of the config."""
    import transformers  # noqa: F401

    plan = str(PLANS / "hf_qwen3_moe_ep.yaml")
    argv = ["validate", "--hf-model", "qwen3_moe", "--plan", plan, "--mesh", "dp_shard=2,ep=2"]
    code, out, err = run_cli(capsys, *argv, "--model-overrides", '{"num_experts": 3}')
    assert code == 1, out + err
    assert "3 experts cannot be split over ep=2 ranks" in out, out
    code, _, err = run_cli(capsys, *argv, "--model-overrides", '{"num_expert": 3}')
    assert code == 2 and "'num_expert' (did you mean" in err, err


def test_validate_an_hf_plan_against_your_own_config_fields(capsys, tmp_path):
    """--hf-model refused --model-overrides ("give it alone"), so no command could check a
    plan against a tied or otherwise shaped Hugging Face config; its config's fields are
    overrides now, each checked to be one (transformers keeps a typo silently).
    transformers is a test dependency (make test installs the [hf] extra): no skip."""
    import transformers  # noqa: F401

    tied = ["--model-overrides", '{"tie_word_embeddings": true}']
    good = str(PLANS / "hf_llama_tp.yaml")
    code, out, err = run_cli(
        capsys, "validate", "--hf-model", "llama", "--plan", good, "--mesh", "tp=2", *tied
    )
    assert code == 0, out + err
    # HF's tp_plan habit on a tied model: lm_head alone. Its tied weight is the embedding's.
    lm_head_only = tmp_path / "lm_head.yaml"
    lm_head_only.write_text(
        "lm_head:\n"
        "  state_shardings: {weight: {tp: Shard(0)}}\n"
        "  in_dst_shardings: {input: {tp: Replicate()}}\n"
        "  out_dst_shardings: {tp: Replicate()}\n"
        "  use_local_output: true\n"
    )
    argv = ["validate", "--hf-model", "llama", "--plan", str(lm_head_only), "--mesh", "tp=2"]
    code, out, err = run_cli(capsys, *argv, *tied)
    assert code == 1, out + err
    assert "model.embed_tokens.weight is the same tensor as lm_head.weight (tied)" in out, out
    code, out, err = run_cli(capsys, *argv)  # untied: nothing shared
    assert "(tied)" not in out, out
    code, _, err = run_cli(capsys, *argv, "--model-overrides", '{"num_atention_heads": 8}')
    assert code == 2 and "'num_atention_heads' (did you mean 'num_attention_heads'?)" in err
    code, _, err = run_cli(capsys, *argv, "--model-overrides", '{"num_attention_heads": 6}')
    assert code == 2 and "transformers refuses the llama config" in err, err
    assert "not a multiple of the number of attention heads" in err, err


def test_validate_and_plan_the_transformers_model_a_config_json_describes(capsys, tmp_path):
    """A user's checkpoint config was not accepted by --hf-model (only family names), and
    --hf-config (this library's own model of that config) matched none of a transformers
    plan's module paths with a fix that said only "use a real module path"."""
    from transformers import LlamaConfig

    ckpt = tmp_path / "ckpt"
    # Heads 6 and kv heads 3: tp=2 splits q heads evenly but not the kv heads.
    LlamaConfig(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=3, vocab_size=256,
    ).save_pretrained(ckpt)  # fmt: skip
    plan = str(PLANS / "hf_llama_tp.yaml")
    for source in (str(ckpt), str(ckpt / "config.json")):
        code, out, err = run_cli(
            capsys, "validate", "--hf-model", source, "--plan", plan, "--mesh", "tp=3",
            "--format", "json",
        )  # fmt: skip
        assert code == 0, out + err
        assert json.loads(out)["model"] == f"hf:{source}"
    # The config's own sizes, not the family's small defaults: 3 kv heads on tp=2.
    code, out, _ = run_cli(capsys, "validate", "--hf-model", str(ckpt), "--mesh", "tp=2")
    assert code == 1 and "num_key_value_heads=3, not divisible" in out, out
    code, out, _ = run_cli(
        capsys, "plan", "--hf-model", str(ckpt), "--mesh", "tp=3", "--format", "json"
    )
    assert code == 0, out
    # The config's 3 layers of hidden 96 (the family's default: 2 of 64), counted by hand:
    # per layer q,o 96x96, k,v 96x48 (3 kv heads of 16), gate/up/down 96x128, 2 norms of 96.
    layer = 2 * 96 * 96 + 2 * 96 * 48 + 3 * 96 * 128 + 2 * 96
    assert json.loads(out)["num_params"] == 3 * layer + 2 * 256 * 96 + 96
    code, _, err = run_cli(capsys, "validate", "--hf-model", str(tmp_path), "--mesh", "tp=2")
    assert code == 2 and "a directory without a config.json" in err, err
    # --hf-config builds this library's model: the transformers paths are pointed at --hf-model.
    code, out, _ = run_cli(
        capsys, "validate", "--hf-config", str(ckpt), "--plan", plan, "--mesh", "tp=3"
    )
    assert code == 1 and f"with --hf-model {ckpt} (instead of --hf-config)" in out, out


def test_plan_and_validate_an_fp32_hugging_face_mixture_of_experts(capsys):
    """transformers runs experts with torch's grouped GEMM, whose meta kernel takes bf16
    only: `plan --hf-model qwen3_moe` with the shipped ep plan failed when traced, and
    validate skipped its boundary analysis; the failing kernel's traceback went to stderr."""
    for family in ("qwen3_moe", "mixtral"):
        plan = str(PLANS / f"hf_{family}_ep.yaml")
        argv = ["--hf-model", family, "--plan", plan, "--mesh", "dp_shard=2,ep=2"]
        code, out, err = run_cli(capsys, "plan", *argv, "--format", "json")
        assert code == 0, out + err
        # Half the experts per rank: their states are counted, and the activations.
        states = json.loads(out)["per_rank_bytes"]
        assert states["experts"]["params"] > 0 and states["activations"] > 0, states
        code, out, err = run_cli(capsys, "validate", *argv)
        assert code == 0 and "boundary analysis skipped" not in out, out
        assert "boundary analysis: one forward pass" in out, out
        assert "Traceback" not in err, err
