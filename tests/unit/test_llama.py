"""The reference Llama: presets and parameter counts, the maths, configs, registry, loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.dmodule import ModelSpec, Module, get_spec, list_specs
from hyper_parallel.models.llama import (
    PRESETS,
    ScaledDotProductAttention,
    Transformer,
    apply_rotary_emb,
    apply_tp,
    apply_tp_sp,
    cross_entropy_loss,
    llama3_config,
    num_params,
    preset_config,
)

# Published totals (untied output projection): Llama 3 8B "8.03B", 70B "70.6B", 405B "405B".
EXPECTED_PARAMS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


def _debug_model(seed: int = 0, **overrides) -> Transformer:
    model = preset_config("llama3-debug", **overrides).build()
    torch.manual_seed(seed)
    model.init_states()
    return model


def _tokens(batch: int = 2, seq_len: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_num_params_of_published_presets(name):
    assert num_params(preset_config(name)) == EXPECTED_PARAMS[name]


def test_70b_on_meta_device_counts_exactly():
    with torch.device("meta"):
        model = preset_config("llama3-70b").build()
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496
    assert all(p.device.type == "meta" for p in model.parameters())


def test_num_params_matches_a_built_model():
    config = preset_config("llama3-debug")
    model = config.build()
    assert num_params(config) == sum(p.numel() for p in model.parameters())
    # Formula by hand: embedding + output (V*d each), per layer 2 norms + attention
    # (d*(H + 2*Hkv)*hd + H*hd*d) + feed-forward (3*d*f), final norm.
    v, d, layers, hd, h, hkv, f = 256, 64, 2, 8, 8, 4, 192
    per_layer = 2 * d + d * (h + 2 * hkv) * hd + h * hd * d + 3 * d * f
    assert num_params(config) == 2 * v * d + layers * per_layer + d


def test_preset_shapes():
    config = preset_config("llama3-70b")
    assert len(config.layers) == 80
    attention = config.layers[0].attention
    assert (attention.head_dim, attention.wq.out_features, attention.wk.out_features) == (
        128,
        8192,
        1024,
    )
    assert config.layers[0].feed_forward.w1.out_features == 28672
    assert config.tok_embeddings.num_embeddings == config.output.out_features == 128256


def test_registry_has_every_preset_with_its_typed_family():
    assert set(PRESETS) <= set(list_specs())
    for name in PRESETS:
        spec = get_spec(name)
        assert isinstance(spec, ModelSpec)
        family = spec.family
        assert family.name == "llama3" and family.blocks == "layers"
        assert spec.sharding("tp") is apply_tp
        assert spec.sharding("tp", sequence_parallel=True) is apply_tp_sp
        assert family.loss_fn is cross_entropy_loss and family.num_params is num_params
        assert family.ep is None and family.expert_paths == ()
        with pytest.raises(
            ValueError, match=rf"model '{name}' does not support ep \(Llama is dense"
        ):
            spec.sharding("ep")
    config = get_spec("llama3-8b").config(num_layers=2, max_seq_len=128)
    assert len(config.layers) == 2 and config.rope.max_seq_len == 128


def test_preset_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"no preset 'llama3-7b'.*llama3-8b"):
        preset_config("llama3-7b")
    with pytest.raises(ValueError, match=r"num_layer.*overrides are arguments of llama3_config"):
        preset_config("llama3-debug", num_layer=3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        llama3_config(vocab_size=8, dim=16, num_layers=1, num_heads=4, num_kv_heads=3, ffn_dim=8)


# --------------------------------------------------------------------------- maths


def test_forward_shape_and_finite_loss():
    model = _debug_model()
    tokens = _tokens()
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    loss = cross_entropy_loss(logits[:, :-1], tokens[:, 1:])
    assert math.isfinite(loss.item())
    # A fresh model predicts roughly uniformly: loss near log(vocab).
    assert abs(loss.item() - math.log(256)) < 1.0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_init_is_deterministic_and_follows_the_recipe():
    a, b = _debug_model(seed=3), _debug_model(seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(a.layers[0].attention_norm.weight, torch.ones(64))
    # Depth-scaled output projections: layer 1's std is 0.02 / sqrt(4).
    assert a.layers[1].attention.wo.weight.std().item() == pytest.approx(0.01, rel=0.15)
    assert a.layers[0].attention.wq.weight.abs().max().item() <= 3 * 0.02
    c = _debug_model(seed=4)
    assert not torch.equal(a.output.weight, c.output.weight)


def test_causal_prefix_does_not_see_the_future():
    model = _debug_model()
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sdpa_matches_naive_grouped_query_attention():
    torch.manual_seed(0)
    bsz, seq_len, heads, kv_heads, hd = 2, 5, 4, 2, 8
    q = torch.randn(bsz, seq_len, heads, hd)
    k, v = torch.randn(bsz, seq_len, kv_heads, hd), torch.randn(bsz, seq_len, kv_heads, hd)
    out = ScaledDotProductAttention.Config().build()(q, k, v)
    # Query head i reads key/value head i // (heads // kv_heads).
    k_rep, v_rep = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, k_rep) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(seq_len, seq_len).triu(1).bool(), float("-inf"))
    expected = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v_rep)
    torch.testing.assert_close(out, expected)


def test_rotary_embedding_is_a_relative_rotation():
    model = _debug_model()
    cos, sin = model.rope(12)
    assert cos.shape == (12, 4)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def at(x, pos):
        return apply_rotary_emb(x.expand(1, 12, 1, 8), cos, sin)[0, pos, 0]

    # Norm preserved; <q_m, k_n> depends only on m - n.
    torch.testing.assert_close(at(q, 7).norm(), q.norm())
    torch.testing.assert_close(at(q, 5) @ at(k, 2), at(q, 9) @ at(k, 6))
    torch.testing.assert_close(at(q, 0), q.flatten())


def test_rope_tables_are_non_persistent_buffers():
    model = _debug_model()
    assert {n for n, _ in model.named_buffers()} == {"rope.cos", "rope.sin"}
    assert not any("rope" in k for k in model.state_dict())


def test_meta_build_then_init_equals_eager_build():
    eager = _debug_model(seed=5)
    with torch.device("meta"):
        lazy = preset_config("llama3-debug").build()
    lazy.to_empty(device="cpu")
    torch.manual_seed(5)
    lazy.init_states()
    for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), name
    for (name, b), c in zip(lazy.named_buffers(), eager.buffers()):
        assert torch.equal(b, c), name


def test_cross_entropy_loss_on_plain_tensors_is_f_cross_entropy():
    logits, targets = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    torch.testing.assert_close(
        cross_entropy_loss(logits, targets),
        F.cross_entropy(logits.reshape(6, 7), targets.flatten()),
    )


# --------------------------------------------------------------------------- sharding configs


def _configs(config):
    return {
        path: c.sharding_config
        for path, c, *_ in config.traverse(Module.Config)
        if c.sharding_config is not None
    }


def test_apply_tp_returns_a_new_config_and_leaves_the_input_alone():
    config = preset_config("llama3-debug")
    before = json.dumps(config.to_dict(), sort_keys=True)
    tp = apply_tp(config)
    assert json.dumps(config.to_dict(), sort_keys=True) == before
    assert not _configs(config)
    json.dumps(tp.to_dict())  # still a JSON-serialisable value


def test_tp_layout_is_megatron():
    configs = _configs(apply_tp(preset_config("llama3-debug")))
    for name in ("wq", "wk", "wv"):
        c = configs[f"layers.0.attention.{name}"]
        assert c.state_shardings == {"weight": {"tp": Shard(0)}}
        assert c.in_dst_shardings == {"input": {"tp": Replicate()}}
        assert c.out_dst_shardings == {"tp": Shard(-1)}
    for path in ("layers.1.attention.wo", "layers.1.feed_forward.w2"):
        c = configs[path]
        assert c.state_shardings == {"weight": {"tp": Shard(1)}}
        assert c.in_dst_shardings == {"input": {"tp": Shard(-1)}}
        assert c.out_dst_shardings == {"tp": Replicate()}
    assert configs["tok_embeddings"].state_shardings == {"weight": {"tp": Shard(0)}}
    assert configs["output"].out_dst_shardings == {"tp": Shard(-1)}  # logits stay vocab-sharded
    core = configs["layers.0.attention.inner_attention"]
    assert core.local_map is not None
    assert core.in_dst_shardings == {name: {"tp": Shard(2)} for name in "qkv"}
    assert core.local_map.in_grad_placements == ({"tp": Shard(2)},) * 3


def test_tp_sp_layout_shards_the_residual_stream_on_sequence():
    configs = _configs(apply_tp_sp(preset_config("llama3-debug")))
    assert configs["tok_embeddings"].out_dst_shardings == {"tp": Shard(1)}
    for path in ("layers.0.attention_norm", "layers.0.ffn_norm", "norm"):
        assert configs[path].in_dst_shardings == {"x": {"tp": Shard(1)}}
        assert configs[path].state_shardings == {"weight": {"tp": Replicate()}}
    for path in ("layers.0.attention", "layers.0.feed_forward"):
        assert configs[path].in_dst_shardings == {"x": {"tp": Replicate()}}  # one all-gather
    for path in ("layers.0.attention.wo", "layers.0.feed_forward.w2"):
        assert configs[path].out_dst_shardings == {"tp": Shard(1)}  # reduce-scatter


def test_axis_name_is_configurable():
    configs = _configs(apply_tp(preset_config("llama3-debug"), axis="model"))
    assert configs["layers.0.attention.wq"].state_shardings == {"weight": {"model": Shard(0)}}


def test_tp_size_must_split_whole_heads():
    config = preset_config("llama3-debug")
    apply_tp(config, tp_size=4)
    with pytest.raises(ValueError, match=r"layers\.0\.attention: 4 key/value heads .*tp_size=8"):
        apply_tp_sp(config, tp_size=8)


def test_sequence_longer_than_the_rope_tables_is_refused():
    model = _debug_model(max_seq_len=8)
    with pytest.raises(ValueError, match="9 tokens exceeds max_seq_len=8"):
        model(_tokens(seq_len=9))
