"""Presets (the configs they produce), the shipped HF plan files, and HF plan checks.

No process group: plans are checked against meta-device Hugging Face models the
way ``validate`` does (match the patterns, then check every entry).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.dmodule import (
    ShardingConfig,
    colwise,
    load_plan,
    prepare_input,
    replicate_input,
    rowwise,
    sequence_parallel_norm,
    vocab_parallel_embedding,
)
from hyper_parallel.dmodule._checks import check_entries
from hyper_parallel.dmodule.plan import match_plan
from hyper_parallel.dmodule.types import MeshAxisName
from hyper_parallel.hf import HF_FAMILIES, build_hf_model, check_hf_heads, hf_tp_plan

PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"
TP = {"tp": Replicate()}


# --------------------------------------------------------------------------- presets


def test_colwise_defaults():
    c = colwise()
    assert c.state_shardings == {"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}
    assert c.in_src_shardings is None
    assert c.in_dst_shardings == {"input": {"tp": Replicate()}}
    assert c.out_dst_shardings == {"tp": Shard(-1)}
    assert c.use_local_output is False


def test_colwise_options():
    c = colwise(
        axis=MeshAxisName.TP,
        input=Shard(1),
        output=Replicate(),
        use_local_output=True,
        bias=False,
        input_name="hidden_states",
    )
    assert c.state_shardings == {"weight": {MeshAxisName.TP: Shard(0)}}
    # A sequence-sharded input arrives as Shard(1) and is gathered to Replicate.
    assert c.in_src_shardings == {"hidden_states": {"tp": Shard(1)}}
    assert c.in_dst_shardings == {"hidden_states": {"tp": Replicate()}}
    assert c.out_dst_shardings == {"tp": Replicate()}
    assert c.use_local_output is True


def test_transposed_weight_shards_the_other_dim():
    assert colwise(transposed_weight=True).state_shardings["weight"] == {"tp": Shard(1)}
    assert rowwise(transposed_weight=True).state_shardings == {"weight": {"tp": Shard(0)}}


def test_rowwise_defaults_and_sequence_parallel_output():
    r = rowwise()
    assert r.state_shardings == {"weight": {"tp": Shard(1)}}  # bias: replicated implicitly
    assert r.in_src_shardings is None
    assert r.in_dst_shardings == {"input": {"tp": Shard(-1)}}
    assert r.out_dst_shardings == {"tp": Replicate()}
    sp = rowwise(input=Replicate(), output=Shard(1), use_local_output=True, axis="model")
    assert sp.in_src_shardings == {"input": {"model": Replicate()}}
    assert sp.in_dst_shardings == {"input": {"model": Shard(-1)}}
    assert sp.out_dst_shardings == {"model": Shard(1)}
    assert sp.use_local_output


def test_vocab_parallel_embedding():
    e = vocab_parallel_embedding()
    assert e.state_shardings == {"weight": {"tp": Shard(0)}}
    assert e.in_dst_shardings == {"input": {"tp": Replicate()}}
    assert e.out_dst_shardings == {"tp": Replicate()}
    assert vocab_parallel_embedding(output=Shard(1)).out_dst_shardings == {"tp": Shard(1)}


def test_sequence_parallel_norm():
    n = sequence_parallel_norm(input_name="hidden_states")
    assert n.state_shardings == {}
    assert n.in_dst_shardings == {"hidden_states": {"tp": Shard(1)}}
    assert n.out_dst_shardings == {"tp": Shard(1)}


def test_replicate_input_and_prepare_input():
    assert replicate_input().in_dst_shardings == {"input": TP}
    r = replicate_input("x", "mask", use_local_output=True)
    assert r.in_dst_shardings == {"x": TP, "mask": TP} and r.use_local_output
    p = prepare_input(hidden_states=(Shard(1), Replicate()), mask=Replicate())
    assert p.in_src_shardings == {"hidden_states": {"tp": Shard(1)}}
    assert p.in_dst_shardings == {"hidden_states": TP, "mask": TP}
    assert p.out_dst_shardings is None


def test_preset_argument_errors():
    with pytest.raises(TypeError, match=r"colwise\(output=...\).*Placement.*'Shard\(0\)'"):
        colwise(output="Shard(0)")
    with pytest.raises(TypeError, match=r"prepare_input\(x=...\)"):
        prepare_input(x=0)
    with pytest.raises(ValueError, match="name at least one forward argument"):
        prepare_input()
    with pytest.raises(TypeError, match="argument names must be str"):
        replicate_input(Shard(0))


@pytest.mark.parametrize(
    "config",
    [
        colwise(),
        colwise(input=Shard(1), use_local_output=True, bias=False),
        rowwise(output=Shard(1)),
        vocab_parallel_embedding(),
        sequence_parallel_norm(),
        prepare_input(x=(Shard(1), Replicate()), y=Partial()),
    ],
)
def test_presets_round_trip_through_dicts(config):
    assert ShardingConfig.from_dict(config.to_dict()) == config


# --------------------------------------------------------------------------- shipped plans


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shipped_plan_file_is_the_preset_plan(family):
    assert load_plan(PLANS / f"hf_{family}_tp.yaml") == hf_tp_plan(family)


def test_hf_tp_plan_refuses_gpt2_and_unknown_families():
    with pytest.raises(ValueError, match=r"c_attn.*un-fuse"):
        hf_tp_plan("gpt2")
    with pytest.raises(ValueError, match="unknown Hugging Face model family 'bert'"):
        hf_tp_plan("bert")


def _validate(model, plan, tp: int = 2):
    entries, findings = match_plan(model, plan)
    return entries, [*findings, *check_entries(entries, ("tp",), {"tp": tp})]


@pytest.mark.parametrize(
    ("family", "plan_file"),
    [("llama", "hf_llama_tp.yaml"), ("mistral", "hf_llama_tp.yaml"), ("qwen2", "hf_qwen2_tp.yaml")],
)
def test_shipped_plans_validate_on_meta_models(family, plan_file):
    pytest.importorskip("transformers")
    model = build_hf_model(family, device="meta", num_hidden_layers=3)
    entries, findings = _validate(model, load_plan(PLANS / plan_file))
    assert findings == []
    # 3 layers x 7 projections + embedding + lm_head.
    assert len(entries) == 3 * 7 + 2


# --------------------------------------------------------------------------- GPT-2 Conv1D checks


def _gpt2_findings(plan):
    pytest.importorskip("transformers")
    model = build_hf_model("gpt2", device="meta", n_layer=1)
    return _validate(model, plan)[1]


def test_gpt2_fused_qkv_column_sharding_is_refused_with_why_and_what_to_do():
    findings = _gpt2_findings(
        {"transformer.h.*.attn.c_attn": colwise(transposed_weight=True, input_name="x")}
    )
    assert len(findings) == 1
    f = findings[0]
    assert (f.severity, f.path) == ("error", "transformer.h.0.attn.c_attn")
    assert "fused q|k|v" in f.message and "(64, 192)" in f.message and "['tp']" in f.message
    assert "wrong heads" in f.message
    assert "un-fuse" in f.fix and "local_map" in f.fix and "c_fc" in f.fix


def test_gpt2_fused_qkv_bias_only_sharding_is_refused_too():
    plan = {
        "transformer.h.*.attn.c_attn": ShardingConfig(state_shardings={"bias": {"tp": Shard(0)}})
    }
    assert ["fused q|k|v" in f.message for f in _gpt2_findings(plan)] == [True]


def test_gpt2_fused_qkv_row_sharding_is_allowed():
    """Sharding c_attn's *input* features keeps every head whole (partial sums)."""
    plan = {"transformer.h.*.attn.c_attn": rowwise(transposed_weight=True, input_name="x")}
    assert _gpt2_findings(plan) == []


