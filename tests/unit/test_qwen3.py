"""Qwen3 dense: parameter counts and logits against transformers' Qwen3ForCausalLM."""

from __future__ import annotations

import pytest
import torch
import transformers

from hyper_parallel.dmodule import get_spec
from hyper_parallel.models.qwen3 import PRESETS, apply_cp, apply_tp, preset_config, qwen3_config


def _hf_config(**shape: int | bool) -> transformers.Qwen3Config:
    """The transformers config of our hyperparameters (published names)."""
    return transformers.Qwen3Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["dim"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["ffn_dim"],
        tie_word_embeddings=bool(shape.get("tie_embeddings", False)),
        max_position_embeddings=shape.get("max_seq_len", 40960),
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    )


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied tensor once


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_counts_equal_transformers_meta_build(name: str) -> None:
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(_hf_config(**PRESETS[name]))
        ours = preset_config(name).build()
    expected = _count(hf)
    spec = get_spec(name)
    assert spec.family.num_params(spec.config()) == expected
    assert _count(ours) == expected
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied == (name == "qwen3-0.6b")
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied


def _interleave_rotary(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF rotates dim ``j`` with ``j + head_dim/2``; ours rotates ``2i`` with ``2i+1``:
    reorder each head's rows (or a per-head norm's scale) from halves to pairs."""
    rest = weight.shape[1:]
    per_head = weight.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2)
    return per_head.reshape(weight.shape)


def _copy_from_hf(ours: torch.nn.Module, hf: transformers.Qwen3ForCausalLM, head_dim: int) -> None:
    """Load transformers' weights into our model (names and the rotary layout mapped)."""
    src = hf.state_dict()
    mapping = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    parts = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "attention.q_norm": "self_attn.q_norm",
        "attention.k_norm": "self_attn.k_norm",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w2": "mlp.down_proj",
        "feed_forward.w3": "mlp.up_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i in range(len(ours.layers)):
        for mine, theirs in parts.items():
            mapping[f"layers.{i}.{mine}.weight"] = f"model.layers.{i}.{theirs}.weight"
    state = {}
    for name in ours.state_dict():
        value = src[mapping[name]]
        if any(k in name for k in ("wq.", "wk.", "q_norm.", "k_norm.")):
            value = _interleave_rotary(value, head_dim)
        state[name] = value
    ours.load_state_dict(state, strict=True)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers_with_copied_weights(tied: bool) -> None:
    shape = dict(
        vocab_size=96,
        dim=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_dim=80,
        tie_embeddings=tied,
        max_seq_len=64,
    )  # fmt: skip  (head_dim 16 != 48 / 4)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(_hf_config(**shape)).eval()
    with torch.no_grad():  # non-trivial norm scales, so a wrong norm layout shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = qwen3_config(**shape).build()
    ours.init_states()
    _copy_from_hf(ours, hf, head_dim=16)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        for logits in (ours(tokens), ours(tokens, positions=torch.arange(24))):
            assert torch.isfinite(logits).all()
            assert (logits - expected).abs().max().item() < 1e-5
    assert expected.abs().max().item() > 1e-2  # a reference large enough to compare


def test_shardings_compose_and_ep_is_refused_by_name() -> None:
    spec = get_spec("qwen3-debug")
    config = apply_cp(apply_tp(spec.config(), tp_size=2), cp_size=2)
    axes = {
        str(getattr(a, "value", a))
        for c in (config.layers[0].attention.q_norm, config.layers[0].feed_forward.w1)
        for a in c.sharding_config.state_shardings["weight"]
    }
    assert axes == {"tp", "cp"}
    with pytest.raises(ValueError, match=r"model 'qwen3-debug' does not support ep \(Qwen3 dense"):
        spec.sharding("ep")
    # Fewer key/value heads than ranks: keys and values repeated per query head.
    assert apply_tp(spec.config(), tp_size=8).layers[0].attention.repeat_kv
    with pytest.raises(ValueError, match="8 query heads cannot be split over tp_size=3"):
        apply_tp(spec.config(), tp_size=3)


def test_tied_embeddings_stay_tied_when_materialized_from_meta() -> None:
    small = dict(vocab_size=256, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    with torch.device("meta"):
        model = preset_config("qwen3-0.6b", **small, ffn_dim=32).build()
    model.to_empty(device="cpu")  # a new tensor per module: the model ties them again
    assert model.output.weight is model.tok_embeddings.weight
    model.init_states()
    assert len(list(model.parameters())) == len(model.state_dict()) - 1


def test_tied_embeddings_are_refused_across_pipeline_stages() -> None:
    from hyper_parallel.train import TrainConfig
    from hyper_parallel.train.trainer import check_config

    overrides = {"num_layers": 2}
    tied = check_config(TrainConfig(model="qwen3-0.6b", mesh={"pp": 2}, model_overrides=overrides))
    assert [(f.path, f.field) for f in tied] == [("tok_embeddings", "split")]
    assert "output.weight (stage 1) are one tied tensor" in tied[0].message
    assert (
        check_config(TrainConfig(model="qwen3-8b", mesh={"pp": 2}, model_overrides=overrides)) == []
    )


def test_plan_counts_a_tied_embedding_once_under_cp(capsys) -> None:
    """FSDP2 gives the tied DTensor of cp's plan one parameter per module; the trainer's
    model ties them again when materialized, and the dry run must too: cp counts the
    parameters and their bytes as dp_shard does (it counted the output projection twice)."""
    import json

    from hyper_parallel.cli import main

    reports = {}
    for mesh in ("cp=2", "dp_shard=2"):
        argv = ["plan", "--model", "qwen3-debug", "--mesh", mesh, "--seq", "256"]
        assert (
            main([*argv, "--model-overrides", '{"tie_embeddings": true}', "--format", "json"]) == 0
        )
        reports[mesh] = json.loads(capsys.readouterr().out)
    cp, dp = reports["cp=2"], reports["dp_shard=2"]
    untied = get_spec("qwen3-debug").config()
    vocab, dim = untied.tok_embeddings.num_embeddings, untied.tok_embeddings.embedding_dim
    assert cp["num_params"] == dp["num_params"]
    assert cp["num_params"] == get_spec("qwen3-debug").family.num_params(untied) - vocab * dim
    assert cp["per_rank_bytes"]["params"] == dp["per_rank_bytes"]["params"]
