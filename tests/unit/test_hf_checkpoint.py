"""Hugging Face checkpoints in one process: config conversion, mapping, load/save, errors,
export-hf, generate.

Checkpoints are written by ``transformers``' ``save_pretrained`` from tiny random
configs (several safetensors files); the distributed meshes are in
``tests/distributed/test_hf_checkpoint*.py``.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hyper_parallel.checkpoint_hf import (
    HFCheckpointError,
    HFConfigError,
    checkpoint_files,
    load_hf,
    read_hf_config,
    save_hf,
)
from hyper_parallel.checkpoint_hf.mapping import family_maps, rotary_rows, to_hf_tensors
from tests.distributed.hf_checks import assert_same_checkpoint, hf_model, write_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("moe")))


def _loaded(path):
    cfg = read_hf_config(path)
    model = cfg.model_config().build()
    model.init_states()
    load_hf(model, path)
    return cfg, model


# ---------------------------------------------------------------------- config


def test_llama3_config_with_rope_scaling_maps_to_our_model():
    raw = hf_model("llama").config.to_dict()
    cfg = read_hf_config(raw)
    assert cfg.spec == "llama3-hf" and cfg.family == "llama3"
    o = cfg.model_overrides
    assert (o["dim"], o["num_heads"], o["num_kv_heads"], o["ffn_dim"]) == (64, 8, 4, 96)
    assert o["rope_scaling"]["factor"] == 8.0
    from hyper_parallel.models.llama.rope import Llama3RotaryEmbedding

    rope = cfg.model_config().rope
    assert isinstance(rope, Llama3RotaryEmbedding.Config) and rope.factor == 8.0


def test_older_config_fields_rope_theta_and_rope_scaling_are_read():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }
    assert read_hf_config(raw).model_overrides["rope_theta"] == 500000.0


def test_mistral_without_sliding_window_is_a_llama():
    config = transformers.MistralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=None,
    )  # fmt: skip
    raw = {**config.to_dict(), "architectures": ["MistralForCausalLM"]}
    assert read_hf_config(raw).family == "llama3"
    with pytest.raises(HFConfigError, match=r"sliding_window=4096: null"):
        read_hf_config({**raw, "sliding_window": 4096})


@pytest.mark.parametrize(
    ("family", "change", "expect"),
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 'rope_type="yarn"'),
        ("llama", {"attention_bias": True}, "attention_bias=true: false"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act=\"gelu\": 'silu'"),
        ("llama", {"head_dim": 16}, "head_dim=16"),
        ("llama", {"some_new_field": 3}, "some_new_field=3: not a field"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
        ("qwen3", {"attention_bias": True}, "attention_bias=true"),
        ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=false: true"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
    ],
)
def test_unsupported_fields_are_refused_with_field_value_and_what_is_supported(
    family, change, expect
):
    raw = {**hf_model(family).config.to_dict(), **change}
    with pytest.raises(HFConfigError) as info:
        read_hf_config(raw)
    assert expect in str(info.value)


def test_every_problem_is_listed_at_once_and_unknown_architectures_refused():
    raw = {**hf_model("llama").config.to_dict(), "attention_bias": True, "mlp_bias": True}
    with pytest.raises(HFConfigError) as info:
        read_hf_config(raw)
    assert len(info.value.problems) == 2
    with pytest.raises(HFConfigError, match="architectures"):
        read_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_our_config_round_trips_through_config_json():
    from hyper_parallel.checkpoint_hf import hf_config_from_model
    from hyper_parallel.dmodule import get_spec

    for name in ("llama3-debug", "qwen3-debug", "qwen3-0.6b", "qwen3-moe-debug"):
        ours = get_spec(name).config()
        back = read_hf_config(hf_config_from_model(ours))
        rebuilt = back.model_config()
        with torch.device("meta"):
            a = {n: tuple(p.shape) for n, p in ours.build().named_parameters()}
            b = {n: tuple(p.shape) for n, p in rebuilt.build().named_parameters()}
        assert a == b, name
        assert getattr(rebuilt, "tie_embeddings", False) == getattr(ours, "tie_embeddings", False)


# ---------------------------------------------------------------------- mapping


def test_rotary_rows_is_a_permutation_within_each_head():
    rows = rotary_rows(torch.arange(16), 8)
    assert sorted(rows.tolist()) == list(range(16))
    assert rows[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_mapping_is_reversible_and_covers_every_parameter(moe_dir):
    cfg = read_hf_config(moe_dir)
    config = cfg.model_config()
    maps = family_maps(cfg.family, config)
    params = dict(config.build().named_parameters())
    assert {m.ours for m in maps} == set(params)
    for m in maps:
        full = torch.randn(params[m.ours].shape)
        tensors = to_hf_tensors(m, full)
        # Loading reads our rows from the Hugging Face rows the mapping names.
        pieces = [tensors[name] for name in m.hf]
        back = torch.stack([p[m.hf_rows(torch.arange(p.shape[0]))] for p in pieces])
        assert torch.equal(back if m.stacked else back[0], full), m.ours


# ---------------------------------------------------------------------- load / save


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-tied", "qwen3_moe"])
def test_load_equals_transformers_and_save_is_bitwise(family, llama_dir, moe_dir, tmp_path):
    if family.startswith("qwen3") and family != "qwen3_moe":
        tied = family.endswith("tied")
        path = write_checkpoint("qwen3", str(tmp_path / "in"), tie_word_embeddings=tied)
        # Our Qwen3 ties natively: one parameter, as in transformers.
        assert read_hf_config(path).model_overrides["tie_embeddings"] is tied
    else:
        path = llama_dir if family == "llama" else moe_dir
    cfg, model = _loaded(path)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        diff = (model(tokens) - reference(tokens).logits).abs().max().item()
    assert diff <= 1e-5
    save_hf(model, tmp_path / "out", hf_config=cfg, max_shard_size="60KB")
    assert_same_checkpoint(path, str(tmp_path / "out"))


@pytest.mark.parametrize("head_dim", [0, 4])
def test_shards_in_pieces_are_copied_straight_or_picked_alike(head_dim):
    # A shard in several runs of rows and columns (uneven, strided, rotary heads out of
    # order) is copied block by block from the file's slice, or through index_select
    # when in too many pieces: both give the rows of the full tensor they stand for.
    from hyper_parallel.checkpoint_hf import io
    from hyper_parallel.checkpoint_hf.mapping import TensorMap

    full = torch.randn(16, 10)
    rows = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]) if head_dim else torch.tensor([0, 1, 2, 7, 9])
    cols = torch.tensor([1, 2, 3, 6, 7])
    tensor_map = TensorMap("w", ("w",), head_dim)
    expected = full[tensor_map.hf_rows(rows)][:, cols]
    for copy in (io._copy_blocks, io._copy_picked):
        target = torch.zeros(len(rows), len(cols))
        job = io._Job("w", target, [rows, cols], [io._runs(rows), io._runs(cols)], tensor_map)
        nbytes = copy(full, job, 4)
        assert torch.equal(target, expected), copy
        assert nbytes == 12 * 7 * 4 if head_dim else 10 * 7 * 4
    # Rotary rows not in whole heads, or more pieces than blocks allowed: picked instead.
    if head_dim:
        rows = torch.tensor([1, 2, 3, 4])
    else:
        rows = torch.arange(0, 2 * (io._MAX_BLOCKS + 1), 2)  # MAX_BLOCKS + 1 runs
        full = torch.randn(2 * (io._MAX_BLOCKS + 1), 10)
    job = io._Job("w", torch.zeros(len(rows), 10), [rows, torch.arange(10)], [], tensor_map)
    job.runs = [io._runs(idx) for idx in job.index]
    assert io._copy_blocks(full, job, 4) is None


def test_the_rotary_permutation_is_needed(llama_dir):
    # Reading q/k rows in Hugging Face's order (no permutation) changes the logits.
    from safetensors import safe_open

    _, model = _loaded(llama_dir)
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        right = model(tokens)
        files = checkpoint_files(llama_dir)
        for i in range(2):
            name = f"model.layers.{i}.self_attn.q_proj.weight"
            with safe_open(files[name], framework="pt") as f:
                model.layers[i].attention.wq.weight.copy_(f.get_tensor(name))
        wrong = model(tokens)
    assert (right - wrong).abs().max().item() > 1e-3


def test_shard_sizes_are_transformers_units_and_a_bad_one_writes_nothing(tmp_path, capsys):
    from hyper_parallel.checkpoint_hf.io import parse_size
    from hyper_parallel.cli import main

    assert [parse_size(x) for x in ("5GB", "2GiB", " 500mb ", 123, "1.5KB", "77", "3MiB")] == [
        5 * 10**9, 2 * 2**30, 500 * 10**6, 123, 1500, 77, 3 * 2**20,
    ]  # fmt: skip
    for bad in ("10XB", "0", "-5MB", "", "GB", "nan"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    path = write_checkpoint("llama", str(tmp_path / "src"))
    cfg, model = _loaded(path)
    with pytest.raises(ValueError, match="give a size such as 5GB"):
        save_hf(model, tmp_path / "out", hf_config=cfg, max_shard_size="10XB")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # The command refuses it as argparse does, before reading the checkpoint.
    with pytest.raises(SystemExit) as e:
        main(["export-hf", str(tmp_path / "nothing"), str(tmp_path / "o"), "--max-shard-size", "0"])
    assert e.value.code == 2 and "a file holds at least one byte" in capsys.readouterr().err


def test_tied_embeddings_load_and_save_back_tied(tmp_path):
    path = write_checkpoint("llama", str(tmp_path / "tied"), tie_word_embeddings=True)
    assert "lm_head.weight" not in checkpoint_files(path)
    cfg, model = _loaded(path)
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    save_hf(model, tmp_path / "out", hf_config=cfg, max_shard_size="60KB")
    assert "lm_head.weight" not in checkpoint_files(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]
    # Trained apart: saved untied, with the output projection.
    with torch.no_grad():
        model.output.weight.add_(1.0)
    save_hf(model, tmp_path / "out2", hf_config=cfg, max_shard_size="60KB")
    assert "lm_head.weight" in checkpoint_files(tmp_path / "out2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out2")
    assert torch.equal(loaded.lm_head.weight, model.output.weight)


def test_missing_unexpected_and_misshapen_tensors_are_one_error_and_nothing_is_loaded(
    llama_dir, tmp_path
):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    files = checkpoint_files(broken)
    target = files["model.norm.weight"]
    tensors = load_file(target)
    tensors.pop("model.norm.weight")  # missing
    tensors["model.extra.weight"] = torch.zeros(3)  # unexpected
    save_file(tensors, target)
    wrong = files["model.layers.0.mlp.up_proj.weight"]
    tensors = load_file(wrong)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 64)  # wrong shape
    save_file(tensors, wrong)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = os.path.basename(target)
    del index["weight_map"]["model.norm.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))

    cfg = read_hf_config(broken)
    model = cfg.model_config().build()
    model.init_states()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(HFCheckpointError) as info:
        load_hf(model, broken)
    text = str(info.value)
    assert "missing tensor model.norm.weight" in text
    assert "unexpected tensor model.extra.weight" in text
    assert "model.layers.0.mlp.up_proj.weight: shape (5, 64), expected (96, 64)" in text
    assert len(info.value.problems) == 3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_model_of_another_config_is_refused(llama_dir):
    from hyper_parallel.dmodule import get_spec

    model = get_spec("llama3-debug").build()
    with pytest.raises(HFCheckpointError, match="shape"):
        load_hf(model, llama_dir)


def test_single_file_checkpoint_and_fp16(tmp_path):
    model = hf_model("qwen3_moe").to(torch.float16)
    model.save_pretrained(tmp_path / "one")  # one model.safetensors
    cfg, ours = _loaded(tmp_path / "one")
    # Saved back in the checkpoint's dtype: bitwise (fp16 values are exact in fp32).
    save_hf(ours, tmp_path / "out", hf_config=cfg, max_shard_size="60KB")
    assert_same_checkpoint(str(tmp_path / "one"), str(tmp_path / "out"))
    assert ours.layers[0].moe.experts.w1.dtype == torch.float32
    expected = model.model.layers[0].mlp.experts.gate_up_proj.float()  # (E, 2h, d) gate first
    assert torch.equal(ours.layers[0].moe.experts.w1, expected[:, :32])


def test_config_states_the_dtype_written(llama_dir, tmp_path):
    """bf16 parameters (bf16-true) from an fp32 checkpoint: config.json says bfloat16, so
    ``from_pretrained(dtype="auto")`` loads what the files hold; mixed dtypes write fp32."""
    from safetensors import safe_open

    cfg, model = _loaded(llama_dir)  # the checkpoint says float32
    assert cfg.raw.get("dtype", cfg.raw.get("torch_dtype")) == "float32"
    model.to(torch.bfloat16)
    save_hf(model, tmp_path / "bf16", hf_config=cfg)
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    for tensor, file in checkpoint_files(tmp_path / "bf16").items():
        with safe_open(file, "pt") as f:
            assert f.get_slice(tensor).get_dtype() == "BF16", tensor
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.norm.weight, model.norm.weight)

    model.norm.float()  # one parameter fp32: everything written as fp32, exactly
    save_hf(model, tmp_path / "mixed", model_config=cfg.model_config())
    assert json.loads((tmp_path / "mixed" / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mixed", dtype="auto")
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, model.output.weight.float())


# ---------------------------------------------------------------------- generate


def test_generate_greedy_equals_transformers(moe_dir, llama_dir, tmp_path):
    from hyper_parallel.hf_commands.generate import generate

    qwen3 = write_checkpoint("qwen3", str(tmp_path / "qwen3"))
    for path in (llama_dir, qwen3, moe_dir):
        _, model = _loaded(path)
        reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        prompt = [5, 17, 33, 9]
        theirs = reference.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert generate(model, prompt, 12) == theirs
        sampled = generate(model, prompt, 12, temperature=0.8, top_k=5, seed=3)
        assert sampled == generate(model, prompt, 12, temperature=0.8, top_k=5, seed=3)


def test_top_k_and_top_p_keep_the_tokens_transformers_keeps():
    """The filter against transformers' own warpers (temperature, then top-k, then
    top-p), on random logits: the same tokens left to sample, the rest -inf."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from hyper_parallel.hf_commands.generate import filter_logits

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(97, generator=gen) * (0.5 + trial / 10)
        for top_k, top_p, temperature in ((None, 0.9, 0.8), (5, None, 1.0), (20, 0.5, 1.3),
                                          (None, 0.05, 0.7), (None, 1.0, 1.0), (1, 0.9, 1.0)):  # fmt: skip
            theirs = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
            if top_k is not None:
                theirs = TopKLogitsWarper(top_k)(None, theirs)
            if top_p is not None:
                theirs = TopPLogitsWarper(top_p)(None, theirs)
            ours = filter_logits(logits / temperature, top_k, top_p)
            kept = torch.isfinite(ours)
            assert torch.equal(kept, torch.isfinite(theirs[0])), (trial, top_k, top_p)
            assert torch.allclose(ours[kept], theirs[0][kept])
            assert kept.sum() >= 1
    # By hand: probabilities 0.5, 0.3, 0.15, 0.05: the nucleus of 0.8 is the first two
    # (0.5 + 0.3 reaches it), of 0.81 the first three.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.isfinite(filter_logits(logits, None, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, None, 0.81)).sum() == 3