def test_linear_colwise_on_conv1d_is_refused():
    findings = _gpt2_findings({"transformer.h.*.mlp.c_fc": colwise()})
    messages = [f.message for f in findings]
    assert any("transposed from nn.Linear" in m for m in messages), messages
    assert any("colwise(transposed_weight=True, input_name='x')" in f.fix for f in findings)
    # Conv1D.forward(x): the 'input' key is reported as well, with the real name.
    assert any("'input'" in m and "Conv1D.forward" in m for m in messages), messages


# --------------------------------------------------------------------------- build_hf_model


def test_build_hf_model_on_meta_and_deterministic():
    pytest.importorskip("transformers")
    meta = build_hf_model("llama", device="meta", hidden_size=4096, intermediate_size=11008)
    assert meta.model.embed_tokens.weight.is_meta
    assert tuple(meta.model.layers[0].mlp.up_proj.weight.shape) == (11008, 4096)
    state = torch.random.get_rng_state()
    a, b = build_hf_model("qwen2"), build_hf_model("qwen2")
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG is untouched"
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.config._attn_implementation == "eager"
    assert build_hf_model("mistral", attn_implementation="sdpa").config._attn_implementation == (
        "sdpa"
    )


def test_build_hf_model_families_and_errors(monkeypatch):
    assert set(HF_FAMILIES) >= {"llama", "qwen2", "mistral", "gpt2"}
    with pytest.raises(ValueError, match=r"unknown Hugging Face model family 'llma'.*llama"):
        build_hf_model("llma")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs Hugging Face transformers.*\[test\]"):
        build_hf_model("llama", device="meta")


def test_check_hf_heads_needs_whole_heads_per_rank():
    pytest.importorskip("transformers")
    model = build_hf_model("llama", device="meta")  # 8 query heads, 4 kv heads
    assert check_hf_heads(model, 2) == [] and check_hf_heads(model, 4) == []
    (finding,) = check_hf_heads(model, 8)
    assert finding.severity == "error" and finding.field == "config.num_key_value_heads"
    assert "num_key_value_heads=4, not divisible by the 'tp' axis size 8" in finding.message
    assert len(check_hf_heads(build_hf_model("gpt2", device="meta"), 3)) == 1  # n_head=4
