"""Llama 3.1: the presets (counts as transformers builds them), the ``llama3`` rope scaling
(frequencies and tables against transformers'), and sequences against the positions a
model's rope takes (refused past them, with the fix, by every entry point)."""

from __future__ import annotations

import json

import pytest
import torch

from hyper_parallel.cli import main
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.models.llama import LLAMA31_ROPE_SCALING, PRESETS, Llama3RotaryEmbedding

LLAMA31 = ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b")


def _hf_config(name: str, **extra):
    transformers = pytest.importorskip("transformers")
    shape = PRESETS[name]
    rope = shape.get("rope_scaling")
    return transformers.LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["dim"],
        intermediate_size=shape["ffn_dim"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape.get("max_seq_len", 8192),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=None if rope is None else {"rope_type": "llama3", **rope},
        tie_word_embeddings=False,
        **extra,
    )


@pytest.mark.parametrize("name", LLAMA31)
def test_llama31_counts_equal_transformers_on_meta(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(_hf_config(name))
    expected = sum(p.numel() for p in hf.parameters())
    spec = get_spec(name)
    config = spec.config()
    assert spec.family.num_params(config) == expected
    with torch.device("meta"):  # and the model we build holds that many
        model = spec.config(num_layers=1).build()
    per_layer = sum(p.numel() for p in model.layers.parameters())
    rest = sum(p.numel() for p in model.parameters()) - per_layer
    assert rest + per_layer * PRESETS[name]["num_layers"] == expected


def test_llama31_presets_are_llama3_shapes_with_the_scaled_rope() -> None:
    for name in LLAMA31:
        rope = get_spec(name).config().rope
        base = get_spec(name.replace("3.1", "3")).config().rope
        assert isinstance(rope, Llama3RotaryEmbedding.Config)
        assert not isinstance(base, Llama3RotaryEmbedding.Config)
        assert (rope.max_seq_len, base.max_seq_len) == (131072, 8192)
        assert (rope.theta, rope.head_dim) == (500000.0, 128)
        assert (rope.factor, rope.low_freq_factor, rope.high_freq_factor) == (8.0, 1.0, 4.0)
        assert rope.original_max_position_embeddings == 8192
    assert LLAMA31_ROPE_SCALING["original_max_position_embeddings"] == 8192


def test_llama3_rope_frequencies_and_tables_equal_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = _hf_config("llama3.1-8b")
    hf_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert attention_scaling == 1.0
    rope_config = get_spec("llama3.1-8b").config(max_seq_len=16384).rope
    rope = Llama3RotaryEmbedding(rope_config)
    ours = rope.inv_freq("cpu")
    # Long wavelengths are divided by 8, short ones kept, the band between blended: a
    # test of the scaling itself, not of a plain table.
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    assert (ours < plain).any() and (ours == plain).any()
    assert torch.equal(ours[-1], plain[-1] / 8)
    torch.testing.assert_close(ours, hf_freq.float(), rtol=0, atol=0)
    # The tables the model reads, against transformers' rotary embedding at far positions.
    rope.init_states()
    positions = torch.tensor([[0, 1, 8191, 8192, 16383]])
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2  # transformers repeats the angles over both halves
    torch.testing.assert_close(rope.cos[positions[0]], cos[0, :, :half], rtol=0, atol=1e-5)
    torch.testing.assert_close(rope.sin[positions[0]], sin[0, :, :half], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- positions


def _errors(model: str, seq_len: int, **kw) -> list:
    run = RunPlan.for_model(model, {"dp_shard": 8}, seq_len=seq_len, **kw)
    return [f for f in run.errors if f.field == "max_seq_len"]


def test_a_sequence_follows_seq_up_to_the_ropes_positions() -> None:
    assert _errors("llama3.1-8b", 32768) == []
    assert _errors("llama3.1-8b", 131072) == []
    assert _errors("llama3-8b", 8192) == []
    # Llama 3's rope was trained on 8,192 positions: the fix names Llama 3.1 and the override.
    (found,) = _errors("llama3-8b", 32768)
    assert "seq_len 32,768 exceeds llama3-8b's 8,192 positions" in found.message
    assert "use llama3.1-8b (131,072 positions)" in found.fix
    assert "--model-overrides '{\"max_seq_len\": 32768}'" in found.fix
    assert _errors("llama3-8b", 32768, model_overrides={"max_seq_len": 32768}) == []
    (found,) = _errors("llama3.1-8b", 200000)
    assert "exceeds llama3.1-8b's 131,072 positions" in found.message
    assert found.fix.startswith("shorten the sequence")  # no longer model to point at
    # Under cp too, once (not also as context parallelism's own finding).
    run = RunPlan.for_model("llama3-8b", {"cp": 8}, seq_len=32768)
    assert len([f for f in run.errors if f.field == "max_seq_len"]) == 1


def test_every_entry_point_refuses_a_sequence_past_the_positions(capsys) -> None:
    from hyper_parallel.train.trainer import TrainConfig, check_config

    code = main(["plan", "--model", "llama3-8b", "--mesh", "dp_shard=8", "--seq", "32768"])
    _, err = capsys.readouterr()
    assert code == 1 and "use llama3.1-8b (131,072 positions)" in err
    code = main(["validate", "--model", "llama3-8b", "--mesh", "dp_shard=8", "--seq", "32768"])
    out, _ = capsys.readouterr()
    assert code == 1 and "max_seq_len" in out and "llama3.1-8b" in out
    problems = check_config(TrainConfig(model="llama3-debug", seq_len=1024), 1)
    assert any("exceeds llama3-debug's 512 positions" in str(p) for p in problems)


def test_plan_takes_llama31_at_32k(capsys) -> None:
    code = main(
        ["plan", "--model", "llama3.1-8b", "--mesh", "dp_shard=8", "--seq", "32768",
         "--dtype", "bf16", "--ac", "full", "--format", "json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["num_params"] == 8030261248
    # bf16 is mixed precision: 4 bytes per local parameter element, 8B / 8 ranks.
    assert report["per_rank_bytes"]["params"] == pytest.approx(4 * 8030261248 / 8, rel=1e-3)


@pytest.mark.parametrize("name", ["llama3-debug", "qwen3-debug"])
def test_a_model_built_on_a_device_has_its_rotary_tables_after_build_and_after_a_load(
    name: str,
) -> None:
    """The rotary tables are never in a state dict; they were torch.empty until
    init_states, so a model built on the CPU and given a state dict (load_state_dict, the
    torch way) gave NaN logits with no error. Computed at build and again after a load; a
    meta build keeps them on meta (init_states after to_empty computes them there)."""
    torch.manual_seed(0)
    trained = get_spec(name).build()
    trained.init_states()
    tokens = torch.randint(0, 256, (1, 8))
    want = trained(tokens)
    built = get_spec(name).build()
    assert torch.equal(built.rope.cos, trained.rope.cos)  # at build, before any init
    built.rope.cos.fill_(float("nan"))
    built.rope.sin.fill_(float("nan"))
    built.load_state_dict(trained.state_dict())
    assert torch.equal(built(tokens), want)
    with torch.device("meta"):
        meta = get_spec("llama3.1-8b").build()
    assert meta.rope.cos.device.type == "meta"
    # The Llama 3.1 scaled tables: computed at build as init_states computes them.
    scaled = get_spec("llama3.1-8b").config(max_seq_len=1024).rope.build()
    assert isinstance(scaled, Llama3RotaryEmbedding)
    at_build = scaled.cos.clone()
    scaled.init_states()
    assert torch.equal(at_build, scaled.cos)