def test_generate_refuses_sampling_settings_out_of_range(llama_dir):
    from hyper_parallel.hf_commands.generate import generate

    _, model = _loaded(llama_dir)
    for kwargs, message in (
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        # NaN passed `< 0` and crashed in torch.multinomial on NaN probabilities.
        ({"temperature": float("nan")}, "temperature=nan; give 0"),
        ({"temperature": 1.0, "top_k": 0}, "top_k=0"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p=0.0; give a share in \(0, 1\]"),
        ({"top_p": 0.9}, "temperature 0 picks the most likely token"),
    ):
        args = {"max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=message):
            generate(model, [5, 17], **args)
    sampled = generate(model, [5, 17], 6, temperature=0.9, top_p=0.5, seed=1)
    assert len(sampled) == 6 and sampled == generate(
        model, [5, 17], 6, temperature=0.9, top_p=0.5, seed=1
    )
    # A nucleus this small is the most likely token alone: greedy.
    assert generate(model, [5, 17], 6, temperature=0.9, top_p=1e-6) == generate(model, [5, 17], 6)


def test_generate_stops_at_eos(llama_dir):
    from hyper_parallel.hf_commands.generate import generate

    _, model = _loaded(llama_dir)
    first = generate(model, [5, 17], 1)[0]
    assert generate(model, [5, 17], 8, eos_token_ids=[first]) == [first]


def _cli_generate(capsys, *source, n=8):
    from hyper_parallel.cli import main

    argv = ["generate", *source, "--prompt", "First Citizen:", "--max-new-tokens", str(n)]
    assert main([*argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)["ids"]


def _transformers_generate(path, n=8):
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = list(b"First Citizen:")  # a 256-token model: bytes
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _edit_json(path, **fields):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(fields)
    data = {k: v for k, v in data.items() if v is not None}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def test_generate_stops_where_transformers_does_by_generation_config(tmp_path, capsys):
    """generation_config.json's eos_token_id, when the checkpoint has one, is where
    transformers' generate stops, whatever config.json says (Llama-3-Instruct: 128001
    there, [128001, 128009] here); without one, config.json's."""
    path = write_checkpoint("qwen3", str(tmp_path / "q"), vocab_size=256)  # eos 2
    free = _transformers_generate(path)
    assert _cli_generate(capsys, "--hf-checkpoint", path) == free and len(free) == 8
    stop = free[3]
    assert stop != 2 and stop not in free[:3] and 0 not in free
    # Stops at a token of generation_config.json's list that config.json does not name.
    _edit_json(os.path.join(path, "generation_config.json"), eos_token_id=[0, stop])
    theirs = _transformers_generate(path)
    assert theirs == free[:4]
    assert _cli_generate(capsys, "--hf-checkpoint", path) == theirs
    # A generation_config.json without one stops nowhere, even at config.json's.
    _edit_json(os.path.join(path, "config.json"), eos_token_id=stop)
    _edit_json(os.path.join(path, "generation_config.json"), eos_token_id=None)
    assert _transformers_generate(path) == free
    assert _cli_generate(capsys, "--hf-checkpoint", path) == free
    # No generation_config.json: config.json's.
    os.remove(os.path.join(path, "generation_config.json"))
    assert _transformers_generate(path) == free[:4]
    assert _cli_generate(capsys, "--hf-checkpoint", path) == free[:4]


def test_generate_on_a_trainer_checkpoint_stops_as_on_its_export(tmp_path, capsys):
    """A run from a checkpoint with a generation_config.json records it: ``generate
    --checkpoint`` stops where transformers' generate on the export does, and the
    export (written after the source folder is gone) carries it."""
    from hyper_parallel.cli import main
    from hyper_parallel.train.run import main as run

    source = write_checkpoint("qwen3", str(tmp_path / "q"), vocab_size=256)  # eos 2
    # Every id but config.json's stops generation: the first token, unless it is 2.
    stops = [i for i in range(256) if i != 2]
    _edit_json(os.path.join(source, "generation_config.json"), eos_token_id=stops)
    ckpt = str(tmp_path / "ckpt")
    argv = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    argv += ["--log-every", "0", "--hf-checkpoint", source, "--checkpoint-dir", ckpt]
    assert run(argv) == 0
    shutil.rmtree(source)
    ours = _cli_generate(capsys, "--checkpoint", ckpt)
    assert main(["export-hf", ckpt, str(tmp_path / "out")]) == 0
    capsys.readouterr()
    theirs = _transformers_generate(str(tmp_path / "out"))
    assert ours == theirs and len(ours) == 1 and ours[0] != 2


# ---------------------------------------------------------------------- export-hf


@pytest.mark.parametrize("model", ["llama3-debug", "qwen3-debug", "qwen3-moe-debug"])
def test_export_hf_of_our_own_preset_loads_in_transformers_with_equal_logits(model, tmp_path):
    from hyper_parallel.cli import main
    from hyper_parallel.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model=model, model_overrides={"num_layers": 1}, steps=1, log_every=0,
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"), batch_size=2, seq_len=16,
    )  # fmt: skip
    trainer = Trainer(cfg, device="cpu")
    trainer.fit()
    out = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "ckpt"), str(out)]) == 0
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (trainer.model(tokens) - reference.eval()(tokens).logits).abs().max().item()
    assert diff <= 1e-5


def test_export_hf_without_a_model_record_asks_for_the_model(tmp_path, capsys):
    from hyper_parallel.cli import main
    from hyper_parallel.train import TrainConfig, Trainer, save_checkpoint

    trainer = Trainer(TrainConfig(steps=1, log_every=0, progress=False), device="cpu")
    save_checkpoint(tmp_path / "step_000001", model=trainer.model)  # no train record
    assert main(["export-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "pass --model NAME" in capsys.readouterr().err
    args = ["export-hf", str(tmp_path), str(tmp_path / "out"), "--model", "llama3-debug"]
    assert main([*args, "--dtype", "bf16"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    (name,) = {f for f in checkpoint_files(tmp_path / "out").values()}
    from safetensors import safe_open

    with safe_open(name, "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
